"""The refit half of the vLLM engine: joining the refit group, receiving each refit and
landing it in vLLM's weights (or, with LoRA, its adapter), between generate calls or beside
one in flight (partial rollouts), and the checks benchmarks and tests read.

With one tensor-parallel rank the receiving end lives in vLLM's worker process, next to
the weights (``vllm_worker.py``); with several, the replica's process receives and loads
through vLLM's ``reload_weights``. Mixed into :class:`~rltrain.rollout.vllm_engine.VLLMEngine`,
which owns the attributes declared here.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable
from typing import Any, cast

import torch

from rltrain.config.schema import RunConfig, lora_targets
from rltrain.models.lora import peft_adapter_config
from rltrain.refit import RefitReceiver, join_refit_group
from rltrain.refit.base import RefitGroup, RefitStats
from rltrain.rollout.vllm_worker import LORA_ID, LORA_NAME, from_wire, to_wire


class VLLMRefit:
    """Refits into :class:`VLLMEngine` (see the module doc)."""

    # Owned by VLLMEngine.
    cfg: RunConfig
    device: str
    llm: Any
    _loop: Any  # the engine's _EventLoop
    _partial: bool
    _tie: bool
    _version: int
    _weights_discarded: bool
    _prefix_cache_used: bool
    _refit_ready: bool
    _lora_request: Any
    refit_receiver: RefitReceiver | None
    landing_note: str

    def wake_up(self) -> None:
        raise NotImplementedError

    def _rpc(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        raise NotImplementedError

    def init_refit(self, group: RefitGroup, rank: int) -> None:
        """Join the refit ``group`` as group rank ``rank`` (>= 1); the manifest comes from the
        policy. With one tensor-parallel rank the receiving end lives in vLLM's worker process
        (next to the weights) and maps the manifest onto vLLM's parameters once; with
        several, this process receives and loads through ``reload_weights``."""
        r = self.cfg.refit
        lo = self.cfg.train.lora
        if lo.rank > 0:
            # The base is in the engine since start-up; each refit is an adapter. The worker
            # writes a zero adapter into vLLM's LoRA slots now: they must be mapped.
            self.wake_up()
            config = peft_adapter_config(lo, lora_targets(self.cfg), self.cfg.model.path)
            (note,) = self._rpc(
                "rltrain_init_refit",
                to_wire(group),
                rank,
                r.timeout_s,
                r.verify,
                self._tie,
                self.device == "cuda",
                config,
            )
            self.landing_note = note
            from vllm.lora.request import LoRARequest

            # The worker registered a zero adapter under this id (the base's outputs, exactly);
            # every request names it from now on, so one started before the first refit goes
            # on with the refitted adapter like any other (partial rollouts).
            self._lora_request = LoRARequest(LORA_NAME, LORA_ID, lora_path="memory")
        elif self.cfg.rollout.tp == 1:
            # vLLM's CPU kernels repack linear weights after loading: load through vLLM there.
            direct = self.device == "cuda"
            (note,) = self._rpc(
                "rltrain_init_refit", to_wire(group), rank, r.timeout_s, r.verify, self._tie, direct
            )
            self.landing_note = (
                note if direct else "reload_weights: vLLM on CPU repacks weights after loading"
            )
        else:
            self.refit_receiver = join_refit_group(group, rank, r.timeout_s, self.device, r.verify)
            self.landing_note = (
                "reload_weights: rollout.tp > 1 (the weights live in several processes)"
            )
        self._refit_ready = True

    def refit_receive(self) -> RefitStats:
        """Receive one refit and land it; the version comes from the sender.

        Between generate calls the weights land while the engine is idle. With partial
        rollouts a generate may be in flight: vLLM's scheduler pauses keeping its requests,
        the weights land, the kept requests' KV is recomputed with them, and generation
        resumes (the tokens after the pause carry the new version).
        """
        if not self._refit_ready:
            raise RuntimeError("refit_receive before init_refit")
        t0 = time.perf_counter()
        self.wake_up()
        stats = self._loop.run(self._refit_in_flight() if self._partial else self._refit_idle())
        self._version = stats.weight_version
        self._weights_discarded = False
        return RefitStats(
            stats.weight_version,
            time.perf_counter() - t0,
            stats.bytes,
            stats.buckets,
            stats.extra,
        )

    async def _receive(self) -> RefitStats:
        if self.refit_receiver is None:
            (stats,) = await self.llm.collective_rpc("rltrain_receive", timeout=self._rpc_timeout())
            return cast(RefitStats, from_wire(stats))
        return await asyncio.to_thread(self._receive_here)

    def _rpc_timeout(self) -> float:
        # The sender's own timeout names a stuck transfer; this one a stuck worker process.
        return 2 * self.cfg.refit.timeout_s + 60

    async def _refit_idle(self) -> RefitStats:
        # KV blocks cached for a prompt prefix were computed with the old weights.
        if self._prefix_cache_used:
            await self.llm.reset_prefix_cache()
            self._prefix_cache_used = False
        return await self._receive()

    async def _refit_in_flight(self) -> RefitStats:
        """The refit beside a generate in flight: pause keeping the requests, drop every KV
        block (the kept requests recompute theirs with the new weights), land, resume."""
        await self.llm.pause_generation(mode="keep", clear_cache=True)
        try:
            await self._drain_outputs()
            stats = await self._receive()
            # Tokens streamed from here on were sampled with the new weights.
            self._version = stats.weight_version
            self._prefix_cache_used = False
        finally:
            await self.llm.resume_generation()
        return stats

    async def _drain_outputs(self) -> None:
        """Wait until every output the paused engine sent has reached its row's stream."""
        queue = getattr(self.llm.engine_core, "outputs_queue", None)
        while queue is not None and not queue.empty():
            await asyncio.sleep(0.001)
        for _ in range(8):  # the output handler and the row streams take turns on this loop
            await asyncio.sleep(0)

    def _receive_here(self) -> RefitStats:
        """tp > 1: receive in this process and load through every worker's reload_weights."""
        receiver = cast(RefitReceiver, self.refit_receiver)
        t0 = time.perf_counter()
        versions: set[int] = set()
        named: list[tuple[str, torch.Tensor]] = []
        for sent_version, name, tensor in receiver.receive():
            versions.add(sent_version)
            named.append((name, tensor.detach().cpu().clone()))
        self.load_weights(named, weight_version=-1)
        (version,) = versions  # one header per refit: every tensor has the same version
        m = receiver.manifest
        seconds = time.perf_counter() - t0
        extra = {"tensors": float(len(named)), "land_s": seconds, "direct": 0.0}
        return RefitStats(version, seconds, m.total_bytes, len(m.buckets), extra)

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int
    ) -> int:
        """Replace the model's weights in place from HF-named (CPU) tensors through every
        worker's ``reload_weights``; returns how many loaded."""
        named = [(n, t.detach().cpu()) for n, t in named_tensors]
        self.wake_up()

        async def load() -> None:
            await self.llm.collective_rpc(
                "reload_weights",
                timeout=self._rpc_timeout(),
                kwargs={"weights_iterator": named, "is_checkpoint_format": True},
            )
            if self._prefix_cache_used:
                await self.llm.reset_prefix_cache()
                self._prefix_cache_used = False

        if threading.current_thread() is self._loop.thread:
            raise RuntimeError("load_weights from the engine's own loop")
        self._loop.run(load())
        self._version = weight_version
        return len(named)

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """A CPU copy of vLLM's parameters by vLLM's names (first worker; tests)."""
        return from_wire(self._rpc("rltrain_named_parameters")[0])

    def landing_check(self, manifest: Any) -> str:
        """Whether a refit of ``manifest`` would land directly in vLLM's parameters ("direct"),
        else why not (tests)."""
        return self._rpc("rltrain_landing_note", to_wire(manifest), self._tie)[0]

    def weights_checksum(self) -> torch.Tensor | None:
        """Per bucket of the refit's manifest, the checksum of vLLM's weights that bucket
        lands in ([buckets, 2] int64; ``RefitWorkerExtension.rltrain_weights_checksum``,
        one tensor-parallel rank), None where the manifest does not map onto vLLM's
        parameters (benchmarks check refits bit for bit with it)."""
        return from_wire(self._rpc("rltrain_weights_checksum", self._tie)[0])
