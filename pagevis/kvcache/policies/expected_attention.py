from dataclasses import dataclass

import numpy as np

from pagevis.errors import check_int
from pagevis.kvcache.policy_state import PolicyState
from pagevis.kvcache.policies.base import EvictionPolicy
from pagevis.kvcache.rope_shift import inverse_frequencies, rotate


class QueryMoments(PolicyState):
    """What expected attention needs: the mean and covariance of the queries before RoPE (per query head,
    every query at a position >= n_sink so far), and each token's key and value norm per KV head."""

    def __init__(self, n_slots, n_heads, n_kv_heads, head_dim, rope_base, n_sink):
        super().__init__(n_slots)
        self.keys = self.add_array("keys", np.float32, (n_kv_heads, head_dim))
        self.value_norms = self.add_array("value_norms", np.float32, (n_kv_heads,))
        self.inv_freq = inverse_frequencies(head_dim, rope_base)
        self.n_sink = n_sink
        self.count = 0
        self.total = np.zeros((n_heads, head_dim))
        self.outer = np.zeros((n_heads, head_dim, head_dim))
        self.next_position = 0  # the position the next token takes: where the future starts

    def reset(self):
        super().reset()
        self.count, self.next_position = 0, 0
        self.total.fill(0.0)
        self.outer.fill(0.0)

    def write(self, flat, k, v, position):
        self.keys[flat] = k
        self.value_norms[flat] = np.linalg.norm(v, axis=-1)
        self.next_position = max(self.next_position, position + 1)

    def query(self, q, positions):
        keep = positions >= self.n_sink
        if not keep.any():
            return
        pre = unrotate(q[keep].astype(np.float64), positions[keep], self.inv_freq)  # (n, heads, d)
        self.count += len(pre)
        self.total += pre.sum(axis=0)
        self.outer += np.einsum("nhi,nhj->hij", pre, pre)

    def moments(self) -> tuple[np.ndarray, np.ndarray]:
        """Mean (heads, d) and covariance (heads, d, d) of the queries before RoPE (zeros before any)."""
        if not self.count:
            return self.total.copy(), self.outer.copy()
        mean = self.total / self.count
        return mean, self.outer / self.count - np.einsum("hi,hj->hij", mean, mean)


def unrotate(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Undo RoPE (adjacent pairs, as pagevis.model.rope applies it) on x (n, heads, d) at `positions`."""
    return rotate(x, -np.asarray(positions, dtype=np.float64)[:, None], inv_freq)


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
    so far, not a buffer of the last ones."""

    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: int = 1
    use_vnorm: int = 1
    uses_queries = True
    name = "expected-attention"
    citation = ("Expected Attention: Devoto et al. 2025, Expected Attention: KV Cache Compression by Estimating "
                "Attention from Future Queries Distribution, arXiv:2510.00636 (kvpress defaults: 512 future "
                "positions, 4 sinks, covariance and value norms on).")
    reason = "lowest expected attention from future queries"

    def bind(self, capacity, page_size):
        super().bind(capacity, page_size)
        self.n_future_positions = self.check_int_param("n_future_positions", self.n_future_positions, 1, 1 << 20)
        self.n_sink = self.check_int_param("n_sink", self.n_sink, 0, capacity - 1)
        self.use_covariance = check_int(f"{self.name}.use_covariance", self.use_covariance, 0, 1)
        self.use_vnorm = check_int(f"{self.name}.use_vnorm", self.use_vnorm, 0, 1)
        self._rotation: tuple[int | None, np.ndarray | None] = (None, None)

    def make_state(self, n_slots):
        return QueryMoments(n_slots, self.n_heads, self.n_kv_heads, self.head_dim, self.rope_base, self.n_sink)

    def head_scores(self, pages):
        state = pages.stats
        n_kv = state.keys.shape[1]
        sinks = pages.occupied() & (pages.positions < self.n_sink)
        candidates = np.broadcast_to(pages.kept(), (n_kv, len(pages.positions))) & ~sinks
        mean, cov = state.moments()
        rotation = self._mean_rotation(state)
        mean = mean @ rotation.T
        group = len(mean) // n_kv
        d = state.keys.shape[2]
        # R is 2 x 2 blocks (one per RoPE pair): kᵀ R Σ Rᵀ k is (Rᵀk)ᵀ Σ (Rᵀk), Rᵀk elementwise per pair
        cos, sin = np.diagonal(rotation)[0::2], np.diagonal(rotation, -1)[0::2]
        scores = np.zeros(candidates.shape)
        for kv in range(n_kv):
            rows = np.flatnonzero(candidates[kv])
            if not len(rows):
                continue
            keys = state.keys[rows, kv].astype(np.float64)  # (T, d)
            heads = slice(kv * group, (kv + 1) * group)
            logits = keys @ mean[heads].T / np.sqrt(d)  # (T, group)
            if self.use_covariance:
                turned = np.empty_like(keys)  # keys @ rotation
                turned[:, 0::2] = cos * keys[:, 0::2] + sin * keys[:, 1::2]
                turned[:, 1::2] = cos * keys[:, 1::2] - sin * keys[:, 0::2]
                # per key and head as a product and a row sum: the three-operand einsum it replaces looped in C
                # (0.05x sinks' decode rate); the same victims (tests/test_expected_attention_victims.py)
                logits += ((turned @ cov[heads]) * turned).sum(axis=2).T / (2 * d)
            weights = np.exp(logits - logits.max(axis=0))
            scores[kv, rows] = (weights / weights.sum(axis=0)).mean(axis=1)
            if self.use_vnorm:
                scores[kv, rows] *= state.value_norms[rows, kv]
        top = scores.max() + 1
        scores[:, sinks] = top  # as kvpress pads them: above every other token
        return scores

    def score(self, pages):
        return self.head_scores(pages).mean(axis=0)

    def protected(self, pages):
        return pages.occupied() & (pages.positions < self.n_sink)

    def _mean_rotation(self, state):
        start, rotation = self._rotation
        if start != state.next_position:  # every layer scores from the same position: computed once
            rotation = mean_rotation(state.next_position, self.n_future_positions, state.inv_freq)
            self._rotation = (state.next_position, rotation)
        assert rotation is not None  # (a start of None never equals a position: computed above)
        return rotation
