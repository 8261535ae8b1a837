"""The chat-template worker: a process of its own that compiles and renders GGUF chat templates in jinja2's
sandbox under hard bounds. chat_template.py starts it as a script (`python -I template_worker.py LIMITS`), so
it is a fresh interpreter: it imports nothing of pagevis (only the standard library and jinja2) and maps none
of the model's memory, so an address-space limit means what it says. Before it reads a template it lowers its
priority (nice 10), limits its address space (RLIMIT_AS) and core files; before each request it sets a CPU
limit (RLIMIT_CPU) a few seconds past what it has used. The parent kills it at the wall-clock limit.

Inside, the sandbox adds its own checks with one-line answers: the render deadline at every call and every
piece of output, an output cap, and `+`, `*`, `**` intercepted (so jinja2 never folds `9 ** (9 ** 9)` or
`'x' * 10**9` while compiling) with size checks before they run.

User spans. A render is done twice: with the messages as given (the prompt), and with every non-empty content
wrapped in two marker characters that appear nowhere in the messages or the template. Filters, methods and
indexing applied to a wrapped content run on the content itself and wrap their result again, so `|trim`,
`|lower`, `.split()[-1]` or `[:5]` do what the template says and their output is still marked as the user's.
Stripping the markers from the second render must give the first exactly, with the markers in order; the
reply is the prompt as (text, from_user) pieces. A template that transforms the messages in a way the marks do
not follow (the two renders differ) is refused: pagevis never guesses which text is whose.

Protocol, on stdin / stdout: each message is a 4-byte big-endian length and that many bytes of JSON.
  {"op": "load", "key", "source", "bos", "eos"}                        -> {"ok": true}
  {"op": "render", "key", "messages", "add_generation_prompt"}        -> {"ok": [[text, from_user], ...]}
Failures: {"error": "one line", "bound": true|false}; {"unknown": true} for a key this process has not loaded.
"""

from __future__ import annotations

import functools
import json
import math
import os
import resource
import struct
import sys
import time

BOUND, FAULT = True, False  # an error reply: the template went over a bound, or failed / was refused
# Marker candidates: Unicode's noncharacters first, then the two supplementary private use planes.
MARKER_POOL = (*range(0xFDD0, 0xFDF0), *range(0xF0000, 0xFFFFE), *range(0x100000, 0x10FFFE))


class TemplateRefusal(Exception):
    """One line saying why the template cannot render this conversation; `bound` if it went over a limit."""

    def __init__(self, message: str, bound: bool = FAULT) -> None:
        super().__init__(message)
        self.bound = bound


def main() -> None:
    limits = json.loads(sys.argv[1])
    _limit_self(limits["memory"])
    from jinja2 import TemplateError  # after the limits: nothing runs unbounded

    templates: dict[str, object] = {}
    reader, writer = sys.stdin.buffer, sys.stdout.buffer
    _send(writer, {"ok": "ready"})
    while True:
        header = reader.read(4)
        if len(header) < 4:
            return  # the parent went away
        request = json.loads(reader.read(struct.unpack(">I", header)[0]))
        _cpu_budget(limits["cpu"])
        try:
            reply = _handle(request, templates, limits)
        except TemplateRefusal as refusal:
            reply = {"error": str(refusal), "bound": refusal.bound}
        except MemoryError:
            reply = {"error": f"the chat template ran out of memory (its limit is {limits['memory'] >> 20} MiB)",
                     "bound": BOUND}
        except RecursionError:
            reply = {"error": "the chat template recursed too deeply", "bound": BOUND}
        except TemplateError as exc:
            reply = {"error": f"the chat template failed: {type(exc).__name__}: {_one_line(exc)}", "bound": FAULT}
        except Exception as exc:  # noqa: BLE001 - anything a template provokes is the template's failure
            reply = {"error": f"the chat template failed: {type(exc).__name__}: {_one_line(exc)}", "bound": FAULT}
        _send(writer, reply)


def _limit_self(memory: int) -> None:
    os.nice(10)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = memory if hard == resource.RLIM_INFINITY else min(memory, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def _cpu_budget(seconds: float) -> None:
    """RLIMIT_CPU a few seconds past the CPU this process has used: a render that spins is ended by SIGXCPU
    even if the parent could not kill it."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + seconds)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _send(writer, reply: dict) -> None:
    data = json.dumps(reply).encode("ascii")
    writer.write(struct.pack(">I", len(data)) + data)
    writer.flush()


def _one_line(exc: object) -> str:
    return " ".join(str(exc).split())[:300]


def _handle(request: dict, templates: dict, limits: dict) -> dict:
    if request["op"] == "load":
        templates[request["key"]] = _Compiled(request["source"], request["bos"], request["eos"], limits)
        return {"ok": True}
    template = templates.get(request["key"])
    if template is None:
        return {"unknown": True}
    return {"ok": template.render(request["messages"], request["add_generation_prompt"])}


class _Compiled:
    """One template compiled in the bounded sandbox."""

    def __init__(self, source: str, bos: str, eos: str, limits: dict) -> None:
        from jinja2 import TemplateSyntaxError

        self.env = _sandbox(limits)
        self.env.deadline = time.monotonic() + limits["seconds"]
        try:
            self.template = self.env.from_string(source)
        except TemplateSyntaxError as exc:
            raise TemplateRefusal(f"the chat template does not parse: {_one_line(exc)}") from None
        self.bos, self.eos, self.limits, self.source_chars = bos, eos, limits, set(source)

    def render(self, messages: list[dict], add_generation_prompt: bool) -> list[list]:
        self.env.deadline = time.monotonic() + self.limits["seconds"]
        self.env.markers = None
        plain = self._render(messages, add_generation_prompt)
        start, end = _markers(messages, self.source_chars)
        self.env.markers = (start, end)
        try:
            marked = self._render([_marked(m, start, end) for m in messages], add_generation_prompt)
        finally:
            self.env.markers = None
        return _pieces(marked, plain, start, end)

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        out, size, cap = [], 0, self.limits["output"]
        for chunk in self.template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                            bos_token=self.bos, eos_token=self.eos, tools=None):
            size += len(chunk)
            if size > cap:
                raise TemplateRefusal(f"the chat template wrote more than {cap} characters (its output limit)",
                                      BOUND)
            self.env.check_deadline()
            out.append(chunk)
        return "".join(out)


def _markers(messages: list[dict], source_chars: set[str]) -> tuple[str, str]:
    """Two characters found in no message and not in the template's own code."""
    used = set(source_chars)
    for message in messages:
        for value in message.values():
            if isinstance(value, str):
                used.update(value)
    free = (chr(c) for c in MARKER_POOL if chr(c) not in used)
    try:
        return next(free), next(free)
    except StopIteration:
        raise TemplateRefusal("the messages use every character pagevis could mark them with") from None


class _Span(str):
    """A message's text between the markers. Slicing (which jinja2 compiles to a plain subscript, past the
    sandbox) slices the text and keeps the markers."""

    def __getitem__(self, index):
        if isinstance(index, slice) and len(self) >= 2:
            inner = str.__getitem__(self, slice(1, -1))[index]
            return _Span(self[0] + inner + self[-1]) if inner else ""
        return str.__getitem__(self, index)


def _marked(message: dict, start: str, end: str) -> dict:
    """The message with its content (every value but the role) between the markers."""
    return {key: (_Span(start + value + end) if key != "role" and isinstance(value, str) and value else value)
            for key, value in message.items()}


def _pieces(marked: str, plain: str, start: str, end: str) -> list[list]:
    """The marked render as [text, from_user] pieces; refused unless it is the plain render, marked in order."""
    pieces: list[list] = []
    inside, text = False, list[str]()
    for ch in marked:
        if ch == start or ch == end:
            if (ch == start) == inside:
                raise TemplateRefusal("the chat template's output cannot be split into its own text and the "
                                      "messages' (it cuts or reorders a message's text)")
            if text:
                pieces.append(["".join(text), inside])
            text, inside = [], not inside
        else:
            text.append(ch)
    if inside:
        raise TemplateRefusal("the chat template's output cannot be split into its own text and the messages' "
                              "(a message's text is cut short)")
    if text:
        pieces.append(["".join(text), False])
    if "".join(str(p[0]) for p in pieces) != plain:
        raise TemplateRefusal("the chat template's output cannot be split into its own text and the messages' "
                              "(it writes something else when the messages are marked)")
    return pieces


def _sandbox(limits: dict):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"+", "*", "**"})
        markers: tuple[str, str] | None = None
        deadline = math.inf

        def check_deadline(self) -> None:
            if time.monotonic() > self.deadline:
                raise TemplateRefusal(f"the chat template ran longer than {limits['seconds']:g} s (its time "
                                      "limit)", BOUND)

        def span(self, value) -> str | None:
            """The text of a marked content (a whole span and nothing else), else None."""
            if self.markers is None or not isinstance(value, str) or len(value) < 2:
                return None
            start, end = self.markers
            if value[0] != start or value[-1] != end:
                return None
            inner = str.__getitem__(value, slice(1, -1))
            return None if start in inner or end in inner else inner

        def wrap(self, value):
            """A value computed from a content's text, marked as the user's again."""
            if isinstance(value, str) and self.markers is not None:  # wrap runs inside a marked render only
                return _Span(self.markers[0] + value + self.markers[1]) if value else value
            if isinstance(value, (list, tuple)):
                return type(value)(self.wrap(v) for v in value)
            if hasattr(value, "__next__"):
                return [self.wrap(v) for v in value]
            return value

        def call(self, context, obj, *args, **kwargs):
            self.check_deadline()
            inner = self.span(getattr(obj, "__self__", None))
            if inner is not None and callable(getattr(str, getattr(obj, "__name__", ""), None)):
                return self.wrap(super().call(context, getattr(inner, obj.__name__), *args, **kwargs))
            return super().call(context, obj, *args, **kwargs)

        def getitem(self, obj, argument):
            inner = self.span(obj)
            if inner is not None and isinstance(argument, (int, slice)):
                return self.wrap(inner[argument])
            return super().getitem(obj, argument)

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right, limits["output"])
            return super().call_binop(context, operator, left, right)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.policies["json.dumps_kwargs"] = {"sort_keys": True, "ensure_ascii": False}

    def raise_exception(message: str) -> None:
        raise TemplateRefusal(f"the chat template refused the conversation: {_one_line(message)}")

    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    for name, function in list(env.filters.items()):
        env.filters[name] = _span_aware(env, function, 1 if getattr(function, "jinja_pass_arg", None) else 0)
    for name, function in list(env.tests.items()):
        env.tests[name] = _span_aware(env, function, 1 if getattr(function, "jinja_pass_arg", None) else 0, wrap=False)
    return env


def _span_aware(env, function, skip: int, wrap: bool = True):
    """A filter or test that runs on a marked content's own text, its result marked again."""
    @functools.wraps(function)
    def aware(*args, **kwargs):
        inner = env.span(args[skip]) if len(args) > skip else None
        if inner is None:
            return function(*args, **kwargs)
        result = function(*args[:skip], inner, *args[skip + 1:], **kwargs)
        return env.wrap(result) if wrap else result
    return aware


def _check_binop(operator: str, left, right, cap: int) -> None:
    numbers = (int, float)
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        if right * math.log2(abs(left)) > 1 << 16:
            raise TemplateRefusal(f"the chat template computes a number of more than {1 << 16} bits "
                                  f"({left} ** {right})", BOUND)
    elif operator == "*" and isinstance(left, (str, list, tuple)) != isinstance(right, (str, list, tuple)):
        sequence, count = (left, right) if isinstance(left, (str, list, tuple)) else (right, left)
        if isinstance(count, int) and len(sequence) * count > cap:
            raise TemplateRefusal(f"the chat template builds a value of {len(sequence) * count} items "
                                  f"(more than its output limit of {cap})", BOUND)
    elif operator == "+" and not isinstance(left, numbers) and hasattr(left, "__len__") and hasattr(right, "__len__"):
        if len(left) + len(right) > cap:
            raise TemplateRefusal(f"the chat template builds a value of {len(left) + len(right)} items (more than "
                                  f"its output limit of {cap})", BOUND)


if __name__ == "__main__":
    main()
