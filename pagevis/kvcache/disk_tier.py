"""The disk tier: page ids are disk frames (the swap file, swap.py, holds every page, written when the page first
leaves RAM) and RAM frames cache pages.

Frames [0, home_frames) keep pages between steps, chosen by least recent read (ties: the older page); frames
[home_frames, max_pages) take disk pages read for one attention call (`load`, by the reader). A page is dirty
while its RAM copy differs from its disk copy; a clean page leaving RAM is not written again. Every move is
counted (`counts`) and told to `on_move` (the cache turns it into a swap_out or fault_in event).
"""

from __future__ import annotations

import numpy as np

from pagevis.kvcache.block_pool import BlockPool
from pagevis.kvcache.events import EventKind
from pagevis.kvcache.slots import page_slots
from pagevis.kvcache.store import PageStore
from pagevis.kvcache.swap import SwapFile

SWAP_OUT, FAULT_IN = EventKind.SWAP_OUT, EventKind.FAULT_IN


class DiskTier(PageStore):
    """A PageStore whose pages live on disk and are cached in RAM frames (mixed with float or quantized pages)."""

    tiered = True
    swap: SwapFile  # always one: the store is made with its layer's swap file

    def _init_frames(self) -> None:
        ps = self.page_size
        self.home = BlockPool(self.home_frames)
        self.frame_positions = np.full(self.n_frames * ps, -1, dtype=np.int64)  # per RAM slot
        self.bias = np.full(self.n_frames * ps, -np.inf, dtype=np.float32)  # per RAM slot: 0 resident
        self.frame_of = np.full(self.n_pages, -1, dtype=np.int64)  # RAM frame holding the page, -1 none
        self.page_in = np.full(self.n_frames, -1, dtype=np.int64)  # page id in each RAM frame, -1 none
        self.dirty = np.zeros(self.n_pages, dtype=bool)
        self.last_read = np.zeros(self.n_pages, dtype=np.int64)
        self.born = np.zeros(self.n_pages, dtype=np.int64)  # allocation order: older pages first
        # each frame's blocks as the disk lays a page out: preadv / pwritev targets
        self._frame_buffers = [self.frame_blocks(f) for f in range(self.n_frames)]

    def reset(self) -> None:
        super().reset()
        self._born = 0
        self.home.reset()
        self.frame_positions.fill(-1)
        self.frame_of.fill(-1)
        self.page_in.fill(-1)
        self.dirty.fill(False)
        self.last_read.fill(0)

    # --- the tier's side of PageStore's changes ------------------------------------------------------
    def in_ram(self, pages: np.ndarray) -> np.ndarray:
        return self.frame_of[pages] >= 0

    def _take_frame(self, page: int, step: int) -> None:
        self.dirty[page] = True  # nothing of it is on disk yet
        self.born[page], self._born = self._born, self._born + 1
        self.last_read[page] = step
        self._place(page, self._home_frame(step))

    def _show_restored(self, page: int) -> None:
        for frame in self._frames_showing(page):
            self._show(page, frame)

    def make_resident(self, page: int, step: int) -> None:
        if self.frame_of[page] < 0:
            self._fault_home(page, step)

    def _hide(self, page: int) -> None:
        pass  # the page's RAM slots were emptied as it left its frames

    def _mark_written(self, page: int, frame: int, slot: int, flat: int, position: int) -> None:
        self.dirty[page] = True
        ram = frame * self.page_size + slot
        self.frame_positions[ram] = position
        self.bias[ram] = 0.0

    def _changed(self, page: int) -> None:
        self.dirty[page] = True

    def _free_frames(self, page: int, cached: bool) -> None:
        """A cached page's disk copy is brought up to date; its RAM frames are freed."""
        for frame in self._frames_showing(page):
            if cached and frame < self.home_frames and self.dirty[page]:
                self.counts.bytes_written += self.swap.write(page, self._frame_buffers[frame])
            self._unplace(frame)
            if frame < self.home_frames:
                self.home.release(frame)
        self.dirty[page] = False
        self.high_water = self.home.high_water()

    def _copy_source(self, src: int, target: int) -> None:
        if self.frame_of[src] < 0:  # the source is only on disk: read it into the target's frame
            self.counts.bytes_read += self.swap.read(src, self._frame_buffers[target])
        else:
            self._copy_frame(self.frame_of[src], target)

    def _show_copy(self, src: int, dst: int, target: int, keep: np.ndarray) -> None:
        self._show(dst, target)

    def _frames_showing(self, page: int) -> list[int]:
        """RAM frames holding a copy of the page: its home frame and any read frame it was read into."""
        return [int(f) for f in np.flatnonzero(self.page_in == page)]

    def reserve(self, new_pages: int) -> None:
        """Reserve disk space for the next new_pages pages `allocate` can hand out (before a step changes
        anything: a full disk fails here, not half-way)."""
        ids = self.pages.peek_free(new_pages)
        needed = max([self.pages.high_water(), *(i + 1 for i in ids)])
        if needed > self.swap.reserved:
            self.swap.reserve(min(self.n_pages, needed + 16))

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
        for stale in self._frames_showing(page):  # a read frame's copy: the home copy replaces it
            self._unplace(stale)
        self.page_in[frame] = page
        self.frame_of[page] = frame
        self._show(page, frame)

    def _show(self, page: int, frame: int) -> None:
        held = self.positions[page_slots(page, self.page_size)]
        self.frame_positions[page_slots(frame, self.page_size)] = held
        self.bias[page_slots(frame, self.page_size)] = np.where(held >= 0, 0, -np.inf)

    def _unplace(self, frame: int) -> None:
        page = self.page_in[frame]
        if page >= 0 and self.frame_of[page] == frame:
            self.frame_of[page] = -1
        self.page_in[frame] = -1
        self.frame_positions[page_slots(frame, self.page_size)] = -1
        self.bias[page_slots(frame, self.page_size)] = -np.inf
