"""pagevis.engine: the paged KV cache, its eviction policies and attention. NumPy only, never Qt."""

from .attention import (
    AttentionResult,
    Partial,
    attend,
    attend_part,
    merge,
    rescale,
    softmax,
)
from .cache import PagedKVCache
from .config import CacheConfig, CacheSettings
from .errors import CacheFullError, ConfigError
from .events import CacheEvent, EventKind
from .frames import FramePool
from .policies import POLICIES, EvictionPolicy, layer_capacities, make_policy, policy_params
from .policy_state import LayerView, PolicyState
from .sequence import Sequence
from .store import COUNT_NAMES, PageStore, TierCounts

__all__ = [
    "COUNT_NAMES",
    "POLICIES",
    "AttentionResult",
    "CacheConfig",
    "CacheEvent",
    "CacheFullError",
    "CacheSettings",
    "ConfigError",
    "EventKind",
    "EvictionPolicy",
    "FramePool",
    "LayerView",
    "PageStore",
    "PagedKVCache",
    "Partial",
    "PolicyState",
    "Sequence",
    "TierCounts",
    "attend",
    "attend_part",
    "layer_capacities",
    "make_policy",
    "merge",
    "policy_params",
    "rescale",
    "softmax",
]
