"""The asynchronous loop's calls made of episodes (a multi-turn environment, ``env.target``).

A call of the asynchronous loop holds ``groups_per_call`` prompt groups. With an
environment its samples are episodes, and the buffer judges such a call as it judges a
single-turn one, as a whole: the environment resets the call's episodes in the
controller's thread, in call order (so which episode gets which first prompt never depends
on thread timing), then a thread of the controller runs them to their end on the call's
replica with the run's turn driver: in lockstep turns on the torch engine (a generate call
per turn, each on that replica), as a turn session on vLLM (each episode's next turn as soon
as its observation is ready). The call returns once every episode is done; its groups then
enter the buffer with the environment's rewards.

Versions: each sampled token carries the weight version of the forward that sampled it.
Without partial rollouts the controller collects every call in flight before a refit, so a
call's episodes are of one version. With partial rollouts a refit lands whenever it comes:
between two turns (the next turn samples with the new weights) or within one (between two
decode steps, or while vLLM's scheduler is paused); the tokens after it carry the newer
version. Observation tokens are context, not samples: a trajectory's staleness counts from
its oldest sampled token (:meth:`~rltrain.envs.trajectory.Trajectory.oldest_version`), and
the off-policy correction compares each sampled token's engine logprob, which its own
version's weights gave, with the proximal policy's: per token, whatever turn it is in.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

from rltrain.cluster.actors import Pending
from rltrain.data.task import PromptItem
from rltrain.envs.driver import COUNT_METRICS, Episodes
from rltrain.logging.metrics import StageTimer
from rltrain.rollout.base import RolloutBatch, SamplingParams

if TYPE_CHECKING:
    from rltrain.loops.context import RunContext

R = TypeVar("R")


class _Scored(Protocol):
    """What :func:`env_metrics` reads of a buffered group."""

    metrics: dict[str, float]
    call: int
    call_groups: int


def _on_thread(work: Callable[[], R], name: str) -> concurrent.futures.Future[R]:
    """``work()`` on a daemon thread of its own; its future holds the result or the failure.
    Daemon: a run that ends (or fails) with episodes still running does not wait for them."""
    future: concurrent.futures.Future[R] = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(work())
        except BaseException as exc:  # noqa: BLE001 - the controller raises it (wait_all)
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class EpisodeCalls:
    """Submits the asynchronous loop's calls as episodes run by ``ctx.driver``."""

    def __init__(self, ctx: RunContext) -> None:
        assert ctx.driver is not None, "calls made of episodes need the run's turn driver"
        self.ctx, self.driver = ctx, ctx.driver

    def submit(
        self, replica: int, index: int, items: list[PromptItem], g: int, sampling: SamplingParams
    ) -> Pending[Episodes]:
        """Call ``index``: ``items`` x ``g`` episodes on replica ``replica``, reset here and
        run on a thread; ``sampling.seed`` is the call's seed (each turn derives its own
        from it, as the synchronous loop's turns do from the step's)."""
        timer = StageTimer()  # the call's own stages (the step times its waits itself)
        started = self.driver.start(items, g, timer)
        pool = self.ctx.rollout.replica(replica)
        name = pool.actors[0].name
        if pool.streams_rows:  # vLLM: a turn session on the replica

            def work() -> Episodes:
                return self.driver.run_per_trajectory(pool, items, g, sampling, timer, started)

        else:  # the torch engine: one generate call per turn, in lockstep

            def generate(prompt_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
                # a turn's call, with the seed the driver derived for the turn
                return pool.calls.wait([pool.submit(0, prompt_ids, sampling)], "generate")[0]

            def work() -> Episodes:
                return self.driver.run(generate, items, g, sampling, timer, started)

        return Pending(_on_thread(work, f"rltrain-episodes-{index}"), name)


def env_metrics(groups: Sequence[_Scored]) -> dict[str, float]:
    """The env/* metrics of a step's groups. Each group holds its call's metrics (over the
    call's episodes) and how many groups the call had. A count (:data:`COUNT_METRICS`) is
    each call's times the share of its groups the step trained, summed; a mean or fraction
    is the calls' weighted by their groups in the step. A step of whole calls (the default
    split) thus gets what the synchronous loop logs, and one call's metrics as they are.
    The controller's timings of a call (``time/*``) are left out."""
    calls: dict[int, tuple[dict[str, float], int, int]] = {}  # call -> (metrics, groups, of)
    for g in groups:
        metrics, n, of = calls.get(g.call, (g.metrics, 0, g.call_groups))
        calls[g.call] = (metrics, n + 1, of)
    total = len(groups)
    out: dict[str, float] = {}
    for metrics, n, of in calls.values():
        for k, v in metrics.items():
            if k.startswith("time/"):
                continue
            part = v * (n / of) if k in COUNT_METRICS else v * (n / total)
            out[k] = out[k] + part if k in out else part
    return out
