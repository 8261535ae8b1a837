"""OpenAI-compatible /v1/models, /v1/completions and /v1/chat/completions, plain and streamed (SSE).

Each completion is a DecodeSession of its own for the request's lifetime (it holds one of the server's
session slots). Cache settings ride in an extra `pagevis` object, e.g. with the openai client:
`client.completions.create(..., extra_body={"pagevis": {"page_size": 8, "max_pages": 4, "policy": "h2o"}})`.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.background import BackgroundTask

from ..decoding import DecodeSession, RunControl, steps
from ..engine import CacheFullError
from .errors import ApiError, error_body
from .parallel import MAX_N, generate_n
from .requests import MAX_PROMPT_CHARS, CacheSettings
from .sessions import build_session, session_config
from .worker import in_worker

router = APIRouter(prefix="/v1", tags=["openai"])
MAX_STOPS = 4


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    # Unknown OpenAI parameters (user, presence_penalty...) are accepted and ignored, as other servers do.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str
    temperature: float | None = Field(None, ge=0, le=10, description="0 = greedy; default 1")
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**32)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N, description=f"samples of the prompt (1-{MAX_N}; more than 1: parallel "
                                                  "sampling over one shared pool, not streamed)")
    pagevis: CacheSettings | None = Field(None, description="cache settings: page_size, max_pages, policy, ...")
    # Accepted only at their no-op values: silently ignoring them would change what the client asked for.
    logprobs: bool | int | None = None
    echo: bool = False
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def refuse_unsupported(self) -> None:
        for name, neutral in (("logprobs", (None, False, 0)), ("echo", (False,)), ("best_of", (None, 1)),
                              ("presence_penalty", (0.0,)), ("frequency_penalty", (0.0,))):
            if getattr(self, name) not in neutral:
                raise ApiError(422, f"{name}: {getattr(self, name)!r} is not supported by this server", param=name,
                               code="unsupported_parameter")


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] = Field(description="a string (a list holding one string is accepted)")
    max_tokens: int | None = Field(16, ge=1)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str | list[dict]


class ChatRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class StopMatcher:
    """Streams text while watching for stop strings: text that could be the start of one is held back
    until it is clearly not; at a match everything from the stop string on is dropped."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        held = max((k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        cut = len(self.pending) - held
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Completion:
    """One generation: steps its session until end of sequence, max_tokens or a stop string."""

    def __init__(self, session: DecodeSession, stops: list[str]) -> None:
        self.session = session
        self.decoder = session.model.tokenizer.incremental_decoder()
        self.stop = StopMatcher(stops)
        self.finish_reason: str | None = None

    def advance(self, max_steps: int | None = None) -> tuple[str, str | None]:
        """Step up to max_steps times (None: to the end); the new text and the finish reason, if finished."""
        session, pieces = self.session, []
        eos = session.model.config.eos_ids
        control = RunControl(budget=max_steps, stop=self.finish_reason is not None)
        try:
            for record in steps(session, control):
                if record.next_token >= 0 and record.next_token not in eos:
                    text, hit = self.stop.push(self.decoder.feed(record.next_token))
                    pieces.append(text)
                    if hit:
                        self.finish_reason = "stop"
                        control.stop = True
        except CacheFullError:  # the engine ended the request ("cache_full")
            pass
        if self.finish_reason is None and session.request.done:
            tail, hit = self.stop.push(self.decoder.flush())
            pieces.append(tail if hit else tail + self.stop.flush())
            self.finish_reason = "stop" if hit or session.stop_reason == "eos" else "length"
        return "".join(pieces), self.finish_reason

    def usage(self) -> dict:
        prompt, generated = len(self.session.prompt_ids), len(self.session.generated)
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


@router.get("/models")
async def list_models(request: Request) -> dict:
    state = request.app.state
    return {"object": "list", "data": [{"id": state.model_id, "object": "model", "created": state.started,
                                        "owned_by": "pagevis"}]}


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request):
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise ApiError(422, f"prompt: a list of {len(prompt)} prompts; this server takes one", param="prompt")
        prompt = prompt[0]
    _check_prompt(prompt, "prompt")
    return await _generate(request, body, prompt, chat=False, max_tokens=body.max_tokens)


@router.post("/chat/completions")
async def chat_completions(body: ChatRequest, request: Request):
    tokenizer = request.app.state.model.tokenizer
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer, so it cannot take messages", param="messages")
    messages = [{"role": m.role, "content": _content_text(m.content, i)} for i, m in enumerate(body.messages)]
    prompt = tokenizer.format_chat(messages)
    _check_prompt(prompt, "messages")
    # Only the template inserts control tokens: the messages' own text is encoded as text.
    prompt_ids = tokenizer.encode_chat(messages)
    return await _generate(request, body, prompt, chat=True, max_tokens=body.max_completion_tokens or body.max_tokens,
                           prompt_ids=prompt_ids)


async def _generate(request: Request, body: _GenerationRequest, prompt: str, chat: bool, max_tokens: int | None,
                    prompt_ids: list[int] | None = None):
    state = request.app.state
    body.refuse_unsupported()
    if body.model != state.model_id:
        raise ApiError(404, f"model {body.model!r} is not served here; this server serves {state.model_id!r} "
                            "(GET /v1/models)", param="model", code="model_not_found")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > MAX_STOPS:
        raise ApiError(422, f"stop: {len(stops)} stop strings; at most {MAX_STOPS}", param="stop")
    temperature = 1.0 if body.temperature is None else body.temperature
    sampled = temperature > 0
    # record_layers "none": a completion's attention snapshots have no reader, so they are not kept.
    fields = dict(body.pagevis.model_dump() if body.pagevis else {}, max_tokens=max_tokens, chat=False,
                  record_layers="none",
                  sample=sampled, temperature=temperature if sampled else None,
                  top_p=body.top_p if sampled else None,
                  seed=body.seed if body.seed is not None else secrets.randbelow(2**32))
    config = session_config(state.settings, fields)
    if body.n > 1 and body.stream:
        raise ApiError(422, f"n: {body.n} samples are not streamed; use stream=false or n=1", param="n")
    state.store.take_slot()
    try:
        session = await in_worker(request, build_session, state.model, state.settings, prompt, config, prompt_ids)
        observer = state.metrics.observe(session)
    except BaseException:
        state.store.give_slot()
        raise
    completion = Completion(session, stops)

    released = False

    def release() -> None:  # idempotent: the stream's end and the response's background task both call it
        nonlocal released
        if not released:
            released = True
            observer.close()
            state.store.give_slot()

    kind = "chat.completion" if chat else "text_completion"
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
    created = int(time.time())
    if body.n > 1:
        try:
            samples, usage = await in_worker(request, generate_n, state.model, session, body.n, stops, state.metrics)
        finally:
            release()
        choices = [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                    "logprobs": None} if chat else {"index": i, "text": text, "finish_reason": finish,
                                                    "logprobs": None}
                   for i, (text, finish) in enumerate(samples)]
        return {"id": ident, "object": kind, "created": created, "model": state.model_id, "choices": choices,
                "usage": usage}
    if not body.stream:
        try:
            text, finish = await in_worker(request, completion.advance, None)
        finally:
            release()
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                   "logprobs": None} if chat else {"index": 0, "text": text, "finish_reason": finish, "logprobs": None})
        return {"id": ident, "object": kind, "created": created, "model": state.model_id, "choices": [choice],
                "usage": completion.usage()}

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(text: str | None, finish: str | None, first: bool = False) -> str:
        if chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        payload = {"id": ident, "object": kind + ".chunk" if chat else kind, "created": created,
                   "model": state.model_id, "choices": [choice]}
        if include_usage:
            payload["usage"] = None
        return _sse(payload)

    async def events():
        try:
            if chat:
                yield chunk(None, None, first=True)
            finish = None
            while finish is None:
                text, finish = await in_worker(request, completion.advance, 1)
                if text or finish:
                    yield chunk(text, finish)
            if include_usage:
                yield _sse({"id": ident, "object": kind + ".chunk" if chat else kind, "created": created,
                            "model": state.model_id, "choices": [], "usage": completion.usage()})
        except Exception as error:  # noqa: BLE001 - the status is sent; the client learns of it in-band
            yield _sse(error_body(500, f"decoding failed: {type(error).__name__}: {error}"))
        finally:
            release()
        yield "data: [DONE]\n\n"

    # The background task covers a client that leaves before the stream starts (the generator never runs).
    return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-cache"},
                             background=BackgroundTask(release))


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _check_prompt(prompt: str, field: str) -> None:
    if not prompt:
        raise ApiError(422, f"{field}: empty prompt", param=field)
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ApiError(422, f"{field}: {len(prompt)} characters; at most {MAX_PROMPT_CHARS}", param=field)


def _content_text(content: str | list[dict], index: int) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(422, f"messages[{index}].content: only text parts are supported", param="messages")
        texts.append(part["text"])
    return "".join(texts)
