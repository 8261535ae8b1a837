"""The numbers of a many-sequence run: pages with and without sharing, what contiguous per-sequence
allocation would reserve, copy-on-write, prefix-cache hits, preemptions and aggregate speed."""

from __future__ import annotations

from pagevis.kvcache import EventKind


def batch_summary(batch, records, seconds: float) -> dict:
    """`records` are the BatchRecords of the run (in order); peaks are over them, in each record's fullest layer's pages
    (BatchRecord.pages_used)."""
    page_size = batch.config.page_size
    decoded = sum(r.tokens_decoded for r in records)
    peak_used = max((r.pages_used for r in records), default=0)
    peak_unshared = max((r.pages_unshared for r in records), default=0)
    peak_reserved = max((r.contiguous_reserved_tokens for r in records), default=0)
    longest = max((len(s.prompt_ids) + len(s.generated) for s in batch.requests.values()), default=0)
    stats = batch.cache.prefix_stats
    return {
        "sequences": len(batch.requests),
        "steps": len(records),
        "generated_tokens": sum(len(s.generated) for s in batch.requests.values()),
        "page_size": page_size,
        "pool_pages": batch.cache.pool_pages,
        "pages_used_peak": peak_used,
        "pages_without_sharing_peak": peak_unshared,
        "pages_one_sequence": min(-(-longest // page_size), batch.config.max_pages),
        "sharing_saves": 1 - peak_used / peak_unshared if peak_unshared else 0.0,
        "contiguous_reserved_pages_peak": -(-peak_reserved // page_size),
        "copy_on_write": sum(1 for r in records for e in r.events if e.kind is EventKind.COPY_ON_WRITE and e.layer == 0),
        "prefix_cache_queries": stats.queries,
        "prefix_cache_hits": stats.hits,
        "prefix_cache_hit_rate": stats.hit_rate,
        "preemptions": batch.preemptions,
        "aggregate_tokens_per_s": decoded / seconds if seconds > 0 else None,
        "seconds": seconds,
    }
