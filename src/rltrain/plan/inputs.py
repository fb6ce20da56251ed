"""What a run reads, in the plan (a part of :mod:`rltrain.plan`): the model, the tokenizer,
the data source and the reward, named from the config alone (planning needs no local
files; :mod:`rltrain.config.inputs` checks them before a run starts)."""

from __future__ import annotations

from dataclasses import dataclass

from rltrain.config.schema import RunConfig


@dataclass(frozen=True)
class ModelInputs:
    name: str
    path: str
    tokenizer: str


@dataclass(frozen=True)
class CopyTaskInputs:
    """The embedded copy task: prompts drawn from an alphabet, nothing read from disk."""

    name: str
    task: str
    alphabet: str


@dataclass(frozen=True)
class DataFields:
    prompt: str
    answer: str


@dataclass(frozen=True)
class DatasetInputs:
    """A dataset read from a local file or the HF hub."""

    name: str
    task: str
    source: str  # local path, or "hf_name:split"
    fields: DataFields
    max_prompt_tokens: int | None  # None: no limit
    validation: str  # where validation prompts come from


@dataclass(frozen=True)
class RewardInputs:
    fn: str  # import path "module:function"
    timeout_s: float
    on_error: str


@dataclass(frozen=True)
class EvalInputs:
    every_n_steps: int
    samples_per_prompt: int


@dataclass(frozen=True)
class InputsPlan:
    """What the run reads: model, tokenizer, data source, reward (see plan_inputs)."""

    model: ModelInputs
    data: CopyTaskInputs | DatasetInputs
    reward: RewardInputs
    eval: EvalInputs


def plan_inputs(cfg: RunConfig) -> InputsPlan:
    """Model, data and reward the run will read (not checked here: planning needs no local files)."""
    m, da, ev = cfg.model, cfg.data, cfg.eval
    model = ModelInputs(
        name=m.name,
        path=m.path or "embedded tiny model",
        tokenizer=m.tokenizer or m.path or "embedded",
    )
    data: CopyTaskInputs | DatasetInputs
    if da.task == "copy":
        data = CopyTaskInputs(name=da.name, task="copy", alphabet=da.alphabet)
        reward = cfg.reward.fn or "rltrain.rewards.copy:score"
    else:
        data = DatasetInputs(
            name=da.name,
            task=da.task,
            source=da.path or f"{da.hf_name}:{da.split}",
            fields=DataFields(prompt=da.prompt_field, answer=da.answer_field),
            max_prompt_tokens=da.max_prompt_tokens,
            validation=da.val_path
            or (
                f"{da.hf_name}:{da.val_split}"
                if da.val_split
                else f"{da.val_fraction:.0%} of train"
            ),
        )
        reward = cfg.reward.fn or "rltrain.rewards.math:score"
    return InputsPlan(
        model=model,
        data=data,
        reward=RewardInputs(
            fn=reward, timeout_s=cfg.reward.timeout_s, on_error=cfg.reward.on_error
        ),
        eval=EvalInputs(every_n_steps=ev.every_n_steps, samples_per_prompt=ev.samples_per_prompt),
    )
