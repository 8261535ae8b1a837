"""A sequence: the pages it reads, per layer, in logical order (its block tables)."""

from __future__ import annotations


class Sequence:
    """Block table per layer: logical page i of layer l is page id `block_tables[l][i]` in that layer's
    PageStore, which says where the page lives (tier and frame). Each table is one list object for the
    sequence's whole life (reset clears it in place), so views built on it stay valid."""

    def __init__(self, n_layers: int, seq_id: int = 0):
        self.seq_id = seq_id
        self.block_tables: list[list[int]] = [[] for _ in range(n_layers)]

    def reset(self) -> None:
        for table in self.block_tables:
            table.clear()

    def n_pages(self, layer: int) -> int:
        return len(self.block_tables[layer])
