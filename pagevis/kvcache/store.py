"""One layer's page store: which token sits in which slot, which pages are in use, the K/V frames — by kind:
float pages (here) or quantized pages (quantized_pages.py) — and the tier it holds: RAM only (ram_tier.py) or a
disk tier under the RAM frames (disk_tier.py, over swap.py's files). store_kinds.py's `make_store` builds the one
a CacheConfig asks for.

RAM storage is laid out (n_kv_heads, frames, page_size, head_dim) rather than pages-first, so that for
each KV head the pool is one contiguous matrix: attention runs on a view of the pool's used prefix with
no gather and no copy (see attention_kernels.py). A page id names a page for its whole life; a "flat slot" is
page * page_size + slot (slots.py), the index every per-token array (positions, policy statistics) uses.
RAM only, page id and RAM frame are the same number; with a disk tier, page ids are disk frames and RAM
frames cache them.

A freed page keeps its K/V only when it is cached (its prefix hash is registered); its positions are emptied
and restored from its logical index on a prefix hit. Quest's key bounds (per KV head and page, the smallest
and largest key) are kept here for the reader.
"""

from __future__ import annotations

import mmap

import numpy as np

from pagevis.kvcache import quant
from pagevis.kvcache.attention_kernels import DECODE_DTYPES, batch_decode_kernels
from pagevis.kvcache.block_pool import BlockPool
from pagevis.kvcache.disk_tier import DiskTier
from pagevis.kvcache.ram_tier import RamTier, TierCounts
from pagevis.kvcache.slots import page_slots
from pagevis.kvcache.swap import SwapFile


def note_peak(store: PageStore) -> None:
    """store.used_peak: at least the pages in use now (BlockPool.n_used, inline: asked for every layer after every
    sequence's step)."""
    pages = store.pages
    used = pages.n_frames - len(pages.empty) - len(pages.cached)
    if used > store.used_peak:
        store.used_peak = used


class PageStore:
    """One layer's pages: positions, fill, the pool of page ids, Quest's bounds, and the tier it holds (`tier`:
    RamTier, or DiskTier with a swap file), which owns the RAM frames' side (which page each frame holds, its
    slots' positions and occupancy bias). Its subclasses give the K/V frames (FloatPages, QuantizedPages)."""

    quantized = False
    kivi = False
    # FloatPages' K and V, (n_kv_heads, frames, page_size, head_dim) each: what attention reads in place, merging
    # and re-rotation rewrite (a quantized store has neither: `frame_kv` decodes its frames)
    k: np.ndarray
    v: np.ndarray
    k_rows: np.ndarray  # FloatPages' K and V as (n_kv_heads, frames * page_size, head_dim) views
    v_rows: np.ndarray

    def __init__(self, config, layer: int, swap: SwapFile | None = None, n_pages: int | None = None):
        """n_pages: page ids (default the config's: RAM frames, or disk frames with a disk tier, whose RAM
        frames stay config.max_pages)."""
        self.layer = layer
        self.page_size = ps = config.page_size
        self.n_pages = n_pages or config.n_page_ids
        self.n_frames = config.max_pages if swap is not None else self.n_pages
        self.home_frames = config.home_frames
        self.n_kv, self.head_dim = config.n_kv_heads, config.head_dim
        self.layout = quant.layout_for(config)
        # a sliding-window layer's float RAM pages: a free page's memory goes back to the system (`give_back`)
        self.gives_back = not self.quantized and swap is None and bool(config.layer_specs[layer].window) and CAN_GIVE_BACK
        self._init_kv(config)
        self.pages = BlockPool(self.n_pages)  # page ids: RAM frames, or disk frames with a disk tier
        self.positions = np.full(self.n_pages * ps, -1, dtype=np.int64)  # flat slot -> position, -1 empty
        self.fill = np.zeros(self.n_pages, dtype=np.int64)  # resident tokens per page
        self.quest = config.select == "quest"
        if self.quest:  # per KV head and page, the smallest and largest key (Quest's bounds), head-major
            self.key_min = np.zeros((config.n_kv_heads, self.n_pages, config.head_dim), np.float32)
            self.key_max = np.zeros_like(self.key_min)
        self.tier: RamTier | DiskTier = RamTier(self) if swap is None else DiskTier(self, swap)
        # float RAM pages whose frames are the page ids, no Quest bounds: the kernels read them in place, and a decode
        # step's token may be written by the attention kernel itself (paged_attention.write_and_attend)
        self.in_place = not self.quantized and swap is None and not self.quest and self.k.dtype in DECODE_DTYPES
        self.reset()

    def reset(self) -> None:
        self.pages.reset()
        self.positions.fill(-1)
        self.fill.fill(0)
        self.used_peak = 0  # pages in use at most between steps (the cache manager notes it after each step)
        self.newest = -1  # the newest position ever written (a report's length)
        self.tier.reset()

    # --- questions -------------------------------------------------------------------------------
    @property
    def n_slots(self) -> int:
        return self.n_pages * self.page_size

    @property
    def resident(self) -> int:
        """Tokens in pages in use (free pages hold none: `release` empties them)."""
        return int(self.fill.sum())

    def occupied(self) -> np.ndarray:
        return self.positions >= 0

    def frame_slot_map(self) -> np.ndarray:
        """(frames, page_size) token position per RAM slot, -1 where empty (a live view)."""
        return self.frame_positions.reshape(self.n_frames, self.page_size)

    def take_counts(self) -> TierCounts:
        return self.tier.take_counts()

    # --- the tier's frames (ram_tier.py, disk_tier.py): what attention and the views read -----------------
    @property
    def tiered(self) -> bool:
        return self.tier.tiered

    @property
    def high_water(self) -> int:
        """1 + highest used RAM (home) frame: attention reads frames [0, high_water)."""
        return self.tier.high_water

    @property
    def bias(self) -> np.ndarray:
        """Per RAM slot: 0 resident, -inf empty."""
        return self.tier.bias

    @property
    def frame_positions(self) -> np.ndarray:
        """Per RAM slot: its token's position, -1 empty."""
        return self.tier.frame_positions

    @property
    def frame_of(self) -> np.ndarray:
        """Per page id: the RAM frame holding it, -1 none."""
        return self.tier.frame_of

    @property
    def page_in(self) -> np.ndarray:
        """Per RAM frame: the page id it holds, -1 none."""
        return self.tier.page_in

    def in_ram(self, pages: np.ndarray) -> np.ndarray:
        return self.tier.in_ram(pages)

    def make_resident(self, page: int, step: int) -> None:
        """With a disk tier, read the page back into a home frame if it is only on disk (to write to it)."""
        self.tier.make_resident(page, step)

    def reserve(self, new_pages: int) -> None:
        """With a disk tier, reserve disk space for the next new_pages pages (RAM only: nothing to do)."""
        self.tier.reserve(new_pages)

    # --- tokens ----------------------------------------------------------------------------------
    def allocate(self, step: int) -> tuple[int, int | None]:
        """A free page (the lowest empty id, else the least recently freed cached one) in a RAM frame, and
        the prefix hash it stood for if it was a cached page (its contents are dropped now)."""
        page, old_hash = self.pages.allocate()
        self._clear(page)
        self._drop_slots(np.arange(page * self.page_size, (page + 1) * self.page_size))  # a reclaimed page's own
        self.tier.take_frame(page, step)
        if self.quest:
            self.key_min[:, page] = np.inf
            self.key_max[:, page] = -np.inf
        return page, old_hash

    def restore(self, page: int, first_position: int) -> None:
        """A cached full page comes back into use (a prefix hit): its tokens are first_position onwards."""
        ps = self.page_size
        self.positions[page_slots(page, ps)] = np.arange(first_position, first_position + ps)
        self.fill[page] = ps
        self.tier.show_restored(page)

    def _clear(self, page: int) -> None:
        self.positions[page_slots(page, self.page_size)] = -1
        self.fill[page] = 0
        self.tier.hide(page)

    def write(self, flat: int, k: np.ndarray, v: np.ndarray, position: int) -> None:
        page, slot = divmod(flat, self.page_size)
        frame = int(self.frame_of[page])
        self._write_kv(flat, frame, slot, k, v)
        self.mark_written(flat, page, frame, slot, position)
        if self.quest:
            np.minimum(self.key_min[:, page], k, out=self.key_min[:, page])
            np.maximum(self.key_max[:, page], k, out=self.key_max[:, page])

    def write_rows(self, flats: np.ndarray, rows: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray,
                   newest: int) -> None:
        """`write` of several tokens at once: row rows[i] of k, v (B, n_kv_heads, head_dim) and positions (B,) into
        flat slot flats[i] (distinct slots), in one numba call; `newest`: the largest of positions[rows] (the caller
        has them as ints). Float RAM pages only (`in_place`: frames are page ids, `k_rows` / `v_rows` the pool; no
        Quest bounds): kvcache/batch_writes.py."""
        batch_decode_kernels().write_rows(self.k_rows, self.v_rows, self.positions, self.fill, self.tier.bias, flats,
                                          rows, k, v, positions, self.page_size)
        self.newest = max(self.newest, newest)

    def mark_written(self, flat: int, page: int, frame: int, slot: int, position: int) -> None:
        """A token's K/V went into slot flat (`write`; the decode kernel, in place: `in_place`)."""
        self.positions[flat] = position
        if position > self.newest:
            self.newest = position
        self.fill[page] += 1
        self.tier.mark_written(page, frame, slot, flat, position)

    def remove(self, flat: int) -> int:
        """Take the token out of a slot (its K/V stays, masked, so the page stays clean); return its
        position."""
        position = int(self.positions[flat])
        if position < 0:
            raise RuntimeError(f"evict of empty slot {flat} in layer {self.layer}")
        page, slot = divmod(flat, self.page_size)
        self.positions[flat] = -1
        self._drop_slots(np.array([flat]))
        tier = self.tier
        for frame in tier.frames_showing(page):
            ram = frame * self.page_size + slot
            tier.frame_positions[ram] = -1
            tier.bias[ram] = -np.inf
        self.fill[page] -= 1
        return position

    def release(self, page: int) -> bool:
        """Drop one block-table reference to the page; when it was the last, the page is free: its tokens
        leave (a cached page keeps its K/V for `restore`, and with a disk tier its disk copy is brought
        up to date) and its RAM frame is free. True when the page became free."""
        if not self.pages.release(page):
            return False
        cached = page in self.pages.frame_hash
        self.tier.free_frames(page, cached)
        self._clear(page)
        if not cached:
            self._drop_slots(np.arange(page * self.page_size, (page + 1) * self.page_size))
            self.give_back(page)
        return True

    def copy_page(self, src: int, dst: int, keep: np.ndarray) -> None:
        """Copy-on-write: the `keep` slots of page src into the freshly allocated page dst."""
        target = self.frame_of[dst]
        self.tier.copy_source(src, target)
        self._copy_slots(src, dst, keep)
        src_slots, dst_slots = page_slots(src, self.page_size), page_slots(dst, self.page_size)
        self.positions[dst_slots] = np.where(keep, self.positions[src_slots], -1)
        self.fill[dst] = int(keep.sum())
        self.tier.show_copy(src, dst, target, keep)
        if self.quest:  # the source's bounds still bound the kept keys
            self.key_min[:, dst] = self.key_min[:, src]
            self.key_max[:, dst] = self.key_max[:, src]

    # --- the K/V frames (FloatPages, QuantizedPages) -----------------------------------------------
    def _init_kv(self, config) -> None:
        raise NotImplementedError

    def kv_arrays(self) -> tuple[np.ndarray, ...]:
        """The arrays that hold every frame's K/V."""
        raise NotImplementedError

    def give_back(self, page: int) -> None:
        """The memory of this free, uncached page's frame back to the system, where the store does (FloatPages)."""

    def frame_blocks(self, frame: int) -> list[np.ndarray]:
        """One RAM frame's arrays in the order the disk lays a page out (a swap file's preadv / pwritev targets)."""
        raise NotImplementedError

    def _write_kv(self, flat: int, frame: int, slot: int, k: np.ndarray, v: np.ndarray) -> None:
        raise NotImplementedError

    def frame_kv(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of RAM frames [lo, hi), each (n_kv, (hi - lo) * page_size, head_dim)."""
        raise NotImplementedError

    def copy_frame(self, src: int, dst: int) -> None:
        """RAM frame src's K/V into RAM frame dst."""
        raise NotImplementedError

    def nbytes(self) -> int:
        """Bytes of K/V storage this layer holds."""
        raise NotImplementedError

    def peak_bytes(self) -> int:
        """`nbytes` with what grows (int4 / int2's key groups and residual rows) counted at its most in use."""
        return self.nbytes()

    def _copy_slots(self, src: int, dst: int, keep: np.ndarray) -> None:
        """What the kind keeps per slot beside the frames, copied with the kept slots."""

    def _drop_slots(self, flats: np.ndarray) -> None:
        """The tokens of these slots are gone (removed, freed uncached, or reclaimed)."""

    def residual_slots(self, flats: np.ndarray) -> np.ndarray:
        """Those of `flats` (occupied slots) whose tokens are in the residual window (float32: int4 / int2)."""
        return flats[:0]

    def group_reach(self, pages: list[int]) -> int:
        """The highest token position any key group of these pages' slots covers (-1 if none: int4 / int2
        only): a page's codes depend on every token of their groups, which may sit in later pages."""
        return -1


class FloatPages(PageStore):
    """float32 / float16 K and V, (n_kv_heads, frames, page_size, head_dim) each: attention reads them in place."""

    def _init_kv(self, config) -> None:
        shape = (config.n_kv_heads, self.n_frames, self.page_size, config.head_dim)
        if self.gives_back:
            (self.k, k_map), (self.v, v_map) = anonymous_zeros(shape, config.dtype), anonymous_zeros(shape, config.dtype)
            self._maps = (k_map, v_map)
        else:
            self.k = np.zeros(shape, dtype=config.dtype)
            self.v = np.zeros(shape, dtype=config.dtype)
        rows = (config.n_kv_heads, self.n_frames * self.page_size, config.head_dim)
        self.k_rows, self.v_rows = self.k.reshape(rows), self.v.reshape(rows)  # the frames' slots as rows (views)

    def kv_arrays(self) -> tuple[np.ndarray, ...]:
        return self.k, self.v

    def frame_blocks(self, frame: int) -> list[np.ndarray]:
        return [self.k[h, frame] for h in range(self.n_kv)] + [self.v[h, frame] for h in range(self.n_kv)]

    def _write_kv(self, flat: int, frame: int, slot: int, k: np.ndarray, v: np.ndarray) -> None:
        self.k[:, frame, slot] = k
        self.v[:, frame, slot] = v

    def frame_kv(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Views of the pool (no copy)."""
        n = (hi - lo) * self.page_size
        return (self.k[:, lo:hi].reshape(self.n_kv, n, self.head_dim),
                self.v[:, lo:hi].reshape(self.n_kv, n, self.head_dim))

    def copy_frame(self, src: int, dst: int) -> None:
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def give_back(self, page: int) -> None:
        """The memory of a free, uncached page's frame back to the system (`gives_back` stores: RAM only, so the page
        is its frame), in the whole OS pages inside the frame of each KV head: it reads as zeros from now on, as a
        fresh frame does, and is taken again page by page when written (a sliding-window layer lets go of a page every
        page_size tokens, and of all but a window's after a long prefill chunk)."""
        if not self.gives_back:
            return
        frame_bytes = self.page_size * self.head_dim * self.k.dtype.itemsize
        for mapping in self._maps:
            for head in range(self.n_kv):
                start = (head * self.n_frames + page) * frame_bytes
                _advise_free(mapping, start, start + frame_bytes)


CAN_GIVE_BACK = all(hasattr(mmap, name) for name in ("MAP_PRIVATE", "MAP_ANONYMOUS", "MADV_DONTNEED"))


def anonymous_zeros(shape: tuple[int, ...], dtype) -> tuple[np.ndarray, mmap.mmap]:
    """Zeros in a private anonymous mapping of their own (and the mapping): page-aligned, taken from the system as they
    are written, in 4 KiB pages (NumPy asks for 2 MiB pages above 4 MiB: one token written to such a store takes
    2 MiB), and given back page by page (`FloatPages.give_back`)."""
    count = int(np.prod(shape))
    mapping = mmap.mmap(-1, max(1, count * np.dtype(dtype).itemsize), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(mapping, dtype, count=count).reshape(shape), mapping


def _advise_free(mapping: mmap.mmap, start: int, end: int) -> None:
    """MADV_DONTNEED on the whole pages of [start, end) of a private anonymous mapping: they read as zeros again."""
    size = mmap.PAGESIZE
    first, last = -(-start // size) * size, end // size * size
    if last > first:
        mapping.madvise(mmap.MADV_DONTNEED, first, last - first)


def heads_first(array: np.ndarray) -> np.ndarray:
    """(frames, n_kv, page_size, ...) -> (n_kv, frames * page_size, ...)."""
    frames, n_kv, ps = array.shape[:3]
    return array.transpose(1, 0, 2, *range(3, array.ndim)).reshape(n_kv, frames * ps, *array.shape[3:])

