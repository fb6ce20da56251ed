"""The rollout side of the run configuration (a part of :mod:`rltrain.config.schema`,
which re-exports its names): the engines and their sampling defaults, vLLM's settings,
and the refit that carries the trainer's weights to them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RefitConfig:
    """Weight transport from trainer to rollout engines after every step."""

    # auto | gloo | nccl | ipc | local (auto: local in one process, ipc colocated, nccl on
    # GPUs, else gloo; local: the engine in the trainer's process reads its packed buckets)
    transport: str = "auto"
    # Chosen by scripts/bench_refit.py on H200x2 (1.5B shapes, bf16): 512 MiB x 2 was the
    # best of the num_buffers x bucket grid (see scripts/results/bench_refit-*.json).
    bucket_bytes: int = 512 * 2**20  # bytes per packed bucket (at least 1 MiB)
    num_buffers: int = 2  # buckets in flight: pack bucket k+1 while bucket k is sent
    # Bound on every wait of a refit; the error names the side that stopped.
    timeout_s: float = 120.0
    # Compare a checksum of every bucket on both sides after each refit.
    verify: bool = False
    # nccl: SMs the cast + pack kernels may use (a CUDA green context), so they leave
    # memory bandwidth to the broadcast they overlap; 0 = all SMs; null = 3/8 of the SMs
    # (48 on H100/H200: 0.93 of raw broadcast against 0.91 on all SMs in bench_refit).
    pack_sms: int | None = None


@dataclass
class VLLMEngineConfig:
    """Settings of the vLLM engine (rollout.engine=vllm); the torch engine ignores them."""

    # GPU: fraction of the GPU's memory vLLM may take (weights + KV cache).
    gpu_memory_utilization: float = 0.8
    # CPU: KV cache size in GiB (vLLM reads it as VLLM_CPU_KVCACHE_SPACE; set from here).
    cpu_kv_cache_gib: float = 1.0
    # GPU: KV cache size in GiB per replica. null = colocated engines get enough for one
    # step's sequences at once (waking and sleeping costs grow with the cache; the rest of
    # the GPU stays with the trainer), or, where the gpu_memory_utilization share vLLM
    # would then take does not fit beside the trainers, the largest of 48/32/24/16/12/8/4
    # GiB that does (the plan says which); other engines what gpu_memory_utilization leaves.
    kv_cache_gib: float | None = None
    # Eager mode (no CUDA graphs / torch.compile). null = auto: CUDA graphs on GPUs (decoding
    # ~2.8x faster at 1.5B shapes for ~17 s more start-up), eager on CPU (required there).
    enforce_eager: bool | None = None
    # With CUDA graphs: compile the model with vLLM's torch.compile pipeline (piecewise graphs
    # around attention) or not (full CUDA graphs of decode steps over the eager model, prefill
    # eager: no Inductor compile at start-up). null = auto: no compile.
    torch_compile: bool | None = None
    # Longest prompt + response; null = the model's max_position_embeddings.
    max_model_len: int | None = None
    # A seed of its own for every request (row or turn): its sample does not depend on the
    # rows beside it. vLLM's sampler draws each seeded request's noise in a loop of its own
    # (one kernel per request and decode step); unseeded requests share one draw from the
    # engine's seeded generator. null = auto: per-request seeds on CPU, the engine's
    # generator on GPUs (where vLLM's logits depend on the batch's make-up anyway).
    request_seeds: bool | None = None
    # LoRA (train.lora.rank > 0) on GPUs: vLLM's LoRA kernels on a second CUDA stream beside
    # the base layers' GEMMs (vLLM's VLLM_LORA_ENABLE_DUAL_STREAM), so that a decode step's
    # small adapter kernels overlap the base's. null = auto: on for LoRA on GPUs.
    lora_dual_stream: bool | None = None
    # Colocated (rollout.colocated), asleep while the trainers train: keep the weights in GPU
    # memory and free only the KV cache (true), or not (false: discarded where every refit
    # overwrites them all, else moved to host memory and back, vLLM's sleep levels 2 and 1).
    # null = auto: kept with LoRA (train.lora.rank > 0), whose refits are adapters: the base
    # is not copied out and back each step, at the cost of its bytes beside the trainer.
    sleep_keeps_weights: bool | None = None
    # vLLM's kernel warm-up at engine start (GPUs, its V2 model runner): run = one pass with
    # the run's own sampling (rollout.temperature, top_p, top_k, the sampled token's logprob),
    # so that start-up compiles only the Triton kernels the run samples with; all = vLLM's
    # own, every sampling feature it has (penalties, min_p, logit bias, bad words, top-5 and
    # prompt logprobs), each kernel compiled on a host without Triton's cache.
    warmup: str = "run"
    # Where the sampled tokens' logprobs come from when a call wants every row's (GPUs):
    # true = kept inside vLLM's worker and taken once per generate call (its V2 model
    # runner; vllm_capture.py); false = vLLM's own, sent with every decode step's output
    # (1.34x the engine's time for a 256-row call at 1.5B shapes on an H100). null = auto:
    # the worker on GPUs wherever every row's logprobs are wanted (rollout.engine_logprobs)
    # and vLLM runs its V2 model runner, vLLM's own otherwise.
    worker_logprobs: bool | None = None


@dataclass
class RolloutConfig:
    """Inference engines and sampling defaults."""

    engine: str = "torch"
    replicas: int = 1
    tp: int = 1
    # Engines on the trainer's GPU (policy rank 0's), sharing it through fractional GPU
    # requests: they sleep after generate and wake for the refit (refit over CUDA IPC).
    # null = auto: colocated on GPUs when the cluster cannot hold rollout GPUs of their
    # own next to the trainer (the policy, and PPO's critic); never on CPU.
    colocated: bool | None = None
    # A copy of the policy's frozen reference model (a KL penalty's) beside each replica, on
    # its GPU: once the engines are done, the step's last rows get their reference logprobs
    # there and on the policy's GPUs at once. null = auto: on GPUs where the engines have
    # GPUs of their own (rollout.colocated false, rollout.tp=1), the policy runs its passes
    # on rows as they stream out (train.logprobs_while_generating) and the copy fits beside
    # the engine; not PPO (its critic hosts one: value.hosts_reference).
    hosts_reference: bool | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 5
    top_k: int = 0  # 0 = off; vllm engine only
    # Which rows of a generate call carry the engine's logprobs (vLLM; the torch engine
    # always has them): all | sample (one row in ENGINE_LOGPROB_SAMPLE, enough for the
    # token_mult_prob_error diagnostic; multi-turn: one episode in n) | auto: all where the
    # run uses them (rollout correction, the asynchronous loop) and on CPU, else sample. vLLM's output
    # path builds a Python object per token's logprob: on GPUs at 1.5B shapes, decoding
    # with every row's logprobs ran at 0.66 of the speed without.
    engine_logprobs: str = "auto"
    vllm: VLLMEngineConfig = field(default_factory=VLLMEngineConfig)
