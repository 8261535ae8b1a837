"""`pagevis.Session` and `pagevis.load_trace`: a decoding session (or a trace of one) as a notebook uses it —
stepped by hand, its records as columns, saved as a trace, and shown inline as the HTML export shows it."""

from __future__ import annotations

import html
import os

import numpy as np

from pagevis.errors import ConfigError
from pagevis.notebook import arguments, records, views

DEFAULT_TOKENS = 512  # a teacher-forced session reads this many tokens of its text, as `pagevis run` does


class Recorded:
    """What a session and a trace share: the steps as records, the grid of a step, the inline view."""

    layer = 0  # the layer the inline view shows

    def _records(self) -> list:
        raise NotImplementedError

    def _trace(self):
        raise NotImplementedError

    def _nll(self) -> list | None:
        return None

    @property
    def records(self):
        """One row per step: a pandas DataFrame when pandas is installed, else a dict of NumPy arrays."""
        return records.frame(records.columns(self._records(), self._nll()))

    def __len__(self) -> int:
        return len(self._records())

    def record(self, step: int = -1):
        """The full StepRecord of one step (pagevis.engine.StepRecord): slot maps, events, attention..."""
        steps = self._records()
        if not steps:
            raise IndexError("no steps yet: call .step() first")
        try:
            return steps[step]
        except IndexError:
            raise IndexError(f"step {step}: there are {len(steps)} steps (0 to {len(steps) - 1})") from None

    def positions(self, step: int = -1, layer: int = 0) -> np.ndarray:
        """(pages, page size) token position held by each slot of `layer` after `step` (-1: a free slot) — the
        numbers the page grid shows."""
        slot_maps = self.record(step).slot_maps
        if not 0 <= layer < len(slot_maps):
            raise ConfigError("layer", layer, f"a layer from 0 to {len(slot_maps) - 1}")
        return np.array(slot_maps[layer])

    def view(self, layer: int | None = None, step: int | None = None) -> views.HtmlView:
        """The inline view at `layer` (default self.layer), opening at `step` (default the last)."""
        layer = self.layer if layer is None else layer
        if not self._records():
            return views.HtmlView(f"<p>{html.escape(repr(self))}: no steps yet (call .step())</p>")
        from pagevis.export.html import HtmlExportError

        try:
            return views.session_view(self._trace(), layer, step, self._label())
        except HtmlExportError as error:  # a layer the session does not have
            raise ConfigError("layer", layer, str(error)) from None

    def _label(self) -> str | None:
        return None

    def _repr_html_(self) -> str:
        return self.view()._repr_html_()


class Session(Recorded):
    """One decoding session of a real model in a paged KV cache.

        s = pagevis.Session(policy="h2o", max_pages=12)   # the settings are `pagevis run`'s flags, by name
        s.step(60)                                          # 60 steps; s shows the page grid inline
        s.records                                           # one row per step
        s.save("h2o.pvtrace")                               # a trace `pagevis replay` opens

    model: smollm2 (default), gemma3-270m, synthetic or a .gguf path. prompt: the text to continue (default the
    app's sample prompt). teacher_forced: a text (or a shipped text's name, e.g. "pride-and-prejudice-ch1") to
    read through the cache instead, scoring each next token (`tokens`: how many of its tokens, default 512).
    Every other keyword is a setting of pagevis/settings.py (policy, page_size, max_pages, policy_params,
    dtype, oracle, temperature, max_new_tokens, ...); a bad one raises pagevis.ConfigError.
    """

    def __init__(self, model: str | None = None, *, prompt: str | None = None, teacher_forced: str | None = None,
                 tokens: int | None = None, policy: str | None = None, page_size: int | None = None,
                 max_pages: int | None = None, layer: int = 0, **settings):
        from pagevis.cli.checks import check_cache_memory, check_prompt_fits
        from pagevis.engine import DecodeSession

        self._given = dict(model=model, prompt=prompt, teacher_forced=teacher_forced, tokens=tokens, policy=policy,
                           page_size=page_size, max_pages=max_pages, layer=layer, **settings)
        self.spec = arguments.model_spec(model)
        self.config = arguments.session_config(dict(policy=policy, page_size=page_size, max_pages=max_pages,
                                                    **settings))
        if prompt is not None and teacher_forced is not None:
            raise ConfigError("teacher_forced", "...", "a text to read, or a prompt to continue, not both")
        if tokens is not None and teacher_forced is None:
            raise ConfigError("tokens", tokens, "given only with teacher_forced (the tokens of the text to read)")
        self.layer = layer
        self.model = self.spec.load()
        with arguments.usage_errors("max_pages", self.config.max_pages):
            check_cache_memory(self.config, self.model.config)
        self._forced, self._nll_steps = None, []
        if teacher_forced is not None:
            self._forced = _teacher_forced(self.model, teacher_forced, tokens, self.config)
            self._session = self._forced.session
        else:
            self._session = DecodeSession(self.model, _prompt(prompt, self.spec.kind), self.config)
            with arguments.usage_errors("prompt", prompt):
                check_prompt_fits(self.config, self._session.prompt_ids, self.model.config)

    # --- stepping ------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """Finished: max_new_tokens, an end of sequence, or (teacher-forced) the end of the text."""
        return self._session.done

    def step(self, n: int = 1) -> Session:
        """Advance up to `n` steps (fewer if the session ends); returns the session, which shows itself."""
        from pagevis.errors import check_int

        check_int("n", n, 0, 1 << 30)
        for _ in range(n):
            if self.done:
                break
            if self._forced is not None:
                self._nll_steps.append(self._forced.step().nll)
            else:
                self._session.step()
        return self

    def run(self) -> Session:
        """Step until the session ends (max_new_tokens, an end of sequence, or the end of the text)."""
        while not self.done:
            self.step()
        return self

    @property
    def stop_reason(self) -> str | None:
        """Why it finished ("max_new_tokens", "eos", ...), or None while it runs."""
        return self._session.stop_reason

    # --- what it holds -------------------------------------------------------------------------------
    @property
    def prompt_ids(self) -> tuple[int, ...]:
        """The token ids the session read first: the prompt (with the chat template), or the text."""
        return tuple(self._session.prompt_ids)

    @property
    def text(self) -> str:
        """The generated text so far (a teacher-forced session generates nothing: "")."""
        return "" if self._forced is not None else self._session.text()

    def token_text(self, token_id: int) -> str:
        return self._session.token_text(token_id)

    @property
    def nll(self) -> np.ndarray:
        """Teacher-forced: the negative log-likelihood of each token of the text predicted so far, in order."""
        if self._forced is None:
            raise ConfigError("teacher_forced", None, "a text: only a teacher-forced session scores tokens")
        return np.concatenate(self._nll_steps) if self._nll_steps else np.zeros(0)

    @property
    def perplexity(self) -> float | None:
        """Teacher-forced: exp(mean negative log-likelihood) over the tokens predicted so far."""
        from pagevis.engine.teacher_forced import perplexity

        return perplexity(self.nll)

    def save(self, path) -> int:
        """Write the steps so far as a trace file (`pagevis replay PATH` opens it); returns its size in bytes."""
        from pagevis.trace import write_trace

        if not self._records():
            raise ConfigError("path", os.fspath(path), "a trace of at least one step: call .step() first")
        with arguments.usage_errors("path", os.fspath(path)):
            from pagevis.cli.options import check_writable

            check_writable(os.fspath(path), "save")
        return write_trace(path, self._trace())

    def with_policy(self, policy: str, **policy_params) -> Session:
        """A new session like this one (model, text, settings) under another policy, stepped as far."""
        other = Session(**{**self._given, "policy": policy, "policy_params": policy_params or None})
        return other.step(len(self))

    def widget(self, **options):
        """A live view (the pagevis[notebook] extra, anywidget): step, play, pause, layer and policy."""
        from pagevis.notebook.widget import SessionWidget

        return SessionWidget(self, **options)

    def close(self) -> None:
        self._session.close()

    def _records(self) -> list:
        return self._session.records

    def _nll(self) -> list | None:
        return self._nll_steps if self._forced is not None else None

    def _trace(self):
        from pagevis.trace import Trace

        return Trace.from_session(self._session, model_spec=self.spec, meta={"command": "pagevis.Session"})

    def _label(self) -> str:
        return self.spec.label

    def __repr__(self) -> str:
        c = self.config
        mode = "teacher-forced" if self._forced is not None else "decoding"
        return (f"pagevis.Session({self.spec.label}, {c.policy} in {c.max_pages} pages × {c.page_size}, {mode}, "
                f"{len(self)} steps{', ' + self.stop_reason if self.done else ''})")


class TraceFile(Recorded):
    """A trace read back (pagevis.load_trace): its records, its configuration, its inline view."""

    def __init__(self, path):
        from pagevis.trace import TraceError, read_trace

        self.path = os.fspath(path)
        try:
            self.trace = read_trace(self.path)
        except TraceError as error:  # no such file, not a trace, a damaged one: one line saying which
            raise arguments.usage_config_error("path", self.path, str(error)) from None
        self.config = self.trace.config

    @property
    def text(self) -> str:
        return self.trace.text

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return tuple(self.trace.prompt_ids)

    def token_text(self, token_id: int) -> str:
        return self.trace.token_texts.get(token_id, f"<{token_id}>")

    def _records(self) -> list:
        return self.trace.records

    def _trace(self):
        return self.trace

    def _label(self) -> str:
        return self.trace.model_label

    def __repr__(self) -> str:
        c = self.config
        return (f"pagevis trace {self.path} ({self.trace.model_label}, {c.policy} in {c.max_pages} pages × "
                f"{c.page_size}, {len(self)} steps)")


def load_trace(path) -> TraceFile:
    """A trace file (`pagevis run --trace`, the app's File > Save trace, Session.save) as a notebook object."""
    return TraceFile(path)


def _prompt(prompt: str | None, model_kind: str) -> str:
    from pagevis.presets import default_prompt

    if prompt is None:
        return default_prompt(model_kind)
    if not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError("prompt", prompt, "some text (or leave it out for the sample prompt)")
    return prompt


def read_text(text: str, field: str = "teacher_forced") -> str:
    """A shipped text by its name (e.g. "pride-and-prejudice-ch1"), else `text` itself."""
    from pagevis.presets import shipped_text, shipped_texts

    if not isinstance(text, str) or not text.strip():
        raise ConfigError(field, text, "a text, or the name of a shipped text such as pride-and-prejudice-ch1")
    return shipped_text(text) if text in shipped_texts() else text


def text_ids(model, text: str, tokens: int | None, field: str = "teacher_forced") -> list[int]:
    """The first `tokens` token ids of a text (or shipped text), at least 2 of them."""
    from pagevis.cli.compare import MAX_TOKENS
    from pagevis.errors import check_int

    tokens = check_int("tokens", DEFAULT_TOKENS if tokens is None else tokens, 2, MAX_TOKENS)
    ids = model.tokenizer.encode(read_text(text))[:tokens]
    if len(ids) < 2:
        raise ConfigError(field, text, "a text that encodes to at least 2 tokens")
    return ids


def _teacher_forced(model, text: str, tokens: int | None, config):
    from dataclasses import replace

    from pagevis.engine.teacher_forced import TeacherForced

    return TeacherForced(model, text_ids(model, text, tokens), replace(config))
