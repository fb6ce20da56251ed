"""The vLLM engine (real vLLM on CPU) against the trainer's forward, before and after a refit."""

from __future__ import annotations

import math
import os
import threading

import pytest
import torch

from rltrain.algorithms.logprobs import token_logprobs
from rltrain.config.schema import RunConfig
from rltrain.models.loader import load_model
from rltrain.refit.base import RefitGroup, fill_from, plan_buckets
from rltrain.refit.gloo import GlooRefitSender
from rltrain.rollout.base import SamplingParams
from rltrain.train.distributed import free_port

BLOCKED = ["<pad>", "<bos>", "<unk>"]
# One prompt longer than a KV block (128 tokens on CPU): vLLM caches its first block, so a
# prefix cache kept across a refit would show as stale logprobs.
PROMPTS = ["a=", "abc=", "dd=", "bcad=", "c=", "abcd" * 35 + "="]


def _cfg() -> RunConfig:
    cfg = RunConfig()
    cfg.model.blocked_tokens = list(BLOCKED)
    cfg.model.tiny.max_position_embeddings = 192
    cfg.rollout.vllm.cpu_kv_cache_gib = 0.25
    # Refits may land while a generate is in flight (one engine serves every test here:
    # vLLM's engine processes take a while to start on a 2-core machine).
    cfg.algorithm.async_rollout.enabled = True
    cfg.algorithm.async_rollout.partial_rollouts = True
    return cfg


@pytest.fixture(scope="module")
def engine():
    from rltrain.rollout.vllm_core import start_core_server
    from rltrain.rollout.vllm_engine import VLLMEngine

    # As in a replica's actor: the engine core is forked from this process's server (every
    # test of this module then checks an engine whose core started that way).
    start_core_server("cpu")
    # vLLM's CPU worker replaces torch.set_num_threads and lowers the thread count for the
    # whole process (harmless in a replica's actor); give later tests of this session both back.
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    eng = VLLMEngine(_cfg(), num_threads=1)
    yield eng
    eng.shutdown()
    torch.set_num_threads = set_num_threads
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trainer_model():
    """The trainer's view of the initial weights (same seed, fp32)."""
    return load_model(_cfg()).eval()


def _encode(engine, prompts: list[str]) -> list[list[int]]:
    return [engine.tokenizer(p)["input_ids"] for p in prompts]


def _blocked_ids(engine) -> torch.Tensor:
    return torch.tensor(engine.tokenizer.convert_tokens_to_ids(BLOCKED))


def _max_logprob_diff(engine, model, prompts, out, temperature: float) -> tuple[float, float]:
    """(max |engine - trainer| logprob, mean exp|diff|) over every response token."""
    worst, mult, n = 0.0, 0.0, 0
    for prompt, resp, lps in zip(prompts, out.response_ids, out.response_logprobs, strict=True):
        assert len(resp) == len(lps) >= 1
        ids = torch.tensor([prompt + resp])
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        ref, _ = token_logprobs(logits, ids, temperature, _blocked_ids(engine))
        diff = (torch.tensor(lps) - ref[0, len(prompt) :]).abs()
        worst = max(worst, float(diff.max()))
        mult += float(diff.exp().sum())
        n += len(resp)
    return worst, mult / n


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_trainer_forward(engine, trainer_model, temperature):
    prompts = _encode(engine, PROMPTS) * 4
    out = engine.generate(
        prompts, SamplingParams(temperature=temperature, max_new_tokens=6, seed=11)
    )
    assert out.prompt_ids == prompts and out.weight_version == 0
    worst, mult = _max_logprob_diff(engine, trainer_model, prompts, out, temperature)
    assert worst < 1e-4, worst
    assert mult < 1.0001, mult
    # Scored at this temperature, not at 1 (vLLM's raw mode would ignore it).
    if temperature != 1.0:
        worst_at_1, _ = _max_logprob_diff(engine, trainer_model, prompts, out, 1.0)
        assert worst_at_1 > 1e-3


def test_blocked_tokens_never_sampled(engine):
    blocked = set(_blocked_ids(engine).tolist())
    prompts = _encode(engine, PROMPTS) * 40
    # vLLM caps the temperature at 2 (validate.py rejects more for rollout=vllm).
    out = engine.generate(prompts, SamplingParams(temperature=2.0, max_new_tokens=6, seed=9))
    sampled = [t for r in out.response_ids for t in r]
    assert len(sampled) > 400
    assert not blocked & set(sampled)
    # At temperature 2 every allowed token shows up: the check is not vacuous.
    assert set(sampled) == set(range(len(engine.tokenizer))) - blocked


def test_eos_stops_a_row_and_sets_finished(engine):
    eos = engine.eos_id
    prompts = _encode(engine, PROMPTS) * 16
    out = engine.generate(prompts, SamplingParams(max_new_tokens=5, seed=2))
    n_finished = 0
    for resp, lps, fin in zip(out.response_ids, out.response_logprobs, out.finished, strict=True):
        assert len(resp) == len(lps)
        assert fin == (resp[-1] == eos)
        assert eos not in resp[:-1]
        n_finished += fin
        if not fin:
            assert len(resp) == 5
    assert 0 < n_finished < len(prompts)


def test_seeds_make_rows_independent_and_reproducible(engine):
    prompts = _encode(engine, ["ab="]) * 32
    a = engine.generate(prompts, SamplingParams(max_new_tokens=4, seed=123))
    b = engine.generate(prompts, SamplingParams(max_new_tokens=4, seed=123))
    c = engine.generate(prompts, SamplingParams(max_new_tokens=4, seed=124))
    assert a.response_ids == b.response_ids and a.response_logprobs == b.response_logprobs
    assert a.response_ids != c.response_ids
    # Rows of one group (same prompt) must not share a seed: they differ.
    assert len({tuple(r) for r in a.response_ids}) > 8


def test_top_k_one_is_greedy(engine, trainer_model):
    prompts = _encode(engine, PROMPTS)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=4, seed=3, top_k=1))
    for prompt, resp in zip(prompts, out.response_ids, strict=True):
        ids = torch.tensor([prompt + resp])
        with torch.no_grad():
            logits = trainer_model(input_ids=ids).logits[0]
        logits[:, _blocked_ids(engine)] = float("-inf")
        for j, tok in enumerate(resp):
            assert tok == int(logits[len(prompt) + j - 1].argmax())


def test_direct_landing_finds_vllms_fused_parameters_and_cpu_falls_back(engine, trainer_model):
    """The manifest of the trainer's HF tensors finds vLLM's fused parameters by name (q_proj ->
    qkv_proj); on CPU vLLM has repacked and emptied them after loading, so the landing is
    refused with that reason and the engine loads through reload_weights. (On CUDA the
    mapped rows are checked against the trainer's weights in the gpu tier.)"""
    params = {n: p.detach() for n, p in trainer_model.named_parameters()}
    manifest = plan_buckets([(n, tuple(p.shape)) for n, p in params.items()], "float32", 1 << 16)
    # Built where the weights live: in vLLM's worker process.
    why = engine.landing_check(manifest)
    assert "self_attn.qkv_proj.weight" in why and "(0,)" in why, why


def test_refit_through_gloo_replaces_weights(engine, trainer_model):
    """Changed weights sent over the real gloo transport (small buckets, 2 buffers in flight)."""
    gen = torch.Generator().manual_seed(0)
    new_model = load_model(_cfg()).eval()
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    params = {n: p.detach() for n, p in new_model.named_parameters()}
    largest = max(p.numel() for p in params.values()) * 4
    manifest = plan_buckets(
        [(n, tuple(p.shape)) for n, p in params.items()], "float32", largest // 3, num_buffers=2
    )
    assert len(manifest.buckets) > 4

    prompts = _encode(engine, PROMPTS) * 4
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=21)
    before = engine.generate(prompts, sampling)  # also fills the prefix cache

    port = free_port()
    sender: dict[str, GlooRefitSender] = {}

    def build_sender():
        sender["s"] = GlooRefitSender(manifest, "127.0.0.1", port, 2, 60.0)

    t = threading.Thread(target=build_sender)
    t.start()
    engine.init_refit(RefitGroup(manifest, "127.0.0.1", port, 2), 1)
    t.join()

    def send(version: int, result: dict) -> None:
        result["stats"] = sender["s"].send(fill_from(params), weight_version=version)

    for version in (1, 2):
        result: dict = {}
        t = threading.Thread(target=send, args=(version, result))
        t.start()
        stats = engine.refit_receive()
        t.join()
        assert stats.weight_version == version == engine.weight_version()
        assert stats.extra["tensors"] == len(params)
        assert stats.extra["direct"] == 0.0 and "CPU" in engine.landing_note
        assert result["stats"].weight_version == version

    after = engine.generate(prompts, sampling)
    assert after.weight_version == 2
    worst, mult = _max_logprob_diff(engine, new_model, prompts, after, 1.0)
    assert worst < 1e-4 and mult < 1.0001, (worst, mult)
    # ... and no longer the old weights.
    worst_old, _ = _max_logprob_diff(engine, trainer_model, prompts, after, 1.0)
    assert worst_old > 1e-2
    assert after.response_logprobs != before.response_logprobs
    at_07 = engine.generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=6, seed=5))
    worst, mult = _max_logprob_diff(engine, new_model, prompts, at_07, 0.7)
    assert worst < 1e-4 and mult < 1.0001, (worst, mult)


def _perturbed(model, seed: int):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model


def test_rows_stream_out_as_they_finish(engine):
    """``on_row`` hears of every row once, with what the batch returns for it, before the
    call returns: a caller can score rows while the rest still generate."""
    prompts = _encode(engine, PROMPTS) * 2
    heard: dict[int, tuple[list[int], list[float], bool]] = {}
    order: list[int] = []

    def on_row(i, ids, lps, finished):
        heard[i] = (ids, lps, finished)
        order.append(i)

    out = engine.generate(prompts, SamplingParams(max_new_tokens=12, seed=9), on_row=on_row)
    assert sorted(order) == list(range(len(prompts)))
    for i, (ids, lps, finished) in heard.items():
        assert ids == out.response_ids[i] and lps == out.response_logprobs[i]
        assert finished == out.finished[i]
    # Rows are heard as they end, not in request order: the shortest row is heard before
    # the last of the longest ones.
    lengths = {i: len(heard[i][0]) for i in order}
    short = min(lengths, key=lambda i: (lengths[i], order.index(i)))
    longest = [i for i in order if lengths[i] == max(lengths.values())]
    assert lengths[short] < lengths[longest[-1]], lengths
    assert order.index(short) < order.index(longest[-1])


def pause_at_first_tokens(engine) -> threading.Event:
    """Set ``engine.on_tokens`` so that the first tokens of the next call freeze vLLM's
    scheduler where it is (a refit then pauses it again and resumes it); the event is set
    then. Clear ``engine.on_tokens`` after the refit."""
    import asyncio

    first_tokens = threading.Event()

    def on_tokens() -> None:
        if not first_tokens.is_set():
            asyncio.ensure_future(engine.llm.pause_generation(mode="keep", clear_cache=False))
            first_tokens.set()

    engine.on_tokens = on_tokens
    return first_tokens


def test_refit_lands_while_requests_are_in_flight(engine):
    """Partial rollouts on vLLM: a refit lands while a generate's requests are in flight.
    The scheduler pauses keeping them, the weights land, their KV is recomputed with the new
    weights, and they go on: each token carries the version of the weights that sampled it,
    and its logprob is that model's over everything before it."""

    # Known weights to start from (whatever earlier tests of this module left in the engine).
    start = _perturbed(load_model(_cfg()).eval(), 0)
    new = _perturbed(load_model(_cfg()).eval(), 11)
    manifest = plan_buckets(
        [(n, tuple(p.shape)) for n, p in start.named_parameters()], "float32", 1 << 20
    )
    port = free_port()
    sender: dict[str, GlooRefitSender] = {}
    t = threading.Thread(
        target=lambda: sender.setdefault("s", GlooRefitSender(manifest, "127.0.0.1", port, 2, 60.0))
    )
    t.start()
    engine.init_refit(RefitGroup(manifest, "127.0.0.1", port, 2), 1)
    t.join()

    def refit(model, version: int):
        params = {n: p.detach() for n, p in model.named_parameters()}
        box: dict = {}
        th = threading.Thread(
            target=lambda: box.setdefault("s", sender["s"].send(fill_from(params), version))
        )
        th.start()
        stats = engine.refit_receive()
        th.join()
        return stats

    base = engine.weight_version()
    refit(start, base + 1)
    prompts = _encode(engine, PROMPTS) * 3
    first_tokens = pause_at_first_tokens(engine)
    box: dict = {}
    gen = threading.Thread(
        target=lambda: box.setdefault(
            "out", engine.generate(prompts, SamplingParams(max_new_tokens=48, seed=4))
        )
    )
    gen.start()
    try:
        assert first_tokens.wait(300)
        stats = refit(new, base + 2)
    finally:
        engine.on_tokens = None
    gen.join(300)
    out = box["out"]
    assert stats.weight_version == base + 2 == engine.weight_version()
    v0, v1 = base + 1, base + 2
    assert out.response_versions is not None
    seen = set()
    for versions in out.response_versions:
        # A row's tokens: the old version, then the new one (never back).
        assert versions == sorted(versions) and set(versions) <= {v0, v1}, versions
        seen |= set(versions)
    assert seen == {v0, v1}
    assert out.row_versions == [min(v) for v in out.response_versions]
    # Each token's logprob is that of the weights that sampled it, over the whole row so far.
    for prompt, resp, lps, versions in zip(
        prompts, out.response_ids, out.response_logprobs, out.response_versions, strict=True
    ):
        ids = torch.tensor([prompt + resp])
        with torch.no_grad():
            ref = {
                v: token_logprobs(m(input_ids=ids).logits, ids, 1.0, _blocked_ids(engine))[0][
                    0, len(prompt) :
                ]
                for v, m in ((v0, start), (v1, new))
            }
        for j, v in enumerate(versions):
            assert abs(lps[j] - float(ref[v][j])) < 1e-4, (j, v, lps[j], float(ref[v][j]))
    # After the refit, a new call samples with the new weights only.
    after = engine.generate(prompts[:4], SamplingParams(max_new_tokens=4, seed=1))
    assert after.row_versions == [v1] * 4


def test_decode_graphs_cover_a_calls_rows_and_no_more():
    """CUDA graphs are captured for the decode batch sizes one generate call can reach: every
    size up to the replica's rows is padded to at most 1.5x, none past the first that holds
    them; eager engines and vLLM's compile pipeline keep vLLM's own capture list."""
    from dataclasses import replace

    from rltrain.rollout.vllm_settings import capture_sizes, compilation_config

    sizes = capture_sizes(256)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == 256
    for n in range(1, 257):
        padded = min(s for s in sizes if s >= n)
        assert padded <= max(2 * n, n + 1) and (n < 8 or padded <= 1.5 * n)
    assert capture_sizes(300)[-1] == 384 and capture_sizes(5000)[-1] == 512
    assert capture_sizes(1) == [1] and capture_sizes(9) == [1, 2, 4, 8, 12]

    cfg = RunConfig()
    cfg = replace(cfg, rollout=replace(cfg.rollout, replicas=2))
    got = compilation_config(cfg, "cuda")
    assert got is not None and got["cudagraph_mode"] == "FULL_DECODE_ONLY"
    rows = -(-cfg.rollout_batch() // 2)
    assert got["cudagraph_capture_sizes"] == capture_sizes(rows)
    assert compilation_config(cfg, "cpu") is None  # eager on CPU
    compiled = replace(
        cfg, rollout=replace(cfg.rollout, vllm=replace(cfg.rollout.vllm, torch_compile=True))
    )
    assert compilation_config(compiled, "cuda") is None


def test_lora_dual_stream_resolves_for_lora_on_gpus_only():
    """``rollout.vllm.lora_dual_stream=null``: on for LoRA on GPUs; nothing to set without
    LoRA or on CPU; an explicit false holds."""
    from dataclasses import replace

    from rltrain.rollout.vllm_settings import lora_dual_stream

    cfg = RunConfig()
    lora = replace(cfg, train=replace(cfg.train, lora=replace(cfg.train.lora, rank=16)))
    assert lora_dual_stream(cfg, "cuda") is None and lora_dual_stream(lora, "cpu") is None
    assert lora_dual_stream(lora, "cuda") is True
    off = replace(
        lora, rollout=replace(lora.rollout, vllm=replace(lora.rollout.vllm, lora_dual_stream=False))
    )
    assert lora_dual_stream(off, "cuda") is False


def test_lora_dual_stream_variable_is_set_and_removed(monkeypatch):
    """On: vLLM's variable is set for the engine process; off: removed (vLLM's one stream),
    whatever the environment held before."""
    import os

    from rltrain import env

    name = env.VLLM_LORA_DUAL_STREAM.name
    monkeypatch.setenv(name, "0")
    env.apply(env.VLLM_LORA_DUAL_STREAM)
    assert os.environ[name] == "1"
    env.unset(env.VLLM_LORA_DUAL_STREAM)
    assert name not in os.environ
    env.unset(env.VLLM_LORA_DUAL_STREAM)  # absent: nothing to do


def test_request_seeds_resolve_per_device_and_reach_the_sampling_params():
    """``rollout.vllm.request_seeds=null``: a seed per request on CPU, none on GPUs (vLLM's
    sampler then draws every row's noise at once from the engine's seeded generator); an
    explicit value holds on both."""
    from dataclasses import replace

    pytest.importorskip("vllm")
    from rltrain.rollout.vllm_settings import seeds_per_request
    from rltrain.rollout.vllm_turns import VLLMTurns

    cfg = RunConfig()
    assert seeds_per_request(cfg, "cpu") and not seeds_per_request(cfg, "cuda")
    for choice in (True, False):
        v = replace(cfg.rollout.vllm, request_seeds=choice)
        c = replace(cfg, rollout=replace(cfg.rollout, vllm=v))
        assert seeds_per_request(c, "cpu") is choice and seeds_per_request(c, "cuda") is choice

    turns = VLLMTurns()
    turns._partial, turns.eos_id = False, 7
    sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4)
    for seeded in (True, False):
        turns._request_seeds = seeded
        params = turns._vllm_sampling(sampling, 1234, 4)
        assert params.seed == (1234 if seeded else None)
        assert params.logprobs == 0 and params.stop_token_ids == [7]


def test_engine_logprobs_sample_gives_every_nth_row_and_the_metric_skips_the_rest(engine):
    """``rollout.engine_logprobs=sample``: rows 0, n, 2n, ... carry the engine's logprobs (the
    same values as with every row's), the others NaN, and token_mult_prob_error counts only
    the rows that have them; ``auto`` samples only on GPUs and where nothing else reads them."""
    import math
    from dataclasses import replace

    from rltrain.algorithms.logprobs import token_mult_prob_error
    from rltrain.config.resolved import ENGINE_LOGPROB_SAMPLE, engine_logprob_stride

    prompts = [[1, 2, 3]] * 6
    sampling = SamplingParams(temperature=1.0, max_new_tokens=5, seed=11)
    full = engine.generate(prompts, sampling)
    engine._logprob_stride = 4
    try:
        part = engine.generate(prompts, sampling)
    finally:
        engine._logprob_stride = 1
    assert part.response_ids == full.response_ids  # the sample is the same (request seeds)
    pairs = zip(part.response_logprobs, full.response_logprobs, strict=True)
    for i, (lp, ref) in enumerate(pairs):
        if i % 4 == 0:
            assert lp == ref
        else:
            assert len(lp) == len(ref) and all(math.isnan(x) for x in lp)

    engine_lp = torch.tensor([[0.0, -1.0, float("nan")], [0.0, -2.0, -3.0]])
    train_lp = torch.tensor([[0.0, -1.5, -9.0], [0.0, -2.0, -3.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    want = (math.exp(0.5) + 1.0 + 1.0) / 3
    assert token_mult_prob_error(train_lp, engine_lp, mask) == pytest.approx(want, rel=1e-6)

    cfg = RunConfig()
    assert engine_logprob_stride(cfg, "cpu") == 1
    assert engine_logprob_stride(cfg, "cuda") == ENGINE_LOGPROB_SAMPLE
    a = cfg.algorithm
    on = replace(a, async_rollout=replace(a.async_rollout, enabled=True))
    assert engine_logprob_stride(replace(cfg, algorithm=on), "cuda") == 1
    rc = replace(a, rollout_correction=replace(a.rollout_correction, weights="token"))
    assert engine_logprob_stride(replace(cfg, algorithm=rc), "cuda") == 1
    every = replace(cfg, rollout=replace(cfg.rollout, engine_logprobs="all"))
    assert engine_logprob_stride(every, "cuda") == 1


def test_sampled_logprobs_read_vllms_flat_and_dict_forms():
    """The engine asks vLLM for flat logprobs (a few lists per request, not a dict and an
    object per token); each sampled token's logprob comes out of either form, and a row
    asked without them gives NaN."""
    import math

    from vllm.logprobs import FlatLogprobs, Logprob

    from rltrain.rollout.vllm_turns import sampled_logprobs

    ids = [5, 9, 2]
    per_position = [
        {5: Logprob(-0.5, 1)},
        {9: Logprob(-1.25, 3), 4: Logprob(-0.1, 1)},  # the sampled token listed first
        {7: Logprob(-0.2, 1), 2: Logprob(-3.0, 8)},  # ... or not
    ]
    flat = FlatLogprobs()
    for position in per_position:
        flat.append(position)
    assert sampled_logprobs(ids, flat) == [-0.5, -1.25, -3.0]
    assert sampled_logprobs(ids, per_position) == [-0.5, -1.25, -3.0]
    assert all(math.isnan(x) for x in sampled_logprobs(ids, None))
    with pytest.raises(RuntimeError, match="logprobs for 3 positions, 2 tokens"):
        sampled_logprobs(ids[:2], flat)


def test_the_engine_core_is_forked_from_the_replicas_server(engine):
    """The engine core (the process that holds the model) is a child of the server the
    replica started, not of the replica: its imports were done there ahead of the build."""
    import multiprocessing.forkserver

    import psutil

    server_pid = multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    assert server_pid is not None
    (core,) = engine.llm.engine_core.resources.engine_manager.processes
    assert psutil.Process(core.pid).ppid() == server_pid != os.getpid()
    # how long the core's start waited for the server's imports, among the start-up phases
    assert 0 <= engine.startup_phases["core_fork_wait_s"] < engine.startup_phases["async_llm_s"]


def test_the_model_class_is_inspected_in_the_replicas_process():
    """vLLM's first inspection of a model class on a host runs in a fresh interpreter;
    while an engine is built it runs in the replica's process instead, and vLLM's own hook
    is back afterwards."""
    from vllm.model_executor.models import registry

    from rltrain.rollout.vllm_settings import model_inspection_in_process

    original = registry._run_in_subprocess
    pid = os.getpid()
    with model_inspection_in_process():
        assert registry._run_in_subprocess(os.getpid) == pid
    assert registry._run_in_subprocess is original


_FIRST_IMPORT_CHECK = """
import sys
from rltrain.rollout import vllm_engine

class Stop(Exception):
    pass

def submit(self, coro):
    coro.close()
    print("TRANSFORMERS_AT_SUBMIT", "transformers" in sys.modules, flush=True)
    raise Stop

vllm_engine._EventLoop.submit = submit
cfg = vllm_engine.RunConfig()
cfg.model.path = sys.argv[1]
cfg.model.blocked_tokens = []
try:
    vllm_engine.VLLMEngine(cfg)
except Stop:
    pass
"""


def test_transformers_is_imported_before_the_engine_builds_beside_the_tokenizer(tmp_path):
    """The early build (a model folder, no blocked tokens) runs beside the tokenizer's read:
    transformers is imported before the build starts, in a fresh interpreter, so the two
    threads never make its first import at once (its lazy module failed that way)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _FIRST_IMPORT_CHECK, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert "TRANSFORMERS_AT_SUBMIT True" in out.stdout, out.stdout + out.stderr[-3000:]


def test_an_engine_from_a_model_folder_builds_while_its_tokenizer_loads(tmp_path):
    """A model folder without blocked tokens: the engine starts building before the replica
    reads its tokenizer, and then serves as any other (greedy tokens equal the trainer's
    argmax; logprobs match its forward)."""
    from rltrain.models.loader import load_tokenizer
    from rltrain.rollout.vllm_engine import VLLMEngine

    cfg = _cfg()
    cfg.model.blocked_tokens = []
    cfg.algorithm.async_rollout.enabled = False
    cfg.algorithm.async_rollout.partial_rollouts = False
    model = load_model(cfg).eval()
    model.save_pretrained(tmp_path)
    load_tokenizer(cfg).save_pretrained(tmp_path)
    cfg.model.path = str(tmp_path)
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    eng = VLLMEngine(cfg, num_threads=1)
    try:
        assert eng.startup_phases["async_llm_s"] >= eng.startup_phases["tokenizer_s"] > 0
        assert eng._blocked == set()
        prompts = _encode(eng, PROMPTS[:3])
        out = eng.generate(prompts, SamplingParams(max_new_tokens=4, seed=3, top_k=1))
        for prompt, resp in zip(prompts, out.response_ids, strict=True):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + resp])).logits[0]
            assert resp == [int(logits[len(prompt) + j - 1].argmax()) for j in range(len(resp))]
        # sampled at temperature 1: each token's logprob is the trainer's (nothing blocked)
        out = eng.generate(prompts, SamplingParams(max_new_tokens=5, seed=5))
        for prompt, resp, lps in zip(prompts, out.response_ids, out.response_logprobs, strict=True):
            ids = torch.tensor([prompt + resp])
            with torch.no_grad():
                ref, _ = token_logprobs(model(input_ids=ids).logits, ids, 1.0, None)
            assert (torch.tensor(lps) - ref[0, len(prompt) :]).abs().max() < 1e-4
    finally:
        eng.shutdown()
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)


def test_the_kernel_warmup_samples_with_the_runs_settings(engine, monkeypatch):
    """``rollout.vllm.warmup=run``: vLLM's warm-up (in the engine's worker process, forked
    from the replica's server) samples with what the engine's requests ask for, not with
    every feature vLLM has; ``all`` leaves vLLM's own."""
    import json
    from dataclasses import replace

    from vllm.sampling_params import SamplingParams as VLLMSamplingParams

    from rltrain import env
    from rltrain.loops.collect import sampling_params
    from rltrain.rollout.vllm_settings import set_warmup_env, warmup_sampling
    from rltrain.rollout.vllm_worker import from_wire

    cfg = engine.cfg
    (seen,) = [from_wire(b) for b in engine._rpc("rltrain_warmup_sampling")]
    # what a step's rows ask for: the run's sampling settings, as the loop builds them
    request = engine._vllm_sampling(sampling_params(cfg), 5, 4)
    for key in ("temperature", "top_p", "top_k", "logprobs", "prompt_logprobs", "min_p"):
        assert seen[key] == getattr(request, key), key
    assert (seen["seed"] is None) == (request.seed is None)  # seeded where requests are

    hot = replace(cfg, rollout=replace(cfg.rollout, temperature=0.7, top_k=5))
    assert warmup_sampling(hot, "cuda") == {
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": 5,
        "logprobs": 0,
    }  # GPUs: the engine's seeded generator, no seed per request
    vllm_all = replace(hot.rollout.vllm, warmup="all")
    assert (
        warmup_sampling(replace(hot, rollout=replace(hot.rollout, vllm=vllm_all)), "cuda") is None
    )

    # In this process too (the replica imports the module): what an engine built next would
    # pass its core, read at each call. run: the run's settings; all: vLLM's own.
    monkeypatch.setenv(env.VLLM_WARMUP_SAMPLING.name, "{}")  # restored after the test
    set_warmup_env(hot, "cuda")
    assert json.loads(os.environ[env.VLLM_WARMUP_SAMPLING.name]) == warmup_sampling(hot, "cuda")
    assert VLLMSamplingParams.for_sampler_warmup().top_k == 5
    set_warmup_env(replace(hot, rollout=replace(hot.rollout, vllm=vllm_all)), "cuda")
    assert env.VLLM_WARMUP_SAMPLING.name not in os.environ
    own = VLLMSamplingParams.for_sampler_warmup()  # vLLM's: every sampling feature
    assert own.logprobs == 5 and own.min_p > 0 and own.repetition_penalty != 1.0


def test_a_prompt_id_outside_the_vocabulary_fails_its_call_not_the_engine(engine):
    """vLLM checks no prompt ids without a tokenizer of its own: the engine refuses a row
    holding an id past the model's vocabulary, names it, and serves the next call."""
    vocab = engine.llm.model_config.get_vocab_size()
    (ids,) = _encode(engine, ["a="])
    with pytest.raises(ValueError, match=f"prompt row 1 holds token id {vocab}, outside"):
        engine.generate([ids, [*ids, vocab]], SamplingParams(max_new_tokens=2, seed=1))
    out = engine.generate([ids], SamplingParams(max_new_tokens=2, seed=1))
    assert 1 <= len(out.response_ids[0]) <= 2


def test_worker_logprobs_fall_back_to_vllms_own_where_its_runner_cannot_keep_them(engine):
    """vLLM's CPU worker runs its V1 model runner, which the worker cannot wrap: the replica
    keeps vLLM's own logprobs and says why (GPUs: tests/gpu/test_vllm_cuda.py)."""
    from rltrain.rollout.base import SamplingParams

    assert engine._capture is False  # null resolves to off on CPU: nothing was tried
    engine._install_capture()  # as on a GPU whose runner is vLLM's V1 (null: fall back)
    assert engine._capture is False
    assert "is not its V2 runner" in engine.logprobs_note, engine.logprobs_note
    out = engine.generate(_encode(engine, PROMPTS[:2]), SamplingParams(max_new_tokens=4, seed=1))
    assert all(len(lp) == len(ids) and not any(math.isnan(x) for x in lp)
               for ids, lp in zip(out.response_ids, out.response_logprobs, strict=True))  # fmt: skip


def test_sleep_keeping_weights_pauses_releases_and_resumes():
    """``rollout.vllm.sleep_keeps_weights`` (null = on with LoRA): asleep, the engine has
    paused vLLM's scheduler (dropping the prefix cache) before its workers release the KV
    cache, and refuses to generate; woken, the workers map the cache back before the
    scheduler resumes. Without LoRA vLLM's own sleep levels are used. (vLLM's side is the
    gpu tier's tests/gpu/test_vllm_cuda.py::test_lora_engine_sleeps_keeping_its_weights.)"""
    from dataclasses import replace

    from rltrain.plan.parts import sleep_keeps_weights
    from rltrain.rollout.vllm_engine import VLLMEngine, _EventLoop

    cfg = RunConfig()
    lora = replace(cfg, train=replace(cfg.train, lora=replace(cfg.train.lora, rank=8)))
    off = replace(
        lora,
        rollout=replace(lora.rollout, vllm=replace(lora.rollout.vllm, sleep_keeps_weights=False)),
    )
    assert sleep_keeps_weights(lora) and not sleep_keeps_weights(cfg)
    assert not sleep_keeps_weights(off)

    calls: list[tuple] = []

    class FakeLLM:
        async def pause_generation(self, **kw):
            calls.append(("pause", kw))

        async def resume_generation(self):
            calls.append(("resume",))

        async def collective_rpc(self, method, timeout=None, args=()):
            calls.append((method,))
            return [1 << 30] if method == "rltrain_sleep_kv_cache" else [None]

        async def sleep(self, level):
            calls.append(("vllm_sleep", level))

        async def wake_up(self):
            calls.append(("vllm_wake",))

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.replica_index, engine.llm = 0, FakeLLM()
    engine._loop = _EventLoop("test-sleep")
    engine.landing_note = "adapter: vLLM's LoRA manager"
    engine._asleep = engine._weights_discarded = engine._prefix_cache_used = False
    try:
        engine._keeps_weights = sleep_keeps_weights(lora)
        engine.sleep()
        assert calls == [
            ("pause", {"mode": "abort", "clear_cache": True}),
            ("rltrain_sleep_kv_cache",),
        ]
        with pytest.raises(RuntimeError, match="asleep"):
            engine._check_awake()
        engine.wake_up()
        engine.wake_up()  # a no-op when awake
        assert calls[2:] == [("rltrain_wake_kv_cache",), ("resume",)]
        engine._check_awake()

        calls.clear()
        engine._keeps_weights = sleep_keeps_weights(off)
        engine.sleep()
        engine.wake_up()
        assert calls == [("vllm_sleep", 1), ("vllm_wake",)]
    finally:
        engine._loop.close()
