"""Text: the prompt and the generated tokens, each tinted by whether the selected layer still holds it and
by how much attention the selected step's query gives it."""

from __future__ import annotations

import functools
import html
from typing import NamedTuple

import numpy as np
from PySide6.QtCore import QEvent, QPointF, Qt
from PySide6.QtWidgets import QLabel, QTextBrowser, QToolTip, QVBoxLayout, QWidget

from pagevis.gui.widgets import theme
from pagevis.viewmodel.cells import STATE_COLORS
from pagevis.viewmodel.view_state import ViewState

ATTENTION_RGB = (255, 176, 32)  # amber, alpha grows with attention
EVICTED_BG = "#4a2026"
EVICTED_FG = "#c98a92"
PROMPT_FG = "#aab2bf"
GENERATED_FG = "#ffffff"
TOP_K = 8  # only the most attended tokens are tinted: a tint on every token says nothing
MAX_POSITIONS = 320  # the text shows the newest positions only (laying out a token costs ~30 µs)


class TokenTint(NamedTuple):
    position: int
    text: str
    prompt: bool
    resident: bool
    attention: float  # this step's weight on the token (layer/head as selected); 0 when evicted
    alpha: float  # 0..1 strength of the attention tint


@functools.lru_cache(maxsize=65536)
def _escaped(text: str) -> str:
    """A token's text as HTML (escaped once per distinct token, not once per redraw)."""
    return html.escape(text).replace("\n", "↵<br>") or "∅"


def _shown(text: str) -> str:
    """A token's text as the document's plain text has it (`_escaped`, read back: a line break is one character)."""
    return text.replace("\n", "↵\n").replace("\xa0", " ") or "∅"


def _earlier(first_position: int) -> str:
    """The line before a long session's text, which shows its newest MAX_POSITIONS positions only."""
    return f"… {first_position} earlier positions not shown … "


def token_starts(plain: str, texts: list[str], start: int = 0) -> np.ndarray:
    """Where each token's text starts in the document's plain text, in order from `start`: where the previous one
    ended, or, when the document changed a text (a carriage return dropped), where it is found nearby."""
    starts = np.zeros(len(texts), dtype=np.int64)
    at, previous = start, start - 1
    for i, text in enumerate(texts):
        shown = _shown(text)
        if not plain.startswith(shown, at):
            found = plain.find(shown, max(previous + 1, at - 2), at + len(shown) + 8)
            at = found if found >= 0 else at
        starts[i], previous = at, at
        at += len(shown)
    return starts


def top_k_alpha(attention: np.ndarray, k: int) -> np.ndarray:
    """Tint strength per token: the k most attended get 0.35..1 (by the square root of their share of the
    top weight), every other token 0."""
    alpha = np.zeros(attention.shape, dtype=np.float64)
    top = float(attention.max()) if attention.size else 0.0
    if top <= 0:
        return alpha
    chosen = np.argsort(attention, kind="stable")[-k:]
    chosen = chosen[attention[chosen] > 0]
    alpha[chosen] = np.maximum(np.sqrt(attention[chosen] / top), 0.35)
    return alpha


class TextView(QWidget):
    title = "Text"
    live_interval = 0.25  # while decoding, re-tint at most 4 times a second (re-laying the text is costly)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.tints: list[TokenTint] = []
        self.first_position = 0  # the text starts here (long sessions show the newest MAX_POSITIONS)
        self.next_text = ""
        self._key = None
        self._starts: np.ndarray | None = None  # each tint's offset in the document, found on the first hover
        self.browser = QTextBrowser()
        self.browser.setOpenLinks(False)
        # a token's tooltip is looked up on hover (a title attribute on every span made setHtml and the layout
        # 40 % slower: 3.9 -> 2.3 ms for 174 tokens, 2-4 times a second while decoding)
        self.browser.viewport().installEventFilter(self)
        self.set_presentation(False)
        self.legend = QLabel(
            f"<span style='background:rgba{ATTENTION_RGB + (0.8,)};color:#000'>&nbsp;{TOP_K} most attended"
            f"&nbsp;</span>&nbsp; "
            f"<span style='color:{PROMPT_FG}'>prompt</span> · <span style='color:{GENERATED_FG}'>generated</span> · "
            f"<span style='background:{EVICTED_BG};color:{EVICTED_FG}'><s>&nbsp;evicted&nbsp;</s></span> · "
            f"<span style='color:{STATE_COLORS[3]}'>▸ next token</span>")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.browser, 1)
        layout.addWidget(self.legend)

    def set_presentation(self, on: bool) -> None:
        """The presentation layout's text: large enough to read from the back of a room."""
        self.browser.setStyleSheet("QTextBrowser { font-family: 'DejaVu Sans Mono', monospace; "
                                   f"font-size: {17 if on else 12}px; }}")

    def export_target(self):
        return self

    def show_state(self, state: ViewState) -> None:
        timeline, record = state.timeline, state.record
        key = (id(timeline), state.index, state.layer, state.head)
        if key == self._key:
            return
        self._key = key
        if record is None:
            self.tints, self.next_text = [], ""
            self.browser.setHtml("")
            return
        n = timeline.n_positions(state.index)
        low = max(0, n - MAX_POSITIONS)
        resident = record.resident_mask(state.layer, n)[low:]
        if state.layer in record.attention_layers:
            by_position = record.attention_over_positions(state.layer, n)[:, low:]
            attention = by_position.mean(axis=0) if state.head is None else by_position[state.head]
        else:
            attention = np.zeros(n - low, dtype=np.float32)
        alpha = top_k_alpha(attention, TOP_K)
        n_prompt = len(timeline.info.prompt_ids)
        positions = range(low, n)
        self.first_position = low
        self.tints = list(map(TokenTint, positions, map(timeline.position_text, positions),
                              [p < n_prompt for p in positions], resident.astype(bool).tolist(),
                              attention.astype(np.float64).tolist(), alpha.astype(np.float64).tolist()))
        self.next_text = record.next_text
        self._starts = None
        self.browser.setHtml(self._html(record))
        bar = self.browser.verticalScrollBar()
        bar.setValue(bar.maximum())

    def _html(self, record) -> str:
        parts = [f"<span style='color:{theme.MUTED}'>{_earlier(self.first_position)}</span>"] \
            if self.first_position else []
        for tint in self.tints:
            text = _escaped(tint.text)
            color = PROMPT_FG if tint.prompt else GENERATED_FG
            if not tint.resident:
                style = f"background:{EVICTED_BG};color:{EVICTED_FG};text-decoration:line-through"
            elif tint.alpha > 0:
                fg = "#000000" if tint.alpha > 0.55 else color
                style = f"background:rgba({ATTENTION_RGB[0]},{ATTENTION_RGB[1]},{ATTENTION_RGB[2]}," \
                        f"{tint.alpha:.2f});color:{fg}"
            else:
                style = f"color:{color}"
            parts.append(f"<span style='{style}'>{text}</span>")
        if record.next_token >= 0:
            parts.append(f"<span style='color:{STATE_COLORS[3]};font-weight:bold'>▸"
                         f"{html.escape(record.next_text).replace(chr(10), '↵')}</span>")
        return "<div style='white-space:pre-wrap;line-height:140%'>" + "".join(parts) + "</div>"

    def eventFilter(self, watched, event) -> bool:  # noqa: N802 - Qt's name
        if event.type() == QEvent.ToolTip and watched is self.browser.viewport():
            text = self.tooltip_at(event.pos())
            if text:
                QToolTip.showText(event.globalPos(), text, watched)
            else:
                QToolTip.hideText()
            return True
        return False

    def tooltip_at(self, point) -> str:
        """What hovering the token under a point of the text's viewport says ("" off the tokens)."""
        index = self.token_at(point)
        if index is None:
            return ""
        tint = self.tints[index]
        return f"position {tint.position}: {'resident' if tint.resident else 'evicted'}, attention {tint.attention:.3g}"

    def token_at(self, point) -> int | None:
        """The index in `tints` of the token under a point of the viewport, or None."""
        browser = self.browser
        document = browser.document()
        scrolled = QPointF(point) + QPointF(browser.horizontalScrollBar().value(), browser.verticalScrollBar().value())
        char = document.documentLayout().hitTest(scrolled, Qt.ExactHit)
        if char < 0 or not self.tints:
            return None
        if self._starts is None:
            first = len(_earlier(self.first_position)) if self.first_position else 0
            self._starts = token_starts(document.toPlainText(), [t.text for t in self.tints], first)
        index = int(np.searchsorted(self._starts, char, side="right")) - 1
        if index < 0 or char >= self._starts[index] + len(_shown(self.tints[index].text)):
            return None
        return index
