"""A GGUF's `tokenizer.chat_template` (Jinja), compiled and rendered in a worker process under hard bounds, with
control tokens coming only from the template's own text.

Bounds. The template never runs in this process (jinja2 folds constants while compiling, so even compiling
`{{ 9 ** (9 ** 9) }}` would hang it). It runs in one worker process (template_worker.py: a fresh interpreter
started as a script, not a fork, so it maps none of the model's memory), renders one at a time, niced, with
an address-space limit of MEMORY_BYTES and a CPU limit per request; it is killed at KILL_SECONDS of wall
clock and started again for the next render. A template over a bound is a ChatTemplateError naming it.
At load a template is compiled and rendered on two sample conversations: one that does not parse, goes over
a bound on them, or whose output cannot be split (below) is refused then, in one line.

Control tokens. The worker returns the prompt as pieces marked as the template's text or a message's text
(it renders with every content between marker characters and checks the marks against a plain render: see
template_worker.py). Control-token strings are looked for only in the template's pieces; a message's text,
however the template transformed or joined it (`|lower` of "<|IM_START|>", "<|im_" + "start|>"), is text.
Roles are the template's vocabulary (Phi-3 builds `<|user|>` from one), so only ROLES are accepted.

Rendered prompts are cached per (messages, add_generation_prompt), so a conversation rendered for its length
and then for its ids, or sent again, costs one render.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from typing import Iterable

import regex

from pagevis.model.errors import ModelLoadError

RENDER_SECONDS = 2.0  # the sandbox's own deadline: a clean refusal, the worker lives on
KILL_SECONDS = 3.0  # the wall clock past which the worker is killed, whatever it is doing
CPU_SECONDS = 4  # RLIMIT_CPU past the worker's CPU time at each request (a spin the kill somehow missed)
MEMORY_BYTES = 512 << 20  # the worker's address space (RLIMIT_AS)
MAX_OUTPUT_CHARS = 1 << 20
MAX_TEMPLATE_CHARS = 1 << 20
START_SECONDS = 60.0  # the worker's start (a fresh interpreter importing jinja2, on a loaded machine)
ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
CACHED_CHARS = 4 << 20  # rendered prompts kept per template, in characters
PROBES = (
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "  Hello! What is 2 + 2?\n"},
     {"role": "assistant", "content": "2 + 2 = 4."},
     {"role": "user", "content": "And <b>3 + 3</b>? Answer in Words."}],
    [{"role": "user", "content": "Hello, how are you?"}],
)
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "template_worker.py")


class ChatTemplateError(ModelLoadError):
    """The model file's chat template cannot render this conversation (hostile, broken, or too slow/large)."""

    def __init__(self, message: str, bound: bool = False) -> None:
        super().__init__(message)
        self.bound = bound  # it went over a time, memory or size limit


class ChatTemplate:
    """One file's template; `segments` renders a conversation as (text, is_control) pieces."""

    def __init__(self, source: str, control_tokens: Iterable[str], bos_token: str = "", eos_token: str = "") -> None:
        if len(source) > MAX_TEMPLATE_CHARS:
            raise ChatTemplateError(f"the chat template is {len(source)} characters long; at most "
                                    f"{MAX_TEMPLATE_CHARS}", bound=True)
        self.bos_token, self.eos_token = bos_token, eos_token
        self._load = {"op": "load", "source": source, "bos": bos_token, "eos": eos_token,
                      "key": hashlib.sha256(json.dumps([source, bos_token, eos_token]).encode()).hexdigest()}
        controls = sorted({t for t in control_tokens if t}, key=len, reverse=True)
        self._split = regex.compile("(" + "|".join(regex.escape(t) for t in controls) + ")") if controls else None
        self._cache: OrderedDict[tuple, list[tuple[str, bool]]] = OrderedDict()
        self._cached_chars = 0
        self._lock = threading.Lock()
        _call(self._load, self._load)
        self._probe()

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt as one string."""
        return "".join(text for text, _ in self.segments(messages, add_generation_prompt))

    def segments(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[tuple[str, bool]]:
        """The prompt in pieces, (text, is_control): control tokens only where the template's own text has them."""
        key = (_checked(messages), bool(add_generation_prompt))
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return list(self._cache[key])
        pieces = _call(self._load, {"op": "render", "key": self._load["key"], "add_generation_prompt": key[1],
                                    "messages": [dict(m) for m in key[0]]})
        segments = self._controls(pieces)
        self._remember(key, segments)
        return list(segments)

    def _probe(self) -> None:
        """Render the sample conversations: a template that goes over a bound or cannot be split is refused now;
        one that raises on them (it wants other roles, say) may still render real ones."""
        for messages in PROBES:
            try:
                self.segments(messages)
            except ChatTemplateError as error:
                if error.bound or "cannot be split" in str(error):
                    raise

    def _controls(self, pieces: list[list]) -> list[tuple[str, bool]]:
        segments: list[tuple[str, bool]] = []

        def text(piece: str) -> None:
            if segments and not segments[-1][1]:
                segments[-1] = (segments[-1][0] + piece, False)
            else:
                segments.append((piece, False))

        for piece, from_user in pieces:
            if from_user or self._split is None:
                text(piece)
                continue
            for index, part in enumerate(self._split.split(piece)):
                if index % 2:
                    segments.append((part, True))
                elif part:
                    text(part)
        return segments

    def _remember(self, key: tuple, segments: list[tuple[str, bool]]) -> None:
        size = sum(len(text) for text, _ in segments) + sum(len(v) for m in key[0] for _, v in m)
        if size > CACHED_CHARS // 4:
            return
        with self._lock:
            if key in self._cache:
                return
            self._cache[key] = segments
            self._cached_chars += size
            while self._cached_chars > CACHED_CHARS:
                old_key, old = self._cache.popitem(last=False)
                self._cached_chars -= sum(len(t) for t, _ in old) + sum(len(v) for m in old_key[0] for _, v in m)


def _checked(messages: list[dict[str, str]]) -> tuple:
    """The messages as a hashable key, refused here if the template could not take them."""
    out, total = [], 0
    for index, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ChatTemplateError(f"messages[{index}].role: {role!r} is not a role; one of "
                                    f"{', '.join(sorted(ROLES))}")
        if not isinstance(content, str):
            raise ChatTemplateError(f"messages[{index}].content: text, not {type(content).__name__}")
        bad = _lone_surrogate(content)
        if bad is not None:
            raise ChatTemplateError(f"messages[{index}].content: a lone surrogate (U+{ord(content[bad]):04X}) at "
                                    f"character {bad}; text must be valid Unicode")
        total += len(content)
        out.append((("content", content), ("role", role)))
    if total > MAX_OUTPUT_CHARS:
        raise ChatTemplateError(f"messages: {total} characters of content; the chat template writes at most "
                                f"{MAX_OUTPUT_CHARS}", bound=True)
    return tuple(out)


def _lone_surrogate(text: str) -> int | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return error.start
    return None


# --- the worker process --------------------------------------------------------------------------------------

class _Worker:
    """The running worker: its process and the templates it has compiled (keys)."""

    def __init__(self) -> None:
        limits = {"memory": MEMORY_BYTES, "cpu": CPU_SECONDS, "seconds": RENDER_SECONDS,
                  "output": MAX_OUTPUT_CHARS}
        self.pid = os.getpid()
        self.loaded: set[str] = set()
        self.process = subprocess.Popen([sys.executable, "-I", WORKER, json.dumps(limits)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
        stdin, stdout = self.process.stdin, self.process.stdout
        assert stdin is not None and stdout is not None  # both are PIPE
        self._stdin, self._stdout = stdin, stdout
        self._out = stdout.fileno()
        try:
            ready = self.receive(time.monotonic() + START_SECONDS)
        except (_Timeout, _Died):
            self.stop()
            raise
        if ready.get("ok") != "ready":
            self.stop()
            raise _Died("it answered something else")

    def send(self, request: dict) -> None:
        data = json.dumps(request).encode("ascii")
        self._stdin.write(struct.pack(">I", len(data)) + data)
        self._stdin.flush()

    def receive(self, deadline: float) -> dict:
        header = self._read(4, deadline)
        return json.loads(self._read(struct.unpack(">I", header)[0], deadline))

    def _read(self, size: int, deadline: float) -> bytes:
        chunks, got = [], 0
        while got < size:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._out], [], [], left)[0]:
                raise _Timeout("no answer in time")
            chunk = os.read(self._out, size - got)
            if not chunk:
                raise _Died("it exited")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def stop(self) -> int | None:
        """Kill the process (if this one started it) and reap it; its exit status."""
        if self.pid == os.getpid() and self.process.poll() is None:
            self.process.kill()
        code = self.process.wait() if self.pid == os.getpid() else None
        for stream in (self._stdin, self._stdout):
            try:
                stream.close()
            except OSError:
                pass
        return code


class _Timeout(Exception):
    pass


class _Died(Exception):
    pass


_WORKER: _Worker | None = None
_WORKER_LOCK = threading.Lock()  # one render at a time


def _call(load: dict, request: dict):
    """The worker's answer to `request` (its template loaded first if this worker has not got it)."""
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None or _WORKER.pid != os.getpid():
            _WORKER = _start()
        worker = _WORKER
        try:
            if load["key"] not in worker.loaded:
                _answer(worker, load)
                worker.loaded.add(load["key"])
            return _answer(worker, request) if request is not load else None
        except (_Timeout, _Died, OSError) as failure:
            _WORKER = None
            code = worker.stop()
            raise ChatTemplateError(_ended(failure, code), bound=True) from None


def _start() -> _Worker:
    try:
        return _Worker()
    except (_Timeout, _Died, OSError) as failure:
        raise ChatTemplateError(f"the chat template's worker process did not start: {failure}") from None


def _answer(worker: _Worker, request: dict):
    worker.send(request)
    reply = worker.receive(time.monotonic() + KILL_SECONDS)
    if "error" in reply:
        raise ChatTemplateError(reply["error"], bound=reply.get("bound", False))
    return reply["ok"]


def _ended(failure: Exception, code: int | None) -> str:
    if isinstance(failure, _Timeout):
        return f"the chat template ran longer than {KILL_SECONDS:g} s (its time limit); it was stopped"
    if code == -signal.SIGXCPU:
        return f"the chat template used more than {CPU_SECONDS} s of CPU (its limit); it was stopped"
    if code == -signal.SIGKILL:
        return f"the chat template's worker was killed (out of memory? its limit is {MEMORY_BYTES >> 20} MiB)"
    return f"the chat template's worker ended ({'exit status ' + str(code) if code is not None else failure})"


@atexit.register
def _stop_worker() -> None:
    if _WORKER is not None:
        _WORKER.stop()
