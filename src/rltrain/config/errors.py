"""The one exception type for a user's config or input mistake (exit code 2)."""


class ConfigError(ValueError):
    """A user-facing config/input error: one sentence naming the key and the fix."""
