"""/v1/sessions: decoding sessions driven step by step over HTTP, as the app drives them.

Each session is a request in its layout's shared engine that pauses between calls: a step call unpauses it
for n of its steps (the engine's thread records each, masked to the session's own pages) and it pauses again,
keeping its pages."""

from __future__ import annotations

import asyncio
import json
import math
import os
import tempfile
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from pagevis import settings as table
from pagevis.kvcache import EventKind
from pagevis.serve.core import StepOrder
from pagevis.kvcache.quant import storage_summary
from pagevis.serve.errors import ApiError, CheckedRoute
from pagevis.serve.requests import SessionRequest
from pagevis.serve.sessions import ServedSession, build_session, session_config
from pagevis.serve.worker import in_worker

router = APIRouter(prefix="/v1/sessions", tags=["sessions"], route_class=CheckedRoute)


class StepRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n: int = Field(1, ge=1, le=1 << 20, description="steps to take (prefill chunks count as steps)")
    events: Literal["all", "evictions", "none"] = Field("all", description="which cache events to return")


@router.post("", status_code=201)
async def create_session(body: SessionRequest, request: Request) -> dict:
    state = request.app.state
    config = session_config(state.settings, body.model_dump())
    core = state.engines.core(config)
    state.store.take_slot()
    core.holders += 1  # while the session is built: its pool stays
    try:
        fit = state.settings.full_cache and body.max_pages is None  # a session's snapshots are cache-sized
        session = await in_worker(request, build_session, state.model, state.settings, body.prompt, config, None,
                                  core.engine, fit)
    except BaseException:
        state.store.give_slot()
        raise
    finally:
        core.holders -= 1
    served = state.store.add(session, core)
    return {"id": served.id, **describe(served, state)}


@router.get("/{session_id}")
async def get_session(session_id: str, request: Request) -> dict:
    """The session's state after its latest step (read from that step's snapshot: never waits for a step)."""
    served = request.app.state.store.get(session_id)
    served.touch()
    return {"id": served.id, **describe(served, request.app.state, layers=True)}


@router.post("/{session_id}/step")
async def step_session(session_id: str, body: StepRequest, request: Request) -> dict:
    state = request.app.state
    served = state.store.get(session_id)
    async with served.lock:
        served.touch()
        if served.session.done:
            raise ApiError(409, f"session {session_id} has finished ({served.session.stop_reason}); "
                                "create a new one", code="session_finished")
        order = StepOrder(served.session, body.n, asyncio.get_running_loop().create_future())
        await served.core.run(served.core.step_session, order)
        records = await order.future
        answer = await in_worker(request, step_answer, served, records, body, state)
        served.touch()
    return Response(answer, media_type="application/json")


@router.get("/{session_id}/trace", response_class=Response,
            responses={200: {"content": {"application/zip": {}}, "description": "a .pvtrace file"}})
async def session_trace(session_id: str, request: Request) -> Response:
    state = request.app.state
    served = state.store.get(session_id)
    async with served.lock:
        served.touch()
        if not served.session.records:
            raise ApiError(409, "the session has taken no step yet, so there is nothing to trace", code="no_steps")
        data = await in_worker(request, trace_bytes, served, state.settings.model_spec)
    return Response(data, media_type="application/zip",
                    headers={"content-disposition": f'attachment; filename="{session_id}.pvtrace"'})


@router.delete("/{session_id}")
async def delete_session(session_id: str, request: Request) -> dict:
    store = request.app.state.store
    served = store.get(session_id)
    async with served.lock:
        store.remove(served)
    return {"id": session_id, "deleted": True}


# --- work done in a worker thread ------------------------------------------------------------------

def step_answer(served: ServedSession, records, body: StepRequest, state) -> bytes:
    """Encode the answer to the steps taken, off the event loop (n SmolLM2 steps carry ~30 events each)."""
    session, pieces = served.session, []
    for record in records:
        if record.next_token >= 0 and record.next_token not in session.model.config.eos_ids:
            pieces.append(served.decoder.feed(record.next_token))
    text = "".join(pieces)
    answer = {"id": served.id, "steps": [step_json(r) for r in records],
              "tokens": [r.next_token for r in records if r.next_token >= 0], "new_text": text,
              "events": [event_json(e) for r in records for e in r.events if _wanted(e, body.events)],
              "metrics": steps_metrics(records), **describe(served, state)}
    return json.dumps(answer, ensure_ascii=False, allow_nan=False).encode()


def trace_bytes(served: ServedSession, model_spec) -> bytes:
    from pagevis.trace import write_trace

    with tempfile.TemporaryDirectory(prefix="pagevis-serve-") as folder:
        path = os.path.join(folder, "session.pvtrace")
        write_trace(path, served.session, model_spec=model_spec, meta={"command": "pagevis serve",
                                                                      "session": served.id})
        with open(path, "rb") as handle:
            return handle.read()


# --- JSON views of records and events --------------------------------------------------------------

def describe(served: ServedSession, state, layers: bool = False) -> dict[str, Any]:
    session = served.session
    records = session.records
    last = records[-1] if records else None
    config = session.config
    info: dict[str, Any] = {
        "model": state.model_id, "created": int(served.created), "prompt_tokens": len(session.prompt_ids),
        "total_steps": len(records), "generated_tokens": len(session.generated), "text": session.text(),
        "done": session.done, "stop_reason": session.stop_reason,
        "config": config_json(config),
        "capacity": config.capacity,
        "storage": storage_summary(session.cache_config),  # K/V bytes per token: pages, scales, residual window
        "resident_tokens": last.resident_tokens if last else 0, "pages_used": last.pages_used if last else 0,
        "evictions_total": last.evictions_total if last else 0,
    }
    if layers:
        info["layers"] = [] if last is None else [
            {"layer": i, "block_table": list(table), "resident_tokens": int((slots >= 0).sum()),
             "resident_positions": np.sort(slots[slots >= 0]).tolist()}
            for i, (table, slots) in enumerate(zip(last.block_tables, last.slot_maps.reshape(len(last.block_tables), -1)))]
    return info


def config_json(config) -> dict[str, Any]:
    """The settings a request may set, named as in requests (`max_tokens`), sampling as one object."""
    values = table.to_dict(config)
    out = {s.dest: values[s.name] for s in table.in_group("cache", "session") if s.request}
    out["sampling"] = values["sampling"]
    return out


def step_json(record) -> dict:
    data = {"step": record.step, "kind": record.kind, "token_ids": list(record.token_ids),
            "positions": list(record.positions), "next_token": record.next_token, "next_text": record.next_text,
            "resident_tokens": record.resident_tokens, "pages_used": record.pages_used,
            "evictions": len(record.evictions), "evictions_total": record.evictions_total,
            "block_table_layer0": list(record.block_tables[0]),
            "seconds": {k: round(v, 6) for k, v in record.timings.items()}}
    if record.oracle is not None:
        data["oracle"] = {k: _finite(v) for k, v in record.oracle.__dict__.items()}
    return data


def event_json(event) -> dict:
    return {"kind": event.kind.value, "step": event.step, "layer": event.layer, "page": event.page,
            "slot": event.slot, "position": event.position, "policy": event.policy or None,
            "reason": event.reason or None, "score": _finite(event.score)}


def steps_metrics(records) -> dict:
    decode = [r for r in records if r.kind == "decode"]
    seconds = sum(r.timings.get("total", 0.0) for r in decode)
    return {"steps": len(records), "decode_steps": len(decode),
            "prefill_tokens": sum(len(r.token_ids) for r in records if r.kind == "prefill"),
            "evictions": sum(len(r.evictions) for r in records),
            "seconds": round(sum(r.timings.get("total", 0.0) for r in records), 6),
            "decode_tokens_per_s": len(decode) / seconds if seconds > 0 else None}


def _wanted(event, which: str) -> bool:
    return which == "all" or (which == "evictions" and event.kind is EventKind.EVICT)


def _finite(value):
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    value = float(value)
    return value if math.isfinite(value) else None
