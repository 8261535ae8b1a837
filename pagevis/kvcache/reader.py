"""Which pages a query reads, and attention over pages that do not all sit in RAM at once.

`all` reads every page of the sequence: the pages in RAM are attended in place, the pages on disk are
read into the read frames a batch at a time, and the partial attentions are merged by log-sum-exp, so
the result is the exact attention over every token. `quest` (Tang et al. 2024, arXiv:2406.10774) reads
only the pages whose keys can score highest: for every page and KV head the store keeps the smallest
and largest key, so q·k <= Σᵢ max(qᵢ·minᵢ, qᵢ·maxᵢ) bounds each query head's score on the page. Heads
differ in scale, so each head's bounds become shares (a softmax over pages) and a page is worth the
largest share any head gives it; the newest page is always read. Weights come back over the tokens
actually read.

A quantized store is read a block of pages at a time (at most quant.BLOCK_TOKENS slots): each block is
dequantized to float32, attended, and merged like the disk batches, so the whole cache is never
dequantized at once; blocks with no slot to read are skipped.
"""

from __future__ import annotations

import numpy as np

from pagevis.kvcache.attention_kernels import AttentionResult, Partial, attend_part, merge, rescale
from pagevis.kvcache.disk_tier import DiskTier
from pagevis.kvcache.quant import BLOCK_TOKENS
from pagevis.kvcache.slots import flat_slots
from pagevis.kvcache.store import PageStore

NO_OUTPUT = np.zeros(0, np.float32)  # a Partial kept for its max and sum only (rescaling the weights)


def quest_pages(store: PageStore, pages: np.ndarray, q: np.ndarray, k: int) -> np.ndarray:
    """The k pages of `pages` (a block table) with the highest upper bound, always including the last."""
    if len(pages) <= k:
        return pages
    n_kv, _, d = store.key_min.shape
    grouped = q[-1].reshape(n_kv, -1, d).transpose(0, 2, 1)  # (n_kv, d, group)
    # Σᵢ max(qᵢ·minᵢ, qᵢ·maxᵢ) = max·q⁺ + min·q⁻: two matrix products over every page id
    bound = np.matmul(store.key_max, np.maximum(grouped, 0)) + np.matmul(store.key_min, np.minimum(grouped, 0))
    bound = bound.transpose(1, 0, 2).reshape(store.n_pages, -1)[pages] / np.sqrt(d)  # (pages, heads)
    shares = np.exp(bound - bound.max(axis=0))
    shares /= shares.sum(axis=0)
    worth = shares.max(axis=1)[:-1]
    best = np.argpartition(-worth, k - 2)[: k - 1] if k > 1 else np.zeros(0, dtype=np.int64)
    return pages[np.sort(np.append(best, len(pages) - 1))]


def read_attention(store: PageStore, table: list[int], q: np.ndarray, positions: np.ndarray, step: int,
                   select_pages: int | None, all_weights: bool, own_pages_only: bool = False,
                   keep: np.ndarray | None = None, window: int | None = None) -> AttentionResult:
    """Attention over the pages of `table` that the selection reads (all, or quest's top select_pages).
    With `own_pages_only` (other sequences' pages share the RAM frames) only the table's pages are read.
    `keep` (n_kv_heads, flat slots), a per-head policy's masks: KV head h reads only the slots keep[h] holds.
    With a sliding `window`, keys at or below positions - window are masked, and quest chooses among the pages
    holding a key the last query can see.

    Weights come back over flat slots `result.slots` (page * page_size + slot): all queries' if
    `all_weights`, else only the last query's (shape (1, n_heads, m)).
    """
    ps, tier = store.page_size, store.tier
    pages = np.asarray(table, dtype=np.int64)
    if select_pages is not None:
        if window:
            newest = store.positions.reshape(-1, ps)[pages].max(axis=1)
            pages = pages[newest > positions[-1] - window]
        pages = quest_pages(store, pages, q, select_pages)
    in_ram = store.in_ram(pages)
    ram_pages, disk_pages = pages[in_ram], np.sort(pages[~in_ram])
    rows = len(q) if all_weights else 1  # the queries whose weights come back
    whole: Partial | None = None  # the merge so far: one running partial, not one per batch
    pieces: list[tuple[Partial, np.ndarray, np.ndarray]] = []  # per batch: its max and sum, weights, slots

    def attend_frames(lo: int, hi: int, bias: np.ndarray) -> None:
        if store.quantized:  # a block at a time, skipping blocks with nothing to read
            block = max(1, BLOCK_TOKENS // ps)
            for start in range(lo, hi, block):
                end = min(start + block, hi)
                part = bias[(start - lo) * ps: (end - lo) * ps]
                if np.isfinite(part).any():
                    attend_block(start, end, part)
        else:
            attend_block(lo, hi, bias)

    def attend_block(lo: int, hi: int, bias: np.ndarray) -> None:
        nonlocal whole
        span = slice(lo * ps, hi * ps)
        keys, values = store.frame_kv(lo, hi)
        slots = flat_slots(store.page_in[lo:hi], ps)
        held = None if keep is None else np.where(slots >= 0, keep[:, np.maximum(slots, 0)], False)
        part, weights = attend_part_kept(q, keys, values, bias, store.frame_positions[span], positions, held, window)
        whole = part if whole is None else merge(whole, part)
        resident = np.isfinite(bias)  # resident slots of read pages only
        # copies of the rows kept: views would keep a prefill's whole (queries, heads, keys) arrays alive
        pieces.append((Partial(NO_OUTPUT, part.max[-rows:].copy(), part.total[-rows:].copy()),
                       weights[-rows:].copy(), np.where(resident, slots, -1)))

    if isinstance(tier, DiskTier):
        tier.clear_read_frames()
        tier.last_read[ram_pages] = step
    tier.counts.hits += len(ram_pages)
    if high := store.high_water:
        bias = store.bias[: high * ps]
        if select_pages is not None or own_pages_only:  # read only the chosen pages among those in RAM
            chosen = np.zeros(high, dtype=bool)
            chosen[store.frame_of[ram_pages]] = True
            bias = np.where(np.repeat(chosen, ps), bias, np.float32(-np.inf)).astype(np.float32)
        attend_frames(0, high, bias)
    batch = max(1, store.n_frames - store.home_frames)  # 0 read frames: RAM only, no disk page
    promote = select_pages is not None
    for start in range(0, len(disk_pages), batch):
        assert isinstance(tier, DiskTier)  # only a disk tier has pages outside RAM
        chunk = disk_pages[start: start + batch]
        tier.load(chunk, step, announce=select_pages is not None)
        lo = store.home_frames
        attend_frames(lo, lo + len(chunk), store.bias[lo * ps: (lo + len(chunk)) * ps])
        if promote:
            for frame in range(lo, lo + len(chunk)):
                tier.promote(frame, step)

    if whole is None:  # nothing to read (a quantized store skipped every block): no key is visible
        attend_block(0, 0, store.bias[:0])
    assert whole is not None  # attend_block set it
    last = Partial(NO_OUTPUT, whole.max[-rows:], whole.total[-rows:])
    weights = np.concatenate([w * rescale(p, last)[..., None] for p, w, _ in pieces], axis=-1)
    slots = np.concatenate([s for _, _, s in pieces])
    keep = slots >= 0
    return AttentionResult(whole.output, weights[..., keep], slots[keep])


def attend_part_kept(q: np.ndarray, keys: np.ndarray, values: np.ndarray, bias: np.ndarray, key_positions: np.ndarray,
                     positions: np.ndarray, keep: np.ndarray | None, window: int | None = None
                     ) -> tuple[Partial, np.ndarray]:
    """`attend_part` where KV head h reads only the keys keep[h] holds (a per-head policy's masks; None: every
    head reads every key). When the heads differ on a key, each KV head's queries attend alone with its mask
    added to the bias, and their partials are joined in query-head order (they merge head by head)."""
    if keep is None or (keep.all(axis=0) | ~keep.any(axis=0)).all():
        return attend_part(q, keys, values, bias, key_positions, positions, window)
    group = q.shape[1] // keys.shape[0]
    parts, weights = [], []
    for head in range(keys.shape[0]):
        head_bias = np.where(keep[head], np.float32(0), np.float32(-np.inf)) + bias
        part, w = attend_part(q[:, head * group: (head + 1) * group], keys[head: head + 1], values[head: head + 1],
                              head_bias, key_positions, positions, window)
        parts.append(part)
        weights.append(w)
    joined = Partial(*(np.concatenate(arrays, axis=1) for arrays in zip(*parts, strict=True)))
    return joined, np.concatenate(weights, axis=1)
