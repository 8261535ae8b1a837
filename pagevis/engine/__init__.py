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
from .policies import POLICIES, EvictionPolicy, make_policy, policy_params
from .policy_state import LayerView, PolicyState
from .sequence import Sequence
from .store import PageStore

__all__ = [
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
    "attend",
    "attend_part",
    "make_policy",
    "merge",
    "policy_params",
    "rescale",
    "softmax",
]
