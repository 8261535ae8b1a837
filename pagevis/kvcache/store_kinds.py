"""Which store a layer gets: its pages' kind (float, or quantized: quant.py), a class each, chosen from the
CacheConfig's dtype; and its tier, an object the store holds: RAM only, or with the layer's swap file a disk tier
under the RAM frames (ram_tier.py, disk_tier.py)."""

from __future__ import annotations

from pagevis.kvcache import quant
from pagevis.kvcache.quantized_pages import QuantizedPages
from pagevis.kvcache.store import FloatPages, PageStore
from pagevis.kvcache.swap import SwapFile


def make_store(config, layer: int, swap: SwapFile | None = None, n_pages: int | None = None) -> PageStore:
    """The store of one layer of a CacheConfig (with `swap`, its disk tier's file); n_pages: its page ids."""
    kind = QuantizedPages if quant.is_quantized(config.dtype) else FloatPages
    return kind(config, layer, swap, n_pages)
