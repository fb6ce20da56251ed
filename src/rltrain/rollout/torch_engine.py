"""Torch rollout engine: a transformers model with KV-cache batched sampling.

Runs anywhere torch runs (CPU and GPU). Plain Python: ``cluster/`` wraps it as
a Ray actor. Weights arrive through a refit receiver (see ``refit/``).

Partial rollouts (``algorithm.async_rollout.partial_rollouts=true``): a refit may
land while ``generate`` runs, called from a second thread of the same process.
Each decode step holds ``_swap_lock`` for its forward pass, and the landing holds
it for the swap, so the weights change only between two decode steps; the KV
cache built with the older weights is kept (as AReaL's and verl's partial
rollouts do). The bytes are received into staging tensors outside the lock: a
decode step waits for the pointer swap only, never for the network.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import torch

from rltrain.algorithms.logprobs import scale_logits
from rltrain.config.schema import RunConfig, lora_targets
from rltrain.models.loader import TORCH_DTYPES, blocked_token_ids, load_model, load_tokenizer
from rltrain.models.lora import inject_lora
from rltrain.refit import RefitReceiver, make_refit_receiver
from rltrain.refit.base import RefitGroup, RefitStats
from rltrain.rollout.base import OnRow, RolloutBatch, SamplingParams


def top_p_filter(probs_BV: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail of each row outside the smallest set with mass >= top_p."""
    if top_p >= 1.0:
        return probs_BV
    sorted_p, idx = probs_BV.sort(dim=-1, descending=True)
    cum = sorted_p.cumsum(-1)
    drop = (cum - sorted_p) >= top_p  # keep the token that crosses top_p
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs_BV).scatter(-1, idx, sorted_p)


class TorchEngine:
    """One rollout replica. ``generate`` is called by the controller; refit by the refit group."""

    def __init__(
        self, cfg: RunConfig, device: str = "cpu", replica_index: int = 0, num_threads: int = 0
    ):
        if num_threads:
            torch.set_num_threads(num_threads)
        self.cfg = cfg
        self.device = torch.device(device)
        self.tokenizer = load_tokenizer(cfg)
        self.dtype = TORCH_DTYPES[cfg.precision.rollout_dtype]
        self.model = load_model(cfg, cfg.precision.rollout_dtype).to(self.device).eval()  # type: ignore[arg-type]
        if cfg.train.lora.rank > 0:
            # The base came in once, here; each refit moves only the adapters, which the
            # forward applies as the trainer does (never merged into the base). B = 0 until
            # the first refit: the base alone.
            inject_lora(self.model, cfg.train.lora, lora_targets(cfg))
            self.model.to(self.dtype)
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        )
        self.blocked = torch.tensor(
            blocked_token_ids(cfg, self.tokenizer), dtype=torch.long, device=self.device
        )
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(cfg.seed * 1000 + replica_index + 1)
        self._version = 0
        self._params = dict(self.model.named_parameters())
        self.refit_receiver: RefitReceiver | None = None
        self.refit_in_place = False  # True: the weights are views into the receiver's buckets
        self.asleep = False
        ar = cfg.algorithm.async_rollout
        # A refit may land while generate runs (from a second thread, see the module doc).
        self.partial_rollouts = ar.enabled and ar.partial_rollouts
        # Held by each decode step's forward and by the landing of a refit: a swap happens
        # only between decode steps.
        self._swap_lock = threading.Lock()
        # One generate at a time: a second call waits for the first (the pool keeps one in
        # flight per replica, leaving the actor's second thread to a refit).
        self._generate_lock = threading.Lock()
        # Partial rollouts: per parameter, the tensor the next refit is received into (the
        # weights of two versions ago after a swap), outside the lock.
        self._staging: dict[str, torch.Tensor] = {}
        # Called with the step index before each decode step takes the lock (tests pace a
        # refit against the decode loop with it); None in runs.
        self.on_decode_step: Callable[[int], None] | None = None

    # -- engine interface -------------------------------------------------
    def weight_version(self) -> int:
        return self._version

    # -- sleep / wake (GPUs, colocated with the trainer) ----------------------
    def sleep(self) -> None:
        """Give the GPU memory this process caches back to the driver, for the trainer.

        What ``generate`` left in torch's caching allocator (the KV cache, logits,
        sampling buffers: all freed when it returned) is released with
        ``torch.cuda.empty_cache``. The weights stay where they are: colocated,
        they are views into the flat tensor the trainer packs each refit into
        over CUDA IPC, so moving them would cut that link. On CPU a no-op.
        """
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        self.asleep = True

    def wake_up(self) -> None:
        """Nothing to bring back (``generate`` allocates its KV cache as it goes); a no-op
        when awake. Present so that the pool treats every engine alike."""
        self.asleep = False

    def shutdown(self) -> None:
        """Drop the model and the refit receiver (the actor is ended right after)."""
        self.refit_receiver = None
        self._params = {}
        self.model = None  # type: ignore[assignment]

    @torch.no_grad()
    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingParams, on_row: OnRow | None = None
    ) -> RolloutBatch:
        """Sample one response per prompt (repeat prompts for several samples).

        Prompts are left-padded into one batch; each step feeds the last token
        with the KV cache. A row stops at EOS; the batch stops when all rows did.

        With partial rollouts a refit may land between two decode steps (see the module
        doc): each token carries the version of the forward that produced it
        (``response_versions``), ``row_versions`` is each row's oldest and
        ``weight_version`` the first step's (the minimum: versions only grow). Without,
        the version cannot change during the call and those per-row fields stay None.
        """
        with self._generate_lock:
            out = self._generate(prompt_ids, sampling)
        if on_row is not None:  # rows decode in lockstep: they all end with the batch
            for i, (ids, lps, fin) in enumerate(
                zip(out.response_ids, out.response_logprobs, out.finished, strict=True)
            ):
                on_row(i, ids, lps, fin)
        return out

    def _generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        t0, started_at = time.perf_counter(), time.time()
        if sampling.seed is not None:
            self.generator.manual_seed(sampling.seed)
        B = len(prompt_ids)
        P = max(len(p) for p in prompt_ids)
        ids = torch.full((B, P), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, P), dtype=torch.long)
        for i, p in enumerate(prompt_ids):
            ids[i, P - len(p) :] = torch.tensor(p)
            mask[i, P - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)

        out_tokens = torch.full(
            (B, sampling.max_new_tokens), self.pad_id, dtype=torch.long, device=self.device
        )
        out_logprobs = torch.zeros(
            (B, sampling.max_new_tokens), dtype=torch.float32, device=self.device
        )
        done = torch.zeros(B, dtype=torch.bool, device=self.device)
        eos_hit = torch.zeros(B, dtype=torch.bool, device=self.device)
        stop_ids = torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=self.device)
        lengths = torch.zeros(B, dtype=torch.long, device=self.device)
        past = None
        step_ids, step_pos = ids, position_ids
        step_versions: list[int] = []  # the weight version of each decode step's forward
        for t in range(sampling.max_new_tokens):
            if self.on_decode_step is not None:
                self.on_decode_step(t)
            # The forward reads the weights: a refit's swap waits for it, or it for the swap.
            with self._swap_lock:
                step_versions.append(self._version)
                out = self.model(
                    input_ids=step_ids,
                    attention_mask=mask,
                    position_ids=step_pos,
                    past_key_values=past,
                    use_cache=True,
                    logits_to_keep=1,
                )
            past = out.past_key_values
            # temperature 0 = greedy (evaluation): argmax, logprobs of the unscaled distribution.
            greedy = sampling.temperature == 0
            logp = torch.log_softmax(
                scale_logits(
                    out.logits[:, -1], 1.0 if greedy else sampling.temperature, self.blocked
                ),
                dim=-1,
            )
            if greedy:
                tok = logp.argmax(-1)
            else:
                probs = top_p_filter(logp.exp(), sampling.top_p)
                tok = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
            tok = torch.where(done, torch.full_like(tok, self.pad_id), tok)
            out_tokens[:, t] = tok
            out_logprobs[:, t] = logp.gather(-1, tok[:, None]).squeeze(-1).masked_fill(done, 0.0)
            lengths += (~done).long()
            eos_hit |= (tok == self.eos_id) & ~done
            done |= tok == self.eos_id
            if len(stop_ids):
                done |= torch.isin(tok, stop_ids)
            if sampling.stop:
                done |= self._stop_strings(out_tokens[:, : t + 1], lengths, done, sampling.stop)
            if bool(done.all()):
                break
            step_ids = tok[:, None]
            step_pos = step_pos[:, -1:] + 1
            mask = torch.cat(
                [mask, torch.ones((B, 1), dtype=mask.dtype, device=self.device)], dim=1
            )

        tokens, logprobs, n = out_tokens.tolist(), out_logprobs.tolist(), lengths.tolist()
        finished = eos_hit.tolist()
        start_version = step_versions[0] if step_versions else self._version
        response_versions = row_versions = None
        if self.partial_rollouts:
            response_versions = [step_versions[: n[i]] for i in range(B)]
            # Versions only grow, so a row's oldest token is its first (an empty row: the start).
            row_versions = [v[0] if v else start_version for v in response_versions]
        return RolloutBatch(
            prompt_ids=[list(p) for p in prompt_ids],
            response_ids=[tokens[i][: n[i]] for i in range(B)],
            response_logprobs=[logprobs[i][: n[i]] for i in range(B)],
            finished=finished,
            weight_version=start_version,
            engine_seconds=time.perf_counter() - t0,
            started_at=started_at,
            row_versions=row_versions,
            response_versions=response_versions,
        )

    def _stop_strings(
        self,
        tokens_BT: torch.Tensor,
        lengths_B: torch.Tensor,
        done_B: torch.Tensor,
        stop: tuple[str, ...],
    ) -> torch.Tensor:
        """Rows still running whose decoded tail contains one of ``stop`` (a tail of as many
        tokens as the longest stop has characters, plus one: every token holds a character
        or more of text)."""
        window = max(len(s) for s in stop) + 1
        hit = torch.zeros_like(done_B)
        for i in torch.nonzero(~done_B).squeeze(-1).tolist():
            n = int(lengths_B[i])
            tail = self.tokenizer.decode(tokens_BT[i, max(0, n - window) : n].tolist())
            hit[i] = any(s in tail for s in stop)
        return hit

    # -- refit --------------------------------------------------------------
    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int
    ) -> int:
        """Copy (name, tensor) pairs into the model; returns the number of tensors loaded."""
        n = 0
        with torch.no_grad(), self._swap_lock:
            for name, tensor in named_tensors:
                param = self._params.get(name)
                if param is None:
                    raise KeyError(
                        f"rollout engine has no parameter '{name}' (refit manifest mismatch)"
                    )
                param.copy_(tensor)
                n += 1
        self._version = weight_version
        return n

    def init_refit(self, group: RefitGroup, rank: int) -> None:
        """Join the refit ``group`` as group rank ``rank`` (>= 1); the manifest comes from the
        policy. Where the transport can, the weights become views into its bucket storage so
        a refit lands in place."""
        manifest = group.manifest
        missing = [s.name for b in manifest.buckets for s in b.slots if s.name not in self._params]
        if missing:
            raise KeyError(
                f"rollout engine has no parameters {missing[:3]}... named in the refit manifest"
            )
        r = self.cfg.refit
        self.refit_receiver = make_refit_receiver(
            group.transport,
            manifest,
            group.host,
            group.port,
            rank,
            group.world_size,
            r.timeout_s,
            self.device,
            r.verify,
        )
        if self.partial_rollouts:
            # Received into staging tensors (outside the swap lock), then swapped in between
            # two decode steps: landing in place would change the weights under a forward.
            self._staging = {
                name: torch.empty_like(self._params[name])
                for b in manifest.buckets
                for name in (s.name for s in b.slots)
            }
        else:
            self.refit_in_place = self.refit_receiver.bind(self._params)

    def refit_receive(self) -> RefitStats:
        """Receive one refit and load it; the weight version comes from the sender.

        Without partial rollouts the whole receive holds the swap lock (nothing generates
        meanwhile: the actor runs one call at a time) and the bytes land in place. With
        them it may run while ``generate`` runs on another thread: the bytes go into staging
        tensors without the lock, then, holding it between two decode steps, every
        parameter is re-pointed at its staged tensor and the version changes (``land_s``:
        the wait for the lock and the swap).
        """
        if self.refit_receiver is None:
            raise RuntimeError("refit_receive before init_refit")
        t0 = time.perf_counter()
        if self.partial_rollouts:
            version, n = self._receive(self._staging)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # staged bytes complete before the swap
            t_land = time.perf_counter()
            with self._swap_lock:
                for name, staged in list(self._staging.items()):
                    param = self._params[name]
                    # Re-pointed, not copied: modules sharing the parameter (tied embeddings)
                    # see the new tensor, and the old one receives the next refit.
                    self._staging[name], param.data = param.data, staged
                self._version = version
            extra = {"tensors": float(n), "land_s": time.perf_counter() - t_land}
        else:
            with self._swap_lock:
                version, n = self._receive(None if self.refit_in_place else self._params)
                self._version = version
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # the stats' time covers the landing
            extra = {"tensors": float(n)}
        m = self.refit_receiver.manifest
        return RefitStats(version, time.perf_counter() - t0, m.total_bytes, len(m.buckets), extra)

    def _receive(self, into: dict[str, torch.Tensor] | None) -> tuple[int, int]:
        """One refit's tensors copied into ``into`` (None: bound, the bytes already are the
        weights); returns (the sender's weight version, tensors received)."""
        assert self.refit_receiver is not None
        versions = set()
        n = 0
        with torch.no_grad():
            for sent_version, name, tensor in self.refit_receiver.receive():
                if into is not None:
                    into[name].copy_(tensor)
                versions.add(sent_version)
                n += 1
        (version,) = versions  # one header per refit: every tensor carries the same version
        return version, n
