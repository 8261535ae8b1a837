"""The scoring loops of the policies that score every resident token at every eviction, one numba call per layer.

Each policy's NumPy definition stays in its own file (`score`, `head_scores`: what the records show and what AdaKV
reads); these kernels compute the same sums in float64 for its per-step choice, where ~20 NumPy calls a layer (a
gather, a cast, a mean, a product per KV head, masks, sorts) cost more than the arithmetic. Dot products may be summed
in any order (fastmath reassoc: vectorised), so a score differs from NumPy's by float64 rounding only (BLAS sums in
its own order too); the tests compare every choice with the policies' brute-force references
(tests/test_engine_policies.py, tests/test_compression.py, tests/test_policy_kernels.py).

Compiled once and kept in numba's on-disk cache (cache=True), as the attention and weight kernels are.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from pagevis.kernel_intrinsics import NjitOptions

_FLAGS: NjitOptions = {"cache": True, "nogil": True, "fastmath": {"reassoc", "contract"}, "error_model": "numpy",
                       "boundscheck": False}


@njit(**_FLAGS)
def keydiff_choice(unit, positions, window):  # pragma: no cover (numba)
    """KeyDiff's victim among the resident slots (positions >= 0) outside the `window` newest: per KV head the anchor
    is the mean of every resident unit key, a token's score minus the mean over KV heads of its key's cosine to the
    anchor; the lowest score goes, ties to the oldest position. unit (n_slots, n_kv, d) float32. Returns
    (flat slot, score), or (-1, inf) when every resident token is protected."""
    n_slots, n_kv, d = unit.shape
    count = 0
    for s in range(n_slots):
        if positions[s] >= 0:
            count += 1
    rows = np.empty(count, np.int64)
    i = 0
    for s in range(n_slots):
        if positions[s] >= 0:
            rows[i] = s
            i += 1
    if count <= window:
        return -1, np.inf
    cutoff = np.iinfo(np.int64).max  # positions at or after it are the window's
    if window > 0:
        cutoff = np.sort(positions[rows])[count - window]
    # the keys are read token by token (each token's KV heads side by side, as they lie: one pass through the array,
    # which is cold at every step: the weights went through the caches since), each sum in the same order as head by
    # head: an anchor entry over the tokens in slot order, a dot over the channels, a token's total over the heads
    anchors = np.zeros((n_kv, d))
    for r in rows:
        for h in range(n_kv):
            anchor = anchors[h]
            for j in range(d):
                anchor[j] += unit[r, h, j]
    norms = np.empty(n_kv)
    for h in range(n_kv):
        anchor = anchors[h]
        square = 0.0
        for j in range(d):
            anchor[j] /= count
            square += anchor[j] * anchor[j]
        norm = math.sqrt(square)
        if not norm > 0:
            norm = 1.0
        norms[h] = norm
    total = np.zeros(count)
    for i in range(count):
        r = rows[i]
        for h in range(n_kv):
            anchor = anchors[h]
            dot = 0.0
            for j in range(d):
                dot += unit[r, h, j] * anchor[j]
            total[i] += -dot / norms[h]
    victim, best, oldest = -1, np.inf, np.iinfo(np.int64).max
    for i in range(count):
        r = rows[i]
        if positions[r] >= cutoff:
            continue
        score = total[i] / n_kv
        if score < best or (score == best and positions[r] < oldest):
            victim, best, oldest = r, score, positions[r]
    return victim, best


@njit(**_FLAGS)
def most_similar(unit, survivors, victim):  # pragma: no cover (numba)
    """The survivor (flat slot where `survivors` is True) whose unit keys are most like the victim's: the largest sum
    over KV heads of the cosines (the first such slot on a tie), or -1 if none survives."""
    n_slots, n_kv, d = unit.shape
    target, best = -1, -np.inf
    for s in range(n_slots):
        if not survivors[s]:
            continue
        dot = 0.0
        for h in range(n_kv):
            for j in range(d):
                dot += np.float64(unit[s, h, j]) * np.float64(unit[victim, h, j])
        if target < 0 or dot > best:
            target, best = s, dot
    return target


_EXACT: NjitOptions = {"cache": True, "nogil": True, "error_model": "numpy", "boundscheck": False}  # sums in NumPy's order


@njit(**_EXACT)
def snapkv_head_scores(rows, positions, kernel):  # pragma: no cover (numba)
    """SnapKV's per-KV-head scores (SnapKV.head_scores): the window's rows (window, n_kv, n_slots) summed in their
    order (as NumPy's sum over the first axis: the same float64 values), then max-pooled over `kernel` neighbouring
    resident tokens in position order (ends clipped); 0 on empty slots."""
    return _pooled_window(rows, _resident_by_position(positions), kernel)


@njit(**_EXACT)
def _pooled_window(rows, order, kernel):  # pragma: no cover (numba)
    """snapkv_head_scores over the resident slots `order` (oldest first). The rows are summed as they lie, every slot
    (one pass through them, cold at every step), each slot's sum in window order; then pooled in position order."""
    window, n_kv, n_slots = rows.shape
    sums = rows[0].copy()
    for w in range(1, window):
        for h in range(n_kv):
            for s in range(n_slots):
                sums[h, s] += rows[w, h, s]
    count = len(order)
    scores = np.zeros((n_kv, n_slots))
    seen = np.empty(count)
    half = kernel // 2
    for h in range(n_kv):
        for i in range(count):
            seen[i] = sums[h, order[i]]
        for i in range(count):
            best = seen[i]
            for j in range(max(0, i - half), min(count, i + half + 1)):
                if seen[j] > best:
                    best = seen[j]
            scores[h, order[i]] = best
    return scores


@njit(**_EXACT)
def adakv_drops(scores, kept, positions, protected, n_safe, need):  # pragma: no cover (numba)
    """AdaKV's `need` (KV head, slot) entries to drop (AdaKV.choose_head_victims): each kept entry's tier is 2 where
    the token is protected, else 1 among its head's n_safe best (highest score, ties to the newest), else 0; the
    entries go by (tier, score, position, head), lowest first. scores (n_kv, n_slots) float64, kept (n_kv, n_slots)
    bool (resident and kept by that head). Returns (heads, slots), in the order they go."""
    return _adakv_drops(scores, kept, positions, _resident_by_position(positions), protected, n_safe, need)


@njit(**_EXACT)
def _adakv_drops(scores, kept, positions, order, protected, n_safe, need):  # pragma: no cover (numba)
    """adakv_drops with the resident slots sorted by position (`order`, oldest first) given."""
    n_kv, n_slots = kept.shape
    tier = np.zeros((n_kv, n_slots), np.int64)
    newest_first = order[::-1]
    rows = np.empty(len(newest_first), np.int64)
    for h in range(n_kv):
        n = 0
        for s in newest_first:
            if kept[h, s]:
                rows[n] = s
                n += 1
        for s in rows[:n]:
            tier[h, s] = 2 if protected[s] else 0
        # the n_safe highest scores, ties to the newest: a stable sort of the newest-first rows by score, descending
        best = rows[:n][np.argsort(-scores[h, rows[:n]], kind="mergesort")[:n_safe]]
        for s in best:
            if tier[h, s] == 0:
                tier[h, s] = 1
    heads, slots = np.empty(need, np.int64), np.empty(need, np.int64)
    taken = np.zeros((n_kv, n_slots), np.bool_)
    n = 0
    while n < need:
        bh, bs = -1, -1
        for h in range(n_kv):
            for s in range(n_slots):
                if not kept[h, s] or taken[h, s]:
                    continue
                if bh < 0 or tier[h, s] < tier[bh, bs] or (tier[h, s] == tier[bh, bs] and (
                        scores[h, s] < scores[bh, bs] or (scores[h, s] == scores[bh, bs] and (
                            positions[s] < positions[bs] or (positions[s] == positions[bs] and h < bh))))):
                    bh, bs = h, s
        if bh < 0:
            break
        taken[bh, bs] = True
        heads[n], slots[n] = bh, bs
        n += 1
    return heads[:n], slots[:n]


@njit(**_EXACT)
def _resident_by_position(positions):  # pragma: no cover (numba)
    """The flat slots holding a token (positions >= 0), oldest position first."""
    count = 0
    for s in range(len(positions)):
        if positions[s] >= 0:
            count += 1
    resident = np.empty(count, np.int64)
    i = 0
    for s in range(len(positions)):
        if positions[s] >= 0:
            resident[i] = s
            i += 1
    return resident[np.argsort(positions[resident])]


@njit(**_EXACT)
def newest_mask(positions, n):  # pragma: no cover (numba)
    """Per flat slot, True on the n newest resident tokens (base.newest)."""
    mask = np.zeros(len(positions), np.bool_)
    if n > 0:
        order = _resident_by_position(positions)
        for s in order[max(0, len(order) - n):]:
            mask[s] = True
    return mask


@njit(**_EXACT)
def moments_add_one(deviations, mean, q, cos, sin, scale, fraction):  # pragma: no cover (numba)
    """Expected attention's running moments after one query (QueryMoments.query, n = 1; Chan et al.'s update): the
    query q (heads, d) float32 unrotated (RoPE's pairs turned back by cos, sin of its position's angles:
    rope_shift.rotate's arithmetic), shift = pre - mean; deviations += (shift * scale) shiftᵀ; mean += shift *
    fraction, with NumPy's operations in its order (no fused multiply-add): the same float64 values as the NumPy
    update, without its (heads, d, d) temporaries."""
    n_heads, d = mean.shape
    shift = np.empty(d)
    for h in range(n_heads):
        for i in range(d // 2):
            even, odd = np.float64(q[h, 2 * i]), np.float64(q[h, 2 * i + 1])
            shift[2 * i] = (even * cos[i] - odd * sin[i]) - mean[h, 2 * i]
            shift[2 * i + 1] = (even * sin[i] + odd * cos[i]) - mean[h, 2 * i + 1]
        for i in range(d):
            scaled = shift[i] * scale
            for j in range(d):
                deviations[h, i, j] += scaled * shift[j]
        for i in range(d):
            mean[h, i] += shift[i] * fraction


@njit(**_EXACT)
def covariance_columns(deviations, mean, inverse_count, columns):  # pragma: no cover (numba)
    """ExpectedAttention._columns: per KV head, (d, group * d + group) float32, its query heads' covariances
    (deviations * inverse_count, cast as written) side by side, then their means."""
    n_kv, d, width = columns.shape
    group = width // (d + 1)
    for kv in range(n_kv):
        for g in range(group):
            head = kv * group + g
            for i in range(d):
                for j in range(d):
                    columns[kv, i, g * d + j] = np.float32(deviations[head, i, j] * inverse_count)
                columns[kv, i, group * d + g] = np.float32(mean[head, i])


@njit(**_FLAGS)
def expected_weights(products, turned, value_norms, use_covariance, use_vnorm):  # pragma: no cover (numba)
    """ExpectedAttention._expected after its one product: products (heads, T, group * d + group) float32 (per query
    head (Rᵀk)ᵀΣ, then k·Rμ), turned (heads, T, d) float32 (Rᵀk), value_norms (heads, T) float32. Per query head the
    logits k·Rμ / sqrt(d) (float64) + (Rᵀk)ᵀΣ(Rᵀk) / (2d) (a float32 dot, summed in any order), softmax over the T
    keys in float64, the mean over the group's query heads, times ||v||: (heads, T) float64."""
    n_kv, n_keys, d = turned.shape
    group = products.shape[2] // (d + 1)
    root = math.sqrt(d)
    logits = np.empty((group, n_keys))
    expected = np.zeros((n_kv, n_keys))
    for h in range(n_kv):
        for t in range(n_keys):
            for g in range(group):
                logit = np.float64(products[h, t, group * d + g]) / root
                if use_covariance:
                    quadratic = np.float32(0.0)
                    for j in range(d):
                        quadratic += products[h, t, g * d + j] * turned[h, t, j]
                    logit += np.float64(quadratic / np.float32(2 * d))
                logits[g, t] = logit
        for g in range(group):
            top = -np.inf
            for t in range(n_keys):
                top = max(top, logits[g, t])
            total = 0.0
            for t in range(n_keys):
                logits[g, t] = math.exp(logits[g, t] - top)
                total += logits[g, t]
            for t in range(n_keys):
                expected[h, t] += logits[g, t] / total
        for t in range(n_keys):
            expected[h, t] /= group
            if use_vnorm:
                expected[h, t] *= value_norms[h, t]
    return expected


@njit(**_EXACT)
def adakv_snapkv_drops(rows, positions, head_keep, window, kernel, n_safe, budget):  # pragma: no cover (numba)
    """AdaKV.choose_head_victims over SnapKV's per-KV-head scores in one call: the kept entries (head_keep where a
    token is resident), `need` = kept + n_kv - n_kv * budget, and if any, SnapKV's head scores (snapkv_head_scores),
    its window (newest_mask) and adakv_drops. Returns (heads, slots, their scores); empty when nothing is due."""
    n_kv, n_slots = head_keep.shape
    kept = np.empty((n_kv, n_slots), np.bool_)
    count = 0
    for h in range(n_kv):
        for s in range(n_slots):
            kept[h, s] = head_keep[h, s] and positions[s] >= 0
            if kept[h, s]:
                count += 1
    need = count + n_kv - n_kv * budget
    if need <= 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    order = _resident_by_position(positions)  # (sorted once for the scores' pooling, the window and the tiers)
    scores = _pooled_window(rows, order, kernel)
    protected = np.zeros(n_slots, np.bool_)
    for s in order[max(0, len(order) - window):]:
        protected[s] = True
    heads, slots = _adakv_drops(scores, kept, positions, order, protected, n_safe, need)
    chosen = np.empty(len(heads))
    for i in range(len(heads)):
        chosen[i] = scores[heads[i], slots[i]]
    return heads, slots, chosen


@njit(**_EXACT)
def kept_entries(head_keep, positions):  # pragma: no cover (numba)
    """The (KV head, token) entries kept: head_keep where a token is resident (positions >= 0), summed."""
    n_kv, n_slots = head_keep.shape
    count = 0
    for h in range(n_kv):
        for s in range(n_slots):
            if head_keep[h, s] and positions[s] >= 0:
                count += 1
    return count


@njit(**_EXACT)
def head_mask_bias(keep, bias):  # pragma: no cover (numba)
    """paged_attention.kept_bias: (n_kv, n) float32, 0 where KV head h keeps slot s, -inf where it does not, plus the
    occupancy bias (n,) (None: 0); a (0, 0) array when no slot is kept by some KV heads and not others."""
    n_kv, n = keep.shape
    differ = False
    for s in range(n):
        first = keep[0, s]
        for h in range(1, n_kv):
            if keep[h, s] != first:
                differ = True
                break
        if differ:
            break
    if not differ:
        return np.zeros((0, 0), np.float32)
    out = np.empty((n_kv, n), np.float32)
    for h in range(n_kv):
        for s in range(n):
            value = np.float32(0.0) if keep[h, s] else np.float32(-np.inf)
            if bias is not None:
                value += bias[s]
            out[h, s] = value
    return out


@njit(**_EXACT)
def observe_window(rows, row, weights, start):  # pragma: no cover (numba)
    """ObservationWindow.observe of one decode query's weights (1, n_heads, m) float32 over the slots start:start + m,
    per KV head (rows (window, n_kv, n_slots) float64): ring row `row` zeroed, then each KV head's query heads' mean
    (a float32 sum in head order, divided in float64 and rounded to float32: NumPy's mean) on those slots."""
    _, n_kv, n_slots = rows.shape
    n_heads, m = weights.shape[1], weights.shape[2]
    group = n_heads // n_kv
    count = np.float64(group)
    for h in range(n_kv):
        for s in range(n_slots):
            rows[row, h, s] = 0.0
        for i in range(m):
            total = weights[0, h * group, i]
            for g in range(1, group):
                total += weights[0, h * group + g, i]
            rows[row, h, start + i] = np.float32(np.float64(total) / count)


@njit(**_EXACT)
def lowest_unprotected(scores, positions, n_newest):  # pragma: no cover (numba)
    """EvictionPolicy.choose_victims where the protected tokens are the n_newest resident ones (H2O, merge): the
    resident slot outside them with the lowest score, ties to the oldest position; -1 if every resident token is
    protected."""
    order = _resident_by_position(positions)
    victim = -1
    for i in range(len(order) - max(n_newest, 0)):  # oldest first: a later slot wins only with a lower score
        s = order[i]
        if victim < 0 or scores[s] < scores[victim]:
            victim = s
    return victim


@njit(**_FLAGS)
def merge_targets(unit, positions, victims, accumulated):  # pragma: no cover (numba)
    """MergeValues.merge_targets: for each victim in turn, the survivor most like it (most_similar over the resident
    slots that are not victims) and the victim's weight a_v / (a_s + a_v) (0.5 if both are 0); the survivor's
    accumulated attention becomes a_s + a_v (in `accumulated`). Returns (targets, weights): every target -1 when
    no token survives."""
    survivors = positions >= 0
    for victim in victims:
        survivors[victim] = False
    targets, weights = np.zeros(len(victims), np.int64), np.zeros(len(victims))
    for i in range(len(victims)):
        victim = victims[i]
        target = most_similar(unit, survivors, victim)
        if target < 0:  # (survivors are the same for every victim: the first finds none)
            return np.full(len(victims), -1, np.int64), weights
        mass = accumulated[target] + accumulated[victim]
        weights[i] = accumulated[victim] / mass if mass > 0 else 0.5
        accumulated[target] = mass
        targets[i] = target
    return targets, weights


@njit(**_EXACT)
def fold_value(v, page, slot, values, weight):  # pragma: no cover (numba)
    """Rewrites.fold_values for one survivor of float32 values v (n_kv, pages, page_size, d): v[:, page, slot] <-
    (1 - weight) v + weight values (values (n_kv, d) float64), in float64 and rounded to float32, as NumPy does."""
    n_kv, d = values.shape
    keep = 1.0 - weight
    for h in range(n_kv):
        for j in range(d):
            v[h, page, slot, j] = np.float32(keep * np.float64(v[h, page, slot, j]) + weight * values[h, j])


@njit(**_EXACT)
def unit_rows(k, out):  # pragma: no cover (numba)
    """keydiff.unit_keys for float32 keys (n, d), into out (n, d) float32: each row over the square root of its sum of
    squares, summed as NumPy sums a float32 row (pairwise: eight running sums per block of up to 128, halves above)
    so that every unit key is NumPy's bit for bit (a zero row stays zero)."""
    n, d = k.shape
    squares = np.empty(d, np.float32)
    for h in range(n):
        for j in range(d):
            squares[j] = k[h, j] * k[h, j]
        norm = np.sqrt(_pairwise_sum(squares, 0, d))
        if not norm > 0:
            norm = np.float32(1.0)
        for j in range(d):
            out[h, j] = k[h, j] / norm


@njit(**_EXACT)
def _pairwise_sum(a, lo, n):  # pragma: no cover (numba)
    """NumPy's pairwise sum of a[lo:lo + n] (float32, its FLOAT_pairwise_sum): up to 128 (PW_BLOCKSIZE) one block
    (_block_sum), else the sum of its two halves (the first a multiple of 8), each summed so: here with a stack of
    the halves still open rather than recursion (a recursive kernel loaded from numba's cache crashes)."""
    if n <= 128:
        return _block_sum(a, lo, n)
    starts, sizes, stage = np.empty(64, np.int64), np.empty(64, np.int64), np.zeros(64, np.int64)
    sums = np.empty(64, np.float32)
    starts[0], sizes[0], depth, done = lo, n, 1, 0
    while depth:
        top = depth - 1
        first, size = starts[top], sizes[top]
        half = size // 2
        half -= half % 8
        if size <= 128:
            sums[done] = _block_sum(a, first, size)
            done += 1
            depth -= 1
        elif stage[top] < 2:
            starts[depth], sizes[depth], stage[depth] = (first, half, 0) if stage[top] == 0 else (first + half,
                                                                                                  size - half, 0)
            stage[top] += 1
            depth += 1
        else:
            sums[done - 2] = sums[done - 2] + sums[done - 1]
            done -= 1
            depth -= 1
    return sums[0]


@njit(**_EXACT)
def _block_sum(a, lo, n):  # pragma: no cover (numba)
    """NumPy's pairwise sum of at most 128 float32: a plain loop under 8, else eight running sums combined pairwise
    and the rest added in order."""
    if n < 8:
        total = np.float32(0.0)
        for i in range(n):
            total += a[lo + i]
        return total
    r = a[lo: lo + 8].copy()
    last = n - n % 8
    for i in range(8, last, 8):
        for j in range(8):
            r[j] += a[lo + i + j]
    total = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
    for i in range(last, n):
        total += a[lo + i]
    return total
