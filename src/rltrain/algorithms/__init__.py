"""Pure tensor math of the RL objectives: advantages, GAE, losses, logprobs, shaping, values.

Plain functions of tensors and config values; the trainer, the engines and the
loops (``rltrain.loops``) import them, never the other way round.
"""
