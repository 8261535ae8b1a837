from dataclasses import dataclass

import numpy as np

from pagevis.errors import check_int
from pagevis.kvcache.policy_state import PolicyState
from pagevis.kvcache.policies.base import EvictionPolicy
from pagevis.kvcache.rope_shift import inverse_frequencies, rotate
from pagevis.kvcache.policies.lazy_kernels import kernels


class QueryMoments(PolicyState):
    """What expected attention needs: the mean and covariance of the queries before RoPE (per query head,
    every query at a position >= n_sink so far, as a running mean and sum of squared deviations: Chan et al.'s
    update, one batch of queries at a time), and each token's key and value norm per KV head."""

    def __init__(self, n_slots, n_heads, n_kv_heads, head_dim, rope_base, n_sink):
        super().__init__(n_slots)
        self.keys = self.add_array("keys", np.float32, (n_kv_heads, head_dim))
        self.value_norms = self.add_array("value_norms", np.float32, (n_kv_heads,))
        self.inv_freq = inverse_frequencies(head_dim, rope_base)
        self.n_sink = n_sink
        self.count = 0
        self.mean = np.zeros((n_heads, head_dim))
        self.deviations = np.zeros((n_heads, head_dim, head_dim))  # sum of (x - mean)(x - mean)ᵀ
        self.next_position = 0  # the position the next token takes: where the future starts

    def reset(self):
        super().reset()
        self.count, self.next_position = 0, 0
        self.mean.fill(0.0)
        self.deviations.fill(0.0)

    def write(self, flat, k, v, position):
        self.keys[flat] = k
        self.value_norms[flat] = np.linalg.norm(v, axis=-1)
        self.next_position = max(self.next_position, position + 1)

    def query(self, q, positions):
        keep = positions >= self.n_sink
        if not keep.any():
            return
        if len(positions) == 1:  # decoding: one numba call, the same float64 values as the lines below (kernels.py)
            self.count += 1
            cos, sin = unrotation(int(positions[0]), self.inv_freq)
            kernels().moments_add_one(self.deviations, self.mean, q[0], cos, sin, (self.count - 1) / self.count,
                                      1 / self.count)
            return
        pre = unrotate(q[keep].astype(np.float64), positions[keep], self.inv_freq)  # (n, heads, d)
        n, before = len(pre), self.count
        batch_mean = pre.mean(axis=0)
        centred = pre - batch_mean
        self.deviations += np.einsum("nhi,nhj->hij", centred, centred)
        shift = batch_mean - self.mean
        self.count += n
        self.deviations += (shift * (before * n / self.count))[:, :, None] * shift[:, None, :]
        self.mean += shift * (n / self.count)

    def moments(self) -> tuple[np.ndarray, np.ndarray]:
        """Mean (heads, d) and covariance (heads, d, d) of the queries before RoPE (zeros before any)."""
        return self.mean.copy(), self.deviations / max(self.count, 1)


def unrotate(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Undo RoPE (adjacent pairs, as pagevis.model.rope applies it) on x (n, heads, d) at `positions`."""
    return rotate(x, -np.asarray(positions, dtype=np.float64)[:, None], inv_freq)


_UNROTATION: list = [None, None, None]  # the last (position, inv_freq, (cos, sin)): every layer asks for the same


def unrotation(position: int, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of the angles that undo RoPE at `position` (rope_shift.rotate's, by -position), computed once
    for all the layers that ask in a step."""
    last, freq, pair = _UNROTATION
    if last != position or freq is None or not np.array_equal(freq, inv_freq):
        angles = np.asarray([-position], dtype=np.float64)[..., None] * inv_freq
        pair = (np.cos(angles)[0], np.sin(angles)[0])
        _UNROTATION[:] = [position, inv_freq, pair]
    return pair


def mean_rotation(start: int, n_positions: int, inv_freq: np.ndarray) -> np.ndarray:
    """(d, d): RoPE's rotation averaged over positions start .. start + n_positions - 1."""
    angles = np.arange(start, start + n_positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angles).mean(axis=0), np.sin(angles).mean(axis=0)
    d = 2 * len(inv_freq)
    rotation = np.zeros((d, d))
    pairs = np.arange(0, d, 2)
    rotation[pairs, pairs] = rotation[pairs + 1, pairs + 1] = cos
    rotation[pairs, pairs + 1] = -sin
    rotation[pairs + 1, pairs] = sin
    return rotation


@dataclass
class ExpectedAttention(EvictionPolicy):
    """Evict the token the coming queries are expected to attend to least, weighted by its value's norm.
    The queries before RoPE are modelled as a Gaussian (mean and covariance of every query so far, past the
    first n_sink positions), carried to the next `n_future_positions` positions by RoPE's rotation averaged
    over them; a key's expected attention is softmax over the kept keys of k·mu/sqrt(d) + kᵀΣk/(2d) (the
    Gaussian's moment generating function), averaged over each KV head's query heads, times ||v||, and the
    mean over KV heads. The first n_sink tokens are kept. As kvpress's ExpectedAttentionPress, except that
    the statistics come from the queries the cache has seen (pagevis never sees hidden states): every query
    so far, not a buffer of the last ones. The logits are computed in float32 (the keys' precision), the softmax
    and the means in float64: a victim may differ from a float64 score's only where that score ties within
    float32's rounding (tests/test_expected_attention_victims.py states the bound).

    While decoding it compresses every 10 tokens by default, as kvpress runs it (DecodingPress around the press,
    `compression_steps=10`): when the cache is full one scoring evicts the 10 lowest, and the cache refills for 10
    tokens. Its scoring is one product of (kept keys x query heads x d x d) multiply-adds a layer (kvpress's
    einsum), ~9 M a SmolLM2 layer at 256 tokens: scored every token (`compress_every=1`) it costs more than the
    rest of the step (docs/speed.md, "Policies")."""

    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: int = 1
    use_vnorm: int = 1
    uses_queries = True
    default_compress_every = 10
    burst_from_one_scoring = True
    name = "expected-attention"
    citation = ("Expected Attention: Devoto et al. 2025, Expected Attention: KV Cache Compression by Estimating "
                "Attention from Future Queries Distribution, arXiv:2510.00636 (kvpress defaults: 512 future "
                "positions, 4 sinks, covariance and value norms on; DecodingPress's 10 steps a compression).")
    reason = "lowest expected attention from future queries"

    def bind(self, capacity, page_size):
        super().bind(capacity, page_size)
        self.n_future_positions = self.check_int_param("n_future_positions", self.n_future_positions, 1, 1 << 20)
        self.n_sink = self.check_int_param("n_sink", self.n_sink, 0, capacity - 1)
        self.use_covariance = check_int(f"{self.name}.use_covariance", self.use_covariance, 0, 1)
        self.use_vnorm = check_int(f"{self.name}.use_vnorm", self.use_vnorm, 0, 1)
        self._rotation: tuple[int | None, np.ndarray | None, np.ndarray | None] = (None, None, None)

    def make_state(self, n_slots):
        return QueryMoments(n_slots, self.n_heads, self.n_kv_heads, self.head_dim, self.rope_base, self.n_sink)

    def head_scores(self, pages):
        state = pages.stats
        n_kv = state.keys.shape[1]
        sinks = pages.occupied() & (pages.positions < self.n_sink)
        candidates = np.broadcast_to(pages.kept(), (n_kv, len(pages.positions))) & ~sinks
        if pages.head_keep is None:  # one set of candidates for every KV head: scored all at once
            sets = [(np.arange(n_kv), np.flatnonzero(candidates[0]))]
        else:
            sets = [(np.array([kv]), np.flatnonzero(candidates[kv])) for kv in range(n_kv)]
        scores = np.zeros(candidates.shape)
        turn, columns = self._mean_turn(state), self._columns(state)
        for heads, rows in sets:
            if len(rows):
                scores[np.ix_(heads, rows)] = self._expected(state, heads, rows, turn, columns[heads])
        top = scores.max() + 1
        scores[:, sinks] = top  # as kvpress pads them: above every other token
        return scores

    def _expected(self, state, heads, rows, turn, columns) -> np.ndarray:
        """(len(heads), len(rows)): the expected attention of those KV heads' query heads on the keys in rows (the
        softmax over them), averaged over each group, times ||v||."""
        # Rᵀk for every key: R's 2 x 2 blocks [[cos, -sin], [sin, cos]] act as complex numbers on RoPE's pairs, Rᵀ
        # as their conjugates (the keys as the cache holds them, float32: a pair is one complex64)
        keys = np.ascontiguousarray(state.keys[rows[None, :], heads[:, None]])  # (heads, T, d)
        turned = (keys.view(np.complex64) * turn).view(np.float32)
        # one float32 product gives k·Rμ = (Rᵀk)·μ and, per query head, (Rᵀk)ᵀΣ, whose row sums with Rᵀk are
        # kᵀRΣRᵀk: in float64 this cost 3x. tests/test_expected_attention_victims.py checks every victim of a real
        # run against the float64 score, within a bound on this rounding
        products = turned @ columns  # (heads, T, group * d + group)
        # the logits, the softmax over the keys in float64, the group's mean and ||v||: one numba call (kernels.py)
        # where ~12 NumPy calls and their temporaries cost as much as the product
        values = np.ascontiguousarray(state.value_norms[rows[None, :], heads[:, None]])
        return kernels().expected_weights(products, turned, values, self.use_covariance, self.use_vnorm)

    def score(self, pages):
        return self.head_scores(pages).mean(axis=0)

    def protected(self, pages):
        return pages.occupied() & (pages.positions < self.n_sink)

    def _mean_rotation(self, state):
        start, rotation, _ = self._rotation
        if start != state.next_position:  # every layer scores from the same position: computed once
            rotation = mean_rotation(state.next_position, self.n_future_positions, state.inv_freq)
            turn = (np.diagonal(rotation)[0::2] - 1j * np.diagonal(rotation, -1)[0::2]).astype(np.complex64)
            self._rotation = (state.next_position, rotation, turn)
        assert rotation is not None  # (a start of None never equals a position: computed above)
        return rotation

    def _mean_turn(self, state) -> np.ndarray:
        """Rᵀ as complex64 factors, one per RoPE pair (cos - i sin of the averaged angle)."""
        self._mean_rotation(state)
        turn = self._rotation[2]
        assert turn is not None  # (set with the rotation above)
        return turn

    def _columns(self, state) -> np.ndarray:
        """Per KV head, (d, group * d + group) float32: its query heads' covariances Σ side by side, then their
        means — the right-hand side of one product with the turned keys Rᵀk (k·Rμ = (Rᵀk)·μ)."""
        n_kv, d = state.keys.shape[1:]
        group = len(state.mean) // n_kv
        columns = np.empty((n_kv, d, group * d + group), np.float32)
        # Σ = deviations / count
        kernels().covariance_columns(state.deviations, state.mean, 1 / max(state.count, 1), columns)
        return columns
