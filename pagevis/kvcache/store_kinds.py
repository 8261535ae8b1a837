"""Which store a layer gets: its pages' kind (float, or quantized: quant.py) and its tier (RAM, or a disk tier
under RAM frames), one class each, chosen from the CacheConfig."""

from __future__ import annotations

from pagevis.kvcache import quant
from pagevis.kvcache.disk_tier import DiskTier
from pagevis.kvcache.quantized_pages import QuantizedPages
from pagevis.kvcache.store import FloatPages, PageStore
from pagevis.kvcache.swap import SwapFile


class TieredFloatPages(DiskTier, FloatPages):
    """float32 / float16 pages on disk, cached in RAM frames."""


class TieredQuantizedPages(DiskTier, QuantizedPages):
    """Quantized pages on disk (their byte blocks), cached in RAM frames."""


STORES: dict[tuple[bool, bool], type[PageStore]] = {  # (quantized, disk tier) -> the store
    (False, False): FloatPages, (True, False): QuantizedPages,
    (False, True): TieredFloatPages, (True, True): TieredQuantizedPages,
}


def make_store(config, layer: int, swap: SwapFile | None = None, n_pages: int | None = None) -> PageStore:
    """The store of one layer of a CacheConfig (with `swap`, its disk tier's file); n_pages: its page ids."""
    return STORES[quant.is_quantized(config.dtype), swap is not None](config, layer, swap, n_pages)
