"""The JSON `pagevis attach --headless --json` prints and `--save-state` writes (the shapes issue 20 fixes).

    summary: {"endpoints": [{"endpoint", "replay", "batches", "last_seq", "replayed_batches", "gaps_unrecovered",
              "decode_errors", "events": {"BlockStored": n, "BlockRemoved": n, "AllBlocksCleared": n},
              "resident_blocks": {"GPU": n, ...}}, ...], "shared_blocks": n}
    state:   {"endpoints": [{"endpoint", "blocks": [{"hash", "parent", "medium", "tokens"}]}]}
Int hashes are JSON ints, bytes hashes hex strings.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagevis.attach.state import EngineSnapshot, FleetSnapshot


def hash_json(value: Any) -> Any:
    return value.hex() if isinstance(value, (bytes, bytearray)) else value


def summary(snapshot: FleetSnapshot, replays: list[str | None]) -> dict:
    endpoints = []
    for engine, replay in zip(snapshot.engines, replays):
        c = engine.counters
        endpoints.append({
            "endpoint": engine.name, "replay": replay, "batches": c.batches, "last_seq": c.last_seq,
            "replayed_batches": c.replayed_batches, "gaps_unrecovered": c.gaps_unrecovered,
            "decode_errors": c.decode_errors, "events": dict(c.events),
            "resident_blocks": {medium: n for medium, n in engine.resident.items() if n}})
    return {"endpoints": endpoints, "shared_blocks": snapshot.shared_blocks}


def engine_blocks(engine: EngineSnapshot) -> list[dict]:
    """Resident blocks, ordered by (medium, seq, row): stable for a given stream."""
    cols = engine.blocks
    if cols is None:
        raise ValueError("a snapshot taken with blocks=False has no blocks")
    rows = np.flatnonzero(cols.resident)
    media = [engine.tiers[t].medium for t in cols.tier[rows]]
    order = sorted(range(len(rows)), key=lambda i: (media[i], int(cols.seq[rows[i]]), int(rows[i])))
    return [{"hash": hash_json(cols.hashes[rows[i]]), "parent": hash_json(cols.parents[rows[i]]),
             "medium": media[i], "tokens": cols.token_ids(int(rows[i])).tolist()} for i in order]


def state(snapshot: FleetSnapshot) -> dict:
    return {"endpoints": [{"endpoint": engine.name, "blocks": engine_blocks(engine)}
                          for engine in snapshot.engines]}
