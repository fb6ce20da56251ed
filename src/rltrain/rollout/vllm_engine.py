"""vLLM rollout engine: vLLM's asynchronous engine (``AsyncLLM``) driven from the replica.

Drop-in for the torch engine (same ``generate`` / ``init_refit`` /
``refit_receive`` / ``weight_version`` contract, see ``rollout/base.py``).
Plain Python: ``cluster/`` hosts it in a Ray actor. vLLM is imported only
when an engine is built, so nothing the CLI or the GPU scripts load pays for it.

The engine's coroutines run on an event loop of their own (a thread of the
replica's process); the replica's calls wait on them. Every row of a generate
call is a request of its own: rows come back as they finish (``on_row``), so a
caller can score them while the rest still generate, and a refit can land while
requests are in flight (partial rollouts): vLLM's scheduler pauses keeping its
requests (``pause_generation(mode="keep")``), the weights land, the KV of the
kept requests is recomputed with the new weights, and generation resumes; the
tokens after the pause carry the new weight version.

vLLM's engine core runs in a process of its own, and the weights with it: the
refit's receiving end lives there too (``vllm_worker.py``, called through
``collective_rpc``).

How it stays on-policy with the trainer:

* token ids in (``TokensPrompt``), token ids and one logprob per sampled token out (where
  every row's are wanted on GPUs, kept in vLLM's worker and taken once per call:
  ``vllm_capture.py``);
  vLLM loads no tokenizer of its own (``skip_tokenizer_init``), so the engine checks
  prompt ids against the model's vocabulary itself;
* ``logprobs_mode="processed_logprobs"``: logprobs after temperature and the
  blocked-token mask, i.e. the distribution ``algorithms/logprobs.py`` scores
  (vLLM's default, raw logprobs, ignores the temperature); blocked tokens are
  masked for the whole batch by a logits processor of vLLM's sampler
  (``vllm_blocked.py``);
* weights are replaced in place after every refit: with one tensor-parallel
  rank, each received bucket lands straight in vLLM's parameters (in vLLM's
  worker process) with one fused copy (the fused qkv / gate_up layouts are mapped
  once from the manifest, see ``vllm_landing.py``); otherwise through the
  worker's ``reload_weights`` (checkpoint-format names, so the HF names of the
  trainer load as they are). Then the prefix cache is dropped so no KV
  computed with the old weights is reused;
* colocated with the trainer, the engine sleeps between generate calls. With
  LoRA (``rollout.vllm.sleep_keeps_weights``) only its KV cache is freed: the
  base never changes, so it stays in GPU memory. Otherwise, when every parameter
  lands directly, it sleeps at level 2 (weights discarded, not copied to host
  memory and back: the next refit overwrites all of them; vLLM keeps the model's
  buffers) and refuses to generate until a refit landed; else at level 1.

Engine settings come from ``rollout.vllm`` (config fields, no environment):
CUDA graphs on GPUs and eager mode on CPU (``rollout.vllm.enforce_eager=null``),
the KV cache size in bytes on CPU and a memory fraction on GPUs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

from rltrain import env
from rltrain.config.resolved import engine_logprob_stride
from rltrain.config.schema import RunConfig
from rltrain.models.loader import blocked_token_ids, load_model, load_tokenizer
from rltrain.plan.parts import sleep_keeps_weights
from rltrain.refit import RefitReceiver
from rltrain.rollout.base import OnRow, RolloutBatch, SamplingParams
from rltrain.rollout.vllm_capture import MARK
from rltrain.rollout.vllm_core import cores_from_server
from rltrain.rollout.vllm_refit import VLLMRefit
from rltrain.rollout.vllm_settings import (
    apply_lora_stream_env,
    colocated_kv_cache_bytes,
    compilation_config,
    enforce_eager,
    model_inspection_in_process,
    request_seeds,
    seeds_per_request,
    set_warmup_env,
    vllm_lora_rank,
    worker_logprobs,
)
from rltrain.rollout.vllm_turns import VLLMTurns, _Row
from rltrain.rollout.vllm_worker import from_wire, to_wire

log = logging.getLogger(__name__)

T = TypeVar("T")

GIB = 2**30


class _EventLoop:
    """One asyncio event loop on a daemon thread of its own: the engine's coroutines run
    there (vLLM's output handler with them) while the replica's calling threads wait."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (its exception is raised here)."""
        return self.submit(coro).result(timeout_s)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop; its future (``.result()`` waits and raises)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        """Cancel what still runs on the loop (vLLM's output handler), then stop it."""

        async def cancel_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        with contextlib.suppress(Exception):  # best effort on the way out
            self.run(cancel_rest(), timeout_s=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def import_shared_libraries() -> None:
    """Import transformers (and huggingface_hub with it) in the calling thread, before the
    engine's build and the tokenizer's read run side by side: both import them, and a
    first import of transformers' lazy module from two threads at once can fail
    ("cannot import name 'PretrainedConfig' from 'transformers'", seen on a GPU host)."""
    import transformers

    for name in ("PretrainedConfig", "AutoConfig", "AutoTokenizer"):
        getattr(transformers, name)


class VLLMEngine(VLLMRefit, VLLMTurns):
    """One rollout replica backed by ``vllm.AsyncLLM``. ``generate`` is called by the controller;
    ``init_refit`` once and ``refit_receive`` after every optimizer step by the refit wiring.

    ``device`` is "cpu" or "cuda"; on CUDA the replica's actor sees ``rollout.tp`` GPUs.
    With partial rollouts (``algorithm.async_rollout.partial_rollouts``), ``refit_receive``
    may run on another thread while ``generate`` waits for its rows.
    """

    def __init__(
        self, cfg: RunConfig, device: str = "cpu", replica_index: int = 0, num_threads: int = 0
    ):
        if num_threads:
            torch.set_num_threads(num_threads)
        self.cfg = cfg
        self.device = device
        self.replica_index = replica_index
        self._model_dir: tempfile.TemporaryDirectory | None = None
        self._loop = _EventLoop(f"vllm-replica-{replica_index}")
        self.startup_phases: dict[str, float] = {}
        # What the engine core's start recorded (vllm_core.cores_from_server), set by the build.
        self._core_start: dict[str, float] = {}
        # A model folder without blocked tokens: vLLM's engine starts building on its loop
        # while this thread reads the tokenizer (nothing the build is given needs it).
        early = cfg.model.path is not None and not cfg.model.blocked_tokens
        building = None
        t_build = time.perf_counter()
        if early:
            self._blocked: set[int] = set()
            import_shared_libraries()
            building = self._loop.submit(self._build_llm(str(cfg.model.path)))
        t0 = time.perf_counter()
        try:
            self.tokenizer = load_tokenizer(cfg)
        except BaseException:
            if building is not None:  # no engine left behind: wait for it, then shut it down
                with contextlib.suppress(Exception):
                    building.result().shutdown()
            self._loop.close()
            raise
        self.startup_phases["tokenizer_s"] = time.perf_counter() - t0
        self.eos_id = self.tokenizer.eos_token_id
        if not early:
            self._blocked = set(blocked_token_ids(cfg, self.tokenizer))
        model_path = cfg.model.path if cfg.model.path is not None else self._save_tiny_model()
        ar = cfg.algorithm.async_rollout
        # Refits that land mid-generation need each token's version: rows then stream their
        # tokens as they are sampled instead of coming back whole.
        self._partial = ar.enabled and ar.partial_rollouts
        self._request_seeds = seeds_per_request(cfg, device)
        # Rows 0, n, 2n, ... of a generate call carry logprobs (rollout.engine_logprobs).
        self._logprob_stride = engine_logprob_stride(cfg, device)
        if building is None:
            t_build = time.perf_counter()
            building = self._loop.submit(self._build_llm(model_path))
        self.llm: Any = building.result()
        self.vocab_size = self.llm.model_config.get_vocab_size()
        self.startup_phases["async_llm_s"] = time.perf_counter() - t_build
        if "fork_wait_s" in self._core_start:  # the core came from the replica's server
            self.startup_phases["core_fork_wait_s"] = self._core_start["fork_wait_s"]
        self._tie = bool(getattr(self.llm.model_config.hf_config, "tie_word_embeddings", False))
        self._version = 0
        self._calls = 0
        self._request_ids = itertools.count()
        self._asleep = False
        self._weights_discarded = False  # level-2 sleep: no generate before the next refit
        # asleep: only the KV cache freed (rollout.vllm.sleep_keeps_weights)
        self._keeps_weights = sleep_keeps_weights(cfg)
        # Prompt prefixes may be cached since the last reset (a generate ran): a refit drops
        # them (computed with the old weights).
        self._prefix_cache_used = False
        # tp > 1: the weights live in several worker processes; the replica's process
        # receives the refit and hands the tensors to vLLM's reload_weights.
        self.refit_receiver: RefitReceiver | None = None
        self._refit_ready = False
        self.landing_note = "not set up"  # how refits land, or why not directly
        # LoRA: the run's adapter, named once the refit group is joined (None before: the base).
        self._lora_request: Any = None
        # Called on the engine's loop each time tokens stream in (partial rollouts; tests).
        self.on_tokens: Callable[[], None] | None = None
        # The sampled tokens' logprobs kept in vLLM's worker, taken once per generate call
        # (rollout.vllm.worker_logprobs; vllm_capture.py), or vLLM's own with each step.
        self._capture = False
        self.logprobs_note = "vLLM's own, with each decode step's output"
        if worker_logprobs(cfg, device):
            self._install_capture()

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

    async def _build_llm(self, model_path: str) -> Any:
        """``AsyncLLM`` built on the engine's loop (its output handler starts there)."""
        env.apply(env.VLLM_PICKLE_RPC)
        if self.cfg.precision.rollout_dtype == "float32":
            env.apply(env.TRITON_FP32_IEEE)  # fp32 attention in fp32, not TF32
        if Path(model_path).is_dir():
            env.apply(env.HUB_OFFLINE)
            import huggingface_hub.constants as hub

            hub.HF_HUB_OFFLINE = True  # read at import; transformers imported it already
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        ro, v = self.cfg.rollout, self.cfg.rollout.vllm
        kwargs: dict[str, Any] = {
            "model": model_path,
            "tokenizer": self.cfg.model.tokenizer or model_path,
            "dtype": self.cfg.precision.rollout_dtype,
            "seed": self.cfg.seed * 1000 + self.replica_index + 1,
            "enforce_eager": enforce_eager(self.cfg, self.device),
            "logprobs_mode": "processed_logprobs",
            "tensor_parallel_size": ro.tp,
            "max_model_len": v.max_model_len,
            "disable_log_stats": True,
            "worker_extension_cls": "rltrain.rollout.vllm_worker.RefitWorkerExtension",
            # Token ids in and out (this class holds the run's tokenizer): vLLM then loads
            # none, neither here nor in its engine core (2 s there on an H100 host, after
            # the model's warm-up and before the engine answers).
            "skip_tokenizer_init": True,
        }
        lo = self.cfg.train.lora
        if lo.rank > 0:
            # vLLM's own LoRA path: the adapter of each refit is applied by its LoRA kernels.
            apply_lora_stream_env(self.cfg, self.device)  # read by the engine process
            kwargs["enable_lora"] = True
            kwargs["max_lora_rank"] = vllm_lora_rank(lo.rank)
            kwargs["max_loras"] = 1
        compilation = compilation_config(self.cfg, self.device)
        if compilation is not None:
            kwargs["compilation_config"] = compilation
        # Read by vLLM's worker process, started below (rltrain.rollout.vllm_worker).
        # (Engines built at once by one process share its environment, as they do vLLM's own
        # variables: each core reads it when it starts.)
        set_warmup_env(self.cfg, self.device)
        if self._blocked:
            from rltrain.rollout.vllm_blocked import CONFIG_KEY

            # One mask for the whole batch in vLLM's sampler (vllm_blocked.py), not an
            # allowed_token_ids list carried by every request.
            kwargs["logits_processors"] = ["rltrain.rollout.vllm_blocked:BlockedTokens"]
            kwargs["additional_config"] = {CONFIG_KEY: sorted(self._blocked)}
        if ro.tp > 1:
            # Workers as subprocesses, on the GPUs Ray gave this actor (a Ray executor would
            # try to place its own workers in the run's placement group).
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
        from vllm.usage.usage_lib import UsageContext

        # The batch defaults of vLLM's offline LLM class (H100/H200: up to 1024 sequences and
        # 16384 tokens a step), not those of an engine behind a server (128 sequences): a
        # step's 256 rows otherwise decode in two waves, half as fast.
        with model_inspection_in_process(), cores_from_server() as self._core_start:
            return AsyncLLM.from_engine_args(
                AsyncEngineArgs(**kwargs), usage_context=UsageContext.LLM_CLASS
            )

    def _install_capture(self) -> None:
        why = "; ".join(w for w in self._rpc("rltrain_capture_logprobs") if w)
        if not why:
            # Every row of a generate call then carries logprobs (turns keep vLLM's own).
            self._capture = True
            self.logprobs_note = "kept in vLLM's worker, taken once per generate call"
        elif self.cfg.rollout.vllm.worker_logprobs:
            self.shutdown()
            raise RuntimeError(
                f"rollout replica {self.replica_index}: rollout.vllm.worker_logprobs=true, but "
                f"{why}; set rollout.vllm.worker_logprobs=null to use vLLM's own logprobs there"
            )
        else:
            self.logprobs_note = f"vLLM's own, with each decode step's output: {why}"

    async def _take_logprobs(
        self, collectors: list[Any], prompt_ids: list[list[int]], rows: list[_Row]
    ) -> None:
        """Every row's logprobs from vLLM's worker, in one RPC (``_capture``)."""
        wanted = [
            (c.request_id, len(p), len(r.ids))
            for c, p, r in zip(collectors, prompt_ids, rows, strict=True)
        ]
        got = await self.llm.collective_rpc(
            "rltrain_take_logprobs", timeout=self._rpc_timeout(), args=(to_wire(wanted),)
        )
        flat = cast(torch.Tensor, from_wire(got[0])).tolist()
        k = 0
        for r in rows:
            r.logprobs = flat[k : k + len(r.ids)]
            k += len(r.ids)

    def _rpc(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        """``method`` of :class:`~rltrain.rollout.vllm_worker.RefitWorkerExtension` on every
        worker of this replica; one result per worker."""
        return self._loop.run(self.llm.collective_rpc(method, timeout=timeout_s, args=args))

    # -- engine interface -------------------------------------------------
    def weight_version(self) -> int:
        return self._version

    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingParams, on_row: OnRow | None = None
    ) -> RolloutBatch:
        """Sample one response per prompt row (rows repeat a prompt for several samples).

        Every row is a request of its own; ``on_row`` (optional) hears of each as it
        finishes. Outputs keep request order. Each row gets its own seed: from
        ``sampling.seed`` when given, else from the run seed, the replica and the call
        count, so a run is reproducible step by step.
        """
        self._check_awake()
        t0, started_at = time.perf_counter(), time.time()
        self._calls += 1
        base = (
            sampling.seed
            if sampling.seed is not None
            else (self.cfg.seed * 7919 + self.replica_index) * 100_003 + self._calls
        )
        rows = self._loop.run(self._generate(prompt_ids, sampling, base, on_row))
        finished = [bool(r.ids) and r.ids[-1] == self.eos_id for r in rows]
        versions = [r.versions for r in rows] if self._partial else None
        return RolloutBatch(
            prompt_ids=[list(p) for p in prompt_ids],
            response_ids=[r.ids for r in rows],
            response_logprobs=[r.logprobs for r in rows],
            finished=finished,
            weight_version=self._version,
            engine_seconds=time.perf_counter() - t0,
            started_at=started_at,
            row_versions=[min(v, default=self._version) for v in versions] if versions else None,
            response_versions=versions,
        )

    async def _generate(
        self, prompt_ids: list[list[int]], sampling: SamplingParams, base: int, on_row: OnRow | None
    ) -> list[_Row]:
        def params(i: int, seed: int) -> Any:
            p = self._vllm_sampling(sampling, seed, sampling.max_new_tokens)
            if self._capture or i % self._logprob_stride:
                # kept in vLLM's worker instead, or a row outside the logprob sample (NaN)
                p.logprobs = None
            return p

        async def row(i: int, collector: Any) -> _Row:
            out = await self._read_request(collector)
            if on_row is not None:
                on_row(i, out.ids, out.logprobs, bool(out.ids) and out.ids[-1] == self.eos_id)
            return out

        seeds = request_seeds(base, len(prompt_ids))
        mark = MARK if self._capture else ""  # the worker keeps these requests' logprobs
        request_ids = [f"{mark}{self.replica_index}-{next(self._request_ids)}" for _ in prompt_ids]
        # Every request is added while the scheduler holds still, so that the first step
        # schedules them all: added one by one into a running engine, the last ones start
        # steps after the first and the call ends that much later. A refit beside the call
        # (partial rollouts) pauses and resumes the scheduler itself: then no hold here.
        hold = not self._partial and len(prompt_ids) > 1
        collectors: list[Any] = []
        # From the first request on the prefix cache may hold this call's blocks (a failed
        # call's too): the next refit drops them (LoRA keeps one adapter name, and vLLM's
        # block hashes name the adapter, not its weights).
        self._prefix_cache_used = True
        try:
            if hold:
                await self.llm.pause_generation(mode="keep", clear_cache=False)
            try:
                for i, (rid, prompt, seed) in enumerate(
                    zip(request_ids, prompt_ids, seeds, strict=True)
                ):
                    prompt_in = self._tokens_prompt(prompt, f"prompt row {i}")
                    collectors.append(
                        await self.llm.add_request(
                            rid, prompt_in, params(i, seed), lora_request=self._lora_request
                        )
                    )
            finally:
                if hold:
                    await self.llm.resume_generation()
            rows = list(await asyncio.gather(*(row(i, c) for i, c in enumerate(collectors))))
            if self._capture:
                await self._take_logprobs(collectors, prompt_ids, rows)
        except BaseException:
            # A failed or cancelled call leaves nothing running in the engine.
            await self.llm.abort(request_ids)
            if self._capture:  # nor rows kept in the worker
                with contextlib.suppress(Exception):
                    ids = [c.request_id for c in collectors]
                    await self.llm.collective_rpc("rltrain_drop_logprobs", args=(to_wire(ids),))
            raise
        return rows

    def _check_awake(self) -> None:
        if self._asleep:
            raise RuntimeError(
                f"rollout replica {self.replica_index}: generate while asleep; call wake_up first"
            )
        if self._weights_discarded:
            raise RuntimeError(
                f"rollout replica {self.replica_index}: generate after a level-2 sleep without a "
                "refit; the engine's weights were discarded"
            )

    # -- sleep / wake (GPUs, colocated with the trainer) ----------------------
    def sleep(self) -> None:
        """Free the GPU memory for the trainer: drop the KV cache. The weights stay in GPU
        memory where ``rollout.vllm.sleep_keeps_weights`` resolves so (LoRA: refits never
        change them); else they are discarded when every refit overwrites all of them
        (level 2), or offloaded to host memory (level 1)."""
        if self._keeps_weights:
            # A sleep of the KV cache alone, through the workers (vLLM's levels move the
            # weights). As vLLM's own sleep: the scheduler paused first (no step touches the
            # unmapped cache) and the prefix cache dropped (its contents do not survive).
            self._loop.run(self.llm.pause_generation(mode="abort", clear_cache=True))
            self._asleep = True  # from here on, wake_up maps back whatever was released
            self._prefix_cache_used = False
            freed = sum(self._rpc("rltrain_sleep_kv_cache"))
            if freed == 0:
                log.warning(
                    "rollout replica %d: sleep freed no KV cache (not in vLLM's sleep "
                    "allocator); rollout.vllm.sleep_keeps_weights=false uses vLLM's sleep",
                    self.replica_index,
                )
            return
        level = 2 if self.landing_note.startswith("direct") else 1
        self._loop.run(self.llm.sleep(level=level))  # also drops the prefix cache
        self._asleep = True
        self._prefix_cache_used = False
        self._weights_discarded = level == 2

    def wake_up(self) -> None:
        """Bring weights and KV cache back; a no-op when awake."""
        if self._asleep:
            if self._keeps_weights:
                self._rpc("rltrain_wake_kv_cache")
                self._loop.run(self.llm.resume_generation())
            else:
                self._loop.run(self.llm.wake_up())
            self._asleep = False

    def shutdown(self) -> None:
        """Stop vLLM's engine processes, the event loop and free the temporary model folder."""
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None
        self._loop.close()
        if self._model_dir is not None:
            self._model_dir.cleanup()
            self._model_dir = None
