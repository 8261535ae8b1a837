"""`pagevis attach ... --explain FILE` and `--play RECORDING --explain-log FILE`: requests read a JSON object a
line, explained (explain.py) against the rebuilt pools, one JSON object a line out.

A request line: exactly one of `{"prompt": text}` (encoded as the engine's /v1/completions would: the model's BOS
rule, no chat template), `{"prompt_token_ids": [...]}` or `{"messages": [{"role", "content"}, ...]}` (the
tokenizer's chat template), with optional `"cache_salt"` and `"lora_name"` strings. A line that is not one
prints `{"index", "error"}` and the next line is read.

A request log line (`pagevis serve --request-log`): `{"arrival", "prompt_token_ids", "cached_tokens",
"cache_salt"?, "kv_events_endpoint"?}`. Each is explained against the recording played up to its arrival (the
events' own clock: each endpoint's batches whose ts is before the arrival), and `"flag": true` when the cached
tokens the engine reported differ from the hit the pool held then (`"expected"`, `"reported"`).
"""

from __future__ import annotations

import json
from typing import IO, Iterable, Iterator, Sequence

from pagevis.attach.explain import Engine, ExplainRequest, explain
from pagevis.attach.feed import parse_live
from pagevis.attach.events import DecodeError, decode_payload
from pagevis.attach.playback import Playback
from pagevis.attach.recording import Record, Recording
from pagevis.attach.tokens import PromptTokenizer

MAX_LINE = 16 << 20
MAX_TOKENS = 1 << 22
ROLES = ("system", "user", "assistant", "tool", "developer")


class RequestError(ValueError):
    pass


def request_from(obj: object, tokenizer: PromptTokenizer | None) -> ExplainRequest:
    """The ExplainRequest of one decoded line; RequestError with a sentence otherwise."""
    if not isinstance(obj, dict):
        raise RequestError("a request is a JSON object")
    given = [k for k in ("prompt", "prompt_token_ids", "messages") if k in obj]
    if len(given) != 1:
        raise RequestError("give exactly one of \"prompt\", \"prompt_token_ids\" and \"messages\"")
    extras = {}
    for name in ("cache_salt", "lora_name"):
        value = obj.get(name)
        if value is not None and (not isinstance(value, str) or not value):
            raise RequestError(f"{name}: a non-empty string")
        extras[name] = value
    kind, value = given[0], obj[given[0]]
    if kind == "prompt_token_ids":
        if (not isinstance(value, list) or not value or len(value) > MAX_TOKENS
                or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in value)):
            raise RequestError("prompt_token_ids: a non-empty list of token ids (0 to 2^32 - 1)")
        return ExplainRequest(tuple(value), **extras)
    if tokenizer is None:
        raise RequestError(f"{kind}: text needs --tokenizer (the engine's tokenizer.json or .gguf)")
    if kind == "prompt":
        if not isinstance(value, str) or not value:
            raise RequestError("prompt: a non-empty string")
        ids = tokenizer.encode(value)
    else:
        if tokenizer.encode_chat is None:
            raise RequestError("messages: this tokenizer file has no chat template; give the model's .gguf")
        if not isinstance(value, list) or not value or not all(
                isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in value):
            raise RequestError(f"messages: a non-empty list of {{\"role\": one of {', '.join(ROLES)}, "
                               "\"content\": text}")
        ids = tokenizer.encode_chat([{"role": m["role"], "content": m["content"]} for m in value])
    if not ids:
        raise RequestError(f"{kind}: encodes to no tokens")
    return ExplainRequest(tuple(int(t) for t in ids), **extras)


def read_lines(file: IO[str]) -> Iterator[tuple[int, object]]:
    """(index, decoded JSON or a RequestError) of each non-blank line."""
    index = 0
    for line in file:
        if not line.strip():
            continue
        if len(line) > MAX_LINE:
            yield index, RequestError(f"a line of {len(line)} characters; at most {MAX_LINE}")
        else:
            try:
                yield index, json.loads(line)
            except json.JSONDecodeError as error:
                yield index, RequestError(f"not JSON ({error.msg} at column {error.colno})")
        index += 1


def explain_file(file: IO[str], engines: Sequence[Engine], tokenizer: PromptTokenizer | None,
                 out: IO[str]) -> int:
    """Explain every line of `file`; returns how many lines were refused."""
    refused = 0
    detokenize = tokenizer.decode if tokenizer is not None else None
    for index, obj in read_lines(file):
        try:
            if isinstance(obj, RequestError):
                raise obj
            request = request_from(obj, tokenizer)
        except RequestError as error:
            refused += 1
            print(json.dumps({"index": index, "error": str(error)}), file=out, flush=True)
            continue
        print(json.dumps(explain(engines, request, detokenize, index)), file=out, flush=True)
    return refused


def fleet_engines(fleet, ranks: Iterable[int | None] | None = None) -> list[Engine]:
    states = list(fleet.engines)
    ranks = list(ranks) if ranks is not None else [None] * len(states)
    return [Engine(state.name, rank, state) for state, rank in zip(states, ranks)]


def _batch_ts(frames) -> float | None:
    try:
        return decode_payload(parse_live(frames)[2]).ts
    except DecodeError:
        return None


def play_until(playback: Playback, arrival: float) -> None:
    """Advance the playback over every live message whose batch was published before `arrival`."""
    while (frames := playback.live_frames(playback.position)) is not None:
        ts = _batch_ts(frames)
        if ts is not None and ts >= arrival:
            return
        playback.advance(1)


def _engine_for(engines: Sequence[Engine], endpoint: object) -> int:
    """Which engine a logged request was served by: the one whose port is the log's events endpoint's."""
    if isinstance(endpoint, str) and ":" in endpoint:
        port = endpoint.rsplit(":", 1)[1]
        for i, engine in enumerate(engines):
            if engine.endpoint.rsplit(":", 1)[-1] == port:
                return i
    return 0


def explain_log(file: IO[str], playback: Playback, tokenizer: PromptTokenizer | None, out: IO[str]) -> tuple[int, int]:
    """Explain each logged request against the pools as they were at its arrival; returns (flagged, refused).
    Each endpoint is played on its own (its batches' ts only grow), so one engine's batches received after
    another's later ones still count at their own time."""
    detokenize = tokenizer.decode if tokenizer is not None else None
    flagged = refused = 0
    playbacks = [Playback(recording, playback.limits) for recording in split_by_endpoint(playback.recording)]
    for index, obj in read_lines(file):
        try:
            if isinstance(obj, RequestError):
                raise obj
            if not isinstance(obj, dict):
                raise RequestError("a request log line is a JSON object")
            arrival, reported = obj.get("arrival"), obj.get("cached_tokens")
            if not isinstance(arrival, (int, float)) or not isinstance(reported, int):
                raise RequestError("a request log line has a number \"arrival\" and an int \"cached_tokens\"")
            request = request_from({k: obj[k] for k in ("prompt_token_ids", "cache_salt", "lora_name") if k in obj},
                                   tokenizer)
        except RequestError as error:
            refused += 1
            print(json.dumps({"index": index, "error": str(error)}), file=out, flush=True)
            continue
        for one in playbacks:
            if arrival < _position_ts(one):
                one.seek(0)  # a log out of order: start again
            play_until(one, float(arrival))
        engines = [Engine(one.recording.endpoints[0], None, one.fleet.engines[0]) for one in playbacks]
        result = explain(engines, request, detokenize, index)
        served = _engine_for(engines, obj.get("kv_events_endpoint"))
        expected = result["engines"][served]["hit_tokens"]
        result.update(arrival=arrival, served_by=engines[served].endpoint, reported=reported, expected=expected,
                      flag=reported != expected)
        flagged += reported != expected
        print(json.dumps(result), file=out, flush=True)
    return flagged, refused


def split_by_endpoint(recording: Recording) -> list[Recording]:
    """One recording per endpoint, with its own records (live and replay) and its replay endpoint."""
    meta = recording.meta
    replays = meta.get("replays") if isinstance(meta.get("replays"), list) else []
    return [Recording((name,), {**meta, "replays": replays[i:i + 1]},
                      tuple(Record(r.kind, 0, r.time, r.frames) for r in recording.records if r.endpoint == i),
                      recording.truncated) for i, name in enumerate(recording.endpoints)]


def _position_ts(playback: Playback) -> float:
    if playback.position == 0:
        return float("-inf")
    ts = _batch_ts(playback.live_frames(playback.position - 1))
    return float("-inf") if ts is None else ts
