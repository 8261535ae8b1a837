"""Quantized pages (quant.py: int8, KIVI's int4 / int2): each frame one byte block of codes and scales.

The block is what the disk tier moves; attention reads float32 K/V through `frame_kv`, which dequantizes the
frames asked for (a block at a time: see reader.py). For int4 / int2 each slot's key group and the residual
window's float32 K/V are kept per page id beside the frames, like the positions: a token is written into the
residual window in float32 and quantized later, with the rest of its key group (`seal`).
"""

from __future__ import annotations

import numpy as np

from pagevis.kvcache import quant
from pagevis.kvcache.slots import flat_slots, page_slots
from pagevis.kvcache.store import PageStore, heads_first


class QuantizedPages(PageStore):
    """A PageStore whose frames hold int8 or int4 / int2 codes."""

    quantized = True
    layout: quant.Layout  # always one: the store is made for a quantized dtype

    def _init_kv(self, config) -> None:
        self.kivi = self.layout.kivi
        self.data = np.zeros((self.n_frames, self.layout.page_bytes()), np.uint8)
        self.parts = self.layout.views(self.data)  # named views of the block's parts, each (frames, ...)
        if self.kivi:
            n_slots = self.n_pages * self.page_size
            self.slot_group = np.full(n_slots, -1, np.int32)  # per page id slot: its key group, -1 none
            self.res_of = np.full(n_slots, -1, np.int64)  # per page id slot: its residual row, -1 none
            self.groups = quant.KeyGroups(self.n_kv, self.head_dim, -(-n_slots // self.layout.group))
            self.residual = quant.ResidualBuffer(self.n_kv, self.head_dim, min(n_slots, self.layout.window()))

    def kv_arrays(self) -> tuple[np.ndarray, ...]:
        return (self.data,)

    def reset(self) -> None:
        super().reset()
        if self.kivi:
            self.slot_group.fill(-1)
            self.res_of.fill(-1)
            self.groups.reset()
            self.residual.reset()

    def frame_blocks(self, frame: int) -> list[np.ndarray]:
        return [self.data[frame]]

    def _write_kv(self, flat: int, frame: int, slot: int, k: np.ndarray, v: np.ndarray) -> None:
        if self.kivi:  # into the residual window, in float32: quantized later (seal)
            row = self.residual.take()
            self.residual.k[:, row] = k
            self.residual.v[:, row] = v
            self.res_of[flat] = row
        else:  # int8: a scale per token and KV head
            codes, scale = quant.int8_quantize(np.stack([k, v]))
            self.parts["k"][frame, :, slot], self.parts["v"][frame, :, slot] = codes
            self.parts["k_scale"][frame, :, slot], self.parts["v_scale"][frame, :, slot] = scale

    def frame_kv(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """float32 keys and values of RAM frames [lo, hi), dequantized (the residual window's slots exactly as
        written)."""
        return self._dequantize({name: part[lo:hi] for name, part in self.parts.items()}, self.page_in[lo:hi])

    def _dequantize(self, parts: dict[str, np.ndarray], pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """float32 K and V (n_kv, frames * page_size, head_dim) of pages laid out as `parts` (each (frames,
        ...)) holding `pages` (-1: no page)."""
        layout = self.layout
        if not self.kivi:
            return (heads_first(quant.int8_dequantize(parts["k"], parts["k_scale"])),
                    heads_first(quant.int8_dequantize(parts["v"], parts["v_scale"])))
        flat = flat_slots(pages, self.page_size)
        held = flat >= 0
        groups = np.where(held, self.slot_group[np.maximum(flat, 0)], -1)
        codes = heads_first(quant.unpack(parts["k"], layout.bits, self.head_dim))
        safe = np.maximum(groups, 0)  # slots of no group (empty, or in the window) are masked or replaced
        keys = quant.asym_dequantize(codes, np.take(self.groups.scale, safe, axis=1),
                                     np.take(self.groups.zero, safe, axis=1))
        values = heads_first(quant.dequantize_values(quant.unpack(parts["v"], layout.bits, self.head_dim),
                                                     parts["v_scale"], parts["v_zero"]))
        rows = np.where(held, self.res_of[np.maximum(flat, 0)], -1)
        window = np.flatnonzero(rows >= 0)
        if window.size:
            keys[:, window] = self.residual.k[:, rows[window]]
            values[:, window] = self.residual.v[:, rows[window]]
        return keys, values

    def residual_slots(self, flats: np.ndarray) -> np.ndarray:
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
            self.tier.changed(page)
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
        if not self.kivi or not pages:
            return -1
        groups = self.slot_group[flat_slots(pages, self.page_size)]
        groups = groups[groups >= 0]
        return int(self.groups.end[groups].max()) if groups.size else -1

    def nbytes(self) -> int:
        """The frames, and for int4 / int2 each slot's key group, the key groups' table and the residual
        window's rows, as allocated now."""
        total = self.data.nbytes
        if self.kivi:
            total += self.slot_group.nbytes + self.groups.nbytes() + self.residual.nbytes()
        return total

    def peak_bytes(self) -> int:
        if not self.kivi:
            return self.nbytes()
        return (self.data.nbytes + self.slot_group.nbytes + self.groups.nbytes(self.groups.peak)
                + self.residual.nbytes(self.residual.peak))

    def copy_frame(self, src: int, dst: int) -> None:
        self.data[dst] = self.data[src]

    def _copy_slots(self, src: int, dst: int, keep: np.ndarray) -> None:
        """int4 / int2: the kept slots share the source's key groups and get residual rows of their own."""
        if not self.kivi:
            return
        ps = self.page_size
        src_slots, dst_slots = page_slots(src, ps), page_slots(dst, ps)
        groups = np.where(keep, self.slot_group[src_slots], -1)
        self.slot_group[dst_slots] = groups
        self.groups.share(groups)
        for offset in np.flatnonzero(keep & (self.res_of[src_slots] >= 0)).tolist():
            row, old = self.residual.take(), self.res_of[src * ps + offset]
            self.residual.k[:, row], self.residual.v[:, row] = self.residual.k[:, old], self.residual.v[:, old]
            self.res_of[dst * ps + offset] = row

    def _drop_slots(self, flats: np.ndarray) -> None:
        """The tokens of these slots are gone: release their key groups and residual rows."""
        if not self.kivi:
            return
        self.groups.release(self.slot_group[flats])
        self.slot_group[flats] = -1
        self.residual.free(self.res_of[flats])
        self.res_of[flats] = -1
