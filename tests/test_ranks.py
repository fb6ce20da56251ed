"""The spawned-rank harness reports what a failed rank left: its traceback, or for a rank
killed inside native code, its threads' Python stacks."""

from __future__ import annotations

import os

import pytest

from tests.ranks import run_ranks


def _rank(rank: int, how: str) -> int:
    if rank == 1 and how == "abort":
        os.abort()  # what a collective library's std::terminate does to a rank
    if rank == 1 and how == "raise":
        raise ValueError("rank 1 found a bad shard")
    return rank * 10


@pytest.mark.timeout(120)
def test_ranks_return_their_values(tmp_path):
    assert run_ranks(_rank, 2, ("none",), tmp_path, 100, exit_hard=True) == [0, 10]


@pytest.mark.timeout(120)
def test_a_native_abort_is_reported_with_the_ranks_python_stack(tmp_path):
    with pytest.raises(pytest.fail.Exception) as info:
        run_ranks(_rank, 2, ("abort",), tmp_path, 100)
    msg = str(info.value)
    assert "SIGABRT" in msg and "--- fault1 ---" in msg, msg
    assert "Fatal Python error: Aborted" in msg and "in _rank" in msg, msg


@pytest.mark.timeout(120)
def test_a_raising_rank_is_reported_with_its_traceback(tmp_path):
    with pytest.raises(pytest.fail.Exception) as info:
        run_ranks(_rank, 2, ("raise",), tmp_path, 100)
    msg = str(info.value)
    assert "--- error1 ---" in msg and "ValueError: rank 1 found a bad shard" in msg, msg
