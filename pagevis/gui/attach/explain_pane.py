"""The attach window's "Explain" tab: a prompt (pasted, or a request of an opened JSONL file) explained against
every engine's pool (pagevis.attach.explain), a table ranking the engines, and an overlay on the forest: the
selected engine's matched blocks outlined in green, the first divergence marked in magenta with its reason.

The pane only holds the request and shows results; the window runs the explainer (under the fleet's lock) when
the button is pressed and again with each new forest, so a scrubbed recording shows the explanation at that
point of the stream.
"""

from __future__ import annotations

import json
import re
from html import escape

import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QPen
from PySide6.QtWidgets import (QComboBox, QFileDialog, QHBoxLayout, QHeaderView, QLabel, QLineEdit,
                               QPlainTextEdit, QPushButton, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget)

from pagevis.attach.explain import ExplainRequest
from pagevis.attach.explain_run import RequestError, read_lines, request_from
from pagevis.attach.report import hash_json

MATCH_COLOR, MISS_COLOR = "#3ddc84", "#ff4fd8"
COLUMNS = ("#", "engine", "hit", "media (hit blocks)", "first miss")
MAX_REQUESTS = 10_000


class ExplainPane(QWidget):
    def __init__(self, tokenizer=None, parent=None):
        super().__init__(parent)
        self.tokenizer = tokenizer
        self.requests: list = []  # decoded lines of an opened JSONL file
        self.result: dict | None = None
        self.prompt = QPlainTextEdit()
        self.prompt.setPlaceholderText("paste a prompt: text (with --tokenizer) or token ids \"1 2 3\"")
        self.salt, self.lora = QLineEdit(), QLineEdit()
        self.salt.setPlaceholderText("cache_salt")
        self.lora.setPlaceholderText("lora_name")
        self.button = QPushButton("Explain")
        self.button.setToolTip("how much of this prompt each engine's cache holds, where and why the rest misses")
        self.open_button = QPushButton("Open JSONL…")
        self.request_box = QComboBox()
        self.request_box.setVisible(False)
        self.request_box.currentIndexChanged.connect(self._pick)
        self.open_button.clicked.connect(self._open)
        self.summary = QLabel("")
        self.summary.setWordWrap(True)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QTableWidget.NoEditTriggers)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeToContents)
        header.setSectionResizeMode(1, QHeaderView.Interactive)
        header.setSectionResizeMode(len(COLUMNS) - 1, QHeaderView.Stretch)
        self.table.setColumnWidth(1, 110)
        self.detail = QLabel("")  # the forest's engine: its first miss in full
        self.detail.setWordWrap(True)
        self.detail.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.table.setTextElideMode(Qt.ElideMiddle)
        self.table.setWordWrap(False)
        self.table.verticalHeader().setDefaultSectionSize(22)
        keys = QHBoxLayout()
        for widget in (self.salt, self.lora):
            keys.addWidget(widget)
        buttons = QHBoxLayout()
        for widget in (self.button, self.open_button, self.request_box):
            buttons.addWidget(widget)
        left = QVBoxLayout()
        left.addWidget(self.prompt, 1)
        left.addLayout(keys)
        left.addLayout(buttons)
        right = QVBoxLayout()
        right.addWidget(self.summary)
        right.addWidget(self.table, 1)
        right.addWidget(self.detail)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.addLayout(left, 1)
        layout.addLayout(right, 2)

    # --- the request ------------------------------------------------------------------------------------------
    def request(self) -> ExplainRequest:
        """The request in the box; RequestError with a sentence if there is none."""
        text = self.prompt.toPlainText()
        if not text.strip():
            raise RequestError("paste a prompt, or open a JSONL file of requests")
        line: dict = {"cache_salt": self.salt.text() or None, "lora_name": self.lora.text() or None}
        numbers = re.fullmatch(r"\s*\[?\s*(\d+(?:[\s,]+\d+)*)\s*\]?\s*", text)
        if numbers and (self.tokenizer is None or text.strip().startswith("[")):
            line["prompt_token_ids"] = [int(t) for t in re.split(r"[\s,]+", numbers.group(1))]
        else:
            line["prompt"] = text
        return request_from(line, self.tokenizer)

    def load(self, path: str) -> None:
        """Requests of a JSONL file (`pagevis attach --explain`'s lines) into the selector."""
        with open(path, encoding="utf-8", errors="replace") as file:
            self.requests = [obj for _, obj in zip(range(MAX_REQUESTS), (o for _, o in read_lines(file)))]
        self.request_box.blockSignals(True)
        self.request_box.clear()
        for i, obj in enumerate(self.requests):
            self.request_box.addItem(f"request {i}" + (" (not a request)" if not isinstance(obj, dict) else ""))
        self.request_box.blockSignals(False)
        self.request_box.setVisible(bool(self.requests))
        if self.requests:
            self._pick(0)

    def _open(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Requests, a JSON object a line", "", "JSONL (*.jsonl *.json);;"
                                              "all files (*)")
        if path:
            try:
                self.load(path)
            except OSError as error:
                self.summary.setText(f"<span style='color:#ff7a7a'>{error}</span>")

    def _pick(self, index: int) -> None:
        if not 0 <= index < len(self.requests) or not isinstance(self.requests[index], dict):
            return
        obj = self.requests[index]
        if "prompt_token_ids" in obj:
            text = json.dumps(obj["prompt_token_ids"])  # brackets: ids, even with a tokenizer
        elif "messages" in obj and self.tokenizer is not None:
            try:
                text = json.dumps(list(request_from({"messages": obj["messages"]}, self.tokenizer).tokens))
            except RequestError as error:
                text = ""
                self.summary.setText(str(error))
        else:
            text = obj.get("prompt") if isinstance(obj.get("prompt"), str) else json.dumps(obj)
        self.prompt.setPlainText(text)
        self.salt.setText(obj.get("cache_salt") or "" if isinstance(obj.get("cache_salt"), str) else "")
        self.lora.setText(obj.get("lora_name") or "" if isinstance(obj.get("lora_name"), str) else "")
        self.button.click()

    # --- results ----------------------------------------------------------------------------------------------
    def show_detail(self, selected: int, name: str) -> None:
        """The first miss of the engine the forest shows, in full."""
        engines = self.result["engines"] if self.result is not None else []
        if 0 <= selected < len(engines):
            engine = engines[selected]
            self.detail.setText(f"<b>{short_name(name)}</b>: {engine['hit_tokens']:,} tokens cached · "
                                f"{escape(miss_text(engine['first_miss']))}")
        else:
            self.detail.setText("")

    def show_error(self, text: str) -> None:
        self.result = None
        self.detail.setText("")
        self.summary.setText(f"<span style='color:#ff7a7a'>{text}</span>")
        self.table.setRowCount(0)

    def show_result(self, result: dict, names: list[str]) -> None:
        self.result = result
        engines = result["engines"]
        order = [next(i for i, e in enumerate(engines) if (e["endpoint"], e["rank"]) == (r["endpoint"], r["rank"]))
                 for r in result["ranking"]]
        self.table.setRowCount(len(order))
        for place, i in enumerate(order):
            engine = engines[i]
            media = engine["media"]
            cells = (str(place + 1), short_name(names[i] if i < len(names) else engine["endpoint"]),
                     f"{engine['hit_tokens']:,}", ", ".join(f"{m} {media.count(m)}" for m in dict.fromkeys(media)),
                     short_miss(engine["first_miss"]))
            for column, text in enumerate(cells):
                item = QTableWidgetItem(text)
                tip = {1: engine["endpoint"], 4: f"{miss_text(engine['first_miss'])}\n\n"
                                                  f"{json.dumps(engine['first_miss'], indent=1)}"}
                item.setToolTip(tip.get(column, text))
                self.table.setItem(place, column, item)
        best = result["best"]
        self.summary.setText(f"{result['tokens']:,} tokens ({result['blocks']} full blocks) · best: "
                             f"<b>{best['endpoint'] if best else '-'}</b>" if result["blocks"] is not None else
                             f"{result['tokens']:,} tokens · no engine has stored a block yet")


def short_name(endpoint: str) -> str:
    """host:port of a tcp endpoint, the file name of an ipc one (the whole name is the tooltip)."""
    rest = endpoint.split("://", 1)[-1]
    return rest.rsplit("/", 1)[-1] if endpoint.startswith("ipc://") else rest


def short_miss(miss: dict | None) -> str:
    return "none" if miss is None else f"{miss['reason'].replace('_', ' ')} at token {miss['position']:,}"


def miss_text(miss: dict | None) -> str:
    if miss is None:
        return "none: the whole prompt is cached"
    reason, at = miss["reason"], f"block {miss['block']}, token {miss['position']}"
    if reason == "token_differs":
        cached, prompt = miss.get("cached_text"), miss.get("prompt_text")
        detail = f"cached {cached!r} vs {prompt!r}" if cached is not None else (
            f"cached token {miss.get('cached_token')} vs {miss.get('prompt_token')}")
        return f"token differs at {miss['position']}: {detail}"
    if reason == "removed":
        return f"removed ({at}) after living {miss['lived_s']:.3g} s"
    if reason == "extra_keys":
        return f"extra keys differ ({', '.join(miss['which'])}) at {at}"
    if reason == "partial_block":
        return f"partial block: the last {miss['tail_tokens']} tokens fill no block"
    if reason == "capped":
        return f"capped at {at}: the last prompt token is computed"
    return f"never stored ({at})"


class ExplainOverlay(pg.GraphicsObject):
    """Outlines over the forest: the matched path (green) and the first divergence (magenta, with its reason)."""

    def __init__(self):
        super().__init__()
        self.matched: list[QRectF] = []
        self.missed: list[QRectF] = []
        self.line: tuple[float, float, float] | None = None  # x, y0, y1 of the divergence
        self.label = pg.TextItem("", color=MISS_COLOR, anchor=(0, 1))
        self._extent = QRectF()
        self.setZValue(10)

    def show(self, forest, engine: dict | None) -> None:
        """Map `engine`'s result (explain with_path) onto the forest view's current drawing."""
        self.prepareGeometryChange()
        self.matched, self.missed, self.line = [], [], None
        self.label.setText("")
        if engine is not None:
            self._place(forest, engine)
        rects = self.matched + self.missed
        self._extent = rects[0].united(rects[-1]) if rects else QRectF()
        for rect in rects:
            self._extent = self._extent.united(rect)
        self.update()

    def _place(self, forest, engine: dict) -> None:
        item, rows = forest.item, forest.rows
        path = set(engine.get("path") or ())
        miss = engine["first_miss"] or {}
        missed = miss.get("hash")
        last = None
        for box, row in zip(item.boxes, item.box_rows.tolist()):
            if row < 0:
                continue
            key = rows.key(row)
            name = hash_json(key[2]) if isinstance(key, tuple) and len(key) == 3 else None
            rect = QRectF(float(box[0]), float(box[1]), float(box[2] - box[0]), float(box[3] - box[1]))
            if name in path:
                self.matched.append(rect)
                if last is None or rect.right() > last.right():
                    last = rect
            elif missed is not None and name == missed:
                self.missed.append(rect)
        anchor = self.missed[0] if self.missed else last
        if miss and anchor is not None:
            x = float(miss.get("position", 0)) if self.missed else anchor.right()
            self.line = (x, anchor.top(), anchor.bottom())
            self.label.setText(miss["reason"])
            self.label.setPos(x, anchor.top())

    def boundingRect(self) -> QRectF:
        return self._extent.adjusted(-1, -1, 1, 1)

    def paint(self, painter, *args) -> None:
        for rects, color in ((self.matched, MATCH_COLOR), (self.missed, MISS_COLOR)):
            pen = QPen(QColor(color), 3)
            pen.setCosmetic(True)
            painter.setPen(pen)
            painter.setBrush(Qt.NoBrush)
            for rect in rects:
                painter.drawRect(rect)
        if self.line is not None:
            x, y0, y1 = self.line
            pen = QPen(QColor(MISS_COLOR), 3)
            pen.setCosmetic(True)
            painter.setPen(pen)
            painter.drawLine(pg.QtCore.QPointF(x, y0), pg.QtCore.QPointF(x, y1))


def add_overlay(forest) -> ExplainOverlay:
    overlay = ExplainOverlay()
    forest.plot.addItem(overlay, ignoreBounds=True)
    forest.plot.addItem(overlay.label, ignoreBounds=True)
    return overlay



def run_explain(pane: ExplainPane, fleet, detokenizer) -> None:
    """Explain the pane's request against every engine of `fleet` now (the window's thread, under the fleet's
    lock: one walk down each engine's matched path) and show the ranking; a bad request is a sentence."""
    from pagevis.attach.explain import explain
    from pagevis.attach.explain_run import fleet_engines

    try:
        request = pane.request()
    except RequestError as error:
        pane.show_error(str(error))
        return
    except Exception as error:  # noqa: BLE001 - a tokenizer failing on odd text must not take the window down
        pane.show_error(f"the tokenizer failed: {type(error).__name__}: {str(error)[:200]}")
        return
    if fleet is None:
        pane.show_error("not attached yet")
        return
    with fleet.lock:
        result = explain(fleet_engines(fleet), request, detokenizer, with_path=True)
        names = [engine.name for engine in fleet.engines]
    pane.show_result(result, names)


def give_room(splitter, explaining: bool) -> None:
    """The Explain tab takes 40% of the plots' height (its prompt box and ranking need the rows), others 25%."""
    total = sum(splitter.sizes())
    share = 0.6 if explaining else 0.75
    splitter.setSizes([int(total * share), total - int(total * share)])
