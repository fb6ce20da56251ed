"""vLLM rollout engine: vLLM's offline ``LLM`` inside the replica's process.

Drop-in for the torch engine (same ``generate`` / ``init_refit`` /
``refit_receive`` / ``weight_version`` contract, see ``rollout/base.py``).
Plain Python: ``cluster/`` hosts it in a Ray actor. vLLM is imported only
when an engine is built, so nothing the CLI or the GPU scripts load pays for it.

How it stays on-policy with the trainer:

* token ids in (``TokensPrompt``), token ids and one logprob per sampled token out;
* ``logprobs_mode="processed_logprobs"``: logprobs after temperature and the
  blocked-token mask, i.e. the distribution ``algorithms/logprobs.py`` scores
  (vLLM's default, raw logprobs, ignores the temperature); blocked tokens are
  excluded through ``allowed_token_ids`` (every id of the model but them);
* weights are replaced in place after every refit: with one tensor-parallel
  rank in this process, each received bucket lands straight in vLLM's
  parameters with one fused copy (the fused qkv / gate_up layouts are mapped
  once from the manifest, see ``vllm_landing.py``); otherwise through the
  worker's ``reload_weights`` (checkpoint-format names, so the HF names of the
  trainer load as they are). Then the prefix cache is dropped so no KV
  computed with the old weights is reused;
* colocated with the trainer, the engine sleeps between generate calls. When
  every parameter lands directly, it sleeps at level 2 (weights discarded,
  not copied to host memory and back: the next refit overwrites all of them;
  vLLM keeps the model's buffers) and refuses to generate until a refit landed.

Engine settings come from ``rollout.vllm`` (config fields, no environment):
the engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
set here before vLLM is imported: a second process per replica would double
start-up and memory), eager mode, the KV cache size in bytes on CPU and a
memory fraction on GPUs.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, cast

import torch

from rltrain import env
from rltrain.config.schema import RunConfig
from rltrain.models.loader import blocked_token_ids, load_model, load_tokenizer
from rltrain.refit import RefitReceiver, make_refit_receiver
from rltrain.refit.base import RefitGroup, RefitManifest, RefitStats
from rltrain.rollout.base import RolloutBatch, SamplingParams
from rltrain.rollout.vllm_landing import VllmLanding, build_landing

GIB = 2**30


# vLLM reads these when its engine is built; they are set from code, never by the user.
def request_seeds(base: int, n: int) -> list[int]:
    """One deterministic seed per request row (rows of one group must not share a seed)."""
    return [(base * 1_000_003 + i) % (2**31 - 1) for i in range(n)]


KV_BLOCK_TOKENS = 16  # vLLM's default block size on GPU


def colocated_kv_cache_bytes(
    cfg: RunConfig, model_path: str, total_gpu_bytes: int | None = None
) -> int | None:
    """KV cache bytes for a colocated engine: every sequence of one generate call held at
    once (a step's rows on this replica, or an evaluation call's when evaluation is on), at
    the longest length (``rollout.vllm.max_model_len``, else the model's), in whole blocks,
    plus a quarter. None when that would exceed half of the ``gpu_memory_utilization`` share
    (then vLLM sizes the cache from that share, as without colocation).

    Waking a colocated engine maps its whole KV cache back in, and sleeping unmaps it: the
    cost grows with the cache (0.4-0.6 s per step for the embedded model under a cache
    sized by gpu_memory_utilization=0.8 of an H200), while a cache larger than one call's
    sequences is never used in a synchronous loop.
    """
    from transformers import AutoConfig

    ro, e = cfg.rollout, cfg.eval
    hf = AutoConfig.from_pretrained(model_path)
    hf = getattr(hf, "text_config", None) or hf
    rows = -(-cfg.rollout_batch() // ro.replicas)
    if e.every_n_steps > 0:
        rows = max(rows, -(-e.batch_size * e.samples_per_prompt // ro.replicas))
    max_len = ro.vllm.max_model_len or hf.max_position_embeddings
    tokens = rows * (-(-max_len // KV_BLOCK_TOKENS) + 1) * KV_BLOCK_TOKENS
    heads = hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    dtype_bytes = torch.empty((), dtype=getattr(torch, cfg.precision.rollout_dtype)).element_size()
    per_token = 2 * hf.num_hidden_layers * max(kv_heads // ro.tp, 1) * head_dim * dtype_bytes
    need = int(tokens * per_token * 1.25)
    if total_gpu_bytes is None:
        total_gpu_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if need > ro.vllm.gpu_memory_utilization * total_gpu_bytes / 2:
        return None
    return need


class VLLMEngine:
    """One rollout replica backed by ``vllm.LLM``. ``generate`` is called by the controller;
    ``init_refit`` once and ``refit_receive`` after every optimizer step by the refit wiring.

    ``device`` is "cpu" or "cuda"; on CUDA the replica's actor sees ``rollout.tp`` GPUs.
    """

    def __init__(
        self, cfg: RunConfig, device: str = "cpu", replica_index: int = 0, num_threads: int = 0
    ):
        if num_threads:
            # Before vLLM's CPU worker takes over torch.set_num_threads.
            torch.set_num_threads(num_threads)
        self.cfg = cfg
        self.device = device
        self.replica_index = replica_index
        self.tokenizer = load_tokenizer(cfg)
        self.eos_id = self.tokenizer.eos_token_id
        self._blocked = set(blocked_token_ids(cfg, self.tokenizer))
        self._model_dir: tempfile.TemporaryDirectory | None = None
        model_path = cfg.model.path if cfg.model.path is not None else self._save_tiny_model()
        self.llm = self._build_llm(model_path)
        vocab = self.llm.llm_engine.model_config.get_vocab_size()
        # None when nothing is blocked: vLLM then skips building a vocab-wide mask.
        self._allowed: list[int] | None = (
            [t for t in range(vocab) if t not in self._blocked] if self._blocked else None
        )
        self._version = 0
        self._calls = 0
        self._asleep = False
        self._weights_discarded = False  # level-2 sleep: no generate before the next refit
        # KV blocks of prompt prefixes may be cached since the last reset (a generate ran);
        # vLLM's reset walks every KV block (~10 ms for 150k blocks), so it runs only then.
        self._prefix_cache_used = False
        self.refit_receiver: RefitReceiver | None = None
        self.landing: VllmLanding | None = None
        self.landing_note = "not set up"  # why refits land directly, or why they do not

    # -- construction ------------------------------------------------------
    def _save_tiny_model(self) -> str:
        """Write the embedded model (weights, config, tokenizer) where vLLM can load it."""
        self._model_dir = tempfile.TemporaryDirectory(prefix="rltrain-vllm-model-")
        path = Path(self._model_dir.name)
        # In the rollout dtype: what vLLM would cast to on loading (half the bytes to write).
        model = load_model(self.cfg, self.cfg.precision.rollout_dtype)
        model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        return str(path)

    def _build_llm(self, model_path: str) -> Any:
        env.apply(env.VLLM_IN_PROCESS)
        if self.cfg.precision.rollout_dtype == "float32":
            env.apply(env.TRITON_FP32_IEEE)  # fp32 attention in fp32, not TF32
        if Path(model_path).is_dir():
            env.apply(env.HUB_OFFLINE)
            import huggingface_hub.constants as hub

            hub.HF_HUB_OFFLINE = True  # read at import; transformers imported it already
        from vllm import LLM

        ro, v = self.cfg.rollout, self.cfg.rollout.vllm
        kwargs: dict[str, Any] = {
            "model": model_path,
            "tokenizer": self.cfg.model.tokenizer or model_path,
            "dtype": self.cfg.precision.rollout_dtype,
            "seed": self.cfg.seed * 1000 + self.replica_index + 1,
            "enforce_eager": v.enforce_eager,
            "logprobs_mode": "processed_logprobs",
            "tensor_parallel_size": ro.tp,
            "max_model_len": v.max_model_len,
            "disable_log_stats": True,
        }
        if ro.tp > 1:
            # Workers as subprocesses of this actor, on the GPUs Ray gave it (a Ray executor
            # would try to place its own workers in the run's placement group).
            kwargs["distributed_executor_backend"] = "mp"
        if self.device == "cpu":
            kwargs["kv_cache_memory_bytes"] = int(v.cpu_kv_cache_gib * GIB)
        else:
            kwargs["gpu_memory_utilization"] = v.gpu_memory_utilization
            kv_bytes = (
                int(v.kv_cache_gib * GIB)
                if v.kv_cache_gib is not None
                else colocated_kv_cache_bytes(self.cfg, model_path)
                if ro.colocated
                else None
            )
            if kv_bytes is not None:
                kwargs["kv_cache_memory_bytes"] = kv_bytes
            # The run's workers get rollout.colocated resolved by the plan; null (auto) here
            # means an engine built outside a run (eval, benchmarks): nothing to share with.
            kwargs["enable_sleep_mode"] = bool(ro.colocated)
        return LLM(**kwargs)

    # -- engine interface -------------------------------------------------
    def weight_version(self) -> int:
        return self._version

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        """Sample one response per prompt row (rows repeat a prompt for several samples).

        Outputs keep request order. Each row gets its own seed: from
        ``sampling.seed`` when given, else from the run seed, the replica and
        the call count, so a run is reproducible step by step.
        """
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        if self._asleep:
            raise RuntimeError(
                f"rollout replica {self.replica_index}: generate while asleep; call wake_up first"
            )
        if self._weights_discarded:
            raise RuntimeError(
                f"rollout replica {self.replica_index}: generate after a level-2 sleep without a "
                "refit; the engine's weights were discarded"
            )
        t0, started_at = time.perf_counter(), time.time()
        self._calls += 1
        base = (
            sampling.seed
            if sampling.seed is not None
            else (self.cfg.seed * 7919 + self.replica_index) * 100_003 + self._calls
        )
        params = [
            VLLMSamplingParams(
                n=1,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                max_tokens=sampling.max_new_tokens,
                # Stop at the tokenizer's EOS only, as the torch engine does (vLLM would
                # otherwise add generation_config's extra EOS ids).
                ignore_eos=True,
                stop_token_ids=[self.eos_id, *sampling.stop_token_ids],
                seed=seed,
                logprobs=0,  # the sampled token's own logprob only
                allowed_token_ids=self._allowed,
                detokenize=False,
            )
            for seed in request_seeds(base, len(prompt_ids))
        ]
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        self._prefix_cache_used = True
        response_ids, response_logprobs, finished = [], [], []
        for out in outputs:
            comp = out.outputs[0]
            ids = list(comp.token_ids)
            response_ids.append(ids)
            response_logprobs.append(
                [float(step[tok].logprob) for tok, step in zip(ids, comp.logprobs, strict=True)]
            )
            finished.append(bool(ids) and ids[-1] == self.eos_id)
        return RolloutBatch(
            prompt_ids=[list(p) for p in prompt_ids],
            response_ids=response_ids,
            response_logprobs=response_logprobs,
            finished=finished,
            weight_version=self._version,
            engine_seconds=time.perf_counter() - t0,
            started_at=started_at,
        )

    # -- sleep / wake (GPUs, colocated with the trainer) ----------------------
    def sleep(self) -> None:
        """Free the GPU memory for the trainer: drop the KV cache, and discard the weights when
        every refit overwrites all of them (level 2), else offload them to host memory (level 1)."""
        level = 2 if self.landing is not None else 1
        self.llm.sleep(level=level)  # also drops the prefix cache with the KV cache
        self._asleep = True
        self._prefix_cache_used = False
        self._weights_discarded = level == 2

    def wake_up(self) -> None:
        """Bring weights and KV cache back; a no-op when awake."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    # -- refit --------------------------------------------------------------
    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int
    ) -> int:
        """Replace the model's weights in place from HF-named tensors; returns how many loaded.

        Every tensor is copied before vLLM sees it: its loader may keep a
        reference until all tensors of a layer arrived, and the caller may
        reuse the source storage (refit receive buffers) meanwhile.
        """
        count = 0

        def copies() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for name, tensor in named_tensors:
                count += 1
                yield name, tensor.detach().clone()

        self.wake_up()
        # In-process (tp=1) vLLM consumes the iterator while later buckets arrive; tensor-parallel
        # workers live in other processes, so they get the whole list (each loads its shard).
        weights = copies() if self.cfg.rollout.tp == 1 else list(copies())
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
        )
        # KV blocks cached for a prompt prefix were computed with the old weights.
        self._drop_prefix_cache()
        self._version = weight_version
        return count

    def init_refit(self, group: RefitGroup, rank: int) -> None:
        """Join the refit ``group`` as group rank ``rank`` (>= 1); the manifest comes from the
        policy. Then map the manifest onto vLLM's parameters once, so every refit lands each
        bucket with one fused copy (see ``vllm_landing.py``)."""
        r = self.cfg.refit
        self.refit_receiver = make_refit_receiver(
            group.transport,
            group.manifest,
            group.host,
            group.port,
            rank,
            group.world_size,
            r.timeout_s,
            self.device,
            r.verify,
        )
        self.landing, self.landing_note = self._build_landing(group.manifest)

    def _model(self) -> torch.nn.Module:
        """vLLM's model object (in this process: one tensor-parallel rank, in-process core)."""

        def get(worker: Any) -> Any:
            runner = worker.model_runner
            return runner.get_model() if hasattr(runner, "get_model") else runner.model

        (model,) = self.llm.collective_rpc(get)
        return cast(torch.nn.Module, model)

    def _build_landing(self, manifest: RefitManifest) -> tuple[VllmLanding | None, str]:
        if self.device != "cuda":
            # vLLM's CPU kernels repack linear weights after loading: load through vLLM.
            return None, "reload_weights: vLLM on CPU repacks weights after loading"
        if self.cfg.rollout.tp > 1:
            return None, "reload_weights: rollout.tp > 1 (the weights live in other processes)"
        hf_config = self.llm.llm_engine.model_config.hf_config
        landing, why = build_landing(
            manifest, self._model(), bool(getattr(hf_config, "tie_word_embeddings", False))
        )
        if landing is None:
            return None, f"reload_weights: {why}"
        return landing, "direct: one fused copy per bucket into vLLM's parameters"

    def refit_receive(self) -> RefitStats:
        """Receive one refit and land it; the version comes from the sender.

        ``extra`` splits the time: ``wait_s`` waiting for the bytes (transfer),
        ``land_s`` putting them into vLLM's parameters (engine side).
        """
        if self.refit_receiver is None:
            raise RuntimeError("refit_receive before init_refit")
        if self.landing is None:
            return self._refit_reload()
        t0 = time.perf_counter()
        self.wake_up()
        waited = landed = 0.0
        versions: set[int] = set()
        t_wait = time.perf_counter()
        with torch.no_grad():
            # KV of cached prefixes came from the old weights: dropped while the bytes travel.
            buckets = self.refit_receiver.receive_buckets(self._drop_prefix_cache)
            for sent_version, bucket, flat in buckets:
                t_land = time.perf_counter()
                waited += t_land - t_wait
                versions.add(sent_version)
                self.landing.land(bucket, flat)
                t_wait = time.perf_counter()
                landed += t_wait - t_land
        t_sync = time.perf_counter()
        torch.cuda.synchronize()  # the new weights are in place before any generate
        landed += time.perf_counter() - t_sync
        (version,) = versions  # one header per refit: every bucket carries the same version
        self._version = version
        self._weights_discarded = False
        m = self.refit_receiver.manifest
        return RefitStats(
            version,
            time.perf_counter() - t0,
            m.total_bytes,
            len(m.buckets),
            {"wait_s": waited, "land_s": landed, "direct": 1.0},
        )

    def _drop_prefix_cache(self) -> None:
        if self._prefix_cache_used:
            self.llm.reset_prefix_cache()
            self._prefix_cache_used = False

    def _refit_reload(self) -> RefitStats:
        """Receive one refit and load it through vLLM's ``reload_weights`` while later buckets
        arrive (models or placements the direct landing does not map)."""
        t0 = time.perf_counter()
        versions: set[int] = set()

        def named() -> Iterator[tuple[str, torch.Tensor]]:
            for sent_version, name, tensor in cast(RefitReceiver, self.refit_receiver).receive():
                versions.add(sent_version)
                yield name, tensor

        n = self.load_weights(named(), weight_version=-1)
        (version,) = versions  # one header per refit: every tensor carries the same version
        self._version = version
        m = cast(RefitReceiver, self.refit_receiver).manifest
        seconds = time.perf_counter() - t0
        return RefitStats(
            version,
            seconds,
            m.total_bytes,
            len(m.buckets),
            {"tensors": float(n), "land_s": seconds, "direct": 0.0},
        )

    def shutdown(self) -> None:
        """Free the engine and the temporary model folder."""
        self.llm = None
        if self._model_dir is not None:
            self._model_dir.cleanup()
            self._model_dir = None
