"""Rows stream from the rollout replicas to the controller while the replicas still generate
(RolloutPool.generate_streaming over Ray's streaming calls), and the batch is the same."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from rltrain.cluster.actors import Actor, LocalActor, WorkerError, wait_all
from rltrain.cluster.handles import Calls
from rltrain.cluster.pool import RolloutPool
from rltrain.rollout.base import RolloutBatch, SamplingParams

WAIT_S = 120.0


class _Rows:
    """Stands in for an engine behind the Ray boundary: its rows finish in reverse order, and
    after the first it waits until the controller has heard of it (a file the controller's
    callback writes), so the call can only end if rows reach the controller while it runs."""

    def __init__(self, folder: str, replica: int) -> None:
        self.folder = Path(folder)
        self.replica = replica

    def generate(self, prompt_ids, sampling, on_row=None) -> RolloutBatch:
        if self.replica == 1 and len(prompt_ids) == 5:
            raise ValueError("replica 1 cannot take five rows")
        order = list(reversed(range(len(prompt_ids))))
        heard = True
        for k, i in enumerate(order):
            on_row(i, [i, self.replica], [-0.5, -0.25], True)
            if k == 0:
                flag = self.folder / f"heard-{self.replica}"
                deadline = time.monotonic() + WAIT_S
                while not flag.exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
                heard = flag.exists()
        return RolloutBatch(
            prompt_ids=[list(p) for p in prompt_ids],
            response_ids=[[i, self.replica] for i in range(len(prompt_ids))],
            response_logprobs=[[-0.5, -0.25]] * len(prompt_ids),
            finished=[heard] * len(prompt_ids),
            weight_version=3,
        )


def _pool(actors) -> RolloutPool:
    return RolloutPool(actors, colocated=False, calls=Calls(WAIT_S), streams_rows=True)


def test_rows_reach_the_controller_while_the_replicas_generate(ray_session, tmp_path):
    from rltrain.cluster.actors import RemoteHost

    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    actors: list[Actor] = [
        Actor(RemoteHost.options(num_cpus=0).remote(), f"rollout rank {i}") for i in range(2)
    ]
    try:
        wait_all([a.build(_Rows, str(tmp_path), i) for i, a in enumerate(actors)], WAIT_S, "b")
        pool = _pool(actors)
        heard: list[tuple[int, list[int]]] = []

        def on_row(i, ids, logprobs, finished):
            heard.append((i, ids))
            (tmp_path / f"heard-{ids[1]}").touch()

        caught_up: list[int] = []  # rows heard at each call
        prompts = [[7, 8]] * 6
        out = pool.generate_streaming(
            prompts, SamplingParams(), on_row, lambda: caught_up.append(len(heard))
        )
        # Each replica waited for the controller to hear its first row: heard mid-call.
        assert out.finished == [True] * 6
        # The controller caught up with the rows at least once while a replica waited for
        # it, and again once every row was in; never with nothing new heard.
        assert 2 <= len(caught_up) <= 6 and caught_up[0] < 6 and caught_up[-1] == 6
        assert caught_up == sorted(set(caught_up))
        assert sorted(i for i, _ in heard) == list(range(6))
        assert dict(heard) == {i: out.response_ids[i] for i in range(6)}
        # Rows 0-2 on replica 0, 3-5 on replica 1 (request order kept in the batch), each
        # replica's rows heard in the order they finished (reversed).
        assert out.response_ids == [[0, 0], [1, 0], [2, 0], [0, 1], [1, 1], [2, 1]]
        assert [i for i, _ in heard if i < 3] == [2, 1, 0]
        assert [i for i, _ in heard if i >= 3] == [5, 4, 3]
        # A replica that fails ends the call with a WorkerError that names it.
        with pytest.raises(WorkerError, match=r"generate: rollout rank 1 failed: ValueError"):
            pool.generate_streaming([[1]] * 10, SamplingParams(), lambda *row: None)
    finally:
        for a in actors:
            a.kill()


def test_in_process_replicas_give_the_same_rows(tmp_path):
    """A LocalActor runs the call at once: the rows come with its result, in finish order."""
    actors = [LocalActor(f"rollout rank {i}") for i in range(2)]
    wait_all([a.build(_Rows, str(tmp_path), i) for i, a in enumerate(actors)], WAIT_S, "b")
    for i in range(2):
        (tmp_path / f"heard-{i}").touch()  # nothing to wait for in one process
    heard: list[int] = []
    caught_up: list[int] = []
    out = _pool(actors).generate_streaming(
        [[1]] * 4,
        SamplingParams(),
        lambda i, *rest: heard.append(i),
        lambda: caught_up.append(len(heard)),
    )
    assert heard == [1, 0, 3, 2]
    assert caught_up[-1] == 4  # every row in, acted on once more
    assert out.response_ids == [[0, 0], [1, 0], [0, 1], [1, 1]]
    with pytest.raises(WorkerError, match=r"generate: rollout rank 1 failed: ValueError"):
        _pool(actors).generate_streaming([[1]] * 10, SamplingParams(), lambda *row: None)
