"""The disk tier: a store's tier (ram_tier.py says what a tier keeps) when its layer has a swap file. Page ids
are disk frames (the swap file, swap.py, holds every page, written when the page first leaves RAM) and RAM
frames cache pages.

Frames [0, home_frames) keep pages between steps, chosen by least recent read (ties: the older page); frames
[home_frames, max_pages) take disk pages read for one attention call (`load`, by the reader). A page is dirty
while its RAM copy differs from its disk copy; a clean page leaving RAM is not written again. Every move is
counted (`counts`) and told to `on_move` (the cache turns it into a swap_out or fault_in event).
"""

from __future__ import annotations

import numpy as np

from pagevis.kvcache.block_pool import BlockPool
from pagevis.kvcache.events import EventKind
from pagevis.kvcache.ram_tier import MoveListener, TierCounts, TierStore, ignore_move
from pagevis.kvcache.slots import page_slots
from pagevis.kvcache.swap import SwapFile

SWAP_OUT, FAULT_IN = EventKind.SWAP_OUT, EventKind.FAULT_IN


class DiskTier:
    """A store's pages on disk, cached in its RAM frames (the store's K/V arrays, float or quantized)."""

    tiered = True

    def __init__(self, store: TierStore, swap: SwapFile):
        self.store = store  # its positions, page pool and frames (frame_blocks, copy_frame)
        self.swap = swap
        self.page_size = ps = store.page_size
        self.home_frames, n_frames, n_pages = store.home_frames, store.n_frames, store.n_pages
        self.home = BlockPool(self.home_frames)
        self.frame_positions = np.full(n_frames * ps, -1, dtype=np.int64)  # per RAM slot
        self.bias = np.full(n_frames * ps, -np.inf, dtype=np.float32)  # per RAM slot: 0 resident
        self.frame_of = np.full(n_pages, -1, dtype=np.int64)  # RAM frame holding the page, -1 none
        self.page_in = np.full(n_frames, -1, dtype=np.int64)  # page id in each RAM frame, -1 none
        self.dirty = np.zeros(n_pages, dtype=bool)
        self.last_read = np.zeros(n_pages, dtype=np.int64)
        self.born = np.zeros(n_pages, dtype=np.int64)  # allocation order: older pages first
        # each frame's blocks as the disk lays a page out: preadv / pwritev targets
        self._frame_buffers = [store.frame_blocks(f) for f in range(n_frames)]
        self.high_water = 0  # 1 + highest used home frame: attention reads frames [0, high_water)
        self.counts = TierCounts()
        self.on_move: MoveListener = ignore_move  # the cache turns moves into events
        self._born = 0

    def reset(self) -> None:
        self.high_water = 0
        self.counts = TierCounts()
        self._born = 0
        self.home.reset()
        self.frame_positions.fill(-1)
        self.bias.fill(-np.inf)
        self.frame_of.fill(-1)
        self.page_in.fill(-1)
        self.dirty.fill(False)
        self.last_read.fill(0)

    def take_counts(self) -> TierCounts:
        counts, self.counts = self.counts, TierCounts()
        return counts

    # --- the tier's side of the store's changes -----------------------------------------------------
    def in_ram(self, pages: np.ndarray) -> np.ndarray:
        return self.frame_of[pages] >= 0

    def take_frame(self, page: int, step: int) -> None:
        self.dirty[page] = True  # nothing of it is on disk yet
        self.born[page], self._born = self._born, self._born + 1
        self.last_read[page] = step
        self._place(page, self._home_frame(step))

    def show_restored(self, page: int) -> None:
        for frame in self.frames_showing(page):
            self._show(page, frame)

    def make_resident(self, page: int, step: int) -> None:
        if self.frame_of[page] < 0:
            self._fault_home(page, step)

    def hide(self, page: int) -> None:
        pass  # the page's RAM slots were emptied as it left its frames

    def mark_written(self, page: int, frame: int, slot: int, flat: int, position: int) -> None:
        self.dirty[page] = True
        ram = frame * self.page_size + slot
        self.frame_positions[ram] = position
        self.bias[ram] = 0.0

    def changed(self, page: int) -> None:
        self.dirty[page] = True

    def free_frames(self, page: int, cached: bool) -> None:
        """A cached page's disk copy is brought up to date; its RAM frames are freed."""
        for frame in self.frames_showing(page):
            if cached and frame < self.home_frames and self.dirty[page]:
                self.counts.bytes_written += self.swap.write(page, self._frame_buffers[frame])
            self._unplace(frame)
            if frame < self.home_frames:
                self.home.release(frame)
        self.dirty[page] = False
        self.high_water = self.home.high_water()

    def copy_source(self, src: int, target: int) -> None:
        if self.frame_of[src] < 0:  # the source is only on disk: read it into the target's frame
            self.counts.bytes_read += self.swap.read(src, self._frame_buffers[target])
        else:
            self.store.copy_frame(self.frame_of[src], target)

    def show_copy(self, src: int, dst: int, target: int, keep: np.ndarray) -> None:
        self._show(dst, target)

    def frames_showing(self, page: int) -> list[int]:
        """RAM frames holding a copy of the page: its home frame and any read frame it was read into."""
        return [int(f) for f in np.flatnonzero(self.page_in == page)]

    def reserve(self, new_pages: int) -> None:
        """Reserve disk space for the next new_pages pages `allocate` can hand out (before a step changes
        anything: a full disk fails here, not half-way)."""
        ids = self.store.pages.peek_free(new_pages)
        needed = max([self.store.pages.high_water(), *(i + 1 for i in ids)])
        if needed > self.swap.reserved:
            self.swap.reserve(min(self.store.n_pages, needed + 16))

    # --- reads for attention (reader.py) -----------------------------------------------------------
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
        held = self.store.positions.reshape(self.store.n_pages, ps)[pages].ravel()
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
        self.store.copy_frame(frame, home)
        self._unplace(frame)
        self._place(page, home)
        self.high_water = self.home.high_water()
        return True

    # --- frames ------------------------------------------------------------------------------------
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

    def _place(self, page: int, frame: int) -> None:
        for stale in self.frames_showing(page):  # a read frame's copy: the home copy replaces it
            self._unplace(stale)
        self.page_in[frame] = page
        self.frame_of[page] = frame
        self._show(page, frame)

    def _show(self, page: int, frame: int) -> None:
        held = self.store.positions[page_slots(page, self.page_size)]
        self.frame_positions[page_slots(frame, self.page_size)] = held
        self.bias[page_slots(frame, self.page_size)] = np.where(held >= 0, 0, -np.inf)

    def _unplace(self, frame: int) -> None:
        page = self.page_in[frame]
        if page >= 0 and self.frame_of[page] == frame:
            self.frame_of[page] = -1
        self.page_in[frame] = -1
        self.frame_positions[page_slots(frame, self.page_size)] = -1
        self.bias[page_slots(frame, self.page_size)] = -np.inf
