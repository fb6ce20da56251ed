"""Token-in/token-out trajectories: a conversation kept as token id segments.

A trajectory is the prompt's ids, then per model turn the engine's own sampled ids
(with their logprobs and the weight version of the forward that produced each),
then the environment's observation as ids with loss mask 0. Nothing the model
produced is ever decoded and encoded again: what the trainer scores is exactly what
the engine sampled.

The chat template's turn boundaries come from the tokenizer's own template, rendered
once per role (:class:`ObservationFrame`): the ids that close the model's turn and open
the observation's role, and the ids that close the observation and open the model's
next turn. A tokenizer without a chat template (the embedded character tokenizer) gets
the observation's own ids and nothing around them. :func:`template_drift` measures
how far the segment-built ids are from the template rendering the whole conversation
as text and encoding it again (``env/template_drift_tokens``).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

# Stand-ins rendered through the chat template to find where each role's frame starts
# and ends; the template must copy message content through unchanged.
_MODEL_MARK = "\x00RLTRAIN_MODEL_TURN\x00"
_OBS_MARK = "\x00RLTRAIN_OBSERVATION\x00"


@dataclass
class Trajectory:
    """One episode's token ids after the prompt, one entry per token in every list.

    ``mask[j]`` is 1 for a token the engine sampled (a training target) and 0 for an
    observation token (context only); ``logprobs[j]`` the engine's logprob (0 for
    observation tokens); ``versions[j]`` the weight version of the forward that sampled
    it (an observation token carries its turn's)."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[tuple[int, int]] = field(default_factory=list)  # (start, end) of model turns
    observations: list[tuple[int, int]] = field(default_factory=list)  # (start, end)

    def add_turn(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        """Append the engine's sampled ids of one model turn (mask 1)."""
        assert len(ids) == len(logprobs) == len(versions)
        start = len(self.ids)
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += logprobs
        self.versions += versions
        self.turns.append((start, len(self.ids)))

    def add_observation(self, ids: list[int]) -> None:
        """Append an observation's ids (mask 0), stamped with the last turn's version."""
        start = len(self.ids)
        version = self.versions[-1] if self.versions else 0
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)
        self.observations.append((start, len(self.ids)))

    def oldest_version(self, default: int) -> int:
        """The weight version of the trajectory's oldest sampled token (what the asynchronous
        loop's staleness bound counts from), ``default`` when it has none. Observation tokens
        are context, not samples: their version does not count."""
        return min((v for v, m in zip(self.versions, self.mask, strict=True) if m), default=default)

    @property
    def sampled_tokens(self) -> int:
        return sum(self.mask)

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.ids


def _has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


@dataclass(frozen=True)
class ObservationFrame:
    """The ids around an observation, from the tokenizer's chat template (empty without one).

    ``open_ids`` close the model's turn and open the observation's role (for Qwen2.5:
    ``<|im_end|>\\n<|im_start|>tool\\n``); ``close_ids`` close the observation and open
    the model's next turn (``<|im_end|>\\n<|im_start|>assistant\\n``). When the model's
    turn already ended with the end-of-turn token, that token is not repeated
    (:meth:`wrap`)."""

    open_ids: tuple[int, ...] = ()
    close_ids: tuple[int, ...] = ()
    eos_id: int | None = None

    @classmethod
    def of(cls, tokenizer: Any, role: str = "tool") -> ObservationFrame:
        """Render a probe conversation once and cut the frames out of it as ids."""
        if not _has_chat_template(tokenizer):
            return cls()
        text = tokenizer.apply_chat_template(
            [
                {"role": "user", "content": "?"},
                {"role": "assistant", "content": _MODEL_MARK},
                {"role": role, "content": _OBS_MARK},
            ],
            tokenize=False,
            add_generation_prompt=True,
        )
        a = text.index(_MODEL_MARK) + len(_MODEL_MARK)
        b = text.index(_OBS_MARK)
        open_text, close_text = text[a:b], text[b + len(_OBS_MARK) :]
        enc = tokenizer(open_text, add_special_tokens=False).input_ids
        dec = tokenizer(close_text, add_special_tokens=False).input_ids
        return cls(tuple(enc), tuple(dec), tokenizer.eos_token_id)

    def wrap(self, observation_ids: list[int], turn_ended_with_eos: bool) -> list[int]:
        """The observation's ids inside its frame."""
        open_ids = list(self.open_ids)
        if turn_ended_with_eos and open_ids and open_ids[0] == self.eos_id:
            open_ids = open_ids[1:]
        return open_ids + observation_ids + list(self.close_ids)

    @property
    def overhead(self) -> int:
        return len(self.open_ids) + len(self.close_ids)


def encode_observation(tokenizer: Any, text: str) -> list[int]:
    """An observation's own ids: plain text, no special tokens added."""
    return list(tokenizer(text, add_special_tokens=False).input_ids) if text else []


def id_drift(reference: list[int], ours: list[int]) -> int:
    """Tokens by which ``ours`` differs from ``reference``: the longer one's length less the
    tokens both share in order (0 = the same ids)."""
    matcher = difflib.SequenceMatcher(a=reference, b=ours, autojunk=False)
    same = sum(b.size for b in matcher.get_matching_blocks())
    return max(len(reference), len(ours)) - same


def template_drift(tokenizer: Any, messages: list[dict[str, str]], ours: list[int]) -> int:
    """Drift of the segment-built ids ``ours`` from the chat template's rendering of
    ``messages`` (the same conversation as text) encoded in one go. The rendering is cut
    after its last end-of-turn token when ``ours`` ends with one (the template closes a
    final turn with a newline the model never samples)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    rendered = list(tokenizer(text, add_special_tokens=False).input_ids)
    eos = tokenizer.eos_token_id
    if ours and ours[-1] == eos and eos in rendered:
        rendered = rendered[: len(rendered) - rendered[::-1].index(eos)]
    return id_drift(rendered, ours)


def retokenize_drift(tokenizer: Any, trajectory: Trajectory) -> int:
    """Drift of a trajectory's ids from its own text (special tokens kept) encoded in one
    go: what a pipeline that keeps text and tokenizes the conversation again would train
    on instead. 0 without a chat template (the character tokenizer maps text to ids one
    to one)."""
    if not _has_chat_template(tokenizer):
        return 0
    ours = trajectory.all_ids()
    text = tokenizer.decode(ours, skip_special_tokens=False)
    return id_drift(list(tokenizer(text, add_special_tokens=False).input_ids), ours)
