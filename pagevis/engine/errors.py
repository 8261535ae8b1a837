"""Errors the engine raises. Each message names the field, the value and what is allowed."""


class ConfigError(ValueError):
    """An invalid cache or policy setting."""

    def __init__(self, field: str, value: object, allowed: str):
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"{field} = {value!r} is not allowed: {allowed}")


class CacheFullError(RuntimeError):
    """The cache has no free slot and its policy ('none') does not evict."""
