"""The engine's prefix cache in the shared prefix-forest widget (prefix_forest.py): one box per cached full
page (PoolForest's nodes: the pool's hashes, parents from the requests' own chains), labelled with its hit count
and its text, coloured by whether it is shared now, held by one request, or free but still cached."""

from __future__ import annotations

import html

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QWidget

from pagevis.simserver.forest import REMOVED as NODE_REMOVED
from pagevis.simserver.forest import ForestNode
from pagevis.viewmodel.forest_rows import NEWEST, REMOVED, ColourClass, ForestRow, ForestRows
from pagevis.gui.widgets.prefix_forest import PrefixForestView
from pagevis.gui.widgets.pool_grid import CACHED_COLOR, SHARED_COLOR

CLASSES = (ColourClass("shared now", SHARED_COLOR), ColourClass("held by one request", "#3b82c4"),
           ColourClass("free, still cached", CACHED_COLOR))
CLASS_OF = {"shared": 0, "in use": 1, "cached": 2, "removed": 2}


def forest_rows(nodes: tuple[ForestNode, ...]) -> ForestRows:
    rows = []
    for node in nodes:
        text = node.text.replace("\n", "⏎")
        holders = ", ".join(map(str, node.owners[:12])) + (" …" if len(node.owners) > 12 else "")
        hover = (f"page {node.page} · {node.state} · ref count {node.refs} · {node.hits} prefix hits"
                 + (f"\nheld by requests {holders}" if holders else "")
                 + ("\njust reclaimed for other tokens" if node.flags & NODE_REMOVED else "")
                 + f"\n“{text}”")
        label = f"{node.hits}× {text}" if node.hits else text
        flags = (REMOVED if node.flags & NODE_REMOVED else 0) | (NEWEST if node.flags & 1 else 0)
        rows.append(ForestRow(node.key, node.parent, node.n_tokens, CLASS_OF[node.state], hover, flags, label,
                              node.order))
    return ForestRows.from_rows(rows, CLASSES)


def reused_prefix(nodes: tuple[ForestNode, ...]) -> list[ForestNode]:
    """The most reused prefix: from the first page with the most hits, down through the child with the most
    hits while it has any (for a shared system prompt: the prompt's pages)."""
    live = [node for node in nodes if not node.flags & NODE_REMOVED]
    children: dict[int, list[ForestNode]] = {}
    for node in live:
        if node.parent is not None:
            children.setdefault(node.parent, []).append(node)
    roots = [node for node in live if node.parent is None and node.hits]
    if not roots:
        return []
    chain = [max(roots, key=lambda node: (node.hits, -node.order))]
    while True:
        below = [c for c in children.get(chain[-1].key, ()) if c.hits]
        if not below:
            return chain
        chain.append(max(below, key=lambda node: (node.hits, -node.order)))


class ServerForest(PrefixForestView):
    def __init__(self):
        super().__init__(x_label="tokens into the prompt", y_label="")  # rows: the prefix tree's branches
        self.graphics.setMinimumHeight(90)
        self.nodes: tuple[ForestNode, ...] = ()
        self.set_empty_text("no full page cached yet")
        self.hot = QLabel()
        self.hot.setWordWrap(True)
        self.hot.setTextFormat(Qt.RichText)
        self.hot.setFixedHeight(self.hot.fontMetrics().lineSpacing() * 2 + 4)
        QWidget.layout(self).addWidget(self.hot)  # (self.layout is the forest layout)

    def show_state(self, snapshot) -> None:
        """The prefix forest of a side's SideSnapshot."""
        self.nodes = nodes = snapshot.forest
        hits = sum(n.hits for n in nodes if not n.flags & NODE_REMOVED)
        rows = forest_rows(nodes)
        self.set_forest(rows, note=f"{hits} prefix hits on the pages cached now")
        counts = rows.count_by_class()
        swatches = [f"<span style='color:{c.color}'>&#9632;</span>&nbsp;{c.name}&nbsp;{counts.get(c.name, 0)}"
                    for c in CLASSES]
        self.legend.setText("&nbsp;&nbsp; ".join(swatches) + "&nbsp;&nbsp; <span style='color:#ffffff'>&#9633;</span>"
                            "&nbsp;new &nbsp; <span style='color:#ef4b4b'>&#9633;</span>&nbsp;reclaimed · "
                            "hover a page for its text")
        chain = reused_prefix(nodes)
        if chain:
            text = "".join(node.text for node in chain)
            tokens = sum(node.n_tokens for node in chain)
            self.hot.setText(f"most reused prefix: <b>{chain[0].hits}×</b> its first page, {len(chain)} pages "
                             f"({tokens} tokens) reused: “{html.escape(_short(text, 72))}”")
        else:
            self.hot.setText("")


def _short(text: str, limit: int) -> str:
    """The start and the end of `text` around an ellipsis, on one line."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit * 2 // 3] + " … " + text[-(limit // 3):]
