"""Multi-turn episodes under the asynchronous loop (loops/async_episodes.py): a call made of
whole episodes through the real buffer, turn driver and torch engine, with refits landing
between two turns and within one. Each refit lands at a known point of the episodes (the
environment's step, the engine's decode-step hook), so nothing races the clock.
"""

from __future__ import annotations

import math
import threading
from types import SimpleNamespace

import pytest
import torch

from rltrain.algorithms.logprobs import scale_logits, token_logprobs
from rltrain.algorithms.losses import rollout_correction
from rltrain.cluster.actors import LocalActor
from rltrain.cluster.handles import Calls
from rltrain.cluster.pool import RolloutPool
from rltrain.data.task import PromptItem
from rltrain.envs.base import Episode, StepResult, Turn
from rltrain.envs.bench_turns import BenchTurnsEnv
from rltrain.envs.driver import TurnDriver
from rltrain.loops.async_buffer import AsyncController, AsyncState, join_groups
from rltrain.loops.async_episodes import env_metrics
from rltrain.loops.async_grpo import straddling_rows
from rltrain.models.loader import load_tokenizer
from rltrain.rollout.torch_engine import TorchEngine
from rltrain.train.batch import build_train_batch
from tests.conftest import tiny_config

PER_TURN = 4  # sampled tokens per turn (EOS blocked: every turn takes its whole budget)
SWAP_STEP = 2  # the second refit lands before decode step 2 of the third turn
CAP = 2.0


def _cfg():
    return tiny_config(**{
        "env": "bench_turns", "env.max_turns": 3, "env.max_tokens_per_turn": PER_TURN,
        "env.options.observation_chars": 2,
        "model.blocked_tokens": "['<pad>','<bos>','<unk>','<eos>']",
        "algorithm.async_rollout.enabled": True, "algorithm.async_rollout.partial_rollouts": True,
        "algorithm.async_rollout.max_staleness": 1, "algorithm.async_rollout.groups_per_call": 2,
        "algorithm.prompts_per_step": 2, "algorithm.samples_per_prompt": 2,
    })  # fmt: skip


def _perturbed(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: w + 0.05 * torch.randn(w.shape, generator=g) for n, w in weights.items()}


class RefitBetweenTurns(BenchTurnsEnv):
    """bench_turns, with the refits of a trainer that moves on while the episodes run: version
    1 lands once the first turns were answered (between turns 1 and 2), version 2 within the
    third turn (armed when the second turns were answered; it lands before decode step
    SWAP_STEP, as a partial rollout's refit does)."""

    def __init__(self, cfg, engine: TorchEngine, versions: list[dict[str, torch.Tensor]]):
        super().__init__(cfg.env, None, None, cfg.seed, observation_chars=2)
        self.engine, self.versions = engine, versions
        self.lock = threading.Lock()
        self.landed = {1: False, 2: False}
        self.armed = False
        engine.on_decode_step = self._decode_step

    def step(self, episodes: list[Episode], turns: list[Turn]) -> list[StepResult]:
        with self.lock:
            turn = episodes[0].turn
            if turn == 1 and not self.landed[1]:
                self.engine.load_weights(self.versions[1].items(), 1)
                self.landed[1] = True
            if turn == 2:
                self.armed = True
        return super().step(episodes, turns)

    def _decode_step(self, t: int) -> None:
        if self.armed and t == SWAP_STEP:
            self.engine.load_weights(self.versions[2].items(), 2)
            self.armed, self.landed[2] = False, True


@pytest.fixture(scope="module")
def straddled():
    """One call of the asynchronous loop (2 groups x 2 episodes of 3 turns) whose turns
    straddle two refits, collected into the buffer; the weights of versions 0, 1, 2 and the
    trainer's (3)."""
    cfg = _cfg()
    engine = TorchEngine(cfg)
    v0 = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    versions = [v0, _perturbed(v0, 1), _perturbed(v0, 2), _perturbed(v0, 3)]
    tok = load_tokenizer(cfg)
    env = RefitBetweenTurns(cfg, engine, versions)
    driver = TurnDriver(env, cfg.env, tok, cfg.rollout.max_new_tokens, "torch")
    actor = LocalActor("rollout rank 0")
    actor.host.worker = engine
    # Prompts of one length: the engine's rows need no padding, so a plain forward of each
    # version's weights is the reference of its logprobs.
    items = [PromptItem("ab=", "ab"), PromptItem("cd=", "cd")]
    task = SimpleNamespace(sample=lambda n: items[:n])
    ctx = SimpleNamespace(cfg=cfg, rollout=RolloutPool([actor], False, Calls(120.0)),
                          task=task, tokenizer=tok, driver=driver)  # fmt: skip
    gen = AsyncController(ctx, AsyncState())
    gen.fill(taken=0, groups_left=2)  # one call: its episodes run on a thread of their own
    assert len(gen.in_flight) == 1
    while gen.in_flight:
        gen.collect(None)  # waits for the call to return (its future), no polling
    driver.close()
    assert env.landed == {1: True, 2: True}
    return SimpleNamespace(cfg=cfg, gen=gen, engine=engine, versions=versions, tok=tok)


def test_turns_that_straddle_refits_keep_per_token_versions(straddled):
    gen = straddled.gen
    assert [g.version for g in gen.state.waiting] == [0, 0]  # each group's oldest token
    rollout = join_groups(list(gen.state.waiting))
    assert len(rollout.response_ids) == 4
    for mask, versions in zip(rollout.response_mask, rollout.response_versions, strict=True):
        obs = (len(mask) - 3 * PER_TURN) // 2
        assert obs >= 2
        assert mask == [1] * PER_TURN + [0] * obs + [1] * PER_TURN + [0] * obs + [1] * PER_TURN
        sampled = [v for v, m in zip(versions, mask, strict=True) if m]
        # turn 1 on version 0, turn 2 on 1 (the refit landed between), turn 3 on 1 then 2
        assert sampled == [0] * PER_TURN + [1] * PER_TURN + [1] * SWAP_STEP + [2] * (
            PER_TURN - SWAP_STEP
        )
    assert rollout.versions() == [0, 0, 0, 0]  # staleness counts from the oldest token
    assert straddling_rows(rollout) == 4  # async/straddled_frac: every row spans a refit
    # the env/* metrics of the call, as the synchronous loop logs them
    metrics = env_metrics(gen.state.waiting)
    assert metrics["env/turns_mean"] == 3.0 and metrics["env/observation_truncated"] == 0.0


def test_the_checkpointed_buffer_keeps_versions_and_masks(straddled, tmp_path):
    gen = straddled.gen
    torch.save(gen.state.dump([]), tmp_path / "state.pt")
    back = AsyncState.load(torch.load(tmp_path / "state.pt", weights_only=True))
    for a, b in zip(gen.state.waiting, back.waiting, strict=True):
        assert b.version == a.version and b.call_groups == a.call_groups == 2
        assert b.rollout.response_versions == a.rollout.response_versions
        assert b.rollout.response_mask == a.rollout.response_mask
        assert b.metrics == a.metrics


def _logprobs(engine: TorchEngine, weights: dict[str, torch.Tensor], ids: torch.Tensor):
    """Per position t, log p(ids[:, t] | ids[:, :t]) under ``weights`` (one forward)."""
    ref = TorchEngine(engine.cfg)
    ref.load_weights(weights.items(), 0)
    with torch.no_grad():
        logits = ref.model(input_ids=ids).logits
    return token_logprobs(logits, ids, 1.0, engine.blocked)[0][0]


def _stitched(engine, before, after, ids: torch.Tensor, split: int) -> torch.Tensor:
    """Logprobs of ids[:, split:] (sampled after a refit within a turn) with the KV of the
    tokens before the last one sampled ahead of it from ``before``'s weights and the rest
    from ``after``'s: the engine keeps its cache across the swap."""
    a, b = TorchEngine(engine.cfg), TorchEngine(engine.cfg)
    a.load_weights(before.items(), 0)
    b.load_weights(after.items(), 0)
    with torch.no_grad():
        # The token sampled just before the swap is fed (its KV computed) by the new weights.
        past = a.model(input_ids=ids[:, : split - 1], use_cache=True).past_key_values
        logits = b.model(input_ids=ids[:, split - 1 : -1], past_key_values=past).logits
    logp = torch.log_softmax(scale_logits(logits, 1.0, engine.blocked), dim=-1)
    return logp.gather(-1, ids[:, split:, None]).squeeze(-1)


def test_staleness_bound_and_per_token_correction(straddled):
    gen, engine, versions = straddled.gen, straddled.engine, straddled.versions
    groups = list(gen.state.waiting)
    rollout = join_groups(groups)
    batch = build_train_batch(rollout, straddled.tok.pad_token_id)
    B, T = batch.input_ids_BT.shape

    # Each sampled token's engine logprob is its own version's (the turns that straddle a
    # refit included), and not the oldest token's.
    worst_own, least_other = 0.0, math.inf
    full = {v: [_logprobs(engine, versions[v], batch.input_ids_BT[i : i + 1]) for i in range(B)]
            for v in (0, 1, 2)}  # fmt: skip
    for i in range(B):
        p = len(rollout.prompt_ids[i])
        ids = batch.input_ids_BT[i : i + 1]
        turn3 = p + rollout.response_mask[i].index(1, len(rollout.response_mask[i]) - PER_TURN)
        late = _stitched(engine, versions[1], versions[2], ids, turn3 + SWAP_STEP)[0]
        for j, (m, v) in enumerate(
            zip(rollout.response_mask[i], rollout.response_versions[i], strict=True)
        ):
            if not m:
                continue
            pos = p + j
            want = late[pos - turn3 - SWAP_STEP] if v == 2 else full[v][i][pos]
            got = batch.engine_logprobs_BT[i, pos]
            worst_own = max(worst_own, abs(float(got - want)))
            if v > 0:
                least_other = min(least_other, abs(float(got - full[0][i][pos])))
    assert worst_own < 1e-5, worst_own
    assert least_other > 1e-3, least_other

    # The per-token correction: rho_t = pi_proximal / pi_behaviour(version of token t),
    # truncated at the cap; against a plain loop over the trajectories' own logprobs.
    proximal = torch.stack([_logprobs(engine, versions[3], batch.input_ids_BT[i : i + 1])
                            for i in range(B)]) * batch.response_mask_BT  # fmt: skip
    seq_id = torch.arange(B)[:, None].expand(B, T)
    mask, weights, capped = rollout_correction(proximal, batch.engine_logprobs_BT,
                                               batch.loss_mask_BT, seq_id, B, "token", CAP, None)  # fmt: skip
    assert weights is not None and torch.equal(mask, batch.loss_mask_BT)
    reference = torch.zeros(B, T)
    for i in range(B):
        p = len(rollout.prompt_ids[i])
        for j, m in enumerate(rollout.response_mask[i]):
            if m:
                rho = math.exp(float(proximal[i, p + j]) - rollout.response_logprobs[i][j])
                reference[i, p + j] = min(rho, CAP)
    sampled = batch.response_mask_BT.bool()
    assert (weights[sampled] - reference[sampled]).abs().max().item() < 1e-6
    assert 0 < float(capped[sampled].mean()) < 1  # the cap bit some tokens, not all
    # Had every token been judged by its oldest version, the weights would differ.
    oldest = torch.stack(full[0]) * batch.response_mask_BT
    _, as_oldest, _ = rollout_correction(proximal, oldest, batch.loss_mask_BT, seq_id, B,
                                         "token", CAP, None)  # fmt: skip
    assert as_oldest is not None
    assert (as_oldest[sampled] - weights[sampled]).abs().max().item() > 1e-3

    # The bound, from the oldest token: at trainer version 1 (k=1) the groups train; at 2
    # they are dropped and counted, although their newest tokens are of version 2.
    assert gen.drop_stale(1) == 0 and len(gen.state.waiting) == 2
    assert gen.drop_stale(2) == 2 * 2 and gen.state.waiting == []
    assert gen.state.dropped_total == 4
