"""Cache configuration and its validation."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from ..errors import ConfigError, check_int

MAX_PAGE_SIZE = 4096
MAX_PAGES = 1 << 20
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_LAYERS = 1024
MAX_CACHE_BYTES = 8 << 30  # refuse a configuration whose K/V storage alone would exceed 8 GiB
STORAGE_DTYPES = ("float32", "float16")


@dataclass(frozen=True)
class CacheConfig:
    """Shape of the paged KV cache and the policy that evicts from it.

    Capacity is max_pages * page_size tokens per layer. n_heads is the number of query heads;
    it must be a multiple of n_kv_heads (grouped-query attention; n_kv_heads = 1 is multi-query).
    """

    page_size: int = 16
    max_pages: int = 64
    n_layers: int = 1
    n_heads: int = 1
    n_kv_heads: int = 1
    head_dim: int = 64
    dtype: str = "float32"
    policy: str = "sinks"
    policy_params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_int("page_size", self.page_size, 1, MAX_PAGE_SIZE)
        check_int("max_pages", self.max_pages, 1, MAX_PAGES)
        check_int("n_layers", self.n_layers, 1, MAX_LAYERS)
        check_int("n_heads", self.n_heads, 1, MAX_HEADS)
        check_int("n_kv_heads", self.n_kv_heads, 1, MAX_HEADS)
        check_int("head_dim", self.head_dim, 1, MAX_HEAD_DIM)
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                "n_heads", self.n_heads, f"a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.dtype not in STORAGE_DTYPES:
            raise ConfigError("dtype", self.dtype, f"one of {', '.join(STORAGE_DTYPES)}")
        if self.total_bytes() > MAX_CACHE_BYTES:
            per_page = self.total_bytes() // self.max_pages
            raise ConfigError(
                "max_pages",
                self.max_pages,
                f"at most {MAX_CACHE_BYTES // per_page} pages with this page size, layer and head "
                f"layout (the K/V storage must fit in {MAX_CACHE_BYTES >> 30} GiB)",
            )
        object.__setattr__(self, "policy_params", MappingProxyType(dict(self.policy_params)))
        # Building the policy validates its name and parameters against this budget.
        from .policies import make_policy

        make_policy(self)

    @property
    def capacity(self) -> int:
        """Tokens each layer can hold."""
        return self.max_pages * self.page_size

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    def bytes_per_layer(self) -> int:
        """K and V storage of one layer, in bytes."""
        itemsize = np.dtype(self.dtype).itemsize
        return 2 * self.capacity * self.n_kv_heads * self.head_dim * itemsize

    def total_bytes(self) -> int:
        return self.n_layers * self.bytes_per_layer()
