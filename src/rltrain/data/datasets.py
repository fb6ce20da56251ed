"""Prompts and references from a local file or a Hugging Face dataset (``data.task=dataset``).

Rows are read with the ``datasets`` library (``json``/``jsonl``/``parquet``
files, or a dataset name served from the local HF cache), mapped through
``data.prompt_field`` / ``data.answer_field``, rendered with
``data.prompt_template`` and the tokenizer's chat template, and checked:
a row with a missing field, an empty prompt or a prompt longer than
``data.max_prompt_tokens`` is a bad row (skipped and reported once, or an
error under ``data.strict=true``).
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rltrain.config.errors import ConfigError
from rltrain.config.schema import DataConfig, RewardConfig
from rltrain.data.task import PromptItem, ScoredByRewardFunction
from rltrain.rewards.registry import RewardFunction

log = logging.getLogger(__name__)

DEFAULT_REWARD = "rltrain.rewards.math:score"
FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# Rows held out for validation by data.val_fraction come from their own shuffle.
_VAL_SEED_OFFSET = 7_919


@dataclass
class LoadReport:
    """What loading one split kept and skipped (reason -> count, first bad row)."""

    source: str
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    first_bad: str | None = None

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())


def read_rows(cfg: DataConfig, path: str | None, split: str) -> tuple[list[dict[str, Any]], str]:
    """Raw rows of a local file (``path``) or of ``data.hf_name`` at ``split``; returns (rows, source name)."""
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - a dependency of rltrain
        raise ConfigError(
            "data.task=dataset needs the 'datasets' package: pip install datasets."
        ) from exc
    datasets.disable_progress_bars()
    if path is not None:
        p = Path(path).expanduser()
        fmt = FILE_FORMATS.get(p.suffix.lower())
        if fmt is None:
            raise ConfigError(
                f"data file '{path}' has an unknown extension; use a .jsonl, .json or .parquet file."
            )
        if not p.is_file():
            raise ConfigError(
                f"data file '{path}' does not exist; set data.path=/path/to/train.jsonl "
                "(a .jsonl/.json/.parquet file) or data.hf_name=NAME for a dataset in the local HF cache."
            )
        if p.stat().st_size == 0:
            raise ConfigError(
                f"data file '{path}' is empty; point data.path at a file with the training rows."
            )
        # datasets logs the parse error itself before raising; the ConfigError below says it once.
        ds_log = logging.getLogger("datasets")
        level = ds_log.level
        ds_log.setLevel(logging.CRITICAL)
        try:
            ds = datasets.load_dataset(fmt, data_files=str(p), split="train")
        except Exception as exc:  # noqa: BLE001 - malformed file content is the user's input
            raise ConfigError(
                f"data file '{path}' could not be read as {fmt} ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}); fix the file."
            ) from exc
        finally:
            ds_log.setLevel(level)
        return ds.to_list(), str(p)
    name = cfg.hf_name
    try:
        ds = datasets.load_dataset(name, cfg.hf_config, split=split)
    except Exception as exc:  # noqa: BLE001 - not cached / unknown split
        raise ConfigError(
            f"data.hf_name='{name}' (config {cfg.hf_config}, split '{split}') could not be loaded "
            f"({type(exc).__name__}); download it where there is network and point HF_HOME at that "
            "cache, or set data.path=/path/to/file.jsonl."
        ) from exc
    return ds.to_list(), f"{name}:{split}"


def render_prompt(cfg: DataConfig, tokenizer, text: str) -> str:
    """The prompt text fed to the model: template, then the chat template when the tokenizer has one."""
    prompt = cfg.prompt_template.format(prompt=text)
    if cfg.use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        if cfg.system_prompt:
            messages.insert(0, {"role": "system", "content": cfg.system_prompt})
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return prompt


def build_items(
    cfg: DataConfig, tokenizer, rows: list[dict[str, Any]], source: str
) -> tuple[list[PromptItem], LoadReport]:
    """Map, render and check rows; bad rows are skipped (or raise under ``data.strict``)."""
    report = LoadReport(source)
    candidates: list[tuple[int, str, str]] = []

    def bad(index: int, reason: str, detail: str) -> None:
        line = f"row {index} of {source}: {detail}"
        if cfg.strict:
            raise ConfigError(
                f"data: {line}; fix the data or set data.strict=false to skip bad rows."
            )
        report.skipped[reason] += 1
        report.first_bad = report.first_bad or line

    for i, row in enumerate(rows):
        prompt, answer = row.get(cfg.prompt_field), row.get(cfg.answer_field)
        if prompt is None or answer is None:
            missing = cfg.prompt_field if prompt is None else cfg.answer_field
            bad(i, f"missing field '{missing}'", f"the field '{missing}' is missing")
        elif not str(prompt).strip():
            bad(i, "empty prompt", f"the field '{cfg.prompt_field}' is empty")
        else:
            candidates.append((i, render_prompt(cfg, tokenizer, str(prompt)), str(answer)))

    items = []
    lengths = (
        [len(ids) for ids in tokenizer([c[1] for c in candidates]).input_ids] if candidates else []
    )
    for (i, prompt, answer), n in zip(candidates, lengths, strict=True):
        if cfg.max_prompt_tokens is not None and n > cfg.max_prompt_tokens:
            bad(
                i,
                "prompt too long",
                f"the prompt has {n} tokens, more than data.max_prompt_tokens={cfg.max_prompt_tokens}",
            )
            continue
        items.append(PromptItem(prompt=prompt, answer=answer))
    report.kept = len(items)
    if report.num_skipped:
        reasons = ", ".join(f"{n} {r}" for r, n in report.skipped.most_common())
        log.warning(
            "data: skipped %d of %d rows of %s (%s); first: %s. Set data.strict=true to stop instead.",
            report.num_skipped,
            len(rows),
            source,
            reasons,
            report.first_bad,
        )
    if not items:
        raise ConfigError(
            f"data: no usable rows in {source} ({report.num_skipped} bad of {len(rows)}"
            f"{'; first: ' + report.first_bad if report.first_bad else ''}); check data.prompt_field="
            f"{cfg.prompt_field}, data.answer_field={cfg.answer_field} and data.max_prompt_tokens."
        )
    return items, report


class DatasetTask(ScoredByRewardFunction):
    """Prompts from a dataset split, sampled without replacement in a seeded order per epoch.

    Built once in the controller. ``sample`` walks a permutation of the rows
    (reshuffled each epoch from ``seed + epoch`` when ``data.shuffle``); the
    position is the whole sampler state (``state_dict``), so a resumed run
    sees the same prompts.
    """

    def __init__(self, cfg: DataConfig, seed: int, tokenizer, reward: RewardConfig | None = None):
        self.cfg = cfg
        self.seed = seed
        self.reward_fn = RewardFunction.from_config(reward or RewardConfig(), DEFAULT_REWARD)
        if cfg.path is None and cfg.hf_name is None:
            raise ConfigError(
                "data.task=dataset needs data.path=/path/to/file.jsonl or data.hf_name=NAME."
            )
        rows, source = read_rows(cfg, cfg.path, cfg.split)
        val_items: list[PromptItem] = []
        self.reports: dict[str, LoadReport] = {}
        if cfg.val_path is not None or cfg.val_split is not None:
            # A separate file, else another split of data.hf_name (validate() checks which).
            val_rows, val_source = read_rows(cfg, cfg.val_path, cfg.val_split or cfg.split)
            val_items, self.reports["validation"] = build_items(
                cfg, tokenizer, val_rows, val_source
            )
        items, self.reports["train"] = build_items(cfg, tokenizer, rows, source)
        if cfg.val_fraction > 0 and not val_items:
            order = list(range(len(items)))
            random.Random(seed + _VAL_SEED_OFFSET).shuffle(order)
            n_val = max(1, round(len(items) * cfg.val_fraction))
            if n_val >= len(items):
                raise ConfigError(
                    f"data.val_fraction={cfg.val_fraction} leaves no training rows of the {len(items)} "
                    "usable ones; lower it."
                )
            held = set(order[:n_val])
            val_items = [items[i] for i in sorted(held)]
            items = [it for i, it in enumerate(items) if i not in held]
        self.items = items
        self.val_items = val_items
        self.epoch = 0
        self.cursor = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        if self.cfg.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def sample(self, num_prompts: int) -> list[PromptItem]:
        out: list[PromptItem] = []
        while len(out) < num_prompts:
            if self.cursor == len(self._order):
                self.epoch += 1
                self.cursor = 0
                self._order = self._permutation(self.epoch)
            take = self._order[self.cursor : self.cursor + num_prompts - len(out)]
            out.extend(self.items[i] for i in take)
            self.cursor += len(take)
        return out

    def validation(self) -> list[PromptItem]:
        return list(self.val_items)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._permutation(self.epoch)
