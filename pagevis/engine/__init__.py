"""pagevis.engine: the paged KV cache (one block pool, one cache manager), its eviction policies and
attention. NumPy only, never Qt."""

from .attention import (
    AttentionResult,
    Partial,
    attend,
    attend_part,
    merge,
    rescale,
    softmax,
)
from .block_pool import BlockPool
from .config import CacheConfig, CacheSettings
from .errors import CacheFullError, ConfigError
from .events import CacheEvent, EventKind
from .kv_cache_manager import KVCacheManager, SequenceCache
from .policies import POLICIES, EvictionPolicy, layer_capacities, make_policy, policy_params
from .policy_state import LayerView, PolicyState
from .store import COUNT_NAMES, PageStore, TierCounts

__all__ = [
    "COUNT_NAMES",
    "POLICIES",
    "AttentionResult",
    "BlockPool",
    "CacheConfig",
    "CacheEvent",
    "CacheFullError",
    "CacheSettings",
    "ConfigError",
    "EventKind",
    "EvictionPolicy",
    "KVCacheManager",
    "LayerView",
    "PageStore",
    "Partial",
    "PolicyState",
    "SequenceCache",
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
