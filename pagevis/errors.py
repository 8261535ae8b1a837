"""The one error for a bad setting, shared by every layer: it names the field, the value and what is
allowed, so the GUI and the CLI can show it as it is."""

from __future__ import annotations

from typing import Any

import numpy as np


class ConfigError(ValueError):
    """An invalid setting (cache, policy, sampling, model layout...)."""

    def __init__(self, field: str, value: object, allowed: str):
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"{field} = {value!r} is not allowed: {allowed}")


def check_int(name: str, value: Any, low: int, high: int, allowed: str | None = None) -> int:
    """Return value as int if it is an integer in [low, high] (bools are not), else raise ConfigError."""
    allowed = allowed or f"an integer from {low} to {high}"
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
        raise ConfigError(name, value, allowed)
    return int(value)
