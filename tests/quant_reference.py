"""A brute-force reference of quantized K/V storage, sharing no code with pagevis.kvcache.quant: scalar
float16 rounding, loops over heads, channels and groups, and a plain list for the residual window.

The rules it implements (docs/quantization.md):
- int8: per token and KV head, scale = the smallest float16 >= max|x| / 127 (float32 arithmetic), codes
  round(x / scale) in [-127, 127].
- int4 / int2 (KIVI): zero = the largest float16 <= min, scale = the smallest float16 >= (max - zero) /
  (2**bits - 1), codes round((x - zero) / scale) in [0, 2**bits - 1]; keys: min/max per KV head and channel
  over a group's 32 tokens; values: per token, KV head and group of 32 channels. Before n tokens are
  written, while the window holds at least 32 tokens and would hold more than residual + 31 after the
  write, its 32 oldest (by position) are quantized as one key group.
"""

from __future__ import annotations

import numpy as np

GROUP = 32


def f16_down(x: float) -> float:
    y = np.float16(x)
    if float(y) > float(x):
        y = np.nextafter(y, np.float16(-np.inf))
    return float(y)


def f16_up(x: float) -> float:
    y = np.float16(x)
    if float(y) < float(x):
        y = np.nextafter(y, np.float16(np.inf))
    return float(y)


def int8_vector(x: np.ndarray) -> tuple[np.ndarray, float]:
    """(dequantized float64, scale) of one vector."""
    scale = f16_up(np.float32(np.max(np.abs(x))) / np.float32(127))
    out = np.zeros(len(x))
    for i, value in enumerate(x):
        code = 0.0 if scale == 0 else float(np.rint(np.float32(value) / np.float32(scale)))
        out[i] = min(max(code, -127), 127) * scale
    return out, scale


def asym_vector(x: np.ndarray, bits: int) -> tuple[np.ndarray, float]:
    """(dequantized float64, scale) of values sharing one scale and zero point."""
    levels = 2 ** bits - 1
    zero = f16_down(np.float32(min(x)))
    scale = f16_up((np.float32(max(x)) - np.float32(zero)) / np.float32(levels))
    out = np.zeros(len(x))
    for i, value in enumerate(x):
        shifted = np.float32(value) - np.float32(zero)
        code = 0.0 if scale == 0 else float(np.rint(shifted / np.float32(scale)))
        out[i] = min(max(code, 0), levels) * scale + zero
    return out, scale


def kivi_keys(keys: np.ndarray, bits: int) -> np.ndarray:
    """keys (tokens, n_kv, d) of one group: per KV head and channel over the tokens."""
    out = np.zeros(keys.shape)
    for h in range(keys.shape[1]):
        for c in range(keys.shape[2]):
            out[:, h, c] = asym_vector(keys[:, h, c], bits)[0]
    return out


def kivi_values(value: np.ndarray, bits: int) -> np.ndarray:
    """value (n_kv, d) of one token: per KV head and group of 32 channels."""
    out = np.zeros(value.shape)
    for h in range(value.shape[0]):
        for start in range(0, value.shape[1], GROUP):
            out[h, start: start + GROUP] = asym_vector(value[h, start: start + GROUP], bits)[0]
    return out


def clamped_residual(dtype: str, residual: int, capacity: int, n_kv_heads: int, head_dim: int) -> int:
    """The residual the cache uses: the largest r <= residual at which a cache of `capacity` tokens costs no
    more bytes per token than float16, counting bytes by hand — per token and KV head: K and V codes
    (head_dim * bits / 8 bytes each), a float16 scale and zero point per value group of 32 channels, 1/32
    of its key group's float16 scale and zero point per channel, and per token a 4-byte key group index;
    plus, per token held in float32 (r, at least 1, and 31 waiting), 2 x n_kv_heads x head_dim x 4 bytes.
    0 when none fits."""
    bits = {"int4": 4, "int2": 2}.get(dtype)
    if bits is None:
        return residual
    value_groups = -(-head_dim // GROUP)
    quantized = n_kv_heads * (2 * -(-head_dim * bits // 8) + 2 * 2 * value_groups + 2 * 2 * head_dim / GROUP) + 4
    float16 = 2 * n_kv_heads * head_dim * 2
    for r in range(residual, -1, -1):
        window = min(capacity, max(r, 1) + GROUP - 1)
        if quantized + window * 2 * n_kv_heads * head_dim * 4 / capacity <= float16:
            return r
    return 0


class QuantReference:
    """What one sequence's cache holds, position by position: K and V as float64 (exactly as written
    while in the window, else dequantized) and which positions shared a key group."""

    def __init__(self, dtype: str, residual: int):
        self.dtype, self.residual = dtype, residual
        self.bits = {"int8": 8, "int4": 4, "int2": 2}.get(dtype)
        self.window: list[int] = []  # positions in full precision
        self.written: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.stored: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.group_of: dict[int, int] = {}
        self.n_groups = 0

    def before_write(self, n: int) -> None:
        if self.bits not in (4, 2):
            return
        while len(self.window) >= GROUP and len(self.window) + n > self.residual + GROUP - 1:
            group = sorted(self.window)[:GROUP]
            keys = kivi_keys(np.stack([self.written[p][0] for p in group]), self.bits)
            for i, p in enumerate(group):
                self.stored[p] = (keys[i], kivi_values(self.written[p][1], self.bits))
                self.group_of[p] = self.n_groups
            self.n_groups += 1
            self.window = [p for p in self.window if p not in group]

    def write(self, position: int, k: np.ndarray, v: np.ndarray) -> None:
        k, v = np.asarray(k, np.float32), np.asarray(v, np.float32)
        self.written[position] = (k, v)
        if self.bits == 8:
            self.stored[position] = (np.stack([int8_vector(row)[0] for row in k]),
                                     np.stack([int8_vector(row)[0] for row in v]))
        elif self.bits is None:
            self.stored[position] = (k.astype(self.dtype).astype(np.float64), v.astype(self.dtype).astype(np.float64))
        else:
            self.window.append(position)
            self.stored[position] = (k.astype(np.float64), v.astype(np.float64))

    def evict(self, position: int) -> None:
        if position in self.window:
            self.window.remove(position)

    def follow(self, events, k_by_position, v_by_position, layer: int = 0) -> None:
        """Replay one append's write and evict events (the caller ran before_write first)."""
        for event in events:
            if event.layer != layer:
                continue
            if event.kind == "evict":
                self.evict(event.position)
            elif event.kind == "write":
                self.write(event.position, k_by_position[event.position], v_by_position[event.position])
