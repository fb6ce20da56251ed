"""The sizes of the run's model, read without loading it (a part of :mod:`rltrain.plan`).

Its architecture (:func:`model_shape`), the parameters LoRA trains (:func:`lora_params`)
and the parameters one refit moves (:func:`refit_params`): what the memory estimate
(:mod:`rltrain.plan.memory`, which re-exports these names) and the plan's parameter count
start from. Pure: the sizes come from config files and known architectures
(:mod:`rltrain.models.shapes`), never from a loaded model.
"""

from __future__ import annotations

from pathlib import Path

from rltrain.config.schema import LORA_HEAD, RunConfig, lora_targets
from rltrain.models.shapes import ModelShape, known_shape, read_config_json


def model_shape(cfg: RunConfig) -> ModelShape | None:
    """The policy's (``cfg.model``) architecture without loading it: the embedded tiny
    model's config; a folder's config.json; a hub id's config.json in the local HF cache,
    else :data:`rltrain.models.shapes.KNOWN_SHAPES`; None when none of them knows it."""
    m = cfg.model
    if m.path is None:
        from rltrain.models.vocab import tiny_alphabet, vocab_size

        ti = m.tiny
        return ModelShape(
            hidden_size=ti.hidden_size,
            num_layers=ti.num_layers,
            num_heads=ti.num_heads,
            num_kv_heads=ti.num_kv_heads,
            head_dim=ti.hidden_size // ti.num_heads,
            intermediate_size=ti.intermediate_size,
            vocab_size=ti.vocab_size or vocab_size(tiny_alphabet(cfg.data.task, cfg.data.alphabet)),
            tie_word_embeddings=ti.tie_word_embeddings,
            max_position_embeddings=ti.max_position_embeddings,
            source="the embedded tiny model (model.tiny)",
        )
    folder = Path(m.path)
    if (folder / "config.json").is_file():
        return read_config_json(folder / "config.json")
    if folder.exists():
        return None
    cached = _cached_hf_config(m.path)
    shape = read_config_json(cached) if cached is not None else None
    return shape or known_shape(m.path)


def _cached_hf_config(repo_id: str) -> Path | None:
    """config.json of an HF hub id from the local cache (no network), or None."""
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001 - not an HF id: unknown size
        return None
    return Path(hit) if isinstance(hit, str) else None


def lora_params(cfg: RunConfig, shape: ModelShape) -> int:
    """Adapter parameters of ``train.lora`` on ``shape``: rank x (in + out) of every targeted
    projection of every block, and of the LM head when targeted (0 with LoRA off; other
    targets than these are not counted)."""
    lo = cfg.train.lora
    if lo.rank <= 0:
        return 0
    h, q, kv, i = (
        shape.hidden_size,
        shape.num_heads * shape.head_dim,
        shape.kv_dim,
        shape.intermediate_size,
    )
    dims = {
        "q_proj": h + q,
        "k_proj": h + kv,
        "v_proj": h + kv,
        "o_proj": q + h,
        "gate_proj": h + i,
        "up_proj": h + i,
        "down_proj": i + h,
    }
    targets = set(lora_targets(cfg))
    per_layer = sum(dims.get(t, 0) for t in targets)
    head = shape.hidden_size + shape.vocab_size if LORA_HEAD in targets else 0
    return lo.rank * (shape.num_layers * per_layer + head)


def refit_params(cfg: RunConfig, shape: ModelShape) -> int:
    """Parameters one refit moves: the whole model, or with LoRA the adapters only."""
    return lora_params(cfg, shape) or shape.num_params
