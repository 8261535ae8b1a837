"""OpenAI-compatible /v1/models, /v1/completions and /v1/chat/completions, plain and streamed (SSE).

Each completion is a request in its layout's shared engine (n > 1: n parallel samples sharing the prompt's
pages), batched with every other request in flight; its tokens come back through an output queue the engine
thread fills. A client that goes away cancels its request (its pages are freed before the next step).
Cache settings ride in an extra `pagevis` object, e.g. with the openai client:
`client.completions.create(..., extra_body={"pagevis": {"page_size": 8, "max_pages": 4, "policy": "h2o"}})`.
`usage.prompt_tokens_details.cached_tokens` says how much of the prompt the prefix cache held.

Log-probabilities (logprobs.py for the shapes): `logprobs` 0-20 of each generated token and, with `echo`,
of every prompt token too, computed through the request's own cache as it runs — an evicting policy or a
quantized dtype scores each token from what that cache held when the token came (`pagevis compare`'s
teacher forcing); such a request takes nothing from the prefix cache. A prompt may be text or token ids,
or a list of either (each prompt a request of its own, their choices in order, n per prompt).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.background import BackgroundTask

from pagevis.engine.logprobs import MAX_LOGPROBS
from pagevis.engine.session_config import encode_prompt
from pagevis.kvcache import ConfigError, make_policy
from pagevis.serve import logprobs
from pagevis.serve.core import Output
from pagevis.serve.errors import ApiError, CheckedRoute, error_body, log
from pagevis.serve.requests import MAX_PROMPT_CHARS, CacheSettings
from pagevis.serve.sessions import check_tokens, session_config
from pagevis.engine.stop import StopMatcher, stop_problem
from pagevis.serve.worker import in_worker

router = APIRouter(prefix="/v1", tags=["openai"], route_class=CheckedRoute)
MAX_N = 16
MAX_PROMPTS = 32  # prompts in one completion request (lm-eval's batch_size); each is a request in flight
DISCONNECT_POLL = 0.5  # seconds between checks that a non-streamed request's client is still there


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
                                                  "sampling sharing the prompt's pages, not streamed)")
    ignore_eos: bool = Field(False, description="decode max_tokens whatever is sampled (benchmarks of a fixed "
                                                "shape, as vLLM's)")
    pagevis: CacheSettings | None = Field(None, description="cache settings: page_size, max_pages, policy, ...")
    cache_salt: str | None = Field(None, min_length=1, max_length=1024,
                                   description="vLLM's: only requests with the same salt share cached prompt pages")
    # Accepted only at their no-op values: silently ignoring them would change what the client asked for.
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def refuse_unsupported(self) -> None:
        for name, neutral in (("best_of", (None, 1)), ("presence_penalty", (0.0,)), ("frequency_penalty", (0.0,))):
            if getattr(self, name) not in neutral:
                raise ApiError(422, f"{name}: {getattr(self, name)!r} is not supported by this server", param=name,
                               code="unsupported_parameter")
        if self.stream and getattr(self, "echo", False):  # the prompt's scores come when the request ends
            raise ApiError(422, "echo: echo is not streamed by this server; use stream=false", param="echo",
                           code="unsupported_parameter")

    def scores(self) -> tuple[int | None, int | None]:
        """(top-k of each generated token's log-probabilities, of each prompt token's); None: not wanted."""
        return None, None


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description=f"text or token ids, or a list of up to {MAX_PROMPTS} prompts (texts, or lists of token ids)")
    max_tokens: int | None = Field(16, ge=0, description="0 with echo: score the prompt, generate nothing")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="log-probabilities of each token and its top 0-20 alternatives")
    echo: bool = Field(False, description="the prompt before the completion, in the text and the logprobs")

    def scores(self) -> tuple[int | None, int | None]:
        return self.logprobs, self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        """Each prompt, text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise ApiError(422, "prompt: an empty list; give text, token ids or a list of prompts", param="prompt")
        if len(prompt) > MAX_PROMPTS:
            raise ApiError(422, f"prompt: {len(prompt)} prompts; at most {MAX_PROMPTS} in one request",
                           param="prompt")
        return list(prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str | list[dict]


class ChatRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = Field(False, description="the log-probability of each generated token")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                     description="and of the 0-20 most likely tokens at each (needs logprobs)")

    def scores(self) -> tuple[int | None, int | None]:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(422, "top_logprobs: needs logprobs true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None, None


@router.get("/models")
async def list_models(request: Request) -> dict:
    state = request.app.state
    return {"object": "list", "data": [{"id": state.model_id, "object": "model", "created": state.started,
                                        "owned_by": "pagevis"}]}


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request):
    prompts = body.prompts()
    for i, prompt in enumerate(prompts):
        field = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(prompt, str):
            _check_prompt(prompt, field)
        else:
            _check_ids(prompt, field, request.app.state.model.config.vocab_size)
    if len(prompts) > 1 and body.stream:
        raise ApiError(422, f"prompt: {len(prompts)} prompts are not streamed; use stream=false or one prompt",
                       param="prompt")
    return await _generate(request, body, prompts, chat=False, max_tokens=body.max_tokens)


@router.post("/chat/completions")
async def chat_completions(body: ChatRequest, request: Request):
    tokenizer = request.app.state.model.tokenizer
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer, so it cannot take messages", param="messages")
    messages = [{"role": m.role, "content": _content_text(m.content, i)} for i, m in enumerate(body.messages)]
    total = sum(len(m["content"]) for m in messages)
    if total > MAX_PROMPT_CHARS:
        raise ApiError(422, f"messages: {total} characters of content; at most {MAX_PROMPT_CHARS}", param="messages")
    # The template renders in its own bounded process, one render at a time: never on this event loop.
    prompt_ids = await in_worker(request, _chat_ids, tokenizer, messages)
    return await _generate(request, body, [prompt_ids], chat=True,
                           max_tokens=body.max_completion_tokens or body.max_tokens)


async def _generate(request: Request, body: _GenerationRequest, prompts: list[str | list[int]], chat: bool,
                    max_tokens: int | None):
    state = request.app.state
    body.refuse_unsupported()
    scores = body.scores()
    if body.model != state.model_id:
        raise ApiError(404, f"model {body.model!r} is not served here; this server serves {state.model_id!r} "
                            "(GET /v1/models)", param="model", code="model_not_found")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    problem = stop_problem(stops)
    if problem:
        raise ApiError(422, f"stop: {problem}", param="stop")
    temperature = 1.0 if body.temperature is None else body.temperature
    sampled = temperature > 0
    # max_tokens 0 (echo: the prompt scored, nothing generated): the one token the engine samples is dropped
    drop = max_tokens == 0
    fields = dict(body.pagevis.model_dump() if body.pagevis else {}, max_tokens=1 if drop else max_tokens,
                  chat=False, sample=sampled, temperature=temperature if sampled else None,
                  top_p=body.top_p if sampled else None,
                  seed=body.seed if body.seed is not None else secrets.randbelow(2**32))
    config = session_config(state.settings, fields)
    if body.n > 1 and body.stream:
        raise ApiError(422, f"n: {body.n} samples are not streamed; use stream=false or n=1", param="n")
    model = state.model
    if model.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer, so it cannot take text prompts", param="prompt")
    state.engines.core(config)  # a layout it cannot have is refused before the prompt is encoded
    encoded = []
    for i, prompt in enumerate(prompts):
        ids = prompt if not isinstance(prompt, str) else await in_worker(request, encode_prompt, model, prompt, False)
        if not ids:
            raise ConfigError("prompt", prompt, "text that encodes to at least one token")
        check_tokens(state.settings, len(ids), config.max_new_tokens)
        encoded.append(list(ids))
    policies = [make_policy(config.cache_config(model.config)) for _ in encoded]
    longest = max(len(ids) for ids in encoded)
    if scores[1] is not None and not policies[0].evicts and longest > config.capacity:
        raise ConfigError("max_pages", config.max_pages,
                          f"at least {-(-longest // config.page_size)} pages of {config.page_size} to score this "
                          f"{longest}-token prompt under policy {config.policy!r}, which never evicts (or an "
                          "evicting policy)")
    core = state.engines.core(config)
    generations: list[Generation] = []
    try:
        for ids, policy in zip(encoded, policies, strict=True):  # each holds the core (no await before the
            generations.append(Generation(state, core, body.n))  # first one): the pool stays
            await generations[-1].submit(ids, config, tuple(stops), body.ignore_eos, policy, scores, body.cache_salt)
    except BaseException:
        for generation in generations:
            generation.close()
        raise

    reply = _Reply(state, body, chat, drop, scores)
    if not body.stream:
        return await _answer(request, reply, prompts, encoded, generations, stops)
    return _stream(reply, generations[0], len(encoded[0]), stops)


@dataclass(frozen=True)
class _Reply:
    """What every part of one answer shares: its kind, id and time, and how its choices are written."""

    state: object
    body: object
    chat: bool
    drop: bool  # max_tokens 0: the one token sampled to end an echo request is not sent
    scores: tuple
    ident: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def kind(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{self.ident}"


async def _answer(request: Request, reply: _Reply, prompts, encoded, generations, stops) -> dict:
    """The whole answer of a request that is not streamed: every prompt's samples as choices, summed usage."""
    model, body, chat, drop = reply.state.model, reply.body, reply.chat, reply.drop
    try:
        answers = await asyncio.gather(*(g.collect(request, stops) for g in generations))
    finally:
        for generation in generations:
            generation.close()
    choices = []
    for prompt, ids, generation, samples in zip(prompts, encoded, generations, answers, strict=True):
        for sample in samples:
            choices.append(_choice(len(choices), model.tokenizer, chat, body, prompt, ids, generation, sample,
                                   drop))
    usages = [g.usage(len(ids), drop) for g, ids in zip(generations, encoded, strict=True)]
    usage = {key: sum(u[key] for u in usages) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
    usage["prompt_tokens_details"] = {"cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"]
                                                           for u in usages)}
    return {"id": reply.id, "object": reply.kind, "created": reply.created, "model": reply.state.model_id,
            "choices": choices, "usage": usage}


def _stream(reply: _Reply, generation, prompt_tokens: int, stops) -> StreamingResponse:
    """Server-sent events of one streamed request: chunks of text (and their log-probabilities), then usage."""
    state, body, chat, drop, scores = reply.state, reply.body, reply.chat, reply.drop, reply.scores
    model, kind, ident, created = state.model, reply.kind, reply.id, reply.created
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    sent = {"tokens": 0, "offset": 0}  # tokens whose log-probabilities went out, and their text's length

    def chunk_logprobs() -> dict | None:
        """The log-probabilities of the tokens that arrived since the last chunk (as vLLM streams them)."""
        if scores[0] is None:
            return None
        tokens = generation.tokens[0][sent["tokens"]:]
        ids, rows = [t for t, _ in tokens], [row for _, row in tokens]
        sent["tokens"] += len(tokens)
        if chat:
            return logprobs.chat_logprobs(model.tokenizer, ids, rows)
        out = logprobs.completion_logprobs(model.tokenizer, ids, rows, start=sent["offset"])
        sent["offset"] += sum(len(t) for t in out["tokens"])
        return out

    def chunk(text: str | None, finish: str | None, first: bool = False) -> str:
        lp = None if first or drop else chunk_logprobs()
        if chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": lp}
        payload = {"id": ident, "object": kind + ".chunk" if chat else kind, "created": created,
                   "model": state.model_id, "choices": [choice]}
        if include_usage:
            payload["usage"] = None
        return _sse(payload)

    async def events():
        try:
            if chat:
                yield chunk(None, None, first=True)
            async for text, finish in generation.pieces(0, stops):
                text = "" if drop else text  # max_tokens 0: the token sampled to end the request is not sent
                if text or finish:
                    yield chunk(text, finish)
            if include_usage:
                yield _sse({"id": ident, "object": kind + ".chunk" if chat else kind, "created": created,
                            "model": state.model_id, "choices": [],
                            "usage": generation.usage(prompt_tokens, drop)})
        except ApiError as error:  # the status is sent; the client learns of it in-band
            yield _sse(error_body(error.status, error.message, code=error.code))
        finally:
            generation.close()  # a client that left mid-stream: its request ends and its pages are freed now
        yield "data: [DONE]\n\n"

    # The background task covers a client that leaves before the stream starts (the generator never runs).
    return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-cache"},
                             background=BackgroundTask(generation.close))


class Generation:
    """One completion's requests in an engine (n samples of the prompt): admission, their outputs, and the
    end of them. `close()` (idempotent) gives back the admission and cancels whatever has not finished."""

    def __init__(self, state, core, n: int) -> None:
        self.state, self.core, self.n = state, core, n
        self.model = state.model
        self.outputs = [Output(asyncio.get_running_loop()) for _ in range(n)]
        self.ids: list[int] = []
        self.ends: list[tuple | None] = [None] * n
        self.tokens: list[list[tuple]] = [[] for _ in range(n)]  # each sample's (token id, logprob row)
        self.closed = False
        self.arrival, self.logged = time.time(), None  # --request-log: (prompt ids, salt, scored prompt)
        state.engines.take()
        core.holders += 1

    async def submit(self, prompt_ids, config, stops: tuple[str, ...], ignore_eos: bool, policy,
                     scores: tuple[int | None, int | None] = (None, None), cache_salt: str | None = None) -> None:
        self.logged = (prompt_ids, cache_salt, scores[1] is not None)
        try:
            self.ids = await self.core.run(self.core.submit, prompt_ids, config.sampling, config.max_new_tokens,
                                           stops, ignore_eos, policy, self.n, self.outputs, scores, cache_salt,
                                           time.monotonic())
        except BaseException:
            self.close()
            raise

    async def pieces(self, index: int, stops: list[str]):
        """(text, finish_reason) as sample `index` decodes: text held back while it may be the start of a
        stop string; the finish reason with the last piece."""
        eos = self.model.config.eos_ids
        decoder, matcher = self.model.tokenizer.incremental_decoder(), StopMatcher(stops)
        hit = False
        while True:
            item = await self.outputs[index].get()
            if item[0] == "token":
                self.tokens[index].append(item[1:])
                if item[1] not in eos and not hit:
                    text, hit = matcher.push(decoder.feed(item[1]))
                    yield text, None
                continue
            self.ends[index] = item
            reason, error = item[1], item[2]
            if reason == "error":
                ident = secrets.token_hex(6)
                log.error("request %s: decoding failed: %s", ident, error)
                raise ApiError(500, f"decoding failed (request id {ident}): {error}", code="internal_error",
                               request_id=ident)
            tail = ""
            if not hit:
                tail, hit = matcher.push(decoder.flush())
                tail = tail if hit else tail + matcher.flush()
            yield tail, finish_reason(reason, hit)
            return

    async def collect(self, request: Request, stops: list[str]) -> list[tuple[str, str, int]]:
        """Every sample's text, finish reason and index; a client that goes away cancels them."""
        async def one(index: int) -> tuple[str, str, int]:
            pieces, finish = [], None
            async for text, finish in self.pieces(index, stops):
                pieces.append(text)
            return "".join(pieces), finish, index

        work = asyncio.ensure_future(asyncio.gather(*(one(i) for i in range(self.n))))
        try:
            while True:
                done, _ = await asyncio.wait({work}, timeout=DISCONNECT_POLL)
                if done:
                    return work.result()
                if await request.is_disconnected():
                    raise ApiError(499, "the client closed the connection", code="client_closed")
        finally:
            if not work.done():
                work.cancel()

    @property
    def prompt_scores(self):
        """The prompt's log-probabilities (logprobs.Scores), when they were asked for."""
        return self.ends[0][5] if self.ends[0] is not None else None

    def usage(self, prompt_tokens: int, dropped: bool = False) -> dict:
        """dropped: each sample's one token was sampled only to end the request (max_tokens 0)."""
        generated = 0 if dropped else sum(end[3] for end in self.ends if end is not None)
        cached = self.ends[0][4] if self.ends[0] is not None else 0
        return {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                "total_tokens": prompt_tokens + generated, "prompt_tokens_details": {"cached_tokens": cached}}

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        log = getattr(self.state, "request_log", None)
        if log is not None and self.logged is not None and self.ends[0] is not None:
            log.write(self.arrival, self.logged[0], self.ends[0][4], *self.logged[1:])
        self.state.engines.give()
        self.core.holders -= 1
        unfinished = [seq for seq, end in zip(self.ids, self.ends) if end is None]
        if unfinished:
            self.core.call(self.core.cancel, unfinished)


def finish_reason(stop_reason: str, hit: bool) -> str:
    """OpenAI's finish_reason for the engine's stop reason: "stop" (end of sequence or a stop string),
    "length" (max_tokens, or a cache that could take no more), "abort" (cancelled: the server shut down)."""
    if hit or stop_reason in ("eos", "stop"):
        return "stop"
    return "abort" if stop_reason in ("abort", "cancelled") else "length"


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _choice(index: int, tokenizer, chat: bool, body, prompt, prompt_ids: list[int], generation: Generation,
            sample: tuple[str, str, int], drop: bool) -> dict:
    """One choice of the answer: sample `sample` (text, finish reason, its index) of a prompt, with its
    log-probabilities if asked (with echo: the prompt's first)."""
    text, finish, which = sample
    text, tokens = ("", []) if drop else (text, generation.tokens[which])
    ids, rows = [t for t, _ in tokens], [row for _, row in tokens]
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                "logprobs": logprobs.chat_logprobs(tokenizer, ids, rows) if body.logprobs else None}
    if body.echo:
        text = (prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)) + text
        if body.logprobs is not None:
            if not logprobs.complete(generation.prompt_scores):
                raise ApiError(503, f"the request ended ({finish}) before its whole prompt was scored",
                               code="not_scored")
            ids, rows = prompt_ids + ids, logprobs.prompt_rows(generation.prompt_scores) + rows
    return {"index": index, "text": text, "finish_reason": finish,
            "logprobs": None if body.logprobs is None else logprobs.completion_logprobs(tokenizer, ids, rows)}


def _chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The conversation's prompt ids (only the template inserts control tokens); a template that fails on it,
    or a rendered prompt over the limit, is the request's 422."""
    _check_prompt(tokenizer.format_chat(messages), "messages")
    return list(tokenizer.encode_chat(messages))  # the same render, from the template's cache


def _check_ids(ids: list[int], field: str, vocab_size: int) -> None:
    if not ids:
        raise ApiError(422, f"{field}: an empty list of token ids", param="prompt")
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ApiError(422, f"{field}[{bad}]: token id {ids[bad]} is not in this model's vocabulary "
                            f"(0 to {vocab_size - 1})", param="prompt", code="invalid_value")


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
