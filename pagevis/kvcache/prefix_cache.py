"""Prefix hashes of full pages: a page is named by its parent page's hash and its own token ids, so two
sequences get the same hash for page i exactly when their first (i + 1) pages hold the same tokens. A cache
salt (vLLM's `cache_salt`, folded into its first block's hash) starts the chain from another root, so salted
and unsalted prompts, or two salts, share no page."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

ROOT_HASH = 0


def page_hash(parent: int, token_ids) -> int:
    digest = hashlib.blake2b(digest_size=8)
    digest.update(int(parent).to_bytes(8, "little"))
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return int.from_bytes(digest.digest(), "little") >> 1  # 63 bits: fits the int64 columns of a trace


def salt_root(salt: str | None) -> int:
    """The parent hash of a sequence's first page: ROOT_HASH without a salt."""
    if not salt:
        return ROOT_HASH
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8, person=b"cache_salt").digest(), "little") >> 1


def prefix_hashes(token_ids, page_size: int, root: int = ROOT_HASH) -> list[int]:
    """The hash of every full page of token_ids, in order (a partial last page has none)."""
    hashes, parent = [], root
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = page_hash(parent, token_ids[start: start + page_size])
        hashes.append(parent)
    return hashes


@dataclass
class PrefixCacheStats:
    """Counted in tokens, as vLLM's prefix_cache_queries / prefix_cache_hits are."""

    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens whose K/V came from the cache

    def record(self, queries: int, hits: int) -> None:
        self.queries += queries
        self.hits += hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
