"""Errors raised while loading or building a model."""

from __future__ import annotations

from pagevis.errors import ConfigError


class ModelLoadError(ValueError):
    """A model file could not be used: missing, not GGUF, truncated, or of an unsupported kind.

    The message names the file and says what is wrong with it.
    """


# A bad model parameter is a bad setting like any other: one error type across the layers.
ModelConfigError = ConfigError
