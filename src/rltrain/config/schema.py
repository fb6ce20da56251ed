"""Typed run configuration: one dataclass per config node.

These dataclasses are the schema every YAML file in ``conf/`` and ``recipes/``
is merged into (see :mod:`rltrain.config.compose`). This module imports no
Hydra, Ray or vLLM so GPU scripts and workers can use it anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from rltrain.config.algorithm_schema import (  # noqa: F401 - re-exported: the schema's names
    ADV_ESTIMATORS,
    IS_LEVELS,
    IS_WEIGHTS,
    KL_ESTIMATORS,
    KL_REWARD_LEVELS,
    LOSS_AGGREGATIONS,
    OVER_CAP,
    RATIO_LEVELS,
    AdvantageEstimator,
    AlgorithmConfig,
    AsyncRolloutConfig,
    DynamicSamplingConfig,
    ISLevel,
    KLEstimator,
    KLRewardLevel,
    LossAggregation,
    OverCap,
    OverlongConfig,
    RatioLevel,
    RolloutCorrectionConfig,
)
from rltrain.config.env_schema import EnvConfig
from rltrain.config.lora_schema import (  # noqa: F401 - re-exported: the schema's names
    LORA_DEFAULT_TARGETS,
    LORA_HEAD,
    LORA_LR_MULTIPLIER,
    LORA_LR_MULTIPLIER_RANDOM_BASE,
    LoraConfig,
    lora_lr,
    lora_targets,
)
from rltrain.config.rollout_schema import (  # noqa: F401 - re-exported: the schema's names
    RefitConfig,
    RolloutConfig,
    VLLMEngineConfig,
)

# The choices of the config keys: each defined once, here, as a Literal, with the tuple of
# its values (typing.get_args) that validation, the CLI and the plan read; the math
# functions take the Literals as parameter types. OmegaConf (2.3) rejects a Literal
# field annotation ("Unexpected type annotation"), so the fields themselves are str.
Algorithm = Literal["grpo", "ppo"]  # the CLI's training commands
PrecisionName = Literal["fp32", "bf16", "fp16"]  # the precision group's options
Dtype = Literal["float32", "bfloat16", "float16"]
RefitTransport = Literal["auto", "gloo", "nccl", "ipc", "local"]
Engine = Literal["torch", "vllm"]
Task = Literal["copy", "dataset"]
LRSchedule = Literal["constant", "linear_warmup", "cosine"]
Attention = Literal["auto", "sdpa", "flex", "varlen"]
GradSync = Literal["micro_batch", "step"]
ClusterMode = Literal["local", "ray"]
Device = Literal["auto", "cpu", "cuda"]
PlacementStrategy = Literal["pack", "spread"]
WandbMode = Literal["offline", "online", "disabled"]
RewardOnError = Literal["zero", "fail"]

ALGORITHMS: tuple[str, ...] = get_args(Algorithm)
PRECISIONS: tuple[str, ...] = get_args(PrecisionName)
DTYPES: tuple[str, ...] = get_args(Dtype)
REFIT_TRANSPORTS: tuple[str, ...] = get_args(RefitTransport)
ENGINES: tuple[str, ...] = get_args(Engine)
TASKS: tuple[str, ...] = get_args(Task)
LR_SCHEDULES: tuple[str, ...] = get_args(LRSchedule)
ATTENTIONS: tuple[str, ...] = get_args(Attention)
GRAD_SYNCS: tuple[str, ...] = get_args(GradSync)
CLUSTER_MODES: tuple[str, ...] = get_args(ClusterMode)
DEVICES: tuple[str, ...] = get_args(Device)
PLACEMENT_STRATEGIES: tuple[str, ...] = get_args(PlacementStrategy)
WANDB_MODES: tuple[str, ...] = get_args(WandbMode)
REWARD_ON_ERROR: tuple[str, ...] = get_args(RewardOnError)

# Bytes per element of each Dtype (memory estimates, refit bucket sizes).
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


# train.max_tokens_per_micro_batch=null on CPU (and on GPUs where nothing larger fits).
CPU_MICRO_BATCH_TOKENS = 2048


@dataclass
class TrainConfig:
    """Batch shape of the trainer. Sizes count sequences (prompt + response)."""

    # Sequences per optimizer step across all data-parallel ranks; null = the
    # whole rollout batch (one optimizer step per rollout and epoch).
    mini_batch_size: int | None = None
    # Sequences per forward/backward on one data-parallel rank; null = the
    # rank's whole share of a mini batch (one forward/backward per step).
    micro_batch_size: int | None = None
    epochs: int = 1
    # Pack sequences into rows of at most max_tokens_per_micro_batch tokens (one
    # row = one micro batch; position ids restart per sequence, no attention
    # across sequences). Micro batches are then formed by tokens and
    # micro_batch_size is not used. false = padded rows of micro_batch_size.
    packing: bool = True
    # null = auto: 2048 on CPU; on GPUs the largest of 16384, 8192, 4096 tokens whose
    # memory plan fits the GPU (`rltrain plan` shows the pick), else 2048. Larger micro
    # batches keep the GPU's matmuls busy (1.5B shapes, H200: 46k tokens/s at 16384
    # against 30k at 2048-4096).
    max_tokens_per_micro_batch: int | None = None
    # A logprob or value pass (no backward, so no activations kept for one) packs this many
    # times a training micro batch's tokens (rows without packing) into each of its micro
    # batches: fewer, larger forwards launch fewer kernels where the GPU would otherwise
    # wait on the host. null = 4 on CUDA, 1 on CPU.
    pass_micro_batch_scale: int | None = None
    # Attention kernel of the trainer for packed rows: auto = varlen (torch's flash varlen
    # kernel) on CUDA with 16-bit compute, flex on CUDA otherwise, sdpa on CPU.
    attention: str = "auto"  # auto | sdpa | flex | varlen
    # Positions per chunk when logprobs/entropy are formed from hidden states
    # (bounds the fp32 logits held at once to chunk x vocab).
    logprob_chunk_tokens: int = 1024
    # Rows that hold a single sequence (full rows, padded rows, a long sequence
    # alone) run plain causal sdpa (flash / cuDNN kernels) instead of a block mask.
    # Exact. null = on, except for packed rows under compiled blocks (there it would
    # bring a second attention layout into the blocks, compiled at whichever step
    # first packs equal-length sequences); false only to measure the block-mask path.
    causal_rows: bool | None = None
    # torch.compile the forward of each decoder block (before fully_shard) and the
    # logprob head's softmax math. null = on with CUDA for models of at least 100M
    # parameters, off on CPU and for smaller models (the compile would not pay).
    compile: bool | None = None
    # Compiled blocks: the share of the activations they would keep for backward that they
    # may keep (torch's activation_memory_budget; the compiler recomputes the cheapest of
    # the rest in backward, pointwise ops first). null = auto: 0.8 for a LoRA policy, whose
    # activations are most of its memory (the MLP's SiLU x up product and other pointwise
    # results are then recomputed: a third fewer bytes a token at 1.5B shapes, so it runs
    # full fine-tuning's micro batches at under half its memory), 1.0 otherwise. No effect
    # on eager blocks.
    activation_memory_budget: float | None = None
    # liger-kernel's Triton RMSNorm, SwiGLU and RoPE (CUDA; liger-kernel installed).
    liger: bool = False
    # The step's old and reference logprob passes on the rows the engines have finished,
    # while they still generate. null = on where the policy's GPUs hold no engine and the
    # engine streams rows (vLLM, not colocated; sync loops, single turn); true beside a
    # colocated engine exits 2 (a pass needs the memory the engine's sleep frees).
    logprobs_while_generating: bool | None = None
    # Low-rank adapters instead of full fine-tuning (rank 0 = off).
    lora: LoraConfig = field(default_factory=LoraConfig)

    @property
    def micro_batch_tokens(self) -> int:
        """``max_tokens_per_micro_batch`` as the trainer uses it: the plan resolves null
        (auto) before workers start; unresolved (a worker built outside a run), the CPU
        budget."""
        return self.max_tokens_per_micro_batch or CPU_MICRO_BATCH_TOKENS


@dataclass
class OptimConfig:
    """AdamW on fp32 master weights."""

    lr: float = 3e-4  # peak learning rate of the policy (the critic's is value.lr)
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    beta1: float = 0.9  # AdamW's first-moment decay, in [0, 1)
    beta2: float = 0.999  # AdamW's second-moment decay, in [0, 1)
    eps: float = 1e-8  # AdamW's denominator epsilon
    max_grad_norm: float = 1.0  # clip the global gradient norm to this before every step
    # Learning-rate schedule over the run's optimizer steps (max_steps x optimizer
    # steps per rollout): constant | linear_warmup | cosine (after the warm-up).
    lr_schedule: str = "constant"
    warmup_steps: int = 0  # optimizer steps of linear warm-up from 0 to lr
    min_lr_ratio: float = 0.0  # cosine: the last step's lr as a fraction of lr
    # Fused AdamW kernel: null = fused when every parameter is on CUDA, else foreach.
    fused: bool | None = None


@dataclass
class GradScalerConfig:
    """Sharded grad scaler (fp16 only): dynamic loss scale."""

    enabled: bool = False  # on with precision=fp16 (required there), off otherwise
    init_scale: float = 65536.0  # loss scale of the first step
    growth_factor: float = 2.0  # the scale grows by this after growth_interval clean steps (> 1)
    backoff_factor: float = 0.5  # and by this after a step with inf/nan gradients (in (0, 1))
    growth_interval: int = 2000  # optimizer steps without overflow before the scale grows
    # Stop the run after this many optimizer steps in a row were skipped for
    # inf/nan gradients (an overflow storm that will not recover); 0 = never.
    max_consecutive_skips: int = 20


@dataclass
class PrecisionConfig:
    """One switch for the whole run: trainer, rollout and refit dtypes."""

    name: str = "fp32"  # the precision group's option: fp32 | bf16 | fp16
    # FSDP2 MixedPrecisionPolicy: compute dtype of gathered params / grad reduce.
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    grad_scaler: GradScalerConfig = field(default_factory=GradScalerConfig)
    rollout_dtype: str = "float32"  # dtype of the rollout engines' weights
    refit_dtype: str = "float32"  # dtype the weights are cast to on the wire


@dataclass
class DTensorConfig:
    """Trainer mesh: dp x tp ranks, FSDP2 over dp and DTensor tensor parallelism over tp
    (written by the ``parallelism`` group)."""

    dp: int | None = None  # null = auto: the trainer devices left after tp
    tp: int = 1  # tensor-parallel degree; must divide the model's heads, kv heads and MLP width
    # Norms and residual stream on sequence shards between the TP matmuls (needs tp > 1).
    sequence_parallel: bool = False
    activation_checkpointing: bool = False  # recompute each decoder block in backward
    cpu_offload: bool = False  # FSDP2 keeps parameters, gradients and optimizer state on CPU
    # Free each decoder block's gathered parameters after its forward (re-gathered in
    # backward). false keeps them until backward: one all-gather less per micro batch
    # and block, at the memory of the unsharded compute-dtype weights.
    # null = false with one dp rank (nothing is sharded), true with several.
    reshard_after_forward: bool | None = None
    # When gradients are reduce-scattered over dp ranks: "micro_batch" (after every
    # backward; only sharded gradients are ever held) or "step" (accumulated
    # unsharded in the reduce dtype, reduced once after the step's last micro batch:
    # one reduce-scatter per step, at the memory of full fp32 gradients).
    # null = step with one dp rank (the gradient is whole anyway), micro_batch with several.
    grad_sync: str | None = None


@dataclass
class TinyModelConfig:
    """Shape of the embedded randomly initialised Qwen2 model."""

    hidden_size: int = 128
    num_layers: int = 2  # decoder blocks
    num_heads: int = 4  # attention heads (head_dim = hidden_size / num_heads, at least 32)
    num_kv_heads: int = 2  # key/value heads (grouped-query attention); divides num_heads
    intermediate_size: int = 256  # MLP width
    max_position_embeddings: int = 64  # context length (widened to fit a dataset's prompts)
    # null = the tokenizer's size; larger pads the embedding (real-model shapes, benchmarks).
    vocab_size: int | None = None
    tie_word_embeddings: bool = False  # share the input embedding with the LM head


@dataclass
class ModelConfig:
    """Policy model: the embedded tiny model or an HF id / local path."""

    name: str = "tiny"  # the model group's option (a label; path says what is loaded)
    path: str | None = None  # null = build the embedded tiny model in code
    tokenizer: str | None = None  # null = same as path (or the embedded tokenizer)
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    # Tokens that may never be sampled nor trained on (the logits are masked
    # identically in the engine and the trainer).
    blocked_tokens: list[str] = field(default_factory=list)


@dataclass
class DataConfig:
    """Prompt source and reward."""

    name: str = "toy"  # the data group's option (a label)
    task: str = "copy"  # copy (the embedded toy task) | dataset (a file or an HF dataset)
    alphabet: str = "abcd"  # copy task: the characters prompts are drawn from
    min_len: int = 1  # copy task: shortest string to copy
    max_len: int = 3  # copy task: longest string to copy
    # Reward of a wrong answer = partial_credit x fraction of matching positions.
    partial_credit: float = 0.5
    # --- data.task=dataset: prompts and references from a file or a HF dataset ---
    # Local .jsonl/.json/.parquet file; null = use data.hf_name.
    path: str | None = None
    hf_name: str | None = None  # Hugging Face `datasets` name (read from the local cache)
    hf_config: str | None = None  # its config / subset name (e.g. "main" for gsm8k)
    split: str = "train"  # with hf_name: the split to train on
    prompt_field: str = "question"  # the row's field that holds the prompt
    answer_field: str = "answer"  # the row's field that holds the reference answer
    # Python format string; {prompt} is the row's prompt field.
    prompt_template: str = "{prompt}"
    # Wrap the templated prompt in the tokenizer's chat template when it has one.
    use_chat_template: bool = True
    system_prompt: str | None = None
    # Rows whose encoded prompt is longer are bad rows; null = no limit.
    max_prompt_tokens: int | None = None
    # Bad rows (missing field, empty prompt, too long) stop the run instead of being skipped.
    strict: bool = False
    # Validation split: a separate file, or a held-out fraction of the training rows.
    val_path: str | None = None
    val_split: str | None = None  # with hf_name: the split to evaluate on (e.g. "test")
    val_fraction: float = 0.0
    shuffle: bool = True  # reshuffle the training rows every epoch (seeded)


@dataclass
class RewardConfig:
    """Reward function: a ``module:function`` import path, checked at start-up."""

    # fn(response: str, reference: str) -> float. null = the task's default:
    # the copy scorer for data.task=copy, rltrain.rewards.math:score for datasets.
    fn: str | None = None
    # Per-sample limit; a reward that runs longer scores 0 (and is counted).
    timeout_s: float = 5.0
    # An exception or NaN from the reward: "zero" scores 0 and counts it, "fail" stops the run.
    on_error: str = "zero"
    # Processes that score responses side by side as they stream out of the engines; 0 =
    # in the controller. null = 0 on CPU, on GPUs up to 16 (half the machine's cores):
    # a step's rows that end together are then scored in a fraction of the time.
    workers: int | None = None

    def resolved_workers(self, device: str) -> int:
        """``workers`` with null resolved for a run on ``device`` ("cpu" | "cuda")."""
        if self.workers is not None:
            return self.workers
        if device != "cuda":
            return 0
        import os

        return min(16, (os.cpu_count() or 1) // 2)


@dataclass
class EvalConfig:
    """Greedy evaluation on the validation split (``val/*`` metrics)."""

    every_n_steps: int = 0  # 0 = never during training
    max_prompts: int | None = None  # null = the whole validation split
    # Samples per prompt; 1 = greedy accuracy, >1 = pass@k with the rollout temperature.
    samples_per_prompt: int = 1
    max_new_tokens: int | None = None  # null = rollout.max_new_tokens
    batch_size: int = 64  # prompts per generate call


@dataclass
class ClusterConfig:
    """Ray cluster: start a local one or attach to an existing one."""

    mode: str = "local"  # local | ray
    # Run every role in this (the driver's) process, without Ray: the trainer, the critic
    # and the engine take turns on all the cores and the refit hands the engine the
    # trainer's packed weights in memory. null = when the run fits one process (local
    # mode, CPU, one policy rank, one torch-engine replica, the synchronous loop); true =
    # require it (the plan names what does not fit); false = Ray worker processes always.
    # In one process a stuck call cannot be timed out (cluster.call_timeout_s).
    in_process: bool | None = None
    address: str | None = None  # ray mode: null = "auto"
    num_cpus: int | None = None  # local mode: null = all cores of this machine
    num_gpus: int | None = None  # local mode: null = all GPUs found
    # Memory of one GPU in GiB: the plan refuses a layout whose per-GPU estimate is over it
    # (exit 2 before any cluster starts). null = this machine's GPU in local mode (NVML or
    # torch.cuda); not checked where none is found (a CPU machine, cluster=ray).
    gpu_memory_gib: float | None = None
    device: str = "auto"  # auto | cpu | cuda
    # Local mode: Ray's object store size (Ray's own default takes gigabytes).
    object_store_bytes: int = 200 * 2**20
    # Intra-op threads per worker process on CPU; null = the machine's cores
    # divided among the trainer ranks (roles take turns, so they do not compete),
    # or among all worker processes on a machine with under 2 cores per process.
    torch_threads: int | None = None
    startup_timeout_s: float = 120.0  # placement-group reservation and worker start-up
    # mode=ray: how long to try reaching cluster.address before giving up.
    connect_timeout_s: float = 15.0
    # Placement groups: pack = each role on as few nodes as possible (a trainer
    # gang on one node where it fits), spread = one process per node in turn.
    placement: str = "pack"
    # Extra Ray resources each process of a role asks for, to pin roles to
    # nodes started with `ray start --resources='{"trainer_node": 1}'`.
    policy_resources: dict[str, float] = field(default_factory=dict)
    rollout_resources: dict[str, float] = field(default_factory=dict)  # same, rollout replicas
    # Bound on one worker call of the loop (generate, logprobs, train, checkpoint).
    call_timeout_s: float = 1800.0
    # Once a worker died or failed mid-call: how long its peers (possibly blocked
    # in a collective with it) get to finish or be torn down before they are killed.
    failure_timeout_s: float = 30.0
    # torch.distributed timeout of a gang: rendezvous and every collective.
    collective_timeout_s: float = 600.0
    # Restart a run whose worker died or stopped answering, from its last
    # checkpoint (resume=auto), at most this many times; 0 = fail at once.
    restarts: int = 0
    # Show Ray's own output: its start-up notices (token authentication, ...) and
    # every worker's stdout/stderr (log_to_driver). false = only rltrain's lines and errors.
    ray_logs: bool = False


@dataclass
class LoggerConfig:
    """Metric sinks; jsonl always carries every metric."""

    jsonl: bool = True  # metrics.jsonl in the output folder, one JSON object per step
    tensorboard: bool = True  # tensorboard/ event files in the output folder
    wandb: bool = False  # log to Weights & Biases too
    wandb_mode: str = "offline"  # offline | online | disabled
    wandb_project: str = "rltrain"
    progress: bool = True  # the live progress bar (step, reward, loss, throughput)
    # Profile this step (0 = none): torch's profiler on every trainer rank and Python's on
    # the controller, written to <output_dir>/profile/step_<n>/ (docs/user-guide.md)
    profile_step: int = 0


@dataclass
class CheckpointConfig:
    """Checkpoints: sharded trainer state (DCP) plus an HF safetensors export of the policy."""

    every_n_steps: int = 0  # 0 = only the final checkpoint
    save_final: bool = True
    keep_last: int = 2  # newest complete checkpoints kept on disk; 0 = keep all


@dataclass
class ValueDTensorConfig:
    """The value model's mesh; every null field takes the policy's (``dtensor``) value."""

    dp: int | None = None  # the critic's data-parallel ranks
    tp: int | None = None  # the critic's tensor-parallel degree
    activation_checkpointing: bool | None = None
    cpu_offload: bool | None = None


@dataclass
class ValueConfig:
    """PPO's critic: the policy's backbone (or another model) with a fresh fp32 scalar head."""

    model_path: str | None = None  # null = the policy's model (model.path / the tiny model)
    lr: float = 1e-4  # the critic's learning rate (other AdamW settings from optim)
    # Clip range of the value update around the old values; null = unclipped.
    clip: float | None = 0.2
    # fp32 | bf16 | fp16 for the backbone; null = the run's precision. The head
    # and its optimizer state stay fp32 whatever this says.
    precision: str | None = None
    dtensor: ValueDTensorConfig = field(default_factory=ValueDTensorConfig)
    # Diagnostic only (the right-shift ablation): false aligns V[t] with the state
    # *after* token t, which is wrong for PPO. Keep true for training.
    right_shift: bool = True
    # The critic's ranks also hold the frozen reference model of a KL penalty and run its
    # pass with the values on the rows that stream out while the engines generate (the
    # rows left at the end get it from the policy's own copy). null = wherever the critic
    # runs its passes while generating (GPUs of its own); true needs that.
    hosts_reference: bool | None = None


@dataclass
class RunConfig:
    """The whole run. Top-level keys seed, max_steps and output_dir are stable."""

    seed: int = 0  # seeds model init, data order and sampling
    max_steps: int = 300  # training steps (one rollout batch each)
    output_dir: str | None = None  # null = outputs/<run_name>
    run_name: str | None = None  # null = <algorithm>-<timestamp>
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    dtensor: DTensorConfig = field(default_factory=DTensorConfig)
    refit: RefitConfig = field(default_factory=RefitConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    value: ValueConfig = field(default_factory=ValueConfig)  # used by algorithm=ppo only
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    env: EnvConfig = field(default_factory=EnvConfig)  # multi-turn environments (envs/)
    # null = a fresh run; "auto" = continue from the newest complete checkpoint
    # under <output_dir>/checkpoints (fresh if none); or a checkpoint folder.
    resume: str | None = None

    # The batch sizes every part reads (the plan checks they divide; plan.batch shows them).
    def rollout_batch(self) -> int:
        """Sequences per step: algorithm.prompts_per_step x algorithm.samples_per_prompt."""
        return self.algorithm.prompts_per_step * self.algorithm.samples_per_prompt

    def mini_batch(self) -> int:
        """Sequences per optimizer step over all dp ranks: train.mini_batch_size (null = the
        rollout batch, one optimizer step per rollout)."""
        return self.train.mini_batch_size or self.rollout_batch()

    def mini_batch_rows(self, rows: int, dp: int) -> list[int]:
        """A dp rank's row count per mini batch when it holds ``rows`` rows of the step
        (consecutive parts of ``mini_batch() // dp``)."""
        per_rank = self.mini_batch() // dp
        return [min(per_rank, rows - i) for i in range(0, rows, per_rank)]


# The precision group's options (PrecisionName) as (compute dtype, grad scaler on): what
# value.precision=<name> selects for the critic's backbone.
PRECISION_PRESETS: dict[str, tuple[str, bool]] = {
    "fp32": ("float32", False),
    "bf16": ("bfloat16", False),
    "fp16": ("float16", True),
}


def value_run_config(cfg: RunConfig) -> RunConfig:
    """The RunConfig the value worker's shared trainer machinery reads.

    The policy's config with the critic's model path, learning rate, precision
    and mesh substituted (null fields inherit the policy's). Pure; ``cfg`` is
    not modified.
    """
    from dataclasses import replace

    v = cfg.value
    model = replace(cfg.model, path=v.model_path if v.model_path is not None else cfg.model.path)
    if v.model_path is not None and cfg.model.tokenizer is None and cfg.model.path is not None:
        model.tokenizer = cfg.model.path  # the policy's tokenizer produced the token ids
    precision = replace(cfg.precision, grad_scaler=replace(cfg.precision.grad_scaler))
    if v.precision is not None:
        dtype, scaler = PRECISION_PRESETS[v.precision]
        precision.name, precision.param_dtype = v.precision, dtype
        precision.grad_scaler.enabled = scaler
    overrides = {
        k: getattr(v.dtensor, k) for k in ("dp", "tp", "activation_checkpointing", "cpu_offload")
    }
    dtensor = replace(cfg.dtensor, **{k: x for k, x in overrides.items() if x is not None})
    optim = replace(cfg.optim, lr=v.lr)
    # The critic trains in full: its scalar head is new, and LoRA is the policy's (train.lora).
    train = replace(cfg.train, lora=LoraConfig())
    return replace(cfg, model=model, precision=precision, dtensor=dtensor, optim=optim, train=train)
