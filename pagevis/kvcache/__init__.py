"""pagevis.kvcache: the paged KV cache (one block pool, one cache manager), its eviction policies and
attention. NumPy, with Numba for the attention kernels; never Qt."""

from pagevis.kvcache.attention_kernels import AttentionResult, Partial, attend, attend_part, merge, rescale, softmax
from pagevis.kvcache.block_pool import BlockPool
from pagevis.kvcache.config import CacheConfig, CacheSettings
from pagevis.kvcache.errors import CacheFullError, ConfigError
from pagevis.kvcache.events import CacheEvent, EventKind
from pagevis.kvcache.kv_cache_manager import KVCacheManager
from pagevis.kvcache.sequence import SequenceCache
from pagevis.kvcache.policies import POLICIES, EvictionPolicy, layer_capacities, make_policy, policy_params
from pagevis.kvcache.policy_state import LayerView, PolicyState
from pagevis.kvcache.ram_tier import COUNT_NAMES, TierCounts
from pagevis.kvcache.store import PageStore

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
