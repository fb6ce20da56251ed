"""The refit's receiving end inside vLLM's worker process.

vLLM's asynchronous engine (``AsyncLLM``) runs its engine core, and with it the
model's weights, in a process of its own. The weights are received where they
live: this class is mixed into vLLM's worker class (the engine argument
``worker_extension_cls``), and the replica's :class:`~rltrain.rollout.vllm_engine.VLLMEngine`
calls its methods by name through ``AsyncLLM.collective_rpc``. Each method's name
starts with ``rltrain_`` so that it never shadows one of vLLM's.

With one tensor-parallel rank every received bucket lands straight in vLLM's
parameters with one fused copy (``vllm_landing.py``); otherwise (CPU, where vLLM
repacks weights after loading, or layouts the landing does not map) the tensors go
through the model runner's ``reload_weights`` while later buckets still arrive.
``self`` is vLLM's worker; of vLLM, only its sampling parameters are imported at module level.

With LoRA (``train.lora.rank > 0``) every refit is an adapter: its tensors are received
here and become vLLM's one LoRA adapter, built in memory (``LoRAModel.from_lora_tensors``,
never a file), under one id for the run (a zero adapter until the first refit); the base
weights never change.

Where every row's logprobs are wanted on GPUs, the sampled tokens' logprobs stay in this
process and the replica takes a call's rows at once (``vllm_capture.py``).

On import (vLLM imports it into the worker's process) it sets what vLLM's kernel warm-up
samples with: the run's own settings (:func:`install_warmup_sampling`).

Arguments and results cross as pickles (:func:`to_wire` / :func:`from_wire`): vLLM's
message encoding turns dataclasses into plain dicts on the way.
"""

from __future__ import annotations

import json
import pickle
import time
from collections.abc import Iterator
from typing import Any, cast

import torch

from rltrain import env
from rltrain.models.lora import PEFT_PREFIX
from rltrain.refit import RefitReceiver, join_refit_group
from rltrain.refit.base import RefitGroup, RefitStats, bucket_checksum, unpack_bucket
from rltrain.rollout.vllm_capture import LogprobCapture
from rltrain.rollout.vllm_landing import VllmLanding, build_landing


def to_wire(obj: Any) -> bytes:
    """``obj`` as it crosses between the replica and vLLM's worker (a pickle)."""
    return pickle.dumps(obj)


def from_wire(data: bytes) -> Any:
    """What :func:`to_wire` sent (the replica and vLLM's worker run the same code)."""
    return pickle.loads(data)


def lora_name_mapper(mapper: Any) -> Any:
    """The renames of a model's ``hf_to_vllm_mapper`` for LoRA tensor names, without the
    stacking of q/k/v into qkv_proj and gate/up into gate_up_proj that it also holds for
    checkpoint weights (vLLM 0.26's Qwen2): the LoRA manager packs those adapters itself,
    and names already stacked would merge three adapters into one."""
    if mapper is None:
        return None
    if hasattr(mapper, "get_rename_mapper"):  # vLLM releases that split the two
        mapper = mapper.get_rename_mapper()
    import dataclasses

    if not dataclasses.is_dataclass(mapper) or not getattr(mapper, "orig_to_new_stacked", None):
        return mapper
    kept = {
        f.name: getattr(mapper, f.name)
        for f in dataclasses.fields(mapper)
        if f.init and "stacked" not in f.name
    }
    return cast(Any, type(mapper))(**kept)


# vLLM's LoRA id and name of the run's one adapter. They stay the same across refits: each
# refit replaces the adapter's tensors under that id (the weight version is the refit's,
# not vLLM's id), so a request in flight across a refit (partial rollouts) keeps naming an
# adapter vLLM has and continues with the new one, as with a full refit.
LORA_ID = 1
LORA_NAME = "rltrain-adapter"


class RefitWorkerExtension:
    """Methods vLLM's worker gains for the refit (``rltrain_*``), run in the worker's process.

    State lives on the worker object: the receiver (its transport's buffers and group)
    and the landing map, both built once by :meth:`rltrain_init_refit`.
    """

    _rltrain_receiver: RefitReceiver | None = None
    _rltrain_landing: VllmLanding | None = None
    # LoRA: the adapter's PEFT config (adapter_config.json's fields); each refit then
    # carries adapter tensors, loaded into vLLM's LoRA manager from memory.
    _rltrain_lora: dict | None = None
    # Every sampled token's logprob, kept here and taken once per generate call.
    _rltrain_capture: LogprobCapture | None = None

    def _rltrain_model(self) -> torch.nn.Module:
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def rltrain_init_refit(
        self,
        group_wire: bytes,
        rank: int,
        timeout_s: float,
        verify: bool,
        tie_word_embeddings: bool,
        direct: bool,
        lora_config: dict | None = None,
    ) -> str:
        """Join the refit group (``group_wire``: a :class:`RefitGroup` through :func:`to_wire`)
        as group rank ``rank`` (>= 1) and map its manifest onto vLLM's parameters once.
        ``direct=False`` (CPU) loads through ``reload_weights``. With ``lora_config`` (a PEFT
        adapter config) every refit is an adapter for vLLM's LoRA manager instead. Returns
        how refits land."""
        group: RefitGroup = from_wire(group_wire)
        device = "cuda" if torch.cuda.is_available() and direct else "cpu"
        self._rltrain_receiver = join_refit_group(group, rank, timeout_s, device, verify)
        if lora_config is not None:
            self._rltrain_lora = lora_config
            # Until the first refit: a zero adapter (the base's outputs exactly) under the
            # run's id, so that every request names the adapter from the start.
            dtype = group.manifest.torch_dtype
            self._rltrain_add_adapter(
                {
                    PEFT_PREFIX + slot.name: torch.zeros(slot.shape, dtype=dtype, device=device)
                    for bucket in group.manifest.buckets
                    for slot in bucket.slots
                }
            )
            return "adapter: vLLM's LoRA manager, loaded from tensors in memory"
        if not direct:
            return "reload_weights"
        landing, why = build_landing(group.manifest, self._rltrain_model(), tie_word_embeddings)
        self._rltrain_landing = landing
        if landing is None:
            return f"reload_weights: {why}"
        return "direct: one fused copy per bucket into vLLM's parameters"

    def rltrain_landing_note(self, manifest_wire: bytes, tie_word_embeddings: bool) -> str:
        """Whether a manifest (through :func:`to_wire`) would land directly in this worker's
        parameters ("direct"), else why not."""
        manifest = from_wire(manifest_wire)
        landing, why = build_landing(manifest, self._rltrain_model(), tie_word_embeddings)
        return "direct" if landing is not None else why

    def rltrain_receive(self) -> bytes:
        """:meth:`receive`, its :class:`RefitStats` through :func:`to_wire`."""
        return to_wire(self._rltrain_receive())

    def _rltrain_receive(self) -> RefitStats:
        """Receive one refit and put it into the model's weights; the version is the sender's.

        ``extra`` splits the time: ``wait_s`` waiting for the bytes, ``land_s`` putting them
        into vLLM's parameters, ``direct`` 1.0 for the fused landing (0.0: reload_weights),
        ``tensors`` how many tensors reload_weights loaded.
        """
        receiver = self._rltrain_receiver
        if receiver is None:
            raise RuntimeError("rltrain_receive before rltrain_init_refit")
        t0 = time.perf_counter()
        versions: set[int] = set()
        m = receiver.manifest
        if self._rltrain_lora is not None:
            tensors = {}
            for sent_version, bucket, flat in receiver.receive_buckets():
                versions.add(sent_version)
                # one copy of the whole bucket where it arrived (the receive buffer is reused
                # for the next one): on a GPU the adapter is built there and vLLM's slots
                # fill from it device to device, with no host copy and no pinning per tensor
                kept = flat[: bucket.numel].detach().clone()
                for name, tensor in unpack_bucket(bucket, kept):
                    tensors[PEFT_PREFIX + name] = tensor
            (version,) = versions
            t_land = time.perf_counter()
            self._rltrain_add_adapter(tensors)
            extra = {"tensors": float(len(tensors)), "land_s": time.perf_counter() - t_land}
            return RefitStats(
                version, time.perf_counter() - t0, m.total_bytes, len(m.buckets), extra
            )
        if self._rltrain_landing is None:
            count = 0

            def named() -> Iterator[tuple[str, torch.Tensor]]:
                nonlocal count
                for sent_version, name, tensor in receiver.receive():
                    versions.add(sent_version)
                    count += 1
                    # vLLM's loader may hold a tensor until its layer is complete, while the
                    # receive buffer is reused for the next bucket: each tensor gets a copy.
                    yield name, tensor.detach().clone()

            runner: Any = self.model_runner  # type: ignore[attr-defined]
            runner.reload_weights(weights_iterator=named(), is_checkpoint_format=True)
            (version,) = versions  # one header per refit: every tensor has the same version
            seconds = time.perf_counter() - t0
            extra = {"tensors": float(count), "land_s": seconds, "direct": 0.0}
            return RefitStats(version, seconds, m.total_bytes, len(m.buckets), extra)
        waited = landed = 0.0
        t_wait = time.perf_counter()
        with torch.no_grad():
            for sent_version, bucket, flat in receiver.receive_buckets():
                t_land = time.perf_counter()
                waited += t_land - t_wait
                versions.add(sent_version)
                self._rltrain_landing.land(bucket, flat)
                t_wait = time.perf_counter()
                landed += t_wait - t_land
        t_sync = time.perf_counter()
        torch.cuda.synchronize()  # the new weights are in place before the next forward
        landed += time.perf_counter() - t_sync
        (version,) = versions
        extra = {"wait_s": waited, "land_s": landed, "direct": 1.0}
        return RefitStats(version, time.perf_counter() - t0, m.total_bytes, len(m.buckets), extra)

    def rltrain_weights_checksum(self, tie_word_embeddings: bool) -> bytes:
        """Per bucket of the refit's manifest, :func:`~rltrain.refit.base.bucket_checksum` of
        the weights that bucket lands in, in the bucket's order: a [buckets, 2] int64 CPU
        tensor through :func:`to_wire` (None where the manifest does not map onto every one
        of vLLM's parameters). Lets a benchmark check each refit bit for bit against the
        trainer's weights without copying them out of this process. Reads through the
        landing's views (mapped here when refits load through ``reload_weights``)."""
        receiver = self._rltrain_receiver
        if receiver is None:
            raise RuntimeError("rltrain_weights_checksum before rltrain_init_refit")
        buckets = receiver.manifest.buckets
        landing = self._rltrain_landing
        if landing is None:
            landing, _ = build_landing(
                receiver.manifest, self._rltrain_model(), tie_word_embeddings
            )
        if landing is None or any(
            len(keep) != len(b.slots) for keep, b in zip(landing.keep, buckets, strict=True)
        ):
            return to_wire(None)  # a manifest tensor with no place in vLLM's parameters
        with torch.no_grad():
            sums = [
                bucket_checksum(torch.cat([t.reshape(-1) for t in targets]))
                for targets in landing.targets
            ]
        return to_wire(torch.stack(sums).cpu())

    def _rltrain_add_adapter(self, tensors: dict[str, torch.Tensor]) -> None:
        """Build vLLM's LoRA model of ``tensors`` (PEFT names) in memory and make it the one
        adapter of this worker under :data:`LORA_ID`, in place of the previous refit's (one
        RPC, between two of vLLM's steps). Requests name it with a LoRARequest of that id
        (the manager finds it loaded and never reads ``lora_path``)."""
        import inspect

        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        runner: Any = self.model_runner  # type: ignore[attr-defined]
        manager = runner.lora_manager  # vLLM's (LRU) WorkerLoRAManager
        adapters = manager._adapter_manager
        helper = PEFTHelper.from_dict(dict(self._rltrain_lora or {}))
        helper.validate_legal(manager.lora_config)
        mapper = lora_name_mapper(getattr(adapters.model, "hf_to_vllm_mapper", None))
        kwargs: dict[str, Any] = {
            "lora_model_id": LORA_ID,
            "tensors": tensors,
            "peft_helper": helper,
            "device": str(next(iter(tensors.values())).device) if tensors else "cpu",
            "dtype": manager.lora_config.lora_dtype,
            "model_vocab_size": getattr(manager, "vocab_size", None),
            "weights_mapper": mapper,
        }
        accepted = inspect.signature(LoRAModel.from_lora_tensors).parameters
        lora = LoRAModel.from_lora_tensors(**{k: v for k, v in kwargs.items() if k in accepted})
        for old in list(manager.list_adapters()):
            manager.remove_adapter(old)
        adapters.add_adapter(lora)
        adapters.activate_adapter(lora.id)

    def rltrain_sleep_kv_cache(self) -> int:
        """Free the KV cache's GPU memory and keep the weights mapped: vLLM's level-1 sleep
        without moving the weights to host memory and back (``rollout.vllm.
        sleep_keeps_weights``). vLLM's sleep allocator tags each allocation ``weights`` or
        ``kv_cache``; the ``kv_cache`` ones are released, as vLLM's own sleep releases them.
        The caller has paused vLLM's scheduler and dropped the prefix cache (no step runs on
        the unmapped cache; its contents do not survive). Returns the bytes freed."""
        import gc

        from vllm.device_allocator.cumem import CuMemAllocator, unmap_and_release

        torch.cuda.synchronize()
        allocator = CuMemAllocator.get_instance()
        freed = 0
        for data in allocator.pointer_to_data.values():
            if data.tag == "kv_cache" and not data.is_asleep:
                try:
                    unmap_and_release(data.handle)
                finally:  # as vLLM's sleep: a failed release is not mapped again blindly
                    data.is_asleep = True
                freed += data.handle[1]
        gc.collect()
        torch.cuda.empty_cache()
        return freed

    def rltrain_wake_kv_cache(self) -> None:
        """Map the KV cache back after :meth:`rltrain_sleep_kv_cache` (only what it released,
        at the same addresses, so CUDA graphs stay valid), then the model runner's step after
        a KV wake-up, as vLLM's own wake-up does."""
        from vllm.device_allocator.cumem import CuMemAllocator, create_and_map

        for data in CuMemAllocator.get_instance().pointer_to_data.values():
            if data.tag == "kv_cache" and data.is_asleep:
                create_and_map(data.handle)
                data.is_asleep = False
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        if hasattr(runner, "post_kv_cache_wake_up"):
            runner.post_kv_cache_wake_up()

    def rltrain_capture_logprobs(self) -> str:
        """Keep every sampled token's logprob in this worker (``vllm_capture.py``): "" once
        installed, else why this model runner cannot."""
        from rltrain.rollout.vllm_capture import install

        if self._rltrain_capture is not None:
            return ""
        got = install(self.model_runner)  # type: ignore[attr-defined]
        if isinstance(got, str):
            return got
        self._rltrain_capture = got
        return ""

    def rltrain_take_logprobs(self, wanted_wire: bytes) -> bytes:
        """The kept logprobs of ``wanted_wire`` (a list of (request id, first response
        position, tokens) through :func:`to_wire`): one fp32 tensor, rows joined."""
        capture = self._rltrain_capture
        if capture is None:
            raise RuntimeError("rltrain_take_logprobs before rltrain_capture_logprobs")
        states: Any = self.model_runner.req_states  # type: ignore[attr-defined]
        return to_wire(capture.take(from_wire(wanted_wire), states.req_id_to_index.get))

    def rltrain_capture_counts(self) -> dict[str, int]:
        """Rows kept, rows taken live and not yet freed, preempted rows resumed (tests)."""
        c = self._rltrain_capture
        if c is None:
            return {}
        return {"kept": len(c.kept), "taken": len(c.taken), "resumed": c.resumed}

    def rltrain_drop_logprobs(self, req_ids_wire: bytes) -> None:
        """Forget the kept logprobs of a failed call's requests."""
        if self._rltrain_capture is not None:
            states: Any = self.model_runner.req_states  # type: ignore[attr-defined]
            self._rltrain_capture.drop(from_wire(req_ids_wire), states.req_id_to_index.get)

    def rltrain_warmup_sampling(self) -> bytes:
        """What vLLM's kernel warm-up samples with in this process (its
        ``for_sampler_warmup()``), as a dict through :func:`to_wire` (tests)."""
        from vllm.sampling_params import SamplingParams

        p = SamplingParams.for_sampler_warmup()
        keys = ("temperature", "top_p", "top_k", "min_p", "logprobs", "prompt_logprobs", "seed")
        return to_wire({k: getattr(p, k) for k in keys})

    def rltrain_named_parameters(self) -> bytes:
        """A CPU copy of every parameter of vLLM's model by vLLM's names, through
        :func:`to_wire` (tests compare them with the trainer's)."""
        model = self._rltrain_model()
        return to_wire({n: p.detach().cpu().clone() for n, p in model.named_parameters()})


def install_warmup_sampling() -> None:
    """vLLM's kernel warm-up (its V2 model runner on GPUs, in this process) samples once
    with ``SamplingParams.for_sampler_warmup()``: every sampling feature vLLM has, each with
    Triton kernels that a host's first run compiles (seconds each). From here on that
    returns the run's own settings when the replica set them
    (``env.VLLM_WARMUP_SAMPLING``, ``rollout.vllm.warmup=run``), read at each call; vLLM's
    own otherwise. Hand-written: vLLM has no option for what its warm-up samples with."""
    try:
        from vllm.sampling_params import SamplingParams
    except ImportError:
        return
    own = SamplingParams.__dict__.get("for_sampler_warmup")
    if not isinstance(own, staticmethod) or getattr(own.__func__, "_rltrain", False):
        return  # a vLLM without it, or installed already

    def for_sampler_warmup() -> Any:
        spec = env.value(env.VLLM_WARMUP_SAMPLING)
        return SamplingParams(**json.loads(spec)) if spec else own.__func__()

    for_sampler_warmup._rltrain = True  # type: ignore[attr-defined]
    SamplingParams.for_sampler_warmup = staticmethod(for_sampler_warmup)  # type: ignore[method-assign]


# vLLM imports this module into its worker process (worker_extension_cls), where the warm-up
# runs; the replica imports it too (harmless there: it runs no warm-up).
install_warmup_sampling()
