"""A GGUF's `tokenizer.chat_template` (Jinja) rendered in a sandbox, with the injection rule kept.

The template comes from a file: it runs in jinja2's ImmutableSandboxedEnvironment (no attribute access to Python
internals, no mutation of the messages), under a time limit checked at every call the template makes and at
every piece of output, and an output limit. A template that breaks either, fails to parse or raises is a
ChatTemplateError naming what went wrong.

The injection rule: only the template inserts control tokens. Before rendering, every control-token string in
the messages (roles and contents) is replaced by a private-use placeholder character; the rendered text is then
cut at the control-token strings that remain — the template's own — and the placeholders are put back as
text. A user typing "<|im_start|>" gets those characters, never the token (a placeholder character a user
typed becomes a control token's text: still text).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterable

import regex
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pagevis.model.errors import ModelLoadError

RENDER_SECONDS = 1.0
MAX_OUTPUT_CHARS = 1 << 20
PLACEHOLDER_BASE = 0xF0000  # Supplementary Private Use Area-A
MAX_PLACEHOLDERS = 65534


class ChatTemplateError(ModelLoadError):
    """The model file's chat template cannot render this conversation (hostile, broken, or too slow/large)."""


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.render_state = threading.local()  # the deadline of the render running on this thread

    def call(self, context, obj, *args, **kwargs):
        _check_deadline(self)
        return super().call(context, obj, *args, **kwargs)


def _check_deadline(env: _BoundedEnvironment) -> None:
    if time.monotonic() > getattr(env.render_state, "deadline", float("inf")):
        raise ChatTemplateError(f"the chat template ran longer than {RENDER_SECONDS:g} s")


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


class ChatTemplate:
    """One file's template, compiled once; `segments` renders a conversation as (text, is_control) pieces."""

    def __init__(self, source: str, control_tokens: Iterable[str], bos_token: str = "", eos_token: str = "") -> None:
        self._env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        self._env.globals["raise_exception"] = _raise_exception
        self._env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        try:
            self._template = self._env.from_string(source)
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not parse: {exc}") from None
        self._controls = sorted({t for t in control_tokens if t}, key=len, reverse=True)
        if len(self._controls) > MAX_PLACEHOLDERS:
            raise ChatTemplateError(f"{len(self._controls)} control tokens, more than the {MAX_PLACEHOLDERS} the "
                                    "chat template's text guard can hold apart")
        self._placeholder = {token: chr(PLACEHOLDER_BASE + i) for i, token in enumerate(self._controls)}
        self._original = {p: t for t, p in self._placeholder.items()}
        self._split = regex.compile("(" + "|".join(regex.escape(t) for t in self._controls) + ")") \
            if self._controls else None
        self._restore = regex.compile("[" + "".join(self._original) + "]") if self._original else None
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt as one string (control tokens from the messages left as they were typed)."""
        return "".join(text for text, _ in self.segments(messages, add_generation_prompt))

    def segments(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[tuple[str, bool]]:
        safe = [{key: self._defanged(value) for key, value in message.items()} for message in messages]
        rendered = self._render(safe, add_generation_prompt)
        pieces = self._split.split(rendered) if self._split else [rendered]
        return [(piece, True) if index % 2 else (self._restored(piece), False)
                for index, piece in enumerate(pieces) if piece]

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        self._env.render_state.deadline = time.monotonic() + RENDER_SECONDS
        out, size = [], 0
        try:
            for chunk in self._template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                 bos_token=self.bos_token, eos_token=self.eos_token, tools=None):
                size += len(chunk)
                if size > MAX_OUTPUT_CHARS:
                    raise ChatTemplateError(f"the chat template wrote more than {MAX_OUTPUT_CHARS} characters")
                _check_deadline(self._env)
                out.append(chunk)
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, ValueError, AttributeError, KeyError, IndexError, RecursionError,
                ZeroDivisionError, OverflowError) as exc:
            raise ChatTemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from None
        finally:
            self._env.render_state.deadline = float("inf")
        return "".join(out)

    def _defanged(self, value: Any) -> Any:
        if not isinstance(value, str) or self._split is None:
            return value
        return self._split.sub(lambda m: self._placeholder[m.group(0)], value)

    def _restored(self, text: str) -> str:
        return self._restore.sub(lambda m: self._original[m.group(0)], text) if self._restore else text
