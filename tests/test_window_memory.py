"""What a sliding-window (local) layer holds in memory: after a prefill chunk far longer than its window, the
pages below the window leave as soon as the chunk has attended (SLIDE and RELEASE events), the memory of their
frames goes back to the system (mincore: the kernel's count of the store's pages in memory), and
a prefix hit of the same prompt still finds what its local layers read."""

import ctypes
import mmap
import sys

import numpy as np
import pytest

from pagevis.kvcache import CacheConfig, EventKind, KVCacheManager
from pagevis.kvcache.layer_spec import first_kept_page
from pagevis.kvcache.store import CAN_GIVE_BACK

W, PS, D, N = 64, 16, 64, 2048  # one KV head of 64 floats: a page of 16 tokens is one 4 KiB OS page of K, one of V
PAGE_BYTES = PS * D * 4


def config(**settings) -> CacheConfig:
    base = dict(page_size=PS, max_pages=N // PS + 2, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=D, policy="none",
                sliding_windows=(W, None))
    return CacheConfig(**{**base, **settings})


def resident_bytes(array: np.ndarray) -> int:
    """Bytes of the OS pages under the array that are in memory (mincore: the kernel's own count, page by page)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
    size = mmap.PAGESIZE
    start = array.ctypes.data // size * size
    pages = -(-(array.ctypes.data + array.nbytes - start) // size)
    vector = (ctypes.c_ubyte * pages)()
    assert libc.mincore(start, pages * size, vector) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vector) * size


def prefill(cache: KVCacheManager, n: int, seed: int = 0) -> list:
    """One chunk of n tokens through every layer as the engine feeds it (append, attend), then the commit; its events."""
    rng = np.random.default_rng(seed)
    cache.extend(0, list(range(1000, 1000 + n)))
    positions = np.arange(n)
    for layer in range(2):
        kv = rng.standard_normal((n, 1, D)).astype(np.float32)
        q = rng.standard_normal((n, 2, D)).astype(np.float32)
        cache.append(0, layer, kv, kv, positions)
        cache.attend(0, layer, q, positions, all_weights=False)
    cache.commit(0)
    return list(cache.log.events)


@pytest.mark.skipif(not sys.platform.startswith("linux") or not CAN_GIVE_BACK, reason="Linux's mincore")
def test_a_long_chunk_leaves_a_local_layer_one_window_in_memory_and_a_global_one_whole():
    cache = KVCacheManager.single(config(), prefix_caching=True)
    events = prefill(cache, N)
    local, whole = cache.stores
    held = cache.block_table(0, 0)
    kept = first_kept_page(N, W, PS)
    assert [local.positions[p * PS] for p in held] == list(range(kept * PS, N, PS))  # the window's pages only
    slid = sorted(e.page for e in events if e.kind is EventKind.SLIDE and e.layer == 0)
    assert len(slid) == kept and set(slid).isdisjoint(held)
    released = {e.page for e in events if e.kind is EventKind.RELEASE and e.layer == 0}
    assert set(slid) <= released  # each page that left is said to be free
    # every page but the window's and the one below it (which the commit registered) left before the commit: no
    # prefix hash names them, and their memory is the system's again: what the layer holds is a window's pages
    for array in (local.k, local.v):
        assert resident_bytes(array) == (len(held) + 1) * PAGE_BYTES
    assert resident_bytes(whole.k) >= N // PS * PAGE_BYTES  # the global layer keeps every token
    assert set(local.pages.cached_free()) == {slid[-1]}
    assert not local.k[:, slid[:-1]].any() and not local.v[:, slid[:-1]].any()  # (as fresh frames read)

    cache.free(0)  # a prefix hit of the same prompt: the local layer finds its last window
    cache.add_sequence(1)
    hit = cache.match_prefix(1, list(range(1000, 1000 + N)))
    assert hit == (N - 1) // PS * PS


def test_a_store_with_a_disk_tier_or_quantized_pages_keeps_its_frames():
    """Only float RAM pages give memory back (a disk tier's frames cache pages on disk; quantized pages differ)."""
    for settings in ({"dtype": "int8"}, {"disk_pages": N // PS + 2, "max_pages": 8}):
        store = KVCacheManager.single(config(**settings)).stores[0]
        assert not store.gives_back
    assert KVCacheManager.single(config()).stores[0].gives_back == CAN_GIVE_BACK
    assert not KVCacheManager.single(config()).stores[1].gives_back  # a global layer
    taken = KVCacheManager.single(config())
    taken.take_memory()  # a server's pool: its memory taken once and kept (flat resident size)
    assert not any(store.gives_back for store in taken.stores)
