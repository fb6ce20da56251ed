"""Partial rollouts on the torch engine: a refit lands between two decode steps of a generate.

The refit travels the real gloo path (sender and engine in two threads of this
process) while ``generate`` runs in a third. The decode loop's step hook waits on
an event that the test sets once the refit returned, so the swap lands at a known
step without any sleep.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from rltrain.algorithms.logprobs import scale_logits
from rltrain.config.schema import RunConfig
from rltrain.refit.base import RefitGroup, fill_from, plan_refit
from rltrain.refit.gloo import GlooRefitSender
from rltrain.rollout.base import RolloutBatch, SamplingParams
from rltrain.rollout.torch_engine import TorchEngine
from rltrain.train.distributed import free_port

pytestmark = pytest.mark.dist

HOST = "127.0.0.1"
WAIT_S = 120.0  # a bound on every wait; none is expected to come near it
BLOCKED = ["<pad>", "<bos>", "<unk>"]
SWAP_STEP = 5  # the refit lands before decode step 5: tokens 0-4 old, 5.. new
NEW_TOKENS = 12


def _engine(partial: bool, device: str = "cpu") -> TorchEngine:
    cfg = RunConfig()
    cfg.model.blocked_tokens = list(BLOCKED)
    cfg.refit.bucket_bytes = 2**16  # several buckets through the two buffers
    cfg.refit.verify = True
    cfg.algorithm.async_rollout.enabled = True
    cfg.algorithm.async_rollout.partial_rollouts = partial
    engine = TorchEngine(cfg, device)
    # EOS blocked too: every row runs the full NEW_TOKENS, across the swap.
    eos = torch.tensor([engine.eos_id], device=engine.device)
    engine.blocked = torch.cat([engine.blocked, eos])
    return engine


def _weights(engine: TorchEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def _perturbed(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: w + 0.5 * torch.randn(w.shape, generator=g).to(w.device) for n, w in weights.items()}


def _thread(target: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """``target`` in a started thread; the box gets its result or its exception."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = target()
        except BaseException as exc:  # noqa: BLE001 - re-raised by _join in the test thread
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _join(t: threading.Thread, box: dict[str, Any]) -> Any:
    t.join(WAIT_S)
    assert not t.is_alive(), f"a thread did not finish within {WAIT_S}s"
    if "error" in box:
        raise box["error"]
    return box.get("out")


def _connect(engine: TorchEngine) -> GlooRefitSender:
    """A gloo refit group of one sender (this process) and the engine as replica 0."""
    named = engine.model.named_parameters()
    manifest = plan_refit([(n, tuple(p.shape)) for n, p in named], "float32", 2**16, 2)
    port = free_port()
    t, box = _thread(lambda: GlooRefitSender(manifest, HOST, port, 2, WAIT_S, verify=True))
    engine.init_refit(RefitGroup(manifest, HOST, port, 2, "gloo"), 1)
    return _join(t, box)


def _refit(engine: TorchEngine, sender: GlooRefitSender, weights, version: int):
    """One refit: the sender in a thread, the receive in this one; returns the engine's stats."""
    t, box = _thread(lambda: sender.send(fill_from(weights), version))
    stats = engine.refit_receive()
    _join(t, box)
    return stats


def _prompts(engine: TorchEngine) -> list[list[int]]:
    ids = engine.tokenizer("abc=")["input_ids"]
    return [ids, ids, ids]  # one length: the reference below needs no padding


def _teacher_forced(
    engine: TorchEngine, out: RolloutBatch, before: dict, after: dict, swap_step: int
) -> torch.Tensor:
    """The logprobs of ``out``'s tokens replayed through the decode loop with ``before``'s
    weights up to ``swap_step`` and ``after``'s from there, the KV cache kept across."""
    device = engine.device
    ref = TorchEngine(engine.cfg, device.type)
    B = len(out.prompt_ids)
    ids = torch.tensor(out.prompt_ids, device=device)
    mask = torch.ones_like(ids)
    pos = torch.arange(ids.shape[1], device=device).expand(B, -1)
    tokens = torch.tensor(out.response_ids, device=device)
    got = torch.zeros(tokens.shape)
    ref.load_weights(before.items(), 0)
    past, step_ids = None, ids
    with torch.no_grad():
        for t in range(tokens.shape[1]):
            if t == swap_step:
                ref.load_weights(after.items(), 1)
            o = ref.model(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=pos,
                past_key_values=past,
                use_cache=True,
                logits_to_keep=1,
            )
            past = o.past_key_values
            logp = torch.log_softmax(scale_logits(o.logits[:, -1], 1.0, engine.blocked), dim=-1)
            got[:, t] = logp.gather(-1, tokens[:, t : t + 1]).squeeze(-1).cpu()
            step_ids, pos = tokens[:, t : t + 1], pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return got


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_refit_lands_between_decode_steps_and_versions_follow(device):
    """On CUDA the bytes still come over gloo (into host buffers, copied to the GPU's
    staging tensors): the swap and the decode loop are what this checks there."""
    engine = _engine(partial=True, device=device)
    sender = _connect(engine)
    assert not engine.refit_in_place  # staged, then swapped: never written under a forward
    old = _weights(engine)
    new = _perturbed(old, seed=1)
    at_swap, landed = threading.Event(), threading.Event()

    def hook(step: int) -> None:
        if step == SWAP_STEP:
            at_swap.set()
            assert landed.wait(WAIT_S), "the refit did not land"

    engine.on_decode_step = hook
    sampling = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, seed=3)
    gen, box = _thread(lambda: engine.generate(_prompts(engine), sampling))
    assert at_swap.wait(WAIT_S)
    stats = _refit(engine, sender, new, version=1)  # while generate waits before step 5
    landed.set()
    out: RolloutBatch = _join(gen, box)

    assert stats.weight_version == 1 and engine.weight_version() == 1
    assert stats.extra["land_s"] >= 0.0
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, new[name]), f"{name} differs from what was sent"
    assert [len(r) for r in out.response_ids] == [NEW_TOKENS] * 3
    swap = [0] * SWAP_STEP + [1] * (NEW_TOKENS - SWAP_STEP)
    assert out.response_versions == [swap] * 3
    assert out.row_versions == [0, 0, 0] and out.versions() == [0, 0, 0]
    assert out.weight_version == 0  # the start: the oldest token's version

    # Every token was sampled from the weights of its step's version (the KV cache of the
    # tokens before the swap kept from the old weights).
    got = torch.tensor(out.response_logprobs)
    want = _teacher_forced(engine, out, old, new, SWAP_STEP)
    assert (got - want).abs().max().item() < 1e-5
    stale = _teacher_forced(engine, out, old, old, SWAP_STEP)
    assert (got[:, SWAP_STEP:] - stale[:, SWAP_STEP:]).abs().max().item() > 1e-2
    assert (got[:, :SWAP_STEP] - stale[:, :SWAP_STEP]).abs().max().item() < 1e-5


def test_the_network_receive_does_not_wait_for_the_decode_step():
    """Held by a decode step, the lock blocks only the swap: every byte arrives (the sender
    finishes, checksums verified) while the weights and the version stay as they were."""
    engine = _engine(partial=True)
    sender = _connect(engine)
    old = _weights(engine)
    new = _perturbed(old, seed=2)
    with engine._swap_lock:  # what a decode step in progress holds
        recv, recv_box = _thread(engine.refit_receive)
        send, send_box = _thread(lambda: sender.send(fill_from(new), 1))
        _join(send, send_box)
        assert recv.is_alive()  # waiting for the lock, the bytes already in its staging
        assert engine.weight_version() == 0
        for name, p in engine.model.named_parameters():
            assert torch.equal(p, old[name])
    assert _join(recv, recv_box).weight_version == 1
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, new[name])
    # The next refit goes into the tensors the swap freed, and lands bit for bit too.
    newer = _perturbed(new, seed=3)
    assert _refit(engine, sender, newer, version=2).weight_version == 2
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, newer[name])
    out = engine.generate(_prompts(engine), SamplingParams(max_new_tokens=3, seed=0))
    assert out.response_versions == [[2, 2, 2]] * 3 and out.row_versions == [2, 2, 2]


def test_without_partial_rollouts_nothing_changes():
    engine = _engine(partial=False)
    sender = _connect(engine)
    assert engine.refit_in_place  # the weights stay views of the gloo landing
    new = _perturbed(_weights(engine), seed=4)
    stats = _refit(engine, sender, new, version=1)
    assert stats.weight_version == 1 and "land_s" not in stats.extra
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, new[name])
    out = engine.generate(_prompts(engine), SamplingParams(max_new_tokens=NEW_TOKENS, seed=3))
    assert out.weight_version == 1
    assert out.row_versions is None and out.response_versions is None
    assert out.versions() == [1, 1, 1]


class _Replica:
    """Stands in for an engine in a Ray actor: ``generate`` waits for a refit to land while
    it runs, and the refit waits for a generate to be running, so both finish only if the
    refit runs beside the generate."""

    def __init__(self) -> None:
        self.generating, self.landed = threading.Event(), threading.Event()
        self.log: list[str] = []

    def generate(self, tag: int) -> bool:
        self.log.append(f"start {tag}")
        self.generating.set()
        landed = self.landed.wait(WAIT_S)
        self.log.append(f"end {tag}")
        return landed

    def refit_receive(self) -> bool:
        running = self.generating.wait(WAIT_S)
        self.log.append("refit")
        self.landed.set()
        return running

    def events(self) -> list[str]:
        return list(self.log)


def test_a_refit_runs_beside_a_generate_on_the_actor(ray_session):
    """BesideHost: the refit takes its own thread while a generate runs and another one
    waits its turn; the generates still run one after the other, in order."""
    import sys

    from rltrain.cluster.actors import Actor, BesideHost, wait_all

    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    actor: Actor[_Replica] = Actor(BesideHost.options(num_cpus=0).remote(), "rollout rank 0")
    try:
        wait_all([actor.build(_Replica)], WAIT_S, "build")
        first = actor.call(_Replica.generate, 1)
        second = actor.call(_Replica.generate, 2)  # queued behind the first, not on the refit's
        refit = actor.call_beside(_Replica.refit_receive)
        assert wait_all([first, second, refit], WAIT_S, "calls") == [True, True, True]
        events = wait_all([actor.call(_Replica.events)], WAIT_S, "events")[0]
        assert events == ["start 1", "refit", "end 1", "start 2", "end 2"]
    finally:
        actor.kill()
