"""Quantized K/V storage: the codecs, the byte layout of a quantized page, and dequantization of blocks of
pages to the float32 keys and values the attention kernels read.

Three schemes (storage dtypes beside float32 and float16):

- int8: symmetric, one float16 scale per token and KV head for K and for V (scale = max|x| / 127, rounded
  up to a float16, codes in [-127, 127]). A token is quantized when it is written. vLLM's fp8 KV cache
  uses one scale per tensor (per layer's K or V, 1.0 unless calibrated); a per-token scale costs 2 bytes
  per head and token but follows each token's own range, so a token with large values does not coarsen
  every other token's grid.
- int4 / int2, the KIVI way (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV
  Cache", ICML 2024): keys per channel, values per token, asymmetric (a float16 scale and zero point per
  group), in groups of GROUP = 32: a key group is 32 tokens sharing one scale and zero point per channel;
  a value group is 32 channels of one token. The newest `residual` tokens of a sequence stay in full
  precision (float32, exactly as computed); once GROUP more have arrived, the oldest GROUP of them are
  quantized together as one key group (see Rewrites.seal_residual, kvcache/rewrites.py, for when).

Rounding: a zero point is rounded down to a float16 and a scale up, so every value of its group maps to a
code in range and `|x - dequantized| <= scale / 2` (plus float32 rounding) holds for every element — the
bound the tests check. Values beyond float16's range (65504) are clipped.

A quantized page is one byte block per RAM frame (the unit the disk tier moves, `page_bytes`):
  int8:        K codes (n_kv, ps, d) int8 | V codes | K scales (n_kv, ps) float16 | V scales
  int4 / int2: K codes (n_kv, ps, ceil(d * bits / 8)) uint8, packed low bits first | V codes |
               V scales (n_kv, ps, value groups) float16 | V zero points
Kept in RAM beside the pages, per layer: for int4 / int2 each slot's key group (int32, -1 none), the key
groups' per-channel scales and zero points (n_kv, d) float16 each, and the residual window's float32 K/V.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from pagevis.kvcache.memory import peak_bytes

QUANT_BITS = {"int8": 8, "int4": 4, "int2": 2}
GROUP = 32  # KIVI's group size: tokens per key group, channels per value group
FLOAT16_MAX = float(np.finfo(np.float16).max)
BLOCK_TOKENS = 256  # attention dequantizes at most this many slots (whole pages, at least one) at a time


def is_quantized(dtype: str) -> bool:
    return dtype in QUANT_BITS


def has_residual(dtype: str) -> bool:
    """KIVI's schemes keep a full-precision residual window; int8 quantizes every token on write."""
    return dtype in ("int4", "int2")


# --- float16 rounding in a chosen direction ---------------------------------------------------------

def down16(x: np.ndarray) -> np.ndarray:
    """The largest float16 <= x (x clipped to float16's range)."""
    x = np.clip(np.asarray(x, np.float32), -FLOAT16_MAX, FLOAT16_MAX)
    y = x.astype(np.float16)
    return np.where(y.astype(np.float32) > x, np.nextafter(y, np.float16(-np.inf)), y)


def up16(x: np.ndarray) -> np.ndarray:
    """The smallest float16 >= x (x clipped to float16's range)."""
    x = np.clip(np.asarray(x, np.float32), -FLOAT16_MAX, FLOAT16_MAX)
    y = x.astype(np.float16)
    return np.where(y.astype(np.float32) < x, np.nextafter(y, np.float16(np.inf)), y)


# --- int8: symmetric, one scale per vector ----------------------------------------------------------

def int8_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (..., d) -> codes (..., d) int8 and scales (...) float16, one per vector (token and KV head)."""
    x = np.clip(np.asarray(x, np.float32), -FLOAT16_MAX, FLOAT16_MAX)
    scale = up16(np.abs(x).max(axis=-1) / np.float32(127))
    s = scale.astype(np.float32)[..., None]
    codes = np.rint(np.divide(x, s, out=np.zeros_like(x), where=s > 0))
    return np.clip(codes, -127, 127).astype(np.int8), scale


def int8_dequantize(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return codes.astype(np.float32) * scale.astype(np.float32)[..., None]


# --- asymmetric with zero points (KIVI) ---------------------------------------------------------------

def asym_params(low: np.ndarray, high: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """float16 (scale, zero) covering [low, high] with 2**bits - 1 steps: zero <= low, zero + scale *
    (2**bits - 1) >= high."""
    zero = down16(low)
    scale = up16((np.asarray(high, np.float32) - zero.astype(np.float32)) / np.float32(2 ** bits - 1))
    return scale, zero


def asym_codes(x: np.ndarray, scale: np.ndarray, zero: np.ndarray, bits: int) -> np.ndarray:
    """Codes (uint8, unpacked) of x with scale and zero broadcast against it."""
    x = np.asarray(x, np.float32)
    s = scale.astype(np.float32)
    shifted = x - zero.astype(np.float32)
    codes = np.rint(np.divide(shifted, s, out=np.zeros_like(shifted), where=s > 0))
    return np.clip(codes, 0, 2 ** bits - 1).astype(np.uint8)


def asym_dequantize(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    return codes.astype(np.float32) * scale.astype(np.float32) + zero.astype(np.float32)


def quantize_key_group(keys: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """KIVI keys: keys (n_kv, tokens, d) of one group -> codes (n_kv, tokens, d) and a scale and zero
    point per KV head and channel (n_kv, d), over the group's tokens."""
    keys = np.clip(np.asarray(keys, np.float32), -FLOAT16_MAX, FLOAT16_MAX)
    scale, zero = asym_params(keys.min(axis=1), keys.max(axis=1), bits)
    return asym_codes(keys, scale[:, None], zero[:, None], bits), scale, zero


def value_groups(head_dim: int) -> np.ndarray:
    """First channel of each value group (GROUP channels; fewer in the last when head_dim is not a multiple)."""
    return np.arange(0, head_dim, GROUP)


def quantize_values(values: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """KIVI values: values (..., d) -> codes (..., d) and a scale and zero point per token and group of
    GROUP channels (..., groups)."""
    values = np.clip(np.asarray(values, np.float32), -FLOAT16_MAX, FLOAT16_MAX)
    starts = value_groups(values.shape[-1])
    scale, zero = asym_params(np.minimum.reduceat(values, starts, axis=-1),
                              np.maximum.reduceat(values, starts, axis=-1), bits)
    return asym_codes(values, _by_channel(scale, values.shape[-1]), _by_channel(zero, values.shape[-1]), bits), \
        scale, zero


def dequantize_values(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    d = codes.shape[-1]
    return asym_dequantize(codes, _by_channel(scale, d), _by_channel(zero, d))


def _by_channel(per_group: np.ndarray, head_dim: int) -> np.ndarray:
    """(..., groups) -> (..., head_dim): each channel's group's value."""
    return np.repeat(per_group, GROUP, axis=-1)[..., :head_dim]


# --- packing ----------------------------------------------------------------------------------------

def packed_width(head_dim: int, bits: int) -> int:
    return math.ceil(head_dim * bits / 8)


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """(..., d) codes < 2**bits -> (..., packed_width) uint8, channel i in bits [(i % per) * bits, ...) of
    byte i // per (per = 8 // bits), low bits first."""
    if bits == 8:
        return codes
    per = 8 // bits
    d = codes.shape[-1]
    padded = np.zeros((*codes.shape[:-1], packed_width(d, bits) * per), np.uint8)
    padded[..., :d] = codes
    grouped = padded.reshape(*codes.shape[:-1], -1, per).astype(np.uint16)
    shifts = (np.arange(per) * bits).astype(np.uint16)
    return np.bitwise_or.reduce(grouped << shifts, axis=-1).astype(np.uint8)


def _unpack_table(bits: int) -> np.ndarray:
    """(256, 8 // bits) float32: the codes each byte holds, low bits first."""
    per = 8 // bits
    shifts = np.arange(per) * bits
    return ((np.arange(256)[:, None] >> shifts) & (2 ** bits - 1)).astype(np.float32)


UNPACK = {bits: _unpack_table(bits) for bits in (4, 2)}


def unpack(packed: np.ndarray, bits: int, head_dim: int) -> np.ndarray:
    """Codes (..., head_dim) of packed bytes: float32 for int4 / int2 (one table lookup per byte), the
    int8 codes themselves for int8."""
    if bits == 8:
        return packed
    codes = np.take(UNPACK[bits], packed, axis=0)  # (np.take: several times faster than fancy indexing here)
    return codes.reshape(*packed.shape[:-1], -1)[..., :head_dim]


# --- the layout of one page, and the bytes per token --------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """Where each part of a quantized page sits in its byte block, and what a token costs."""

    dtype: str
    n_kv_heads: int
    page_size: int
    head_dim: int
    residual: int = 0  # KIVI's full-precision window (tokens); 0 for int8
    group: int = GROUP  # tokens per key group (int4 / int2)

    @property
    def bits(self) -> int:
        return QUANT_BITS[self.dtype]

    @property
    def kivi(self) -> bool:
        return has_residual(self.dtype)

    @property
    def width(self) -> int:
        """Bytes of one token's codes for one KV head."""
        return self.head_dim if self.bits == 8 else packed_width(self.head_dim, self.bits)

    @property
    def n_value_groups(self) -> int:
        return len(value_groups(self.head_dim))

    def parts(self) -> list[tuple[str, tuple[int, ...], np.dtype]]:
        """(name, shape within one page, dtype) of each array of a page, in byte order."""
        n, ps = self.n_kv_heads, self.page_size
        code: np.dtype = np.dtype(np.int8 if self.bits == 8 else np.uint8)
        parts: list[tuple[str, tuple[int, ...], np.dtype]] = [("k", (n, ps, self.width), code),
                                                               ("v", (n, ps, self.width), code)]
        if self.kivi:
            parts += [("v_scale", (n, ps, self.n_value_groups), np.dtype(np.float16)),
                      ("v_zero", (n, ps, self.n_value_groups), np.dtype(np.float16))]
        else:
            parts += [("k_scale", (n, ps), np.dtype(np.float16)), ("v_scale", (n, ps), np.dtype(np.float16))]
        return parts

    def page_bytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in self.parts())

    def views(self, block: np.ndarray) -> dict[str, np.ndarray]:
        """Named views into a (frames, page_bytes) uint8 block: each (frames, *shape)."""
        out, offset = {}, 0
        for name, shape, dtype in self.parts():
            size = math.prod(shape) * dtype.itemsize
            out[name] = block[:, offset: offset + size].view(dtype).reshape(block.shape[0], *shape)
            offset += size
        return out

    # bytes per token of one layer
    def page_bytes_per_token(self) -> int:
        """What each slot of a page holds: codes and, per token, scales (and zero points)."""
        return self.page_bytes() // self.page_size

    def key_group_bytes(self) -> int:
        """One key group's per-channel scale and zero point, all KV heads (int4 / int2)."""
        return 2 * self.n_kv_heads * self.head_dim * 2 if self.kivi else 0

    def slot_group_bytes(self) -> int:
        """Each slot's key-group index (int32), int4 / int2."""
        return 4 if self.kivi else 0

    def quantized_bytes_per_token(self) -> float:
        """A quantized token's cost, with its key group's scales shared by GROUP tokens."""
        return self.page_bytes_per_token() + self.slot_group_bytes() + self.key_group_bytes() / self.group

    def residual_bytes_per_token(self) -> int:
        """A token of the residual window: float32 K and V, held beside its slot."""
        return 2 * self.n_kv_heads * self.head_dim * 4 if self.kivi else 0

    def window(self) -> int:
        """The most tokens of one sequence held in full precision between decode steps: the residual (at
        least the token just written), plus up to group - 1 waiting for their key group to fill."""
        return max(self.residual, 1) + self.group - 1 if self.kivi else 0

    def largest_residual(self, tokens: int) -> int:
        """The largest residual at which a cache of `tokens` costs no more per token than float16 (what
        int4 / int2 exist to beat): the window's float32 tokens may take at most (float16 - quantized) /
        float32 of the budget. 0 when even the smallest window (one key group waiting) costs more."""
        float16 = 2 * self.n_kv_heads * self.head_dim * 2
        most_window = int((float16 - self.quantized_bytes_per_token()) * tokens // self.residual_bytes_per_token())
        return max(0, most_window - self.group + 1)


def layout_for(config) -> Layout | None:
    """The layout of a CacheConfig's storage, None for float32 / float16. int4 / int2: the residual is
    clamped to the budget (`clamp_residual`)."""
    if not is_quantized(config.dtype):
        return None
    return clamp_residual(Layout(config.dtype, config.n_kv_heads, config.page_size, config.head_dim,
                                 config.residual if has_residual(config.dtype) else 0, GROUP), config.capacity)


def clamp_residual(layout: Layout, tokens: int) -> Layout:
    """The layout with its residual cut to `largest_residual(tokens)`. KIVI's 128 is sized for long
    contexts: in a cache of 96 tokens its window (128 + 31) would hold every token in float32, so int4
    would quantize nothing and cost more per token than float32 (pages, scales and the window besides)."""
    if not layout.kivi:
        return layout
    return dataclasses.replace(layout, residual=min(layout.residual, layout.largest_residual(tokens)))


# --- what sits beside the pages (int4 / int2) ----------------------------------------------------------

def _doubled(array: np.ndarray, axis: int = 0, fill=0) -> np.ndarray:
    """`array` twice as long along `axis`, the new half filled with `fill`."""
    return np.concatenate([array, np.full_like(array, fill)], axis=axis)


class KeyGroups:
    """The key groups of one layer: per group a float16 scale and zero point per KV head and channel, how
    many slots use it (a slot of a page in use or cached), and the highest position among its tokens.
    Grows (doubling) when every row is in use; `peak` counts the most groups in use at once."""

    def __init__(self, n_kv_heads: int, head_dim: int, capacity: int):
        capacity = max(1, capacity)
        self.scale = np.zeros((n_kv_heads, capacity, head_dim), np.float16)
        self.zero = np.zeros_like(self.scale)
        self.refs = np.zeros(capacity, np.int64)
        self.end = np.full(capacity, -1, np.int64)
        self.peak = 0

    def reset(self) -> None:
        self.refs.fill(0)
        self.end.fill(-1)
        self.peak = 0

    @property
    def in_use(self) -> int:
        return int(np.count_nonzero(self.refs))

    def add(self, scale: np.ndarray, zero: np.ndarray, end: int, refs: int) -> int:
        free = np.flatnonzero(self.refs == 0)
        g = int(free[0]) if free.size else self._grow()
        self.scale[:, g], self.zero[:, g] = scale, zero
        self.refs[g], self.end[g] = refs, end
        self.peak = max(self.peak, self.in_use)
        return g

    def _grow(self) -> int:
        old = len(self.refs)
        self.scale, self.zero = _doubled(self.scale, axis=1), _doubled(self.zero, axis=1)
        self.refs, self.end = _doubled(self.refs), _doubled(self.end, fill=-1)
        return old

    def release(self, groups: np.ndarray) -> None:
        """One slot fewer uses each of `groups` (repeats count; -1 entries are ignored)."""
        groups = groups[groups >= 0]
        np.subtract.at(self.refs, groups, 1)
        if np.any(self.refs[groups] < 0):
            raise RuntimeError("a key group released more often than it was used")

    def share(self, groups: np.ndarray) -> None:
        groups = groups[groups >= 0]
        np.add.at(self.refs, groups, 1)

    def nbytes(self, rows: int | None = None) -> int:
        rows = len(self.refs) if rows is None else rows
        return rows * 2 * self.scale.shape[0] * self.scale.shape[2] * 2


class ResidualBuffer:
    """The residual window's float32 K and V of one layer: rows handed out to slots (any sequence's), freed
    when the slot's token is quantized, evicted or its page's contents are dropped. Grows (doubling) when
    full; `peak` counts the most rows in use at once."""

    def __init__(self, n_kv_heads: int, head_dim: int, capacity: int):
        capacity = max(1, capacity)
        self.k = np.zeros((n_kv_heads, capacity, head_dim), np.float32)
        self.v = np.zeros_like(self.k)
        self.used = np.zeros(capacity, bool)
        self.peak = 0

    def reset(self) -> None:
        self.used.fill(False)
        self.peak = 0

    @property
    def in_use(self) -> int:
        return int(np.count_nonzero(self.used))

    def take(self) -> int:
        free = np.flatnonzero(~self.used)
        row = int(free[0]) if free.size else self._grow()
        self.used[row] = True
        self.peak = max(self.peak, self.in_use)
        return row

    def _grow(self) -> int:
        old = len(self.used)
        self.k, self.v, self.used = _doubled(self.k, axis=1), _doubled(self.v, axis=1), _doubled(self.used)
        return old

    def free(self, rows: np.ndarray) -> None:
        rows = rows[rows >= 0]
        if not np.all(self.used[rows]):
            raise RuntimeError("a residual row freed twice")
        self.used[rows] = False

    def nbytes(self, rows: int | None = None) -> int:
        rows = len(self.used) if rows is None else rows
        return rows * 2 * self.k.shape[0] * self.k.shape[2] * 4


def storage_summary(config, stores=None) -> dict:
    """What a cache's K/V storage costs, for reports (run --json, compare, the bench, the server):
    dtype; kv_bytes_per_token (all layers, one sequence at capacity: every page, and for int4 / int2 the
    key groups, slot indices and the residual window in float32: CacheConfig.kv_bytes_per_token);
    kv_bits_per_value (the same over the K and V elements of a token); for quantized dtypes the quantized
    token alone (kv_quantized_bytes_per_token) and for int4 / int2 the window's float32 token
    (kv_residual_bytes_per_token) and `residual`. With the stores of a run, kv_bytes_peak_per_token: what
    they held at most (key groups and window rows at their most in use), over the slots of their page ids
    (a pool of many sequences: all of them). A hybrid cache (sliding-window layers) with the stores adds its
    pages' bytes at their most by layer type and what every layer would hold without windows (memory.py)."""
    elements = 2 * config.n_layers * config.n_kv_heads * config.head_dim
    per_token = config.kv_bytes_per_token()
    out = {"dtype": config.dtype, "kv_bytes_per_token": per_token, "kv_bits_per_value": 8 * per_token / elements}
    layout = layout_for(config)
    if layout is not None:
        out["kv_quantized_bytes_per_token"] = config.n_layers * layout.quantized_bytes_per_token()
    if layout is not None and layout.kivi:
        out.update(residual=layout.residual, kv_residual_bytes_per_token=config.n_layers * layout.residual_bytes_per_token())
        if layout.residual != config.residual:
            out["residual_requested"] = config.residual
    if config.key_channels:  # ThinK: per_token is what a store of the kept key channels needs (key_channels.py)
        out.update(key_channels=config.key_channels, key_channels_kept=config.kept_key_channels,
                   kv_bytes_per_token_full_width=per_token + config.pruned_key_bytes_per_token())
    notice = storage_notice(config)
    if notice:
        out["storage_notice"] = notice
    if stores is not None:
        out["kv_bytes_peak_per_token"] = sum(store.peak_bytes() for store in stores) / stores[0].n_slots
        if config.hybrid:
            out.update(peak_bytes(config, stores).as_dict())
    return out


def storage_notice(config) -> str:
    """What the user must know about this storage at this budget, or "": the residual window clamped (and
    to what), and a quantized cache costing more per token than float32 (and why). Clauses are joined by
    '; ', each a headline, ': ', and its reason (the status bar shows the headlines). With key_channels (ThinK),
    the key channels kept: the bytes per token count those alone, the pages here are full width."""
    notes = [] if not config.key_channels else [
        f"keys {config.kept_key_channels} of {config.head_dim} channels (ThinK): bytes per token count the kept "
        f"channels (what a narrow store needs), the pages here stay full width with the pruned channels zeros"]
    layout = layout_for(config)
    if layout is None or not layout.kivi:
        return "; ".join(notes)
    per_token = config.kv_bytes_per_token() / config.n_layers
    float32 = layout.residual_bytes_per_token()
    if layout.residual != config.residual:
        why = (f"so that {config.dtype} costs no more per token than float16" if per_token <= float32 / 2 else
               f"the fewest it can: one key group of {layout.group} fills in float32")
        notes.append(f"residual {config.residual} clamped to {layout.residual}: a {config.capacity}-token cache "
                     f"keeps at most {layout.window()} tokens in float32, {why}")
    if per_token > float32:
        notes.append(f"{config.dtype} costs {per_token:.0f} B per token and layer, more than float32's {float32}: "
                     f"a {config.capacity}-token cache holds little more than the {layout.window()} tokens kept in "
                     f"float32 until their key group of {layout.group} is complete, and pages, scales and zero "
                     f"points besides")
    return "; ".join(notes)


def storage_text(config) -> str:
    """One line: the storage and its bits per K/V value, e.g. 'int4: 36.3 bits per K/V value (244 B per
    token and layer quantized; the newest 128 + up to 31 tokens in float32)'."""
    summary = storage_summary(config)
    text = f"{config.dtype}: {summary['kv_bits_per_value']:.2f} bits per K/V value"
    layout = layout_for(config)
    if layout is None:
        return text + (f"; {summary['storage_notice']}" if "storage_notice" in summary else "")
    text += f" ({layout.quantized_bytes_per_token():g} B per token and layer quantized"
    if layout.kivi:
        text += f"; the newest {max(layout.residual, 1)} + up to {layout.group - 1} tokens in float32"
    notice = storage_notice(config)
    return text + ")" + (f"; {notice}" if notice else "")
