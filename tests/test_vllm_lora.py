"""LoRA refit into the vLLM engine (real vLLM on CPU): adapter tensors over the gloo
transport become vLLM's LoRA adapter, built in memory; its logprobs then match a forward
of the base with the same adapter applied (fp32), also for requests that an adapter refit
met in flight (partial rollouts)."""

from __future__ import annotations

import threading

import pytest
import torch

from rltrain.algorithms.logprobs import token_logprobs
from rltrain.config.schema import LoraConfig, RunConfig, lora_targets
from rltrain.models.loader import load_model
from rltrain.models.lora import inject_lora
from rltrain.refit.base import RefitGroup, fill_from, plan_buckets
from rltrain.refit.gloo import GlooRefitSender
from rltrain.rollout.base import SamplingParams
from rltrain.train.distributed import free_port
from tests.test_vllm_engine import (
    BLOCKED,
    PROMPTS,
    _encode,
    _max_logprob_diff,
    pause_at_first_tokens,
)

pytest.importorskip("vllm")

# vLLM on CPU, fp32, against the trainer's forward: what the adapter path allows here.
LOGPROB_TOL = 1e-4


def _cfg() -> RunConfig:
    cfg = RunConfig()
    cfg.model.blocked_tokens = list(BLOCKED)
    cfg.model.tiny.max_position_embeddings = 192
    cfg.rollout.vllm.cpu_kv_cache_gib = 0.25
    cfg.rollout.engine = "vllm"  # the adapter targets vLLM serves (no LM-head adapter)
    cfg.train.lora = LoraConfig(rank=8)
    # partial rollouts: refits may land while requests are in flight
    cfg.algorithm.async_rollout.enabled = True
    cfg.algorithm.async_rollout.partial_rollouts = True
    return cfg


def _adapted(seed: int) -> torch.nn.Module:
    """The base with a random (non-zero) adapter: what the trainer holds after some steps."""
    cfg = _cfg()
    model = load_model(cfg).eval()
    inject_lora(model, cfg.train.lora, lora_targets(cfg))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model


@pytest.mark.timeout(900)
def test_adapter_refit_into_vllm_matches_the_adapted_forward():
    from rltrain.rollout.vllm_engine import VLLMEngine

    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    engine = VLLMEngine(_cfg(), num_threads=1)
    try:
        prompts = _encode(engine, PROMPTS) * 3
        blocked = torch.tensor(engine.tokenizer.convert_tokens_to_ids(BLOCKED))
        sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=21)
        base = load_model(_cfg()).eval()
        before = engine.generate(prompts, sampling)  # no adapter yet: the base
        worst, _ = _max_logprob_diff(engine, base, prompts, before, 1.0)
        assert worst < LOGPROB_TOL, worst

        models = {1: _adapted(1), 2: _adapted(2)}
        names = [n for n, _ in models[1].named_parameters() if ".lora_" in n]
        shapes = [(n, tuple(dict(models[1].named_parameters())[n].shape)) for n in names]
        manifest = plan_buckets(shapes, "float32", 2**16, num_buffers=2)
        full_numel = sum(p.numel() for n, p in base.named_parameters())
        assert manifest.total_numel < 0.2 * full_numel  # adapters only

        port = free_port()
        sender: dict[str, GlooRefitSender] = {}
        t = threading.Thread(
            target=lambda: sender.update(s=GlooRefitSender(manifest, "127.0.0.1", port, 2, 60.0))
        )
        t.start()
        engine.init_refit(RefitGroup(manifest, "127.0.0.1", port, 2), 1)
        t.join()
        assert engine.landing_note.startswith("adapter")
        # Joined: requests name the run's adapter, zero until the first refit (the base).
        assert engine._lora_request is not None
        zero = engine.generate(prompts, sampling)
        worst, _ = _max_logprob_diff(engine, base, prompts, zero, 1.0)
        assert worst < LOGPROB_TOL, worst

        for version, model in models.items():
            params = {n: p.detach() for n, p in model.named_parameters() if ".lora_" in n}
            result: dict = {}
            t = threading.Thread(
                target=lambda v=version, ps=params, r=result: r.update(
                    s=sender["s"].send(fill_from(ps), weight_version=v)
                )
            )
            t.start()
            stats = engine.refit_receive()
            t.join()
            assert stats.weight_version == version == engine.weight_version()
            assert stats.extra["tensors"] == len(names)
            out = engine.generate(prompts, sampling)
            assert out.weight_version == version
            worst, mult = _max_logprob_diff(engine, model, prompts, out, 1.0)
            print(f"vLLM LoRA v{version}: max |logprob diff| {worst:.3g}, mean exp|diff| {mult}")
            assert worst < LOGPROB_TOL and mult < 1.0001, (worst, mult)
            # and not the base: the adapter is applied
            worst_base, _ = _max_logprob_diff(engine, base, prompts, out, 1.0)
            assert worst_base > 1e-2

        # An adapter refit while a generate's requests are in flight: they carry on with
        # the new adapter (vLLM still has the adapter they name), each token's logprob is
        # that of the adapter that sampled it.
        models[3] = _adapted(3)
        params = {n: p.detach() for n, p in models[3].named_parameters() if ".lora_" in n}
        first_tokens = pause_at_first_tokens(engine)
        box: dict = {}

        def generate() -> None:
            try:
                box["out"] = engine.generate(prompts, SamplingParams(max_new_tokens=48, seed=4))
            except BaseException as exc:  # noqa: BLE001 - reported below, in the test's thread
                box["error"] = exc

        gen = threading.Thread(target=generate)
        gen.start()
        try:
            assert first_tokens.wait(300)
            t = threading.Thread(
                target=lambda: sender["s"].send(fill_from(params), weight_version=3)
            )
            t.start()
            stats = engine.refit_receive()
            t.join()
        finally:
            engine.on_tokens = None
        gen.join(300)
        assert not gen.is_alive(), "the generate call did not end after the refit"
        assert "error" not in box, box.get("error")
        assert stats.weight_version == 3 == engine.weight_version()
        out = box["out"]
        seen: set[int] = set()
        for prompt, resp, lps, versions in zip(
            prompts, out.response_ids, out.response_logprobs, out.response_versions, strict=True
        ):
            assert versions == sorted(versions) and set(versions) <= {2, 3}, versions
            seen |= set(versions)
            ids = torch.tensor([prompt + resp])
            with torch.no_grad():
                ref = {
                    v: token_logprobs(models[v](input_ids=ids).logits, ids, 1.0, blocked)[0][
                        0, len(prompt) :
                    ]
                    for v in (2, 3)
                }
            for j, v in enumerate(versions):
                assert abs(lps[j] - float(ref[v][j])) < LOGPROB_TOL, (j, v, lps[j])
        assert seen == {2, 3}
    finally:
        engine.shutdown()
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)


def test_lora_names_are_mapped_without_the_models_stacking():
    """A model's ``hf_to_vllm_mapper`` may stack q/k/v into qkv_proj and gate/up into
    gate_up_proj (vLLM 0.26's Qwen2): LoRA tensor names keep the other renames but not the
    stacking, which would merge three adapters into one (vLLM's LoRA manager packs them)."""
    from vllm.lora.utils import parse_fine_tuned_lora_name
    from vllm.model_executor.models.utils import WeightsMapper

    from rltrain.rollout.vllm_worker import lora_name_mapper

    stacked = WeightsMapper(
        orig_to_new_prefix={"lm.": "model."},
        orig_to_new_stacked={".q_proj": (".qkv_proj", "q"), ".gate_proj": (".gate_up_proj", 0)},
    )
    mapper = lora_name_mapper(stacked)
    assert not mapper.orig_to_new_stacked and mapper.orig_to_new_prefix == {"lm.": "model."}
    for part in ("q_proj", "gate_proj"):
        name = f"base_model.model.lm.layers.0.x.{part}.lora_A.weight"
        module, is_a = parse_fine_tuned_lora_name(name, mapper)
        assert module == f"model.layers.0.x.{part}" and is_a
    assert lora_name_mapper(None) is None
    plain = WeightsMapper(orig_to_new_prefix={"a.": "b."})
    assert lora_name_mapper(plain).orig_to_new_prefix == {"a.": "b."}
