"""Checks of ``train.lora`` that need no model (:func:`validate_lora`, called by
:func:`rltrain.config.validate.validate`); the checks against the model's module names and
width live in :func:`rltrain.config.inputs.check_lora_model`."""

from __future__ import annotations

from rltrain.config.errors import ConfigError
from rltrain.config.schema import LORA_HEAD, RunConfig, lora_targets

# The keys of train.lora that stay null while train.lora.rank is 0.
LORA_OPTIONAL_KEYS = ("alpha", "dropout", "targets", "lr", "export_merged")


def validate_lora(cfg: RunConfig) -> None:
    """``train.lora``: off with every other key null, or a positive rank with sane settings
    and a layout the adapters support."""
    lo = cfg.train.lora
    if lo.rank < 0:
        raise ConfigError(
            f"train.lora.rank={lo.rank} is negative; use train.lora.rank=0 (LoRA off) or a "
            "positive rank such as 8 or 16."
        )
    if lo.rank == 0:
        for key in LORA_OPTIONAL_KEYS:
            value = getattr(lo, key)
            if value is not None:
                raise ConfigError(
                    f"train.lora.{key}={value} is set but train.lora.rank=0 (LoRA off), so it "
                    f"would be ignored; set train.lora.rank (e.g. train.lora.rank=16) to train "
                    f"adapters, or drop train.lora.{key}."
                )
        return
    if lo.alpha is not None and not lo.alpha > 0:
        raise ConfigError(
            f"train.lora.alpha={lo.alpha} must be > 0 (the adapter's scale is alpha / rank); "
            "null = 2 x rank."
        )
    if lo.dropout is not None and not 0.0 <= lo.dropout < 1.0:
        raise ConfigError(f"train.lora.dropout={lo.dropout} must be in [0, 1); null = 0.")
    if lo.lr is not None and not lo.lr > 0:
        raise ConfigError(
            f"train.lora.lr={lo.lr} must be > 0; null = 10 x optim.lr (2 x on the embedded model)."
        )
    if lo.targets is not None and not lo.targets:
        raise ConfigError(
            "train.lora.targets=[] adapts nothing; name linear layers (e.g. "
            "train.lora.targets=[q_proj,v_proj]) or set it to null for the attention and MLP "
            "projections."
        )
    if cfg.dtensor.sequence_parallel:
        raise ConfigError(
            f"train.lora.rank={lo.rank} with dtensor.sequence_parallel=true: the adapters are "
            "sharded for tensor parallelism without sequence shards; set "
            "dtensor.sequence_parallel=false (or train.lora.rank=0)."
        )
    ro = cfg.rollout
    if ro.engine == "vllm" and lo.rank > 512:
        raise ConfigError(
            f"train.lora.rank={lo.rank} is above 512, the largest adapter rank vLLM serves; "
            "use train.lora.rank <= 512 or rollout=torch."
        )
    if ro.engine == "vllm" and lo.targets is not None and LORA_HEAD in lo.targets:
        raise ConfigError(
            f"train.lora.targets has {LORA_HEAD} with rollout=vllm, which serves no adapter on "
            f"the LM head; drop {LORA_HEAD} from train.lora.targets, or use rollout=torch."
        )
    if ro.engine == "vllm" and ro.tp > 1:
        raise ConfigError(
            f"train.lora.rank={lo.rank} with rollout=vllm and rollout.tp={ro.tp}: the adapter "
            "refit loads the adapter inside vLLM's single worker process only; set "
            "rollout.tp=1 (more rollout.replicas instead), or use rollout=torch."
        )


# The linear layers of a Qwen2 decoder block (the embedded tiny model's architecture).
QWEN2_LINEAR_NAMES = ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")


def check_lora_model(
    cfg: RunConfig, hidden_size: int, linear_names: list[str], source: str
) -> None:
    """``train.lora`` against the policy model (``source`` names where its sizes came from):
    the rank at most the hidden size, every target one of its decoder blocks' linear layers
    or the LM head."""
    lo = cfg.train.lora
    if lo.rank <= 0:
        return
    if lo.rank > hidden_size:
        raise ConfigError(
            f"train.lora.rank={lo.rank} is above the model's hidden size {hidden_size} ({source}), "
            f"so the adapter would not be low-rank; use train.lora.rank <= {hidden_size} "
            "(8 to 64 is usual)."
        )
    missing = sorted(set(lora_targets(cfg)) - set(linear_names) - {LORA_HEAD})
    if missing:
        raise ConfigError(
            f"train.lora.targets has {', '.join(missing)}, which the model's decoder blocks "
            f"({source}) do not have; its linear layers are: {', '.join(sorted(linear_names))} "
            f"(and {LORA_HEAD}, the output projection)."
        )
