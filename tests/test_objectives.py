"""The objectives (docs/objectives.md) against plain-Python references written from the papers.

Advantage estimators, loss aggregations, token and sequence (GSPO) ratios,
truncated importance weights and rollout masking, KL estimators, overlong
shaping and dynamic sampling: each is computed here again with loops over
Python floats (or torch scalars where a gradient is compared) on random
rewards, masks and lengths, to 1e-6 (the references: tests/objective_refs.py).
The trainer's side (dp=2 with several micro batches equal to one big batch):
tests/test_objective_trainer.py.
"""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from rltrain.algorithms.advantages import (
    grpo_advantages,
    outcome_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    reward_to_go,
    rloo_advantages,
)
from rltrain.algorithms.losses import (
    Objective,
    kl_estimate,
    padded_seq_id,
    policy_loss,
)
from rltrain.algorithms.shaping import (
    fill_groups,
    informative_groups,
    overlong_penalty,
    truncated_keep_mask,
)
from tests.objective_refs import (
    TOL,
    py_mean,
    random_loss_inputs,
    random_masks,
    random_rewards,
    ref_kl,
    ref_outcome,
    ref_policy_loss,
)

# -- advantages ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
)
@pytest.mark.parametrize("with_kl", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_advantage_estimators_match_the_papers(estimator, with_kl, seed):
    g, n = 4, 5
    rewards = random_rewards(n, g, seed)
    mask = random_masks(n * g, 7, seed)
    kl = None
    if with_kl:
        kl = torch.rand(n * g, 7, generator=torch.Generator().manual_seed(seed + 9)) * 0.1 * mask
    got = outcome_advantages(estimator, rewards, g, mask, kl, True, 1e-6)
    want = ref_outcome(
        estimator, rewards.tolist(), g, mask.tolist(), None if kl is None else kl.tolist()
    )
    torch.testing.assert_close(
        got.double(), torch.tensor(want, dtype=torch.float64), atol=TOL, rtol=0
    )
    if estimator in ("grpo", "dr_grpo", "rloo") and not with_kl:
        assert torch.all(got[:g] == 0)  # no spread, no signal (and no NaN)
    if estimator.startswith("reinforce_pp"):
        assert got.shape == mask.shape and torch.all(got[mask == 0] == 0)


@pytest.mark.parametrize("estimator", ["reinforce_pp", "reinforce_pp_baseline"])
@pytest.mark.parametrize("seed", [0, 1])
def test_kl_in_reward_level_sequence_is_verls_formula(estimator, seed):
    """kl_in_reward_level=sequence: the summed KL off each reward (then the group mean),
    the same value on every token; it differs from the per-token charge it replaces."""
    g, n = 4, 5
    rewards = random_rewards(n, g, seed)
    mask = random_masks(n * g, 7, seed)
    kl = torch.rand(n * g, 7, generator=torch.Generator().manual_seed(seed + 9)) * 0.1 * mask
    got = outcome_advantages(estimator, rewards, g, mask, kl, kl_level="sequence")
    want = ref_outcome(
        estimator, rewards.tolist(), g, mask.tolist(), kl.tolist(), kl_level="sequence"
    )
    torch.testing.assert_close(
        got.double(), torch.tensor(want, dtype=torch.float64), atol=TOL, rtol=0
    )
    per_row = [
        {round(float(x), 6) for x, m in zip(row, mrow, strict=True) if m}
        for row, mrow in zip(got, mask, strict=True)
    ]
    assert all(len(values) == 1 for values in per_row)  # one value per response
    token = outcome_advantages(estimator, rewards, g, mask, kl)
    assert float((token - got).abs().max()) > 1e-3
    # without a KL penalty the two levels are one estimator
    torch.testing.assert_close(
        outcome_advantages(estimator, rewards, g, mask, None, kl_level="sequence"),
        outcome_advantages(estimator, rewards, g, mask, None),
    )


def test_advantage_estimators_known_values():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert grpo_advantages(r, 4, eps=0.0).tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5])
    assert outcome_advantages("dr_grpo", r, 4, torch.ones(4, 2)).tolist() == pytest.approx(
        [0.75, -0.25, -0.25, -0.25]
    )
    # leave-one-out = G/(G-1) x the group-centred reward
    assert rloo_advantages(r, 4).tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    # reward-to-go of an outcome reward with a per-token penalty of 0.1 on 3 tokens
    rtg = reward_to_go(torch.tensor([1.0]), torch.ones(1, 3), torch.full((1, 3), 0.1))
    assert rtg.tolist()[0] == pytest.approx([0.7, 0.8, 0.9])
    # batch whitening: rewards {1, 0} on one token each -> +-1/sqrt(2) (unbiased var 0.5)
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), torch.ones(2, 1))
    assert adv.flatten().tolist() == pytest.approx([0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)])
    base = reinforce_pp_baseline_advantages(torch.tensor([1.0, 0.0, 3.0, 2.0]), 2, torch.ones(4, 1))
    # centred {0.5, -0.5, 0.5, -0.5}: unbiased var 1/3
    assert base.flatten().tolist() == pytest.approx(
        [0.5 / math.sqrt(1 / 3), -0.5 / math.sqrt(1 / 3)] * 2
    )
    with pytest.raises(ValueError, match="groups of 3"):
        rloo_advantages(torch.zeros(4), 3)
    # rewards {1, 0} in one group, KL penalty 0.1 on each of 2 tokens: per token the
    # returns are {0.8, 0.9, -0.2, -0.1} before the group mean (0.5) of the rewards; as a
    # sum, {0.8, -0.2} centred to {0.5, -0.5} on both tokens (unbiased var 1/3)
    kl = torch.full((2, 2), 0.1)
    seq = reinforce_pp_baseline_advantages(
        torch.tensor([1.0, 0.0]), 2, torch.ones(2, 2), kl, kl_level="sequence"
    )
    s3 = math.sqrt(1 / 3 + 1e-8)
    assert seq.flatten().tolist() == pytest.approx([0.5 / s3, 0.5 / s3, -0.5 / s3, -0.5 / s3])
    tok = reinforce_pp_baseline_advantages(torch.tensor([1.0, 0.0]), 2, torch.ones(2, 2), kl)
    x = [0.3, 0.4, -0.7, -0.6]  # 0.8 - 0.5, 0.9 - 0.5, -0.2 - 0.5, -0.1 - 0.5
    m = py_mean(x)
    sd = math.sqrt(sum((v - m) ** 2 for v in x) / 3 + 1e-8)
    assert tok.flatten().tolist() == pytest.approx([(v - m) / sd for v in x])


# -- KL estimators --------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimators_match_their_formulas(estimator):
    gen = torch.Generator().manual_seed(3)
    lp = -torch.rand(50, generator=gen, dtype=torch.float64) * 4
    ref = lp + torch.randn(50, generator=gen, dtype=torch.float64) * 2
    ref[0], lp[0] = -30.0, -0.1  # k3 > 10 here: low_var_kl clamps it
    got = kl_estimate(lp, ref, estimator)
    want = [ref_kl(a, b, estimator) for a, b in zip(lp.tolist(), ref.tolist(), strict=True)]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=TOL, rtol=0)
    if estimator in ("k2", "k3"):
        assert torch.all(got >= 0)
    if estimator == "low_var_kl":
        assert got.max() <= 10.0


def test_kl_estimators_are_unbiased_or_not_as_documented():
    """Sampled from pi, the mean of k1 and k3 tends to KL(pi || ref); k2's does not in general."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    true_kl = float((p * (p / q).log()).sum())
    x = torch.multinomial(p, 400_000, replacement=True, generator=gen)
    lp, ref = p.log()[x], q.log()[x]
    assert float(kl_estimate(lp, ref, "k1").mean()) == pytest.approx(true_kl, abs=3e-3)
    assert float(kl_estimate(lp, ref, "k3").mean()) == pytest.approx(true_kl, abs=3e-3)


# -- the loss: aggregation x ratio level x rollout correction ---------------------------------

AGGREGATIONS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
CORRECTIONS = [(None, None), ("token", None), ("sequence", None), (None, 1.6), ("token", 1.6)]


def _objective(aggregation, level, is_level=None, bound=None, kl=None) -> Objective:
    return Objective(
        clip_low=0.2,
        clip_high=0.28,
        ratio_level=level,
        seq_clip_low=0.04,
        seq_clip_high=0.05,
        aggregation=aggregation,
        max_response_tokens=9,
        kl_coef=0.0 if kl is None else 0.3,
        kl_estimator=kl or "k3",
        is_level=is_level,
        is_cap=1.5,
        mask_bound=bound,
    )


def _check_loss(o: Objective, seed: int, spread: float = 0.5, adv_BT: bool = False):
    lp0, old, ref, engine, adv, mask = random_loss_inputs(seed, spread=spread)
    if adv_BT:
        adv = adv[:, None] * torch.linspace(0.5, 1.5, mask.shape[1], dtype=torch.float64) * mask
    lp = lp0.clone().requires_grad_(True)
    out = policy_loss(lp, old, adv, mask, padded_seq_id(mask), mask.shape[0], o, ref, engine)
    count = out.tokens if out.normaliser == "token" else out.sequences
    loss = out.loss_sum / count
    loss.backward()
    lp_ref = lp0.clone().requires_grad_(True)
    want = ref_policy_loss(lp_ref, old, adv, mask.tolist(), o, ref, engine)
    want.backward()
    assert float(loss.detach()) == pytest.approx(float(want.detach()), abs=TOL)
    torch.testing.assert_close(lp.grad, lp_ref.grad, atol=TOL, rtol=0)
    return out


# A sequence-level ratio takes sequence-level weights (token weights are refused).
LOSS_CASES = [
    (agg, level, corr)
    for agg in AGGREGATIONS
    for level in ("token", "sequence")
    for corr in CORRECTIONS
    if not (level == "sequence" and corr[0] == "token")
]


@pytest.mark.parametrize(("aggregation", "level", "correction"), LOSS_CASES)
def test_policy_loss_matches_the_papers(aggregation, level, correction):
    is_level, bound = correction
    o = _objective(aggregation, level, is_level, bound)
    # sequence ratios: log-ratios small enough that some sequences stay inside the clip range
    out = _check_loss(o, seed=7, spread=0.5 if level == "token" else 0.08)
    clipped = float((out.terms["clipped"] * out.mask_BT).sum())
    assert 0 < clipped < float(out.mask_BT.sum())  # both branches of the clip taken
    if bound is not None:
        assert 0 < float(out.terms["rollout_masked"].sum()) < float(out.mask_BT.sum())
    if is_level is not None:
        assert float(out.terms["is_capped"].max()) == 1.0  # the cap bit somewhere


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_sequence_weights_over_all_tokens_is_verls_product(aggregation, level):
    """sequence_weight_all_tokens: each sequence's weight multiplies rho over all its
    response tokens, the masked ones too (verl), not only over those the loss keeps."""
    o = replace(_objective(aggregation, level, "sequence", 1.6), seq_weight_all_tokens=True)
    out = _check_loss(o, seed=7, spread=0.5 if level == "token" else 0.08)
    kept = _check_loss(
        replace(o, seq_weight_all_tokens=False), 7, 0.5 if level == "token" else 0.08
    )
    masked_rows = (out.terms["rollout_masked"].sum(-1) > 0) & (out.mask_BT.sum(-1) > 0)
    assert bool(masked_rows.any())  # sequences that lost tokens to the mask and kept others
    w_all, w_kept = out.terms["is_weight"][masked_rows], kept.terms["is_weight"][masked_rows]
    assert float((w_all - w_kept).abs().max()) > 1e-3  # their weights differ
    same = out.terms["rollout_masked"].sum(-1) == 0  # no token masked: the same product
    torch.testing.assert_close(out.terms["is_weight"][same], kept.terms["is_weight"][same])


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("correction", [(None, None), ("sequence", 1.6)])
def test_dual_clip_matches_the_paper(level, correction):
    """Dual-clip PPO: a negative-advantage token's loss stops at -A c (zero gradient)."""
    # log-ratios up to +-1.2: token ratios up to 3.3, past c = 1.5 for some A < 0 tokens;
    # a sequence's ratio (the mean log-ratio) stays nearer 1, so c = 1.05 there
    c = 1.5 if level == "token" else 1.05
    o = replace(_objective("token_mean", level, *correction), clip_c=c)
    out = _check_loss(o, seed=6, spread=1.2)
    lower = float((out.terms["clipped_lower"] * out.mask_BT).sum())
    assert 0 < lower < float(out.mask_BT.sum())
    # the dual clip's count: A < 0 tokens whose ratio is above c (outside the clip range)
    adv = random_loss_inputs(6, spread=1.2)[4]
    ratio, valid = out.terms["ratio"], out.mask_BT > 0
    want = int(((adv[:, None] < 0) & (ratio > c) & valid).sum())
    assert lower == want


def test_dual_clip_known_values():
    """A = -1: ratio 5 -> loss 3 (c = 3) and no gradient; ratio 2 -> 2; A = +1, ratio 5 ->
    -1.2 (the upper clip, untouched); verl's pg_clipfrac_lower counts the first token only."""
    lp_old = torch.zeros(1, 3, dtype=torch.float64)
    lp = torch.tensor([[math.log(5.0), math.log(2.0), math.log(5.0)]], dtype=torch.float64)
    lp.requires_grad_(True)
    adv = torch.tensor([[-1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    o = Objective(clip_c=3.0)
    out = policy_loss(lp, lp_old, adv, mask, padded_seq_id(mask), 1, o)
    assert out.terms["pg"][0].tolist() == pytest.approx([3.0, 2.0, -1.2])
    assert out.terms["clipped_lower"].tolist() == [[1.0, 0.0, 0.0]]
    out.loss_sum.backward()
    assert lp.grad is not None
    assert lp.grad[0].tolist() == pytest.approx([0.0, 2.0, 0.0])  # d(-A r)/d lp = -A r
    off = policy_loss(lp.detach(), lp_old, adv, mask, padded_seq_id(mask), 1, Objective())
    assert off.terms["pg"][0].tolist() == pytest.approx([5.0, 2.0, -1.2])
    assert "clipped_lower" not in off.terms


def test_dual_clip_changes_nothing_on_policy():
    """One optimizer step per rollout: the old logprobs are the forward's own, every ratio
    is 1 < c, so loss and gradient are bit for bit those without the dual clip (the
    embedded PPO default, clip_ratio_c=3.0, logs pg_clipfrac_lower = 0 and otherwise the
    metrics of clip_ratio_c=null over 40 steps)."""
    lp0, _, _, _, adv, mask = random_loss_inputs(3, spread=0.5)
    grads, losses = [], []
    for c in (3.0, None):
        lp = lp0.clone().requires_grad_(True)
        o = Objective(clip_c=c)
        out = policy_loss(lp, lp.detach(), -adv.abs(), mask, padded_seq_id(mask), 6, o)
        out.loss_sum.backward()
        losses.append(out.loss_sum.detach())
        grads.append(lp.grad)
        if c is not None:
            assert float(out.terms["clipped_lower"].sum()) == 0.0
    assert torch.equal(losses[0], losses[1]) and torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("kl", ["k1", "k2", "k3", "low_var_kl"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_policy_loss_with_kl_and_token_advantages(kl, aggregation):
    _check_loss(_objective(aggregation, "token", kl=kl), seed=11, adv_BT=True)


def test_policy_loss_is_the_same_packed_or_padded():
    """Two rows packed into one (seq_id marks the sequences) give the padded rows' loss."""
    o = _objective("seq_mean_token_mean", "sequence", "sequence", 1.6, kl="k2")
    lp, old, ref, engine, adv, mask = random_loss_inputs(5, spread=0.08)
    padded = policy_loss(lp, old, adv, mask, padded_seq_id(mask), 6, o, ref, engine)
    seq = padded_seq_id(mask)
    flat = [x.reshape(1, -1) for x in (lp, old, ref, engine, mask, seq)]
    adv_BT = (adv[:, None] * torch.ones_like(mask)).reshape(1, -1)
    packed = policy_loss(flat[0], flat[1], adv_BT, flat[4], flat[5], 6, o, flat[2], flat[3])
    assert float(packed.loss_sum) == pytest.approx(float(padded.loss_sum), abs=1e-12)
    assert float(packed.sequences) == float(padded.sequences)


def test_fully_masked_sequences_leave_the_sequence_count():
    """A truncated response under the overlong filter counts in no normaliser."""
    o = _objective("seq_mean_token_mean", "token")
    lp, old, _, _, adv, mask = random_loss_inputs(2)
    keep = truncated_keep_mask(torch.tensor([True, False, True, True, False, True]), mask)
    out = policy_loss(lp, old, adv, keep, padded_seq_id(mask), 6, o)
    assert float(out.sequences) == 4 and float(out.tokens) == float(keep.sum())


# -- shaping ------------------------------------------------------------------------------------


def test_overlong_penalty_is_dapo_eq_13():
    L, cache = 20, 6
    lengths = torch.arange(0, 25)
    got = overlong_penalty(lengths, L, cache, penalty=0.5)
    for n, x in zip(lengths.tolist(), got.tolist(), strict=True):
        if n <= L - cache:
            want = 0.0
        elif n <= L:
            want = ((L - cache) - n) / cache
        else:
            want = -1.0
        assert x == pytest.approx(0.5 * want, abs=TOL), n
    assert torch.all(overlong_penalty(lengths, L, 0) == 0)


def test_dynamic_sampling_choice_of_groups():
    rewards = torch.tensor([1.0, 1, 1, 0, 1, 0, 0.5, 0.5, 0.5, 0.2, 0.2, 0.3])
    assert informative_groups(rewards, 3).tolist() == [False, True, False, True]
    assert fill_groups([False, True, False, True], 2) == ([1, 3], 0)
    assert fill_groups([False, True, False, True, True], 2) == ([1, 3], 0)
    assert fill_groups([False, True, False], 2) == ([0, 1], 1)  # short: topped up, reported


class _FakeRollouts:
    """An engine stand-in whose answers per round are scripted: in round r the first
    ``varied[r]`` groups answer right and wrong alternately (a signal), every other
    group answers right on every sample (all-equal rewards)."""

    streams_rows = False  # every row of a call comes back together

    def __init__(self, tokenizer, varied: list[int]):
        self.tok, self.varied, self.calls = tokenizer, varied, []

    def generate(self, prompt_ids, sampling):
        from rltrain.rollout.base import RolloutBatch

        r = len(self.calls)
        self.calls.append(sampling.seed)
        responses = []
        for i, prompt in enumerate(prompt_ids):
            group, sample = divmod(i, 8)
            target = self.tok.decode(prompt, skip_special_tokens=True).split("=")[0]
            wrong = group < self.varied[r] and sample % 2
            text = "" if wrong else target
            ids = self.tok.encode(text, add_special_tokens=False) if text else []
            responses.append(ids + [self.tok.eos_token_id])
        n = len(responses)
        return RolloutBatch(
            list(prompt_ids), responses, [[0.0] * len(x) for x in responses], [True] * n, 0
        )


@pytest.mark.parametrize("max_rounds", [4, 2])
def test_dynamic_sampling_refills_from_later_rounds_within_the_bound(max_rounds):
    from rltrain.data import build_task
    from rltrain.logging.metrics import StageTimer
    from rltrain.loops.collect import collect_dynamic, sampling_params
    from rltrain.models.tiny import build_tokenizer
    from tests.conftest import tiny_config

    cfg = tiny_config(
        **{
            "algorithm.prompts_per_step": 4,
            "algorithm.dynamic_sampling.enabled": "true",
            "algorithm.dynamic_sampling.max_rounds": max_rounds,
        }
    )
    tok = build_tokenizer(cfg.data.alphabet)
    engine = _FakeRollouts(tok, varied=[0, 3, 2, 4])  # informative groups per round: 0, 3, 2
    ctx = SimpleNamespace(
        cfg=cfg, task=build_task(cfg.data, cfg.seed), tokenizer=tok, rollout=engine, driver=None
    )
    got = collect_dynamic(ctx, 1, sampling_params(cfg), 0, StageTimer())
    assert len(got.rollout.response_ids) == 32 and got.rewards.shape == (32,)
    assert len(set(engine.calls)) == len(engine.calls)  # every round samples with its own seed
    assert got.generated_rewards is not None and got.generated_rewards.shape == (32 * got.rounds,)
    flags = informative_groups(got.rewards, 8).tolist()
    if max_rounds == 4:
        # round 0 all-equal, round 1 three groups, round 2 fills the fourth: 3 rounds
        assert got.rounds == 3 and flags == [True] * 4 and got.filled_groups == 0
        assert got.dropped_groups == 4 + 1 + 2  # all-equal groups generated, none trained on
    else:
        # the bound stops at 2 rounds: 3 groups with a signal, one all-equal group tops up
        assert got.rounds == 2 and sum(flags) == 3 and got.filled_groups == 1
        assert got.dropped_groups == 4 + 1 - 1
    assert len(engine.calls) == got.rounds <= max_rounds


# -- config: every objective knob is one line ------------------------------------------------


@pytest.mark.parametrize(
    "recipe", ["dapo", "dr-grpo", "gspo", "[qwen1.5b-gsm8k,dapo]", "[dr-grpo,toy-long]"]
)
def test_presets_compose_alone_and_with_other_recipes(recipe):
    from rltrain.config.compose import compose

    cfg, choices = compose([f"recipe={recipe}"], algorithm="grpo")
    a = cfg.algorithm
    assert choices["recipe"] == recipe.strip("[]")
    if "dapo" in recipe:
        assert a.dynamic_sampling.enabled and a.clip_ratio_high == 0.28
        assert a.overlong.buffer == 1 and not a.overlong.filter
        assert a.loss_aggregation == "token_mean"
    if "dr-grpo" in recipe:
        assert a.adv_estimator == "dr_grpo" and a.loss_aggregation == "seq_mean_token_sum_norm"
    if "gspo" in recipe:
        assert a.ratio_level == "sequence" and a.seq_clip_ratio_high == 4e-4
    if "qwen" in recipe:
        assert cfg.model.path == "Qwen/Qwen2.5-1.5B-Instruct" and cfg.data.task == "dataset"
    if "toy-long" in recipe:
        assert cfg.rollout.max_new_tokens == 7


def test_plan_shows_the_objective():
    from rltrain.config.compose import compose
    from rltrain.plan import objective_summary

    cfg, _ = compose(
        [
            "recipe=dapo",
            "algorithm.kl_coef=0.01",
            "algorithm.kl_in_reward=true",
            "algorithm.rollout_correction.weights=sequence",
            "algorithm.rollout_correction.mask_bound=2",
        ],
        algorithm="grpo",
    )
    text = objective_summary(cfg)
    assert text["loss"].startswith("token_mean")
    assert text["kl"] == "0.01 x k3 in the reward"
    assert "up to 4 rounds" in text["dynamic sampling"]
    assert "from 4 to 5 tokens" in text["overlong"]
    assert (
        "sequence-level importance weights min(pi_train/pi_engine, 2.0)"
        in text["rollout correction"]
    )
    assert "dual clip" not in text["ratio"]  # GRPO: off
    verl, _ = compose(
        [
            "algorithm.adv_estimator=reinforce_pp_baseline",
            "algorithm.kl_coef=0.01",
            "algorithm.kl_in_reward=true",
            "algorithm.kl_in_reward_level=sequence",
            "algorithm.clip_ratio_c=3",
            "algorithm.rollout_correction.weights=sequence",
            "algorithm.rollout_correction.mask_bound=2",
            "algorithm.rollout_correction.sequence_weight_all_tokens=true",
        ],
        algorithm="grpo",
    )
    text = objective_summary(verl)
    assert text["kl"].endswith("in the reward (summed per response, the same on every token)")
    assert text["ratio"].endswith("dual clip: loss of A < 0 tokens at most -A x 3")
    assert "over every response token (masked ones included)" in text["rollout correction"]
