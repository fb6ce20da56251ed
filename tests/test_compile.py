"""Compiled decoder blocks are built in a run's first step and serve every later batch
shape without recompiling; ``compile/recompiles`` reports it.

CPU: the tiny model's blocks compiled with a CPU backend (``eager`` / ``aot_eager``,
through ``FSDPTrainer.compile_backend``; inductor on CPU takes ~20 s per graph), the
real worker path (logprobs, the split train step, the critic's values and update) over
packed rows of different lengths and counts, equal-length rows, a lone sequence,
empty micro batches and padded rows. GPU (``-m gpu``): the same with inductor on CUDA,
under the varlen kernel (bf16) and sdpa with 4-D masks (fp32).
"""

from __future__ import annotations

import pytest
import torch

from rltrain.train.batch import PolicyBatch, TrainBatch, ValueBatch
from rltrain.train.compile import COMPILE_MIN_PARAMS, resolve_compile
from rltrain.train.fsdp import FSDPTrainer
from rltrain.train.kernels import resolve_causal_rows
from rltrain.train.packing import pack
from rltrain.train.parallel import decoder_layers
from tests.test_packing import mixed_batch

# (rows, tokens per row, equal lengths, empty micro batch added): packed rows of
# 128-384 tokens under varlen/flex, 1-4 rows of 7-40 tokens under sdpa, padded
# micro batches of 1-3 rows, the empty micro batch of a dp rank with fewer.
SHAPES = [
    (7, 12, False, False),
    (12, 40, False, True),
    (4, 16, True, False),
    (1, 10, False, False),
    (9, 33, False, True),
    (1, 9, True, False),
    (8, 7, False, False),
    (2, 30, False, False),
    (10, 25, True, True),
]


def _batch(rows: int, tokens: int, equal: bool, seed: int) -> PolicyBatch:
    """A right-padded batch (mixed lengths, or every row ``tokens`` long) with old logprobs
    and advantages (:func:`_value_batch` gives the critic's)."""
    batch = mixed_batch(B=rows, T=tokens, seed=seed)
    if equal:
        g = torch.Generator().manual_seed(seed)
        batch.input_ids_BT = torch.randint(4, 9, (rows, tokens), generator=g)
        batch.attention_mask_BT.fill_(1)
        batch.response_mask_BT.fill_(1)
        batch.response_mask_BT[:, :2] = 0
    return batch


def _value_batch(batch: TrainBatch, old_values_BT: torch.Tensor, seed: int) -> ValueBatch:
    """``batch`` with random value targets and ``old_values_BT``."""
    g = torch.Generator().manual_seed(seed)
    returns_BT = torch.rand(batch.input_ids_BT.shape, generator=g) * batch.response_mask_BT
    return ValueBatch.of(batch, returns_BT, old_values_BT)


def _record_block_inputs(worker) -> list[tuple[tuple[int, ...], str]]:
    """(hidden_states shape, attention kind) of every call of the first block (eager hook)."""
    seen: list[tuple[tuple[int, ...], str]] = []

    def hook(_module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        mask = kwargs.get("attention_mask")
        kind = "varlen" if "cu_seq_lens_q" in kwargs else type(mask).__name__
        seen.append((tuple(hidden.shape), kind))

    decoder_layers(worker.model)[0].register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def run_steps(worker, value: bool = False) -> tuple[list[dict[str, float]], list, list]:
    """One step per entry of SHAPES through the worker's real path: logprobs (or values),
    then train. Returns each step's train metrics, the block inputs seen from step 2 on,
    and each step's logprobs (or values)."""
    seen = _record_block_inputs(worker)
    real_dp_max = worker.dp_max
    metrics, outputs, later = [], [], []
    for step, (rows, tokens, equal, empty) in enumerate(SHAPES):
        batch = _batch(rows, tokens, equal, seed=step)
        # a dp rank with fewer micro batches runs an empty one (as plan_micro_batches pads)
        worker.dp_max = (lambda n: n + 1) if empty else real_dp_max
        if value:
            outputs.append(worker.values(batch))
            metrics.append(worker.train(_value_batch(batch, outputs[-1], step), [batch.size]))
        else:
            outputs.append(worker.compute_logprobs(batch))
            metrics.append(worker.train(batch, [batch.size]).metrics)
        if step == 0:
            seen.clear()
    later = list(seen)
    worker.dp_max = real_dp_max
    return metrics, later, outputs


def _assert_built_once(metrics: list[dict[str, float]], prefix: str = "") -> None:
    compiles, recompiles = f"{prefix}compile/compiles", f"{prefix}compile/recompiles"
    assert metrics[0][compiles] > 0  # the blocks (and the head) were compiled in step 1
    # ... and again for the training pass: the grad-mode guard of the no-grad graphs failed
    assert metrics[0][recompiles] >= 1
    assert [m[recompiles] for m in metrics[1:]] == [0.0] * (len(metrics) - 1)
    assert [m[compiles] for m in metrics[1:]] == [0.0] * (len(metrics) - 1)


def _policy(cfg, monkeypatch, backend: str):
    from tests.test_train_step import _worker

    monkeypatch.setattr(FSDPTrainer, "compile_backend", backend)
    return _worker(cfg)


pytestmark = pytest.mark.dist


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch (dynamo's caches outlive a worker in this process)
    and leaves the process's shape settings as it found them."""
    import torch._dynamo
    import torch._functorch.config as functorch_config
    import torch.fx.experimental._config as shapes_config

    duck = shapes_config.use_duck_shape
    budget = functorch_config.activation_memory_budget  # a LoRA worker sets the process's
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    shapes_config.use_duck_shape = duck
    functorch_config.activation_memory_budget = budget


BASE = {
    "train.compile": "true",
    "train.max_tokens_per_micro_batch": 300,
    "train.micro_batch_size": 3,
    "optim.lr": 1e-3,
}


def test_packed_sdpa_rows_never_recompile_and_match_eager(monkeypatch):
    """Packed rows under sdpa (rows of the micro batch's longest, a 4-D block mask), aot_eager:
    no compile after step 1 over 1-4 rows of 7-40 tokens; logprobs as an eager worker's."""
    from tests.test_train_step import _cfg

    worker = _policy(_cfg(**BASE), monkeypatch, "aot_eager")
    assert worker.compiled and worker.attention == "sdpa" and not worker.causal_rows
    metrics, seen, lps = run_steps(worker)
    worker.shutdown()
    _assert_built_once(metrics)
    assert len({shape for shape, _ in seen}) >= 6 and len({s[0] for s, _ in seen}) >= 4
    assert {kind for _, kind in seen} == {"Tensor"}  # one layout: no causal-rows shortcut
    assert min(s[0] for s, _ in seen) >= 2  # a lone row gets a padding row (no size 1)

    monkeypatch.undo()
    eager = _policy(_cfg(**{**BASE, "train.compile": "false"}), monkeypatch, "inductor")
    assert not eager.compiled and eager.causal_rows
    _, _, lps_eager = run_steps(eager)
    eager.shutdown()
    for step, (lp, ref) in enumerate(zip(lps, lps_eager, strict=True)):
        torch.testing.assert_close(lp, ref, atol=2e-5, rtol=0, msg=lambda m, s=step: f"{s}: {m}")


def test_padded_rows_never_recompile(monkeypatch):
    """Padded micro batches of 1-3 rows (causal, no mask): a single row is given a padding
    row, so the compiled blocks never see a row count of 1."""
    from tests.test_train_step import _cfg

    worker = _policy(_cfg(**{**BASE, "train.packing": "false"}), monkeypatch, "eager")
    assert worker.causal_rows  # padded rows always hold one sequence each
    metrics, seen, _ = run_steps(worker)
    worker.shutdown()
    _assert_built_once(metrics)
    assert {s[0] for s, _ in seen} == {2, 3} and len({s for s, _ in seen}) >= 5
    assert {kind for _, kind in seen} == {"NoneType"}


def test_varlen_one_row_never_recompiles(monkeypatch):
    """train.attention=varlen (a per-segment sdpa stand-in for the CUDA kernel): one row of
    128-384 tokens per micro batch, segment boundaries and the longest segment varying,
    equal-length and lone sequences too (no causal-rows shortcut under compile)."""
    import torch.nn.attention.varlen as varlen_mod

    import rltrain.train.sharded_model as sharded_model
    from tests.test_kernels import _reference_varlen
    from tests.test_train_step import _cfg

    fake, calls = _reference_varlen("2.13")
    # The stand-in reads the boundaries on the host (.tolist()): keep it out of the graph.
    monkeypatch.setattr(varlen_mod, "varlen_attn", torch.compiler.disable(fake))
    monkeypatch.setattr(
        sharded_model, "choose_attention", lambda cfg, device, compiled=False: "varlen"
    )
    worker = _policy(_cfg(**BASE), monkeypatch, "eager")
    metrics, seen, _ = run_steps(worker)
    worker.shutdown()
    _assert_built_once(metrics)
    assert {kind for _, kind in seen} == {"varlen"} and {s[0] for s, _ in seen} == {1}
    assert {s[1] for s, _ in seen} >= {128, 256} and len(set(calls)) >= 4


def test_value_worker_never_recompiles(monkeypatch):
    """PPO's critic: values (no grad) and the clipped value update through compiled blocks;
    ``value/compile/recompiles`` is 0 after step 1."""
    from rltrain.train.distributed import DistEnv, free_port
    from rltrain.train.value_worker import ValueWorker
    from tests.test_value_worker import _cfg

    monkeypatch.setattr(FSDPTrainer, "compile_backend", "eager")
    cfg = _cfg(**{k: v for k, v in BASE.items() if k != "optim.lr"})
    worker = ValueWorker(cfg, DistEnv(0, 1, "127.0.0.1", free_port(), "gloo", 60.0), num_threads=1)
    assert worker.compiled
    metrics, seen, values = run_steps(worker, value=True)
    worker.shutdown()
    _assert_built_once(metrics, "value/")
    assert len({s for s, _ in seen}) >= 6 and float(values[-1].abs().sum()) > 0


def test_compile_counter_counts_guard_failures():
    """compile_counts: a new frame is a compile; the same frame compiled again after its
    guard failed (a static shape changed) is a compile and a recompile."""
    from rltrain.train.compile import compile_counts, install_compile_counter

    install_compile_counter()

    def double(x):
        return x * 2

    fn = torch.compile(double, backend="eager", dynamic=False)
    before = compile_counts()
    fn(torch.ones(3))
    fn(torch.ones(3))  # same shape: the graph is reused
    mid = compile_counts()
    fn(torch.ones(5))  # shape guard fails: recompiled
    after = compile_counts()
    assert (mid["compiles"] - before["compiles"], mid["recompiles"] - before["recompiles"]) == (
        1,
        0,
    )
    assert (after["compiles"] - mid["compiles"], after["recompiles"] - mid["recompiles"]) == (1, 1)


def test_compile_auto_rule_and_causal_rows():
    """train.compile=null: on with CUDA from COMPILE_MIN_PARAMS parameters, off on CPU and for
    smaller models (the embedded tiny model); explicit values win. causal_rows=null: off only
    for packed rows under compile."""
    from tests.conftest import tiny_config

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_compile(None, cuda, COMPILE_MIN_PARAMS)
    assert not resolve_compile(None, cuda, 400_000)  # the embedded tiny model
    assert not resolve_compile(None, cpu, 10**10)
    assert resolve_compile(True, cpu, 1) and not resolve_compile(False, cuda, 10**10)

    cfg = tiny_config()
    assert resolve_causal_rows(cfg, compiled=False) and not resolve_causal_rows(cfg, True)
    cfg.train.packing = False
    assert resolve_causal_rows(cfg, compiled=True)
    cfg.train.packing, cfg.train.causal_rows = True, True
    assert resolve_causal_rows(cfg, compiled=True)


def test_pack_pads_rows_and_tokens_without_touching_the_sequences():
    """pack(min_rows, min_row_tokens): the extra rows and positions are padding only."""
    batch = mixed_batch(B=5, T=12, seed=3)
    for packed in (True, False):
        base = pack(batch, [2], packed, 0)
        grown = pack(batch, [2], packed, 0, min_rows=2, min_row_tokens=20)
        rows_out, tokens_out = grown.seq_id_RS.shape
        assert rows_out == 2
        assert tokens_out == (20 if packed else base.seq_id_RS.shape[1])
        assert (grown.seq_id_RS[1] == -1).all() and float(grown.response_mask_RS[1].sum()) == 0
        n = base.seq_len[0]
        assert torch.equal(grown.input_ids_RS[0, :n], base.input_ids_RS[0, :n])
        assert (grown.seq_row, grown.seq_start, grown.seq_len) == (
            base.seq_row,
            base.seq_start,
            base.seq_len,
        )


# -- GPU: inductor on CUDA ----------------------------------------------------------------


def _gpu_cfg(precision: str, packing: bool):
    """The embedded tiny model (no Hydra: the GPU image may lack it), compile forced on."""
    from rltrain.config.schema import RunConfig

    cfg = RunConfig()
    cfg.model.blocked_tokens = ["<pad>", "<bos>", "<unk>"]
    p = cfg.precision
    p.name, p.param_dtype, p.reduce_dtype = (
        precision,
        {"bf16": "bfloat16"}.get(precision, "float32"),
        "float32",
    )
    cfg.train.compile = True
    cfg.train.packing = packing
    cfg.train.max_tokens_per_micro_batch = 300
    cfg.train.micro_batch_size = 3
    cfg.optim.lr = 1e-3
    return cfg


@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "case",
    [
        ("bf16", True, "varlen"),
        ("fp32", True, "sdpa"),
        ("bf16", False, None),
        ("value", True, None),
    ],
    ids=["bf16-packed-varlen", "fp32-packed-sdpa", "bf16-padded", "bf16-packed-critic"],
)
def test_inductor_blocks_never_recompile_on_cuda(case):
    """Inductor on CUDA: after step 1 no compile at all over the SHAPES steps, under the
    varlen kernel (bf16), sdpa with 4-D masks (fp32: compiled blocks do not take flex),
    padded rows, and the critic."""
    from rltrain.train.distributed import DistEnv, free_port
    from rltrain.train.kernels import varlen_available
    from rltrain.train.policy_worker import PolicyWorker
    from rltrain.train.value_worker import ValueWorker

    precision, packing, attention = case
    if attention == "varlen" and not varlen_available():
        pytest.skip("this torch has no torch.nn.attention.varlen")
    value = precision == "value"
    cfg = _gpu_cfg("bf16" if value else precision, packing)
    env = DistEnv(0, 1, "127.0.0.1", free_port(), "nccl", 120.0)
    worker = (ValueWorker if value else PolicyWorker)(cfg, env)
    segments: list[tuple[int, int]] = []  # varlen: (boundaries, longest segment) per call

    def record_segments(_module, _args, kwargs):
        if "cu_seq_lens_q" in kwargs:
            segments.append((kwargs["cu_seq_lens_q"].numel(), int(kwargs["max_length_q"])))

    try:
        assert worker.compiled and worker.device.type == "cuda"
        if attention is not None:
            assert worker.attention == attention
        decoder_layers(worker.model)[0].register_forward_pre_hook(record_segments, with_kwargs=True)
        metrics, seen, _ = run_steps(worker, value=value)
    finally:
        worker.shutdown()
    _assert_built_once(metrics, "value/" if value else "")
    if segments:  # one row per micro batch: its length in 128s, the segments varying
        assert len({s for s, _ in seen}) >= 2 and len(set(segments)) >= 4
    else:
        assert len({s for s, _ in seen}) >= 4


def test_lora_blocks_compile_as_often_as_full(monkeypatch):
    """A LoRA policy (frozen embeddings) compiles its blocks as often as full fine-tuning:
    block 0's input requires grad like every later block's, so the training pass builds
    one graph, not a second one for block 0 (a recompile of forward and backward)."""
    from tests.test_train_step import _cfg

    counts = {}
    for name, extra in (("full", {}), ("lora", {"train.lora.rank": 4})):
        worker = _policy(_cfg(**BASE, **extra), monkeypatch, "eager")
        assert worker.lora == (name == "lora")
        metrics, _, _ = run_steps(worker)
        worker.shutdown()
        _assert_built_once(metrics)
        counts[name] = (metrics[0]["compile/compiles"], metrics[0]["compile/recompiles"])
        torch._dynamo.reset()
    assert counts["lora"] == counts["full"], counts


def test_a_lora_policy_keeps_the_budgets_share_of_its_activations(monkeypatch):
    """train.activation_memory_budget reaches the compiler: a LoRA policy's compiled blocks
    (null = 0.8, min-cut partitioner) keep fewer activation bytes for backward than at 1.0,
    and train to the same metrics (what is recomputed is recomputed exactly)."""
    import torch._functorch.config as functorch_config

    from tests.test_train_step import _cfg

    monkeypatch.setattr(functorch_config, "activation_memory_budget", 1.0)
    kept, metrics = {}, {}
    for budget in ("null", "1.0"):
        cfg = _cfg(**BASE, **{"train.lora.rank": 4, "train.activation_memory_budget": budget})
        worker = _policy(cfg, monkeypatch, "aot_eager_decomp_partition")
        assert functorch_config.activation_memory_budget == (0.8 if budget == "null" else 1.0)
        params = {p.untyped_storage().data_ptr() for p in worker.model.parameters()}
        saved: dict[int, int] = {}

        def keep(t: torch.Tensor, saved=saved, params=params) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        batch = _batch(4, 40, False, seed=0)
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            metrics[budget] = worker.train(batch, [batch.size]).metrics
        worker.shutdown()
        if budget == "null":
            # a critic built next in the same process (an in-process PPO run) trains in
            # full and asks for no budget: the policy's stays the process's
            from rltrain.train.distributed import DistEnv, free_port
            from rltrain.train.value_worker import ValueWorker

            env = DistEnv(0, 1, "127.0.0.1", free_port(), "gloo", 60.0)
            critic = ValueWorker(cfg, env, num_threads=1)
            assert critic.compiled and not critic.lora
            critic.shutdown()
            assert functorch_config.activation_memory_budget == 0.8
        kept[budget] = sum(saved.values())
        torch._dynamo.reset()
    assert kept["null"] < 0.85 * kept["1.0"], kept
    for key in ("loss", "grad_norm"):
        assert metrics["null"][key] == pytest.approx(metrics["1.0"][key], rel=1e-6, abs=1e-9)
