"""Icicle layout of a forest (no Qt): the x axis is the token position in the prefix, each node a box as wide as
its tokens, starting where its parent ends; the y axis is leaf slots, each node as tall as the leaves below it.
A prefix cache drawn this way reads left to right like the prompts it holds: a shared prefix is one box spanning
the branches that continue it.

`layout_forest(parent, tokens, order, budget)` → `ForestLayout`, vectorised with NumPy level by level (one
pass down for x and depth, one up for leaves / subtree sizes / reach, one down for y), so 1 M nodes lay out in a
fraction of a second on a worker thread. Siblings (and roots) are placed by `order`, then by row: boxes keep
their place while the forest only grows.

The node budget: at most `budget` nodes are drawn one by one: the ones with the most leaves below them (the
tallest boxes), ties to the shallower. That set contains every drawn node's parent, so what is left out are
whole subtrees hanging off drawn nodes (or roots); each run of consecutive left-out siblings becomes one
aggregate box spanning them, with their block count. At most about 2 × budget boxes are drawn whatever the
size of the forest, and every node is either drawn or counted in exactly one aggregate.

Parent links that cycle (a hostile stream can make them) never reach a root: such rows are laid out as roots
(counted in `cut`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

DEFAULT_BUDGET = 20_000


@dataclass(frozen=True)
class ForestLayout:
    x: np.ndarray  # float64 per row: token position where the node starts
    y: np.ndarray  # float64 per row: first leaf slot
    leaves: np.ndarray  # int64 per row: leaf slots below it (its height)
    size: np.ndarray  # int64 per row: nodes in its subtree, itself included
    depth: np.ndarray  # int32 per row
    drawn: np.ndarray  # int64 rows drawn one by one
    agg_x0: np.ndarray  # aggregates: float64 boxes (x0, x1, y0, y1) of runs of left-out sibling subtrees
    agg_x1: np.ndarray
    agg_y0: np.ndarray
    agg_y1: np.ndarray
    agg_count: np.ndarray  # int64 nodes in each aggregate
    agg_parent: np.ndarray  # int64 the drawn parent row, -1 for roots
    width: float  # the forest's extent in tokens
    height: float  # in leaf slots
    cut: int  # rows laid out as roots because their parent links cycle

    @property
    def n(self) -> int:
        return len(self.x)


class Interrupted(Exception):
    """The `stop` callable said stop (the window is closing)."""


def _children_index(parent: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    n = len(parent)
    by = np.lexsort((np.arange(n), order, parent))  # roots (-1) first, then grouped by parent, by order, by row
    count = np.bincount(parent[parent >= 0], minlength=n)
    n_roots = n - int(count.sum())
    start = n_roots + np.concatenate(([0], np.cumsum(count)[:-1])) if n else np.zeros(0, np.int64)
    return by, count, start, n_roots


def _levels(by, count, start, roots, stop) -> list[np.ndarray]:
    levels = [roots]
    frontier = roots
    while frontier.size:
        if stop is not None and stop():
            raise Interrupted
        c = count[frontier]
        has = c > 0
        if frontier.size == 1 or not has.all():
            frontier, c = frontier[has], c[has]
        if not frontier.size:
            break
        total = int(c.sum())
        before = np.cumsum(c) - c
        frontier = by[np.repeat(start[frontier] - before, c) + np.arange(total)]
        levels.append(frontier)
    return levels


def subtree(parent, row: int) -> np.ndarray:
    """The rows of `row`'s subtree (itself first, then level by level); stops at n rows if links cycle."""
    parent = np.array(parent, dtype=np.int64)
    n = len(parent)
    if not 0 <= row < n:
        return np.zeros(0, np.int64)
    parent[(parent < -1) | (parent >= n) | (parent == np.arange(n))] = -1
    order = np.arange(n)
    by, count, start, _ = _children_index(parent, order)
    found, frontier, total = [np.array([row])], np.array([row]), 1
    while frontier.size and total < n:
        c = count[frontier]
        frontier, c = frontier[c > 0], c[c > 0]
        if not frontier.size:
            break
        before = np.cumsum(c) - c
        frontier = by[np.repeat(start[frontier] - before, c) + np.arange(int(c.sum()))]
        found.append(frontier)
        total += len(frontier)
    return np.unique(np.concatenate(found))[:n] if total >= n else np.concatenate(found)


def _segments(parents: np.ndarray) -> np.ndarray:
    """Starts of the runs of equal parents (children come grouped by parent)."""
    if not parents.size:
        return np.zeros(0, np.int64)
    return np.flatnonzero(np.concatenate(([True], parents[1:] != parents[:-1])))


def _paths(parent: np.ndarray, tokens: np.ndarray, count: np.ndarray):
    """Unary paths (a node that is its parent's only child continues the parent's path), by pointer jumping:
    each row's path top, and its offset from it in tokens and in nodes. Rows whose jumps never settle are in or
    under a cycle of only children: returned in `stuck`."""
    n = len(parent)
    rows = np.arange(n)
    safe = np.maximum(parent, 0)
    linked = (parent >= 0) & (count[safe] == 1)
    top = np.where(linked, parent, rows)
    off_tok = np.where(linked, tokens[safe], 0.0)
    off_n = linked.astype(np.int64)
    active = np.flatnonzero(linked)
    for _ in range(max(1, int(n).bit_length()) + 1):
        if not active.size:
            break
        up = top[active]
        off_tok[active] += off_tok[up]
        off_n[active] += off_n[up]
        top[active] = top[up]
        active = active[top[active] != top[top[active]]]
    # a cycle of only children jumps around it forever, or lands on itself and looks like a top
    stuck = np.flatnonzero(linked[top]) if not active.size else np.union1d(active, np.flatnonzero(linked[top]))
    return top, off_tok, off_n, stuck


def _compressed_layout(parent, tokens, weight, order, stop):
    """The level-by-level layout of a forest (see the module docstring); `weight`: nodes each one stands for
    (its depth and subtree size count them)."""
    n = len(parent)
    by, count, start, n_roots = _children_index(parent, order)
    levels = _levels(by, count, start, by[:n_roots], stop)
    reached = sum(len(level) for level in levels)
    cut = np.zeros(0, np.int64)
    if reached < n:  # branching cycles: every node not reached from a root becomes one
        seen = np.zeros(n, bool)
        for level in levels:
            seen[level] = True
        cut = np.flatnonzero(~seen)
        parent = parent.copy()
        parent[cut] = -1
        by, count, start, n_roots = _children_index(parent, order)
        levels = _levels(by, count, start, by[:n_roots], stop)
    x = np.zeros(n)
    depth = np.zeros(n, np.int64)
    segments = [np.zeros(min(1, n), np.int64)]  # the roots form one segment
    for level in levels[1:]:
        pc = parent[level]
        segments.append(_segments(pc))
        x[level] = x[pc] + tokens[pc]
        depth[level] = depth[pc] + weight[pc]
    leaves = np.ones(n, np.int64)
    size = weight.astype(np.int64)
    reach = x + tokens
    for level, seg in zip(reversed(levels[1:]), reversed(segments[1:])):
        if stop is not None and stop():
            raise Interrupted
        heads = parent[level[seg]]
        leaves[heads] = np.add.reduceat(leaves[level], seg)
        size[heads] += np.add.reduceat(size[level], seg)
        reach[heads] = np.maximum(reach[heads], np.maximum.reduceat(reach[level], seg))
    y = np.zeros(n)
    for d, (level, seg) in enumerate(zip(levels, segments)):
        if not level.size:
            continue
        h = leaves[level]
        before = np.cumsum(h) - h
        base = np.repeat(before[seg], np.diff(np.append(seg, len(level))))
        y[level] = before - base + (y[parent[level]] if d else 0)
    return x, y, leaves, size, depth, reach, levels, segments, cut


class _Placed(NamedTuple):
    """Each row's place: its left edge, top, leaves below it, rows in its subtree, and right edge of it."""

    x: np.ndarray
    y: np.ndarray
    leaves: np.ndarray
    size: np.ndarray
    reach: np.ndarray


def _chosen(leaves: np.ndarray, depth: np.ndarray, budget: int) -> np.ndarray:
    """The rows drawn one by one: all within the budget, else those over the most leaves, shallowest first."""
    n = len(leaves)
    if n <= budget:
        return np.ones(n, bool)
    deepest = int(depth.max())
    key = leaves * (deepest + 2) + (deepest + 1 - depth)
    chosen = np.zeros(n, bool)
    if budget > 0:
        chosen[np.argpartition(-key, budget - 1)[:budget]] = True
    return chosen


def _collapsed(p: _Placed, parent: np.ndarray, in_path: np.ndarray, chosen: np.ndarray, tops: np.ndarray,
               levels: list, segments: list) -> list[np.ndarray]:
    """The collapsed subtrees (x0, x1, y0, y1, rows, parent): each run of undrawn siblings under a drawn row,
    and each path cut after its drawn part."""
    x, y, leaves, size, reach = p
    aggs: list[tuple] = []
    inside = in_path & ~chosen & chosen[np.maximum(parent, 0)]  # a path cut after its drawn part
    if inside.any():
        members = np.flatnonzero(inside)
        aggs.append((x[members], reach[members], y[members], y[members] + leaves[members], size[members],
                     parent[members]))
    for d, (level, seg) in enumerate(zip(levels, segments)):
        if not level.size:
            continue
        heads = tops[level]
        pc = parent[heads] if d else np.full(len(level), -1)
        out = ~chosen[heads] & (chosen[np.maximum(pc, 0)] if d else True)
        if not out.any():
            continue
        new_segment = np.zeros(len(level), bool)
        new_segment[seg] = True
        previous_out = np.concatenate(([False], out[:-1]))
        run_start = out & (~previous_out | new_segment)
        where = np.flatnonzero(out)
        starts = np.flatnonzero(run_start[where])
        members = heads[where]
        last = members[np.append(starts[1:], len(members)) - 1]
        first = members[starts]
        aggs.append((x[first], np.maximum.reduceat(reach[members], starts), y[first], y[last] + leaves[last],
                     np.add.reduceat(size[members], starts), pc[where][starts]))
    if aggs:
        return [np.concatenate(parts) for parts in zip(*aggs)]
    return [np.zeros(0)] * 4 + [np.zeros(0, np.int64)] * 2


def layout_forest(parent, tokens, order=None, budget: int = DEFAULT_BUDGET,
                  stop: Callable[[], bool] | None = None) -> ForestLayout:
    """Lay out the forest of rows whose parent row is `parent` (-1: a root) and width `tokens` (see the module
    docstring). `order`: sibling order (smaller first; default the row). `stop`: polled between levels; when it
    returns True, raises Interrupted.

    Unary paths (chains of only children, which is most of a prefix cache: one per prompt beyond its shared
    prefix) are laid out as one node each, then expanded, so a chain of 65,536 blocks costs what one node does."""
    parent = np.array(parent, dtype=np.int64)
    n = len(parent)
    rows = np.arange(n)
    tokens = np.asarray(tokens, dtype=np.float64)
    order = rows if order is None else np.asarray(order, dtype=np.int64)
    parent[(parent < -1) | (parent >= n) | (parent == rows)] = -1
    count = np.bincount(parent[parent >= 0], minlength=n)
    top, off_tok, off_n, stuck = _paths(parent, tokens, count)
    cut = len(stuck)
    if cut:  # cycles of only children: their rows become roots
        parent[stuck] = -1
        count = np.bincount(parent[parent >= 0], minlength=n)
        top, off_tok, off_n, _ = _paths(parent, tokens, count)
    tops = np.flatnonzero(top == rows)
    cid = np.full(n, -1, np.int64)
    cid[tops] = np.arange(len(tops))
    bottoms = np.flatnonzero(count != 1)  # each path ends at a node with no or several children
    path_tokens = np.zeros(len(tops))
    path_len = np.zeros(len(tops), np.int64)
    path_tokens[cid[top[bottoms]]] = off_tok[bottoms] + tokens[bottoms]
    path_len[cid[top[bottoms]]] = off_n[bottoms] + 1
    up = parent[tops]
    cparent = np.where(up >= 0, cid[top[np.maximum(up, 0)]], -1)
    cx, cy, cleaves, csize, cdepth, creach, levels, segments, ccut = _compressed_layout(
        cparent, path_tokens, path_len, order[tops], stop)
    cut += int(path_len[ccut].sum())
    mine = cid[top]
    x = cx[mine] + off_tok
    y = cy[mine]
    leaves = cleaves[mine]
    size = csize[mine] - off_n
    depth = (cdepth[mine] + off_n).astype(np.int32)
    reach = creach[mine]
    if ccut.size:  # a path cut from its parent: its top is a root now
        parent[tops[ccut]] = -1

    chosen = _chosen(leaves, depth, budget)
    agg = _collapsed(_Placed(x, y, leaves, size, reach), parent, top != rows, chosen, tops, levels, segments)
    roots = tops[levels[0]] if levels and levels[0].size else np.zeros(0, np.int64)
    return ForestLayout(x=x, y=y, leaves=leaves, size=size, depth=depth, drawn=np.flatnonzero(chosen),
                        agg_x0=agg[0].astype(np.float64), agg_x1=agg[1].astype(np.float64),
                        agg_y0=agg[2].astype(np.float64), agg_y1=agg[3].astype(np.float64),
                        agg_count=agg[4].astype(np.int64), agg_parent=agg[5].astype(np.int64),
                        width=float((x + tokens).max()) if n else 0.0,
                        height=float(leaves[roots].sum()) if n else 0.0, cut=cut)
