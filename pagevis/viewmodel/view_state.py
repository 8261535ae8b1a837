"""The views. Each renders one ViewState (a timeline, the record selected on it, and the view options) and
never reads the live engine: what a view shows is exactly what the selected StepRecord holds."""

from __future__ import annotations

from dataclasses import dataclass

from pagevis.engine import SessionConfig, StepRecord
from pagevis.viewmodel.timeline import Timeline, head_label


EMPTY_HINT = "press Space to decode"  # what the views say before the first step


@dataclass(frozen=True)
class ViewState:
    timeline: Timeline | None = None
    index: int = -1  # the record shown; -1 when there is none
    layer: int = 0
    head: int | None = None  # None: mean over heads
    shade: str = "age"  # page-grid colouring of resident cells: "age", "score" or "none"
    log_scale: bool = False  # attention heatmap
    fixed_scale: bool = False  # attention colours keep their scale from step to step
    loading: SessionConfig | None = None  # no session yet: the configuration whose model is loading

    @property
    def record(self) -> StepRecord | None:
        if self.timeline is None or not 0 <= self.index < len(self.timeline):
            return None
        return self.timeline.record(self.index)

    @property
    def config(self) -> SessionConfig | None:
        """The session's configuration, or the one being loaded; None when there is neither."""
        return self.timeline.info.config if self.timeline is not None else self.loading

    @property
    def head_label(self) -> str:
        if self.head is None:
            return "mean of heads"
        info = self.timeline.info if self.timeline is not None else None
        return head_label(self.head, info.n_heads, info.n_kv_heads) if info is not None else f"head {self.head}"
