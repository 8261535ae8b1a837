"""One layer's page store: the K/V frames in their tiers, which token sits in which slot, which pages
are in use, and which RAM frame holds which page.

RAM storage is laid out (n_kv_heads, frames, page_size, head_dim) rather than pages-first, so that for
each KV head the pool is one contiguous matrix: attention runs on a view of the pool's used prefix with
no gather and no copy (see attention.py). A page id names a page for its whole life; a "flat slot" is
page * page_size + slot, the index every per-token array (positions, policy statistics) uses.

RAM only: page id and RAM frame are the same number. With a disk tier, page ids are disk frames (the
disk holds every page, written when the page first leaves RAM) and RAM frames cache pages: frames
[0, home_frames) keep pages between steps, chosen by least recent read (ties: the older page); frames
[home_frames, max_pages) take disk pages read for one attention call. A page is dirty while its RAM copy
differs from its disk copy; a clean page leaving RAM is not written again.

Quantized dtypes (quant.py) keep each RAM frame as one byte block (codes and per-token scales: what the
disk tier moves); for int4 / int2, each slot's key group and the residual window's float32 K/V are kept
per page id beside the frames, like the positions. Attention reads K/V through `frame_kv`, which
dequantizes the frames asked for (a block at a time: see reader.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import numpy as np

from pagevis.kvcache.block_pool import BlockPool
from pagevis.kvcache import quant
from pagevis.kvcache.events import EventKind
from pagevis.kvcache.swap import SwapFile

SWAP_OUT, FAULT_IN = EventKind.SWAP_OUT, EventKind.FAULT_IN


@dataclass
class TierCounts:
    """What moved between the tiers of one layer (since the counts were last taken)."""

    hits: int = 0  # pages a query read from RAM
    faults: int = 0  # pages read from disk
    swapped_out: int = 0  # pages that left RAM (written if dirty)
    bytes_read: int = 0
    bytes_written: int = 0

    def as_tuple(self) -> tuple[int, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))


COUNT_NAMES = tuple(f.name for f in fields(TierCounts))


class PageStore:
    def __init__(self, config, layer: int, swap: SwapFile | None = None, n_pages: int | None = None):
        """n_pages: page ids (default the config's: RAM frames, or disk frames with a disk tier, whose RAM
        frames stay config.max_pages)."""
        self.layer = layer
        self.page_size = ps = config.page_size
        self.n_pages = n_pages or config.n_page_ids
        self.n_frames = config.max_pages if swap is not None else self.n_pages
        self.home_frames = config.home_frames
        self.swap = swap
        self.tiered = swap is not None
        self.n_kv, self.head_dim = config.n_kv_heads, config.head_dim
        self.layout = quant.layout_for(config)
        self.quantized = self.layout is not None
        self.kivi = self.quantized and self.layout.kivi
        if self.quantized:  # one byte block per frame; named views of its parts, each (frames, ...)
            self.data = np.zeros((self.n_frames, self.layout.page_bytes()), np.uint8)
            self.parts = self.layout.views(self.data)
            self.k = self.v = None
        else:
            shape = (config.n_kv_heads, self.n_frames, ps, config.head_dim)
            self.k = np.zeros(shape, dtype=config.dtype)
            self.v = np.zeros(shape, dtype=config.dtype)
        if self.kivi:
            n_slots = self.n_pages * ps
            self.slot_group = np.full(n_slots, -1, np.int32)  # per page id slot: its key group, -1 none
            self.res_of = np.full(n_slots, -1, np.int64)  # per page id slot: its residual row, -1 none
            self.groups = quant.KeyGroups(self.n_kv, self.head_dim, -(-n_slots // self.layout.group))
            self.residual = quant.ResidualBuffer(self.n_kv, self.head_dim, min(n_slots, self.layout.window()))
        self.pages = BlockPool(self.n_pages)  # page ids: RAM frames, or disk frames with a disk tier
        self.positions = np.full(self.n_pages * ps, -1, dtype=np.int64)  # flat slot -> position, -1 empty
        self.fill = np.zeros(self.n_pages, dtype=np.int64)  # resident tokens per page
        self.quest = config.select == "quest"
        if self.quest:  # per KV head and page, the smallest and largest key (Quest's bounds), head-major
            self.key_min = np.zeros((config.n_kv_heads, self.n_pages, config.head_dim), np.float32)
            self.key_max = np.zeros_like(self.key_min)
        if self.tiered:
            self.home = BlockPool(self.home_frames)
            self.frame_positions = np.full(self.n_frames * ps, -1, dtype=np.int64)  # per RAM slot
            self.bias = np.full(self.n_frames * ps, -np.inf, dtype=np.float32)  # per RAM slot: 0 resident
            self.frame_of = np.full(self.n_pages, -1, dtype=np.int64)  # RAM frame holding the page, -1 none
            self.page_in = np.full(self.n_frames, -1, dtype=np.int64)  # page id in each RAM frame, -1 none
            self.dirty = np.zeros(self.n_pages, dtype=bool)
            self.last_read = np.zeros(self.n_pages, dtype=np.int64)
            self.born = np.zeros(self.n_pages, dtype=np.int64)  # allocation order: older pages first
        else:
            self.frame_positions = self.positions
            self.bias = np.full(self.n_pages * ps, -np.inf, dtype=np.float32)
            self.frame_of = self.page_in = np.arange(self.n_pages, dtype=np.int64)
        self.counts = TierCounts()
        self.on_move = lambda kind, page, frame, detail: None  # the cache turns moves into events
        # each frame's blocks as the disk lays a page out (K of each KV head, then V): preadv/pwritev targets
        if not self.tiered:
            self._frame_buffers = []
        elif self.quantized:
            self._frame_buffers = [[self.data[f]] for f in range(self.n_frames)]
        else:
            self._frame_buffers = [[self.k[h, f] for h in range(self.n_kv)] + [self.v[h, f] for h in
                                   range(self.n_kv)] for f in range(self.n_frames)]
        self.reset()

    def reset(self) -> None:
        self.pages.reset()
        self.positions.fill(-1)
        self.bias.fill(-np.inf)
        self.fill.fill(0)
        self.high_water = 0  # 1 + highest used RAM (home) frame: attention reads frames [0, high_water)
        self.used_peak = 0  # pages in use at most between steps (the cache manager notes it after each step)
        self.newest = -1  # the newest position ever written (a report's length)
        self.counts = TierCounts()
        self._born = 0
        if self.kivi:
            self.slot_group.fill(-1)
            self.res_of.fill(-1)
            self.groups.reset()
            self.residual.reset()
        if self.tiered:
            self.home.reset()
            self.frame_positions.fill(-1)
            self.frame_of.fill(-1)
            self.page_in.fill(-1)
            self.dirty.fill(False)
            self.last_read.fill(0)

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

    def in_ram(self, pages: np.ndarray) -> np.ndarray:
        return self.frame_of[pages] >= 0 if self.tiered else np.ones(len(pages), dtype=bool)

    def take_counts(self) -> TierCounts:
        counts, self.counts = self.counts, TierCounts()
        return counts

    # --- tokens ----------------------------------------------------------------------------------
    def allocate(self, step: int) -> tuple[int, int | None]:
        """A free page (the lowest empty id, else the least recently freed cached one) in a RAM frame, and
        the prefix hash it stood for if it was a cached page (its contents are dropped now)."""
        page, old_hash = self.pages.allocate()
        self._clear(page)
        self._drop_contents(page)  # a reclaimed cached page's key groups and residual rows
        if self.tiered:
            self.dirty[page] = True  # nothing of it is on disk yet
            self.born[page], self._born = self._born, self._born + 1
            self.last_read[page] = step
            self._place(page, self._home_frame(step))
        else:
            self.high_water = max(self.high_water, page + 1)
        if self.quest:
            self.key_min[:, page] = np.inf
            self.key_max[:, page] = -np.inf
        return page, old_hash

    def restore(self, page: int, first_position: int) -> None:
        """A cached full page comes back into use (a prefix hit): its tokens are first_position onwards."""
        ps = self.page_size
        self.positions[page * ps: (page + 1) * ps] = np.arange(first_position, first_position + ps)
        self.fill[page] = ps
        if self.tiered:
            for frame in self._frames_showing(page):
                self._show(page, frame)
        else:
            self.bias[page * ps: (page + 1) * ps] = 0.0
            self.high_water = max(self.high_water, page + 1)

    def make_resident(self, page: int, step: int) -> None:
        """With a disk tier, read the page back into a home frame if it is only on disk (to write to it)."""
        if self.tiered and self.frame_of[page] < 0:
            self._fault_home(page, step)

    def _clear(self, page: int) -> None:
        ps = self.page_size
        self.positions[page * ps: (page + 1) * ps] = -1
        self.fill[page] = 0
        if not self.tiered:
            self.bias[page * ps: (page + 1) * ps] = -np.inf

    def write(self, flat: int, k: np.ndarray, v: np.ndarray, position: int) -> None:
        page, slot = divmod(flat, self.page_size)
        frame = self.frame_of[page]
        if self.kivi:  # into the residual window, in float32: quantized later (seal)
            row = self.residual.take()
            self.residual.k[:, row] = k
            self.residual.v[:, row] = v
            self.res_of[flat] = row
        elif self.quantized:  # int8: a scale per token and KV head
            codes, scale = quant.int8_quantize(np.stack([k, v]))
            self.parts["k"][frame, :, slot], self.parts["v"][frame, :, slot] = codes
            self.parts["k_scale"][frame, :, slot], self.parts["v_scale"][frame, :, slot] = scale
        else:
            self.k[:, frame, slot] = k
            self.v[:, frame, slot] = v
        self.positions[flat] = position
        self.newest = max(self.newest, position)
        self.fill[page] += 1
        if self.tiered:
            self.dirty[page] = True
            ram = frame * self.page_size + slot
            self.frame_positions[ram] = position
            self.bias[ram] = 0.0
        else:
            self.bias[flat] = 0.0
        if self.quest:
            np.minimum(self.key_min[:, page], k, out=self.key_min[:, page])
            np.maximum(self.key_max[:, page], k, out=self.key_max[:, page])

    def remove(self, flat: int) -> int:
        """Take the token out of a slot (its K/V stays, masked, so the page stays clean); return its
        position."""
        position = int(self.positions[flat])
        if position < 0:
            raise RuntimeError(f"evict of empty slot {flat} in layer {self.layer}")
        page, slot = divmod(flat, self.page_size)
        self.positions[flat] = -1
        if self.kivi:
            self._drop_slots(np.array([flat]))
        for frame in self._frames_showing(page):
            ram = frame * self.page_size + slot
            self.frame_positions[ram] = -1
            self.bias[ram] = -np.inf
        self.fill[page] -= 1
        return position

    def release(self, page: int) -> bool:
        """Drop one block-table reference to the page; when it was the last, the page is free: its tokens
        leave (a cached page keeps its K/V for `restore`, and with a disk tier its disk copy is brought
        up to date) and its RAM frame is free. True when the page became free."""
        if not self.pages.release(page):
            return False
        cached = page in self.pages.frame_hash
        if self.tiered:
            for frame in self._frames_showing(page):
                if cached and frame < self.home_frames and self.dirty[page]:
                    self.counts.bytes_written += self.swap.write(page, self._frame_buffers[frame])
                self._unplace(frame)
                if frame < self.home_frames:
                    self.home.release(frame)
            self.dirty[page] = False
            self.high_water = self.home.high_water()
        else:
            self.high_water = self.pages.high_water()
        self._clear(page)
        if not cached:
            self._drop_contents(page)
        return True

    def copy_page(self, src: int, dst: int, keep: np.ndarray) -> None:
        """Copy-on-write: the `keep` slots of page src into the freshly allocated page dst."""
        ps = self.page_size
        target = self.frame_of[dst]
        if self.tiered and self.frame_of[src] < 0:  # the source is only on disk: read it into dst's frame
            self.counts.bytes_read += self.swap.read(src, self._frame_buffers[target])
        else:
            self._copy_frame(self.frame_of[src], target)
        src_slots, dst_slots = slice(src * ps, (src + 1) * ps), slice(dst * ps, (dst + 1) * ps)
        if self.kivi:  # the kept slots share the source's key groups and get residual rows of their own
            groups = np.where(keep, self.slot_group[src_slots], -1)
            self.slot_group[dst_slots] = groups
            self.groups.share(groups)
            for offset in np.flatnonzero(keep & (self.res_of[src_slots] >= 0)).tolist():
                row, old = self.residual.take(), self.res_of[src * ps + offset]
                self.residual.k[:, row], self.residual.v[:, row] = self.residual.k[:, old], self.residual.v[:, old]
                self.res_of[dst * ps + offset] = row
        self.positions[dst_slots] = np.where(keep, self.positions[src_slots], -1)
        self.fill[dst] = int(keep.sum())
        if self.tiered:
            self._show(dst, target)
        else:
            self.bias[dst_slots] = np.where(keep, self.bias[src_slots], -np.inf)
        if self.quest:  # the source's bounds still bound the kept keys
            self.key_min[:, dst] = self.key_min[:, src]
            self.key_max[:, dst] = self.key_max[:, src]

    # --- quantized storage -----------------------------------------------------------------------
    def frame_kv(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of RAM frames [lo, hi), each (n_kv, (hi - lo) * page_size, head_dim): views of
        the pool for float32 / float16, float32 dequantized for a quantized dtype (the residual window's
        slots exactly as written)."""
        n = (hi - lo) * self.page_size
        if not self.quantized:
            return (self.k[:, lo:hi].reshape(self.n_kv, n, self.head_dim),
                    self.v[:, lo:hi].reshape(self.n_kv, n, self.head_dim))
        return self._dequantize({name: part[lo:hi] for name, part in self.parts.items()}, self.page_in[lo:hi])

    def peek_page(self, page: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values (n_kv, page_size, head_dim) float32 of one page as attention would read them,
        from its RAM frame or else straight from the disk (nothing moves, nothing is counted)."""
        frame = int(self.frame_of[page])
        if frame >= 0:
            keys, values = self.frame_kv(frame, frame + 1)
            return keys.astype(np.float32), values.astype(np.float32)
        block = np.frombuffer(os.pread(self.swap.fd, self.swap.page_bytes, page * self.swap.page_bytes), np.uint8)
        if not self.quantized:
            kv = block.view(self.k.dtype).reshape(2, self.n_kv, self.page_size, self.head_dim)
            return kv[0].astype(np.float32), kv[1].astype(np.float32)
        return self._dequantize(self.layout.views(block[None].copy()), np.array([page]))

    def _dequantize(self, parts: dict[str, np.ndarray], pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """float32 K and V (n_kv, frames * page_size, head_dim) of pages laid out as `parts` (each (frames,
        ...)) holding `pages` (-1: no page)."""
        layout, ps = self.layout, self.page_size
        if not self.kivi:
            return (_heads_first(quant.int8_dequantize(parts["k"], parts["k_scale"])),
                    _heads_first(quant.int8_dequantize(parts["v"], parts["v_scale"])))
        flat = np.where(pages[:, None] >= 0, pages[:, None] * ps + np.arange(ps), -1).ravel()
        held = flat >= 0
        groups = np.where(held, self.slot_group[np.maximum(flat, 0)], -1)
        codes = _heads_first(quant.unpack(parts["k"], layout.bits, self.head_dim))
        safe = np.maximum(groups, 0)  # slots of no group (empty, or in the window) are masked or replaced
        keys = quant.asym_dequantize(codes, np.take(self.groups.scale, safe, axis=1),
                                     np.take(self.groups.zero, safe, axis=1))
        values = _heads_first(quant.dequantize_values(quant.unpack(parts["v"], layout.bits, self.head_dim),
                                                      parts["v_scale"], parts["v_zero"]))
        rows = np.where(held, self.res_of[np.maximum(flat, 0)], -1)
        window = np.flatnonzero(rows >= 0)
        if window.size:
            keys[:, window] = self.residual.k[:, rows[window]]
            values[:, window] = self.residual.v[:, rows[window]]
        return keys, values

    def residual_slots(self, flats: np.ndarray) -> np.ndarray:
        """Those of `flats` (occupied slots) whose tokens are in the residual window (float32)."""
        if not self.kivi:
            return flats[:0]
        return flats[(self.res_of[flats] >= 0) & (self.positions[flats] >= 0)]

    def seal(self, flats: np.ndarray, step: int) -> int:
        """Quantize the tokens of residual slots `flats` (a sequence's oldest, in pages only it uses): their
        keys as one key group (a scale and zero point per KV head and channel over them), their values per
        token. Returns the key group. Their pages come into RAM if they are on disk (they change)."""
        rows = self.res_of[flats]
        bits, ps = self.layout.bits, self.page_size
        codes, scale, zero = quant.quantize_key_group(self.residual.k[:, rows], bits)
        group = self.groups.add(scale, zero, end=int(self.positions[flats].max()), refs=len(flats))
        v_codes, v_scale, v_zero = quant.quantize_values(self.residual.v[:, rows], bits)
        k_packed, v_packed = quant.pack(codes, bits), quant.pack(v_codes, bits)
        pages, slots = np.divmod(flats, ps)
        for page in np.unique(pages).tolist():
            self.make_resident(page, step)
            if self.tiered:
                self.dirty[page] = True
            mine = pages == page
            frame, at = self.frame_of[page], slots[mine]
            p = self.parts
            p["k"][frame, :, at] = k_packed[:, mine].transpose(1, 0, 2)
            p["v"][frame, :, at] = v_packed[:, mine].transpose(1, 0, 2)
            p["v_scale"][frame, :, at] = v_scale[:, mine].transpose(1, 0, 2)
            p["v_zero"][frame, :, at] = v_zero[:, mine].transpose(1, 0, 2)
        self.slot_group[flats] = group
        self.residual.free(rows)
        self.res_of[flats] = -1
        return group

    def group_reach(self, pages: list[int]) -> int:
        """The highest token position any key group of these pages' slots covers (-1 if none): a page's
        codes depend on every token of their groups, which may sit in later pages."""
        if not self.kivi or not pages:
            return -1
        flats = (np.asarray(pages)[:, None] * self.page_size + np.arange(self.page_size)).ravel()
        groups = self.slot_group[flats]
        groups = groups[groups >= 0]
        return int(self.groups.end[groups].max()) if groups.size else -1

    def nbytes(self) -> int:
        """Bytes of K/V storage this layer holds: the frames, and for int4 / int2 each slot's key group,
        the key groups' table and the residual window's rows, as allocated now."""
        if not self.quantized:
            return self.k.nbytes + self.v.nbytes
        total = self.data.nbytes
        if self.kivi:
            total += self.slot_group.nbytes + self.groups.nbytes() + self.residual.nbytes()
        return total

    def peak_bytes(self) -> int:
        """`nbytes` with the key groups and residual rows counted at the most in use at once (not as
        allocated, which grows by doubling)."""
        if not self.kivi:
            return self.nbytes()
        return (self.data.nbytes + self.slot_group.nbytes + self.groups.nbytes(self.groups.peak)
                + self.residual.nbytes(self.residual.peak))

    def _copy_frame(self, src: int, dst: int) -> None:
        if self.quantized:
            self.data[dst] = self.data[src]
        else:
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]

    def _drop_contents(self, page: int) -> None:
        """The page's contents are gone (freed uncached, or reclaimed): release its slots' key groups and
        residual rows."""
        if self.kivi:
            self._drop_slots(np.arange(page * self.page_size, (page + 1) * self.page_size))

    def _drop_slots(self, flats: np.ndarray) -> None:
        self.groups.release(self.slot_group[flats])
        self.slot_group[flats] = -1
        self.residual.free(self.res_of[flats])
        self.res_of[flats] = -1

    # --- tiers -----------------------------------------------------------------------------------
    def reserve(self, new_pages: int) -> None:
        """Reserve disk space for the next new_pages pages `allocate` can hand out (before a step changes
        anything: a full disk fails here, not half-way)."""
        if not self.tiered:
            return
        ids = self.pages.peek_free(new_pages)
        needed = max([self.pages.high_water(), *(i + 1 for i in ids)])
        if needed > self.swap.reserved:
            self.swap.reserve(min(self.n_pages, needed + 16))

    def clear_read_frames(self) -> None:
        ps, first = self.page_size, self.home_frames
        self.page_in[first:] = -1
        self.frame_positions[first * ps:] = -1
        self.bias[first * ps:] = -np.inf

    def load(self, pages: np.ndarray, step: int, announce: bool) -> None:
        """Read disk pages (ascending ids) into the read frames, in order (as many as there are read
        frames). With `announce`, each read is a fault_in event (quest: a few pages a step); exact reads of
        every disk page every step are only counted."""
        ps, first, n = self.page_size, self.home_frames, len(pages)
        self.page_in[first: first + n] = pages
        held = self.positions.reshape(self.n_pages, ps)[pages].ravel()
        self.frame_positions[first * ps: (first + n) * ps] = held
        self.bias[first * ps: (first + n) * ps] = np.where(held >= 0, np.float32(0), np.float32(-np.inf))
        breaks = np.flatnonzero(np.diff(pages) != 1) + 1
        for start, end in zip(np.r_[0, breaks], np.r_[breaks, n], strict=True):  # one call per run of ids
            blocks = [b for frame in range(first + start, first + end) for b in self._frame_buffers[frame]]
            self.counts.bytes_read += self.swap.read(int(pages[start]), blocks)
        self.counts.faults += n
        self.last_read[pages] = step
        if announce:
            for i, page in enumerate(pages.tolist()):
                self.on_move(FAULT_IN, page, first + i, "read for attention")

    def promote(self, frame: int, step: int) -> bool:
        """Keep a page just read into a read frame in a home frame, if a home page was not read this
        step (else leave it on disk). No disk I/O beyond swapping out a dirty victim."""
        page = self.page_in[frame]
        if not self.home.can_allocate():
            victim = self._least_recent(before=step)
            if victim < 0:
                return False
            self._swap_out(victim)
        home, _ = self.home.allocate()
        self._copy_frame(frame, home)
        self._unplace(frame)
        self._place(page, home)
        self.high_water = self.home.high_water()
        return True

    def _home_frame(self, step: int) -> int:
        """A free home frame, swapping out the least recently read page if there is none."""
        if not self.home.can_allocate():
            self._swap_out(self._least_recent())
        frame, _ = self.home.allocate()
        self.high_water = self.home.high_water()
        return frame

    def _least_recent(self, before: int | None = None) -> int:
        """The home frame whose page was read least recently (ties: the older page); -1 if none
        qualifies (with `before`, only pages last read before that step)."""
        pages = self.page_in[: self.home_frames]
        frames = np.flatnonzero(pages >= 0)
        if before is not None:
            frames = frames[self.last_read[pages[frames]] < before]
        if not frames.size:
            return -1
        order = np.lexsort((self.born[pages[frames]], self.last_read[pages[frames]]))
        return int(frames[order[0]])

    def _swap_out(self, frame: int) -> None:
        page = int(self.page_in[frame])
        if self.dirty[page]:
            self.counts.bytes_written += self.swap.write(page, self._frame_buffers[frame])
            self.dirty[page] = False
            detail = "written"
        else:
            detail = "clean: not rewritten"
        self.counts.swapped_out += 1
        self.on_move(SWAP_OUT, page, frame, detail)
        self._unplace(frame)
        self.home.release(frame)

    def _fault_home(self, page: int, step: int) -> None:
        """Read a disk page back into a home frame (to write into one of its empty slots)."""
        frame = self._home_frame(step)
        self.counts.bytes_read += self.swap.read(page, self._frame_buffers[frame])
        self.counts.faults += 1
        self.last_read[page] = step
        self._place(page, frame)
        self.on_move(FAULT_IN, page, frame, "to take a new token")

    def _frames_showing(self, page: int) -> list[int]:
        """RAM frames holding a copy of the page: its home frame and any read frame it was read into."""
        if not self.tiered:
            return [page]
        return [int(f) for f in np.flatnonzero(self.page_in == page)]

    def _place(self, page: int, frame: int) -> None:
        for stale in self._frames_showing(page):  # a read frame's copy: the home copy replaces it
            self._unplace(stale)
        self.page_in[frame] = page
        self.frame_of[page] = frame
        self._show(page, frame)

    def _show(self, page: int, frame: int) -> None:
        ps = self.page_size
        held = self.positions[page * ps: (page + 1) * ps]
        self.frame_positions[frame * ps: (frame + 1) * ps] = held
        self.bias[frame * ps: (frame + 1) * ps] = np.where(held >= 0, 0, -np.inf)

    def _unplace(self, frame: int) -> None:
        page = self.page_in[frame]
        if page >= 0 and self.frame_of[page] == frame:
            self.frame_of[page] = -1
        self.page_in[frame] = -1
        ps = self.page_size
        self.frame_positions[frame * ps: (frame + 1) * ps] = -1
        self.bias[frame * ps: (frame + 1) * ps] = -np.inf


def _heads_first(array: np.ndarray) -> np.ndarray:
    """(frames, n_kv, page_size, ...) -> (n_kv, frames * page_size, ...)."""
    frames, n_kv, ps = array.shape[:3]
    return array.transpose(1, 0, 2, *range(3, array.ndim)).reshape(n_kv, frames * ps, *array.shape[3:])
