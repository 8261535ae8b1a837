"""K/V bytes by layer type: what a hybrid cache's local and global layers hold, beside what the same cache
would hold with no sliding window (every layer global) at the same length.

The stand-in for "without windows" is a global layer's own page count (it holds what a layer without a window
holds, under the same policy and sharing); with no global layer, the pages of `n_tokens` tokens. Reports call
`hybrid_bytes` with pages per layer (a pool's pages in use, a record's block tables) or `modelled_bytes` with
a length (docs, the compare header).
"""

from __future__ import annotations

from typing import NamedTuple

from pagevis.kvcache.layer_spec import FullAttentionSpec, LayerSpec, pages_held


class HybridBytes(NamedTuple):
    local: int  # bytes the local (sliding-window) layers hold
    global_: int  # bytes the global layers hold
    full: int  # bytes every layer would hold without windows
    n_local: int  # layers of each kind
    n_global: int

    @property
    def hybrid(self) -> int:
        return self.local + self.global_

    def as_dict(self) -> dict[str, int]:
        """For JSON reports (Prometheus-style base units: bytes)."""
        return {"kv_bytes_local": self.local, "kv_bytes_global": self.global_, "kv_bytes_hybrid": self.hybrid,
                "kv_bytes_without_windows": self.full, "local_layers": self.n_local, "global_layers": self.n_global}

    def text(self) -> str:
        """One line, e.g. 'hybrid K/V 19.5 MiB (15 local 7.5 + 3 global 12.0) vs 72.0 MiB without windows'."""
        mib = self.full >= 1 << 20  # one unit for the line: MiB, or KiB for a small cache
        return (f"hybrid K/V {_size(self.hybrid, mib=mib)} ({self.n_local} local {_size(self.local, False, mib)} + "
                f"{self.n_global} global {_size(self.global_, False, mib)}) vs {_size(self.full, mib=mib)} without "
                "windows")


def hybrid_bytes(specs: tuple[LayerSpec, ...], pages: list[int], page_bytes: int, n_tokens: int,
                 page_size: int) -> HybridBytes:
    """Bytes by layer type for `pages` pages in use per layer; n_tokens (the longest sequence's length) stands
    in for a global layer when there is none."""
    local = [n for spec, n in zip(specs, pages, strict=True) if spec.window]
    global_ = [n for spec, n in zip(specs, pages, strict=True) if not spec.window]
    per_layer = max(global_) if global_ else pages_held(FullAttentionSpec(), n_tokens, page_size)
    return HybridBytes(sum(local) * page_bytes, sum(global_) * page_bytes, len(specs) * per_layer * page_bytes,
                       len(local), len(global_))


def modelled_bytes(config, n_tokens: int) -> HybridBytes:
    """What one sequence of n_tokens tokens holds between steps in a cache of this config, nothing evicted."""
    specs, page_size = config.layer_specs, config.page_size
    return hybrid_bytes(specs, [pages_held(spec, n_tokens, page_size) for spec in specs], config.page_bytes(),
                        n_tokens, page_size)


def peak_bytes(config, stores) -> HybridBytes:
    """A cache's pages in use at most between steps (every sequence's; shared pages once), by layer type."""
    newest = max(store.newest for store in stores)
    return hybrid_bytes(config.layer_specs, [store.used_peak for store in stores], config.page_bytes(),
                        newest + 1, config.page_size)


def _size(n: int, unit: bool = True, mib: bool = True) -> str:
    return (f"{n / (1 << 20):.1f}" if mib else f"{n / 1024:.0f}") + ((" MiB" if mib else " KiB") if unit else "")
