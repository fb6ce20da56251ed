"""The controllers: the RL loops (GRPO, PPO) in data-flow order, rollout collection and
evaluation, over the role handles of a :class:`~rltrain.loops.context.RunContext`."""
