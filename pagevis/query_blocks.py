"""How many queries of a long prefill attend at once: the paged cache's attention (kvcache/attention_kernels.py) and
the bare model's dense attention (model/dense.py) block them alike, so that a prefill's scores stay within
SCORE_BYTES and, with blocks aligned as below, no bit of either result moves."""

from __future__ import annotations

import math

SCORE_BYTES = 16 << 20  # a prefill's scores (queries x heads x keys, float32) at most this many bytes a block
# A block's rows (its queries x the group, per KV head) are a multiple of this where the budget allows: BLAS's
# kernels compute a tile of 16, 24, 32, 48 or 64 rows (by CPU) in one order and a shorter tail in another, so
# blocks aligned to every tile give each row the bits the whole product gives it (OpenBLAS's Haswell sgemm: 24)
ROW_ALIGN = 192


def query_block(n_heads: int, n_keys: int, n_kv: int = 1) -> int:
    """Queries a block: as many as keep the scores within SCORE_BYTES, in whole ROW_ALIGN rows of each KV head's
    group when that fits (else as many as fit, at least one). A prefill of a few hundred tokens is one block; over
    4,096 keys SmolLM2's 9 heads take 64 queries a block, not 604 MB of scores for the 4,096 queries of one layer
    (llama.cpp's ubatch: 512 queries)."""
    fit = max(1, SCORE_BYTES // (4 * n_heads * max(n_keys, 1)))
    group = max(1, n_heads // max(n_kv, 1))
    align = ROW_ALIGN // math.gcd(ROW_ALIGN, group)  # queries whose rows are whole ROW_ALIGN multiples
    return fit // align * align if fit >= align else fit
