"""What the attach window's engines table and plots draw, Qt-free: a FleetFrame, which the fleet worker
(gui/attach/worker.py) publishes between polls: a line per engine and the selected engine's snapshot (without
blocks)."""

from __future__ import annotations

from dataclasses import dataclass

from pagevis.attach.fleet_snapshot import Counters, EngineSnapshot


@dataclass(frozen=True)
class EngineLine:
    name: str
    counters: Counters
    resident: dict


@dataclass(frozen=True)
class FleetFrame:
    engines: tuple[EngineLine, ...]
    selected: int
    engine: EngineSnapshot | None  # the selected engine, without blocks
    shared_blocks: int
    position: int | None  # playback: live messages applied; None live
    length: int | None
    started: bool  # the source is attached (a live attach first rebuilds from the replay endpoints)
    error: str  # the worker's own trouble (a bad endpoint, an unexpected exception), not decode errors
    worker_errors: int
    made: float  # time.monotonic()
