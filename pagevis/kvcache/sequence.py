"""One sequence's share of the cache, in two parts (vLLM v1's shape: the request, and each layer manager's
`req_to_blocks` entry for it):

- `SequenceCache`: what the cache manager keeps per sequence whatever the layer: its policy, the tokens it
  wrote and their prefix hashes, its newest position, ThinK's key channels;
- `LayerTable`: its share of one layer, held by that layer's manager (layer_managers.py, `LayerManager.tables`):
  the block table, the empty slots of its own pages, its resident tokens, its policy's statistics and per-head
  masks, what its last attention read, and (local layers) what slid out of the window; and its decode lane
  (batch_writes.write_many's: its lowest empty slot while it decodes, its hole set brought up to date when read).
  Nothing else changes them but attention (paged_attention.py), which feeds the policy's statistics and notes the
  slots it read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagevis.kvcache.key_channels import KeyChannels
from pagevis.kvcache.policies.wrappers import Policy
from pagevis.kvcache.policy_state import PolicyState


@dataclass
class LayerTable:
    """One sequence's share of one layer: its block table (page ids in logical order), the empty slots of its
    own pages (`holes`), its resident tokens, its policy's statistics there (`state`), per KV head the slots whose
    tokens that head keeps (`head_keep`, (n_kv_heads, n_slots) bool: per-head policies only), the flat slots its
    last attention read (None: all); a local layer's logical pages slid off the front (`dropped`) and the newest
    position slid out (`slid`)."""

    state: PolicyState
    head_keep: np.ndarray | None = None
    pages: list[int] = field(default_factory=list)
    hole_set: set[int] = field(default_factory=set)  # `holes` but for the lane's writes (read it through `holes`)
    resident: int = 0
    read_slots: np.ndarray | None = None
    dropped: int = 0
    slid: int = -1
    # a lower bound on each non-empty page's newest position (-1: unknown; a local layer slides nothing while its
    # window starts at or below it): unknown again whenever a page joins the table or a token leaves it
    floor: int = -1
    # the decode lane (batch_writes.write_many; -1: stopped): while lane_next >= 0 the empty slots are hole_set less
    # lane_from .. lane_next - 1 (the lane's writes), the lowest is lane_next and lane_next .. lane_end - 1 are all
    # empty; lane_budget is the layer's budget of the sequence (LayerManager.budget) when the lane started
    lane_next: int = -1
    lane_from: int = -1
    lane_end: int = -1
    lane_budget: int = 0

    @property
    def holes(self) -> set[int]:
        """The empty slots of its own pages: the lane's writes taken out, and the lane stopped (the caller may change
        the set; `start_lane` starts it again)."""
        if self.lane_next >= 0:
            self.hole_set.difference_update(range(self.lane_from, self.lane_next))
            self.lane_next = -1
        return self.hole_set

    def n_holes(self) -> int:
        """len(holes), the lane left running."""
        return len(self.hole_set) - (self.lane_next - self.lane_from if self.lane_next >= 0 else 0)

    def start_lane(self, budget: int) -> int:
        """Start the decode lane at the lowest empty slot (returned; -1: no empty slot, no lane), `budget` the layer's
        budget of the sequence, which stays the same while the lane runs (a policy's layer_capacity once bound)."""
        holes, self.lane_budget = self.holes, budget
        if not holes:
            return -1
        flat = end = min(holes)
        while end in holes:
            end += 1
        self.lane_next, self.lane_from, self.lane_end = flat, flat, end
        return flat

    def resume_lane(self, flat: int, end: int) -> None:
        """Run the lane from flat when flat .. end - 1 are its only empty slots (the rest of a page just allocated
        and its first slot written: `start_lane` found no empty slot), its budget `start_lane`'s."""
        if len(self.holes) == end - flat:
            self.lane_next, self.lane_from, self.lane_end = flat, flat, end

    def clear(self) -> None:
        self.pages.clear()
        self.holes.clear()
        self.resident, self.read_slots, self.dropped, self.slid, self.floor = 0, None, 0, -1, -1
        self.state.reset()
        if self.head_keep is not None:
            self.head_keep.fill(False)


@dataclass
class SequenceCache:
    """One sequence's facts that hold for every layer: its policy, the tokens it wrote (for prefix hashes) and
    their hashes, its newest position, ThinK's key channels. Its pages are its layers' managers' (`LayerTable`)."""

    seq_id: int
    policy: Policy
    token_ids: list[int] = field(default_factory=list)  # tokens whose K/V are written, in position order
    hashes: list[int] = field(default_factory=list)  # prefix hash of each full logical page, while hashable
    hashable: bool = True  # False once the sequence evicted: its pages no longer hold whole prefixes
    root: int = 0  # the parent hash of its first page (prefix_cache.salt_root: 0 without a cache salt)
    newest: int = -1  # the newest position written (its query is the one a sliding window follows)
    channels: KeyChannels | None = None  # ThinK (key_channels): the query window, then the key channels kept

    def clear(self) -> None:
        self.newest = -1
        self.policy.reset()
        if self.channels is not None:
            self.channels.reset()
        self.token_ids.clear()
        self.hashes.clear()
        self.hashable = True
