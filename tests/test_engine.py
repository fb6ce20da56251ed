"""The torch rollout engine against a plain full forward pass of the same model."""

from __future__ import annotations

import pytest
import torch

from rltrain.algorithms.logprobs import token_logprobs
from rltrain.config.schema import RunConfig
from rltrain.rollout.base import SamplingParams
from rltrain.rollout.torch_engine import TorchEngine, top_p_filter

BLOCKED = ["<pad>", "<bos>", "<unk>"]
PROMPTS = ["a=", "abc=", "dd=", "bcad=", "c="]


def _cfg() -> RunConfig:
    cfg = RunConfig()
    cfg.model.blocked_tokens = list(BLOCKED)
    return cfg


@pytest.fixture(scope="module")
def engine() -> TorchEngine:
    return TorchEngine(_cfg())


def _encode(engine: TorchEngine, prompts: list[str]) -> list[list[int]]:
    return [engine.tokenizer(p)["input_ids"] for p in prompts]


def _reference_logprobs(
    engine: TorchEngine, prompt: list[int], response: list[int], temperature: float
):
    """Logprobs of the response under one unpadded full forward of prompt + response."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits
    lp, _ = token_logprobs(logits, ids, temperature, engine.blocked)
    return lp[0, len(prompt) :]


def test_prompts_have_different_lengths(engine):
    ids = _encode(engine, PROMPTS)
    assert len({len(p) for p in ids}) >= 3
    assert all(p[0] == engine.tokenizer.bos_token_id for p in ids)
    assert sorted(engine.blocked.tolist()) == sorted(
        engine.tokenizer.convert_tokens_to_ids(BLOCKED)
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_full_forward(engine, temperature):
    prompts = _encode(engine, PROMPTS) * 4
    out = engine.generate(
        prompts, SamplingParams(temperature=temperature, max_new_tokens=6, seed=11)
    )
    assert len(out.response_ids) == len(prompts)
    assert out.prompt_ids == prompts
    checked = 0
    for prompt, resp, lps in zip(prompts, out.response_ids, out.response_logprobs, strict=True):
        assert len(resp) == len(lps) >= 1
        ref = _reference_logprobs(engine, prompt, resp, temperature)
        got = torch.tensor(lps)
        assert torch.allclose(got, ref, atol=1e-5, rtol=0), (prompt, resp, got, ref)
        assert torch.all(got <= 0) and torch.isfinite(got).all()
        checked += len(resp)
    assert checked > len(prompts)


def test_temperature_changes_logprobs(engine):
    prompts = _encode(engine, PROMPTS)
    out = engine.generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=6, seed=5))
    diffs = []
    for prompt, resp, lps in zip(prompts, out.response_ids, out.response_logprobs, strict=True):
        at_07 = _reference_logprobs(engine, prompt, resp, 0.7)
        at_10 = _reference_logprobs(engine, prompt, resp, 1.0)
        assert torch.allclose(torch.tensor(lps), at_07, atol=1e-5, rtol=0)
        diffs.append((torch.tensor(lps) - at_10).abs().max().item())
    assert max(diffs) > 1e-3  # the engine did not score at temperature 1


def test_eos_stops_a_row(engine):
    eos = engine.eos_id
    prompts = _encode(engine, PROMPTS) * 16
    max_new = 5
    out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=2))
    n_finished = 0
    for resp, lps, fin in zip(out.response_ids, out.response_logprobs, out.finished, strict=True):
        assert len(resp) == len(lps)
        assert fin == (resp[-1] == eos)
        assert eos not in resp[:-1]  # nothing is generated after EOS
        if fin:
            n_finished += 1
        else:
            assert len(resp) == max_new
    assert 0 < n_finished < len(prompts)  # both cases are exercised


def test_blocked_tokens_never_sampled(engine):
    blocked = set(engine.blocked.tolist())
    assert len(blocked) == 3
    prompts = _encode(engine, PROMPTS) * 40
    out = engine.generate(prompts, SamplingParams(temperature=3.0, max_new_tokens=6, seed=9))
    sampled = [t for r in out.response_ids for t in r]
    assert len(sampled) > 400
    assert not blocked & set(sampled)
    # At temperature 3 every allowed token shows up: the check is not vacuous.
    allowed = set(range(len(engine.tokenizer))) - blocked
    assert set(sampled) == allowed


def test_same_seed_same_tokens(engine):
    prompts = _encode(engine, PROMPTS) * 3
    a = engine.generate(prompts, SamplingParams(max_new_tokens=6, seed=123))
    b = engine.generate(prompts, SamplingParams(max_new_tokens=6, seed=123))
    c = engine.generate(prompts, SamplingParams(max_new_tokens=6, seed=124))
    assert a.response_ids == b.response_ids
    assert a.response_logprobs == b.response_logprobs
    assert a.finished == b.finished
    assert a.response_ids != c.response_ids


def _ref_top_p(row: list[float], p: float) -> list[float]:
    order = sorted(range(len(row)), key=lambda i: -row[i])
    keep, mass = set(), 0.0
    for i in order:
        keep.add(i)
        mass += row[i]
        if mass >= p:
            break
    return [row[i] if i in keep else 0.0 for i in range(len(row))]


def test_top_p_filter_exact():
    probs = torch.tensor([[0.125, 0.5, 0.125, 0.25]])
    assert top_p_filter(probs, 0.5).tolist() == [[0.0, 0.5, 0.0, 0.0]]
    assert top_p_filter(probs, 0.4).tolist() == [[0.0, 0.5, 0.0, 0.0]]
    assert top_p_filter(probs, 0.75).tolist() == [[0.0, 0.5, 0.0, 0.25]]
    assert top_p_filter(probs, 0.76).tolist()[0].count(0.0) == 1  # 3 kept (one of the ties)
    assert torch.equal(top_p_filter(probs, 1.0), probs)


def test_top_p_filter_matches_loop():
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(16, 12, generator=gen, dtype=torch.float64) * 2, -1)
    for p in (0.1, 0.3, 0.6, 0.9, 0.99):
        out = top_p_filter(probs, p)
        ref = torch.tensor([_ref_top_p(row, p) for row in probs.tolist()], dtype=torch.float64)
        assert torch.equal(out, ref), p
        kept = out > 0
        assert torch.all(out.sum(-1) >= p - 1e-12)
        # Smallest set: dropping its least likely member falls below p.
        smallest = torch.where(kept, out, torch.full_like(out, 2.0)).min(-1).values
        assert torch.all(out.sum(-1) - smallest < p)


def test_top_p_restricts_sampling(engine):
    prompts = _encode(engine, PROMPTS) * 20
    out = engine.generate(
        prompts, SamplingParams(temperature=1.0, top_p=0.05, max_new_tokens=3, seed=1)
    )
    # top_p this small keeps only the most likely token: sampling is greedy.
    for prompt, resp in zip(prompts, out.response_ids, strict=True):
        ids = torch.tensor([prompt + resp])
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[0].float()
        logits[:, engine.blocked] = float("-inf")
        for j, tok in enumerate(resp):
            assert tok == int(logits[len(prompt) + j - 1].argmax())


def test_load_weights_changes_outputs_and_version():
    eng = TorchEngine(_cfg())
    prompts = _encode(eng, PROMPTS)
    sampling = SamplingParams(max_new_tokens=4, seed=7)
    before = eng.generate(prompts, sampling)
    assert eng.weight_version() == 0 and before.weight_version == 0

    gen = torch.Generator().manual_seed(0)
    new = {
        name: p.detach().clone() + 0.5 * torch.randn(p.shape, generator=gen)
        for name, p in eng.model.named_parameters()
        if name.startswith("lm_head") or "layers.1." in name
    }
    n = eng.load_weights(new.items(), weight_version=7)
    assert n == len(new) > 1
    assert eng.weight_version() == 7
    params = dict(eng.model.named_parameters())
    for name, t in new.items():
        assert torch.equal(params[name].detach(), t)

    after = eng.generate(prompts, sampling)
    assert after.weight_version == 7
    assert after.response_logprobs != before.response_logprobs
    # The logprobs follow the new weights. The 0.5-sigma perturbation makes the logits
    # large, so fp32 rounding of the cached and the full forward differs by ~1e-4 relative.
    for prompt, resp, lps in zip(prompts, after.response_ids, after.response_logprobs, strict=True):
        ref = _reference_logprobs(eng, prompt, resp, 1.0)
        assert torch.allclose(torch.tensor(lps), ref, atol=1e-5, rtol=2e-4)

    with pytest.raises(KeyError, match="no parameter 'nope'"):
        eng.load_weights([("nope", torch.zeros(1))], weight_version=8)
