"""The server's request models for settings, made from the settings table (pagevis/settings.py): one
optional field per setting a request may set, named as its flag (`max_tokens`, `sample`), typed from its
kind and described by its help. Values are checked by the table and the engine, not by pydantic bounds, so a
bad value gets the message `pagevis run` would give (a 422 naming the field, the value and what is allowed).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from pagevis import settings as table

MAX_PROMPT_CHARS = 200_000
PolicyValue = int | float | str | None
TYPES: dict[str, Any] = {"int": int, "float": float, "str": str, "bool": bool, "params": dict[str, PolicyValue],
                         "layers": Literal["all", "none"] | list[int]}


def describe(setting: table.Setting) -> str:
    """The API docs' description: the help and what is allowed (unset: the server's default, which its
    command line sets)."""
    allowed = "" if setting.switch is not None else setting.allowed_text()
    return setting.help + (f"; {allowed}" if allowed else "")


def request_fields(*groups: str) -> dict[str, Any]:
    """Pydantic field definitions for the settings of `groups` that requests may set."""
    fields = {}
    for s in table.in_group(*groups):
        if s.request:
            kind = bool if s.kind == "str" and s.switch is not None else TYPES[s.kind]
            fields[s.dest] = (kind | None, Field(None, description=describe(s)))
    return fields


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


CacheSettings = create_model(
    "CacheSettings", __base__=_Settings, __module__=__name__, **request_fields("cache"),
    __doc__="Cache settings, as `pagevis run`'s flags of the same names; unset ones take the server's defaults.")

SessionRequest = create_model(
    "SessionRequest", __base__=CacheSettings, __module__=__name__,
    prompt=(str, Field(max_length=MAX_PROMPT_CHARS)), **request_fields("session", "sampling"),
    __doc__="A decoding session: its prompt and settings, as `pagevis run`'s flags of the same names.")
