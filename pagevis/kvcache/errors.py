"""Errors the engine raises. Each message names the field, the value and what is allowed."""

from pagevis.errors import ConfigError

__all__ = ["CacheFullError", "ConfigError"]


class CacheFullError(RuntimeError):
    """The cache has no free slot and its policy ('none') does not evict."""
