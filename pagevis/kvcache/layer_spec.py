"""What each layer's cache holds (vLLM v1's KVCacheSpec): every token (full attention, a "global" layer) or the
last W positions (a sliding window, a "local" layer: Gemma 3 keeps W = 512 on five layers of six).

A query at position p of a local layer sees the keys at positions p - W < k <= p (transformers'
`sliding_window_overlay`: kv_idx > q_idx - sliding_window), W keys counting its own. A page leaves a local layer
(a `slide` event) once none of its tokens is visible to the sequence's newest query, so between steps a local
layer holds at most W + page_size - 1 tokens, W + page_size with the token being written. That keeps one position
more than vLLM's SlidingWindowManager frees up to: a fork recomputes its last token (Engine.fork), whose window
starts one position earlier than the parent's next one.

A chunk longer than the window lets go of its pages below the window as soon as its queries have attended
(`LayerManager.attended`), not at the step's commit: a prefill's local layers then hold a window each, not the whole
chunk each (a 4,096-token Gemma 3 prompt: ~100 MiB less at its peak). Those pages leave unregistered in the prefix
cache, but for one page below the window, which stays until the commit registers it: the page a prefix hit of the
same prompt reads (a hit leaves the prompt's last token to compute). A free page that no prefix hash names gives its
memory back to the system (store.PageStore.give_back): the layer's resident memory is its window's, not every page
it ever held.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FullAttentionSpec:
    """A global layer: every token stays (until a policy evicts it)."""

    window: None = None

    @property
    def label(self) -> str:
        return "global"


@dataclass(frozen=True)
class SlidingWindowSpec:
    """A local layer: the last `window` positions."""

    window: int

    @property
    def label(self) -> str:
        return f"local W={self.window}"


LayerSpec = FullAttentionSpec | SlidingWindowSpec


def layer_specs(windows: tuple[int | None, ...] | None, n_layers: int) -> tuple[LayerSpec, ...]:
    """One spec per layer from a model's `sliding_windows` (None: every layer global)."""
    if windows is None:
        return (FullAttentionSpec(),) * n_layers
    return tuple(FullAttentionSpec() if w is None else SlidingWindowSpec(int(w)) for w in windows)


def check_windows(windows: Any, n_layers: int) -> tuple[int | None, ...] | None:
    """`windows` as a tuple, or None; ValueError naming what is wrong (the caller turns it into its error)."""
    if windows is None:
        return None
    windows = tuple(windows)
    if len(windows) != n_layers:
        raise ValueError(f"one entry per layer ({n_layers}), got {len(windows)}")
    for w in windows:
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"None or a positive integer per layer, got {w!r}")
    return windows


def first_visible(last: int, window: int) -> int:
    """The oldest position the query at `last` sees through a window of `window` positions."""
    return last - window + 1


def first_kept_page(n_tokens: int, window: int, page_size: int) -> int:
    """The first logical page a local layer keeps after n_tokens tokens (the last at n_tokens - 1): pages before
    it hold only positions below the newest query's window."""
    return max(0, first_visible(n_tokens - 1, window) // page_size)


def pages_held(spec: LayerSpec, n_tokens: int, page_size: int) -> int:
    """Pages one sequence of n_tokens tokens holds in a layer of this spec (nothing evicted), between steps."""
    pages = -(-n_tokens // page_size)
    if spec.window is None or not n_tokens:
        return pages
    return pages - first_kept_page(n_tokens, spec.window, page_size)
