"""The one run loop: every front end (the app's worker, the CLI, the server, the benches) steps an Engine,
or a one-request DecodeSession, through `steps`; the notebook's Session (notebook/session.py) is the one other
loop over `step()` (`step(n)` and `run()` in a cell, with no pacing or stop flag to honour)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Protocol


class Stepper(Protocol):
    @property
    def done(self) -> bool: ...

    def step(self): ...


@dataclass
class RunControl:
    """How a run goes; another thread may change it between steps (the app's controls, a server's stop)."""

    stop: bool = False  # stop before the next step
    budget: int | None = None  # steps left in this run; None = until stopped or done
    interval: float = 0.0  # minimum seconds per step (a demo's pace); the wait ends early on stop
    breath: float = 0.0  # seconds to sleep after a step shorter than `short_step` (leaves the GIL to a UI)
    short_step: float = 0.02


def steps(stepper: Stepper, control: RunControl | None = None) -> Iterator:
    """Step until the stepper is done, the budget is spent or `control.stop` is set; yield each record."""
    control = control or RunControl()
    while not control.stop and not stepper.done and (control.budget is None or control.budget > 0):
        started = time.perf_counter()
        record = stepper.step()
        if control.budget is not None:
            control.budget -= 1
        yield record
        pause_until = started + control.interval
        while not control.stop and time.perf_counter() < pause_until:
            time.sleep(min(0.01, pause_until - time.perf_counter()))
        if control.breath and time.perf_counter() - started < control.short_step:
            time.sleep(control.breath)


def run(stepper: Stepper, control: RunControl | None = None, on_step=None) -> int:
    """Run `steps` to the end, calling on_step(record) for each; the number of steps taken."""
    taken = 0
    for record in steps(stepper, control):
        taken += 1
        if on_step is not None:
            on_step(record)
    return taken
