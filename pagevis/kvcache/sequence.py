"""One sequence's share of the cache: what the cache manager keeps per sequence, per layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagevis.kvcache.key_channels import KeyChannels
from pagevis.kvcache.policies.wrappers import Policy
from pagevis.kvcache.policy_state import PolicyState


@dataclass
class SequenceCache:
    """One sequence's share of the cache: per layer its block table (page ids in logical order), the empty
    slots of its own pages, its resident tokens; its policy and statistics; the tokens it wrote (for prefix
    hashes)."""

    seq_id: int
    policy: Policy
    states: list[PolicyState]
    block_tables: list[list[int]]
    holes: list[set[int]]
    resident: list[int]
    read_slots: list[np.ndarray | None]  # per layer, the flat slots its last attention read (None: all)
    # per layer, (n_kv_heads, n_slots) bool: the KV heads that keep each slot's token (per-head policies only)
    head_keep: list[np.ndarray | None]
    token_ids: list[int] = field(default_factory=list)  # tokens whose K/V are written, in position order
    hashes: list[int] = field(default_factory=list)  # prefix hash of each full logical page, while hashable
    hashable: bool = True  # False once the sequence evicted: its pages no longer hold whole prefixes
    root: int = 0  # the parent hash of its first page (prefix_cache.salt_root: 0 without a cache salt)
    # local layers: per layer, the logical pages slid off the front of its table, the newest position slid out
    dropped: list[int] = field(default_factory=list)
    slid: list[int] = field(default_factory=list)
    newest: int = -1  # the newest position written (its query is the one a sliding window follows)
    channels: KeyChannels | None = None  # ThinK (key_channels): the query window, then the key channels kept

    def clear(self) -> None:
        for layer, table in enumerate(self.block_tables):
            table.clear()
            self.holes[layer].clear()
            self.resident[layer] = 0
            self.read_slots[layer] = None
            self.states[layer].reset()
            keep = self.head_keep[layer]
            if keep is not None:
                keep.fill(False)
            self.dropped[layer], self.slid[layer] = 0, -1
        self.newest = -1
        self.policy.reset()
        if self.channels is not None:
            self.channels.reset()
        self.token_ids.clear()
        self.hashes.clear()
        self.hashable = True
