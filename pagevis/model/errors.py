"""Errors raised while loading or building a model."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model file could not be used: missing, not GGUF, truncated, or of an unsupported kind.

    The message names the file and says what is wrong with it.
    """


class ModelConfigError(ValueError):
    """A model parameter is invalid. Names the field, the value given and what is allowed."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        super().__init__(f"{field}={value!r} is invalid: must be {allowed}")
        self.field = field
        self.value = value
        self.allowed = allowed
