"""Multi-turn environments: the protocol (base.py), trajectories as token id segments
(trajectory.py), the turn driver (driver.py), loading by import path (registry.py) and
the shipped environments (single_turn, tool_copy, bench_turns, python_tool)."""

from rltrain.envs.base import Environment, Episode, StepResult, Turn

__all__ = ["Environment", "Episode", "StepResult", "Turn"]
