"""pagevis.engine: the paged KV cache, its eviction policies and attention. NumPy only, never Qt."""

from .attention import AttentionResult, attend, softmax
from .cache import PagedKVCache
from .config import CacheConfig, CacheSettings
from .errors import CacheFullError, ConfigError
from .events import CacheEvent, EventKind
from .frames import FramePool
from .policies import POLICIES, EvictionPolicy, layer_capacities, make_policy, policy_params
from .policy_state import LayerView, PolicyState
from .sequence import Sequence
from .store import PageStore

__all__ = [
    "AttentionResult", "attend", "softmax", "PagedKVCache", "CacheConfig", "CacheSettings", "CacheFullError",
    "ConfigError", "CacheEvent", "EventKind", "FramePool", "PageStore", "Sequence", "LayerView", "PolicyState",
    "POLICIES", "EvictionPolicy", "layer_capacities", "make_policy", "policy_params",
]
