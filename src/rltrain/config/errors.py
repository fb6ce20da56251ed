"""The exception type for a user's config or input mistake (exit code 2)."""


class ConfigError(ValueError):
    """A user-facing config/input error: one sentence naming the key and the fix."""


class MemoryRefusal(ConfigError):
    """A layout over its GPUs' memory (the plan's estimate): the plan may still size what
    is left to it (a colocated engine's KV cache) to fit before the refusal stands."""
