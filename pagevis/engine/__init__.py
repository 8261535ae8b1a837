"""pagevis.engine: the paged KV cache, its eviction policies and attention. NumPy only, never Qt."""

from .attention import AttentionResult, attend, softmax
from .cache import PagedKVCache
from .config import CacheConfig
from .errors import CacheFullError, ConfigError
from .events import CacheEvent, EventKind
from .pages import LayerPages
from .policies import POLICIES, EvictionPolicy, make_policy, policy_params

__all__ = [
    "AttentionResult", "attend", "softmax", "PagedKVCache", "CacheConfig", "CacheFullError",
    "ConfigError", "CacheEvent", "EventKind", "LayerPages", "POLICIES", "EvictionPolicy",
    "make_policy", "policy_params",
]
