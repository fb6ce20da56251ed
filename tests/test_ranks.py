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
@pytest.mark.parametrize(
    ("how", "needles"),
    [
        # killed inside native code: the rank's Python stack, from faulthandler
        ("abort", ["SIGABRT", "--- fault1 ---", "Fatal Python error: Aborted", "in _rank"]),
        ("raise", ["--- error1 ---", "ValueError: rank 1 found a bad shard"]),
    ],
)
def test_a_failed_rank_is_reported_with_what_it_left(tmp_path, how, needles):
    with pytest.raises(pytest.fail.Exception) as info:
        run_ranks(_rank, 2, (how,), tmp_path, 100)
    msg = str(info.value)
    assert all(n in msg for n in needles), msg
