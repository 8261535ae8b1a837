"""The API's arguments as the command line's: the same settings table defines them, the same checks refuse bad
ones, and the refusals are ConfigErrors (pagevis.ConfigError) with the command line's words."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from pagevis import settings
from pagevis.errors import ConfigError

SESSION_GROUPS = ("cache", "session", "sampling")  # the settings a Session takes (SessionConfig's)


def usage_config_error(field: str, value: object, message: str) -> ConfigError:
    """A ConfigError whose message is a command-line check's own sentence (a model file that is not there, a
    cache too large for the memory): field and value as any ConfigError's, the text as the CLI prints it."""
    error = ConfigError(field, value, message)
    error.args = (message,)
    return error


def session_settings() -> list[str]:
    return [s.name for s in settings.in_group(*SESSION_GROUPS)]


def session_config(given: Mapping[str, Any]):
    """A SessionConfig from keyword arguments named as the settings table names them (None: not given), over the
    table's defaults, validated as `pagevis run` validates its flags."""
    from pagevis.cli import options
    from pagevis.presets import DEFAULT_CONFIG

    names = session_settings()
    for name, value in given.items():
        if name not in names:
            raise ConfigError(name, value, _unknown(name, names))
    by_dest = {settings.setting(name).dest: _plain(name, value) for name, value in given.items() if value is not None}
    config = settings.apply(DEFAULT_CONFIG, by_dest)
    with usage_errors("special", given.get("special")):
        options.check_cache(config)
    return config


def _plain(name: str, value: Any) -> Any:
    """A keyword's value as the table's apply() takes a flag's: layers as "all", "none" or a tuple."""
    if name == "record_layers" and isinstance(value, (list, tuple, range)):
        return tuple(value)
    if name == "policy_params" and not isinstance(value, Mapping):
        raise ConfigError(name, value, "a dict of the policy's parameters, e.g. {'n_sink': 4}")
    return value


def _unknown(name: str, names: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{hint}a Session takes model, prompt, teacher_forced, tokens and the settings {', '.join(names)}"


def model_spec(model: str | None):
    """The ModelSpec of `model` (smollm2, gemma3-270m, synthetic, or a .gguf path), checked as --model is."""
    from pagevis.cli import options

    if model is not None and not isinstance(model, str):
        raise ConfigError("model", model, "smollm2, gemma3-270m, synthetic, or the path of a .gguf file")
    args = argparse.Namespace(model=model, preset=None, **{flag: None for flag in options.SYNTHETIC_FLAGS})
    with usage_errors("model", model):
        return options.model_spec(args)


class usage_errors:
    """Turns the command line's UsageError into a ConfigError naming `field` (a context manager)."""

    def __init__(self, field: str, value: object):
        self.field, self.value = field, value

    def __enter__(self):
        return self

    def __exit__(self, kind, error, _traceback) -> bool:
        from pagevis.cli.options import UsageError

        if isinstance(error, UsageError):
            raise usage_config_error(self.field, self.value, str(error)) from None
        return False
