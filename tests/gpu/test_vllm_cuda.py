"""The vLLM engine on CUDA (gpu tier): generate, processed logprobs against the trainer's
scoring of the same tokens (fp32 tiny model), and sleep / wake.

One spawned process builds the engine once and runs every check (vLLM joins
torch.distributed and keeps GPU memory for the life of its process); the tests
assert on what it measured.
"""

from __future__ import annotations

import pytest

from tests.gpu.common import BLOCKED, gpu_config, needs
from tests.ranks import run_ranks

pytestmark = [pytest.mark.gpu, needs("vllm"), pytest.mark.timeout(900)]

# As in tests/test_vllm_engine.py: one prompt longer than a KV block, so a prefix cache
# that outlived a sleep (or a refit) would show as changed logprobs.
PROMPTS = ["a=", "abc=", "dd=", "bcad=", "c=", "abcd" * 35 + "="]
GPU_FRACTION = 0.25  # rollout.vllm.gpu_memory_utilization of the engine under test
KV_GIB = 2.0  # its KV cache (rollout.vllm.kv_cache_gib): what sleep must give back at least
MAX_ABS_LOGPROB = 1e-3  # engine vs trainer, fp32 (vLLM runs TRITON_ATTN there)


def _cfg():
    cfg = gpu_config("fp32")
    cfg.model.tiny.max_position_embeddings = 192
    cfg.rollout.engine = "vllm"
    cfg.rollout.colocated = True  # vLLM's sleep mode is on only for colocated engines
    cfg.rollout.vllm.gpu_memory_utilization = GPU_FRACTION
    cfg.rollout.vllm.kv_cache_gib = KV_GIB
    # every row's logprobs (auto gives one row in 8 on GPUs): the checks read them all
    cfg.rollout.engine_logprobs = "all"
    # a seed per request (auto: the engine's generator on GPUs, whose state moves on between
    # calls): the generate after wake-up samples the same rows as the one before the sleep
    cfg.rollout.vllm.request_seeds = True
    return cfg


def _score(model, blocked, batch, temperature: float) -> dict[str, float]:
    """Max |engine - trainer| logprob and mean exp|diff| over every response token."""
    import torch

    from rltrain.algorithms.logprobs import token_logprobs

    worst, mult, n = 0.0, 0.0, 0
    for prompt, resp, lps in zip(
        batch.prompt_ids, batch.response_ids, batch.response_logprobs, strict=True
    ):
        ids = torch.tensor([prompt + resp], device="cuda")
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        ref, _ = token_logprobs(logits, ids, temperature, blocked)
        diff = (torch.tensor(lps, device="cuda") - ref[0, len(prompt) :]).abs()
        worst = max(worst, float(diff.max()))
        mult += float(diff.exp().sum())
        n += len(resp)
    return {"max_abs": worst, "mult": mult / n, "tokens": float(n)}


def _max_logprob_gap(a, b) -> float:
    """Max |a - b| over every response token of two rollouts of the same tokens."""
    return max(
        abs(x - y)
        for ra, rb in zip(a.response_logprobs, b.response_logprobs, strict=True)
        for x, y in zip(ra, rb, strict=True)
    )


def _engine_checks(rank: int) -> dict:
    """Runs in a spawned process: build the engine, generate, score, sleep and wake."""
    import torch

    from rltrain.models.loader import load_model
    from rltrain.rollout.base import SamplingParams
    from rltrain.rollout.vllm_engine import VLLMEngine

    cfg = _cfg()
    engine = VLLMEngine(cfg, device="cuda")
    tok = engine.tokenizer
    prompts = [tok(p)["input_ids"] for p in PROMPTS] * 8
    blocked = torch.tensor(tok.convert_tokens_to_ids(BLOCKED), device="cuda")
    model = load_model(cfg, "float32").cuda().eval()  # the trainer's initial weights
    out: dict = {
        "tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "total_bytes": torch.cuda.mem_get_info()[1],
        "eos_id": engine.eos_id,
        "blocked_ids": blocked.tolist(),
    }

    # generate at two temperatures; score the sampled tokens with the trainer's function
    for temperature in (1.0, 0.7):
        batch = engine.generate(
            prompts, SamplingParams(temperature=temperature, max_new_tokens=8, seed=11)
        )
        out[f"batch_{temperature}"] = batch
        out[f"score_{temperature}"] = _score(model, blocked, batch, temperature)
        if temperature != 1.0:  # scored at 1 instead: must differ (the check is not vacuous)
            out["score_0.7_at_1"] = _score(model, blocked, batch, 1.0)

    # sleep frees the engine's GPU memory; after wake-up it samples exactly as before
    out.update(_sleep_and_wake(engine, prompts))
    engine.shutdown()
    return out


def _sleep_and_wake(engine, prompts: list[list[int]]) -> dict:
    """Generate, sleep (the GPU memory freed, a generate refused), wake (the memory taken
    back) and generate the same seeded call again."""
    import torch

    from rltrain.rollout.base import SamplingParams

    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5)
    out: dict = {"before_sleep": engine.generate(prompts, sampling)}
    torch.cuda.synchronize()
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep()
    torch.cuda.synchronize()
    free_asleep = torch.cuda.mem_get_info()[0]
    try:
        engine.generate(prompts, sampling)
        out["generate_while_asleep"] = "returned"
    except RuntimeError as exc:
        out["generate_while_asleep"] = str(exc)
    engine.wake_up()
    torch.cuda.synchronize()
    out["retaken_bytes"] = free_asleep - torch.cuda.mem_get_info()[0]
    out["freed_bytes"] = free_asleep - free_awake
    out["after_wake"] = engine.generate(prompts, sampling)
    return out


def _lora_sleep_checks(rank: int) -> dict:
    """Runs in a spawned process: a LoRA engine (bf16: vLLM's LoRA kernels) sleeps keeping
    its weights (rollout.vllm.sleep_keeps_weights=null), then wakes and samples as before."""
    from rltrain.rollout.vllm_engine import VLLMEngine

    cfg = _cfg()
    cfg.train.lora.rank = 8
    cfg.precision.rollout_dtype = "bfloat16"
    engine = VLLMEngine(cfg, device="cuda")
    prompts = [engine.tokenizer(p)["input_ids"] for p in PROMPTS] * 8
    out = {"keeps_weights": engine._keeps_weights, **_sleep_and_wake(engine, prompts)}
    engine.shutdown()
    return out


def test_lora_engine_sleeps_keeping_its_weights(tmp_path_factory):
    """With LoRA the engine frees only its KV cache while asleep (its base never changes)
    and, woken, samples the same seeded rows with the same logprobs."""
    (m,) = run_ranks(_lora_sleep_checks, 1, (), tmp_path_factory.mktemp("vllm_lora_sleep"), 800)
    assert m["keeps_weights"]
    _check_sleep_and_wake(m)


def _check_sleep_and_wake(m: dict) -> None:
    """What :func:`_sleep_and_wake` measured: at least the KV cache freed and taken back,
    a generate refused while asleep, the same rows and logprobs after the wake-up."""
    kv_bytes = KV_GIB * 2**30
    assert m["freed_bytes"] >= kv_bytes, (m["freed_bytes"], kv_bytes)
    assert m["retaken_bytes"] >= kv_bytes, (m["retaken_bytes"], kv_bytes)
    assert "asleep" in m["generate_while_asleep"]
    before, after = m["before_sleep"], m["after_wake"]
    assert after.response_ids == before.response_ids
    worst = _max_logprob_gap(after, before)
    assert worst < 1e-5, worst


# The logprobs kept in vLLM's worker (rollout.vllm.worker_logprobs, vllm_capture.py): a KV
# cache of a few sequences, so that vLLM preempts rows and resumes them in other slots.
CAPTURE_KV_TOKENS = 4 * 192
CAPTURE_NEW_TOKENS = 40


def _capture_cfg(keep: bool):
    cfg = _cfg()
    # no blocked tokens: vLLM's custom logits processor would send it to its V1 model runner
    cfg.model.blocked_tokens = []
    cfg.rollout.colocated = False
    cfg.rollout.vllm.worker_logprobs = keep
    t = cfg.model.tiny
    # a padded vocabulary: the random model then rarely samples EOS, and rows run long
    t.vocab_size = 2048
    per_token = 2 * t.num_layers * t.num_kv_heads * (t.hidden_size // t.num_heads) * 4  # fp32
    cfg.rollout.vllm.kv_cache_gib = CAPTURE_KV_TOKENS * per_token / 2**30
    return cfg


def _capture_checks(rank: int) -> dict:
    """Runs in a spawned process: the same seeded call with the logprobs kept in vLLM's
    worker and with vLLM's own, one engine after the other; the kept ones scored by the
    trainer's forward."""
    import torch

    from rltrain.models.loader import load_model
    from rltrain.rollout.base import SamplingParams
    from rltrain.rollout.vllm_engine import VLLMEngine

    out: dict = {}
    for keep in (True, False):
        cfg = _capture_cfg(keep)
        engine = VLLMEngine(cfg, device="cuda")
        prompts = [engine.tokenizer(p)["input_ids"] for p in PROMPTS] * 8
        sampling = SamplingParams(temperature=0.7, max_new_tokens=CAPTURE_NEW_TOKENS, seed=3)
        batch = engine.generate(prompts, sampling)
        out[keep] = {"batch": batch, "note": engine.logprobs_note, "kept": engine._capture}
        if keep:
            (out["counts"],) = engine._rpc("rltrain_capture_counts")
        engine.shutdown()
    model = load_model(_capture_cfg(True), "float32").cuda().eval()
    out["score"] = _score(model, None, out[True]["batch"], 0.7)
    torch.cuda.synchronize()
    return out


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> dict:
    (result,) = run_ranks(_capture_checks, 1, (), tmp_path_factory.mktemp("vllm_capture"), 800)
    return result


def test_logprobs_kept_in_the_worker_equal_vllms_own_and_the_trainers(captured):
    kept, own = captured[True], captured[False]
    assert kept["kept"] and "kept in vLLM's worker" in kept["note"], kept["note"]
    assert not own["kept"]
    a, b = kept["batch"], own["batch"]
    # the same seeded rows (a seed per request), preempted and resumed alike
    assert a.response_ids == b.response_ids
    worst = _max_logprob_gap(a, b)
    assert worst <= 1e-6, worst  # vLLM's own kernel over the same processed logits
    # vLLM preempted rows (a small KV cache) and their kept rows came back with them;
    # whatever the call took is freed (nothing kept for nobody)
    counts = captured["counts"]
    assert counts["resumed"] > 0 and counts["kept"] == 0, counts
    score = captured["score"]
    assert score["tokens"] > 1000
    assert score["max_abs"] < MAX_ABS_LOGPROB, score


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    (result,) = run_ranks(_engine_checks, 1, (), tmp_path_factory.mktemp("vllm_cuda"), 800)
    return result


def test_generate_on_cuda(measured):
    batch, eos = measured["batch_1.0"], measured["eos_id"]
    assert len(batch.response_ids) == len(PROMPTS) * 8 and batch.weight_version == 0
    blocked = set(measured["blocked_ids"])
    for resp, lps, fin in zip(
        batch.response_ids, batch.response_logprobs, batch.finished, strict=True
    ):
        assert 1 <= len(resp) == len(lps) <= 8
        assert fin == (resp[-1] == eos) and (fin or len(resp) == 8)
        assert not blocked & set(resp)
        assert all(lp <= 0.0 for lp in lps)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_the_trainer(measured, temperature):
    score = measured[f"score_{temperature}"]
    assert score["tokens"] > 100
    assert score["max_abs"] < MAX_ABS_LOGPROB, (score, "tf32", measured["tf32"])
    assert score["mult"] < 1.0001, score
    if temperature != 1.0:  # processed logprobs: scored at this temperature, not at 1
        assert measured["score_0.7_at_1"]["max_abs"] > 1e-2


def test_sleep_frees_memory_and_wake_samples_as_before(measured):
    # Sleep gives back what vLLM mapped (the KV cache of KV_GIB and the weights); wake-up maps
    # it again.
    _check_sleep_and_wake(measured)
