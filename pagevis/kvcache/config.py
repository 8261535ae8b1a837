"""Cache settings (what a user chooses) and the cache configuration (settings + the model's head layout)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np

from pagevis import settings
from pagevis.errors import ConfigError, check_int
from pagevis.settings import MAX_PAGE_SIZE, MAX_PAGES, SELECT_MODES, STORAGE_DTYPES, field_for
from pagevis.kvcache.policies import HeadLayout, make_policy
from pagevis.kvcache.key_channels import pruned_count
from pagevis.kvcache.quant import has_residual, is_quantized, layout_for
from pagevis.kvcache.layer_spec import LayerSpec, check_windows, layer_specs

# The settings' bounds live in the table (pagevis.settings); they are named here too for the engine's readers.
__all__ = ["MAX_CACHE_BYTES", "MAX_HEADS", "MAX_HEAD_DIM", "MAX_LAYERS", "MAX_PAGE_SIZE", "MAX_PAGES", "SELECT_MODES",
           "STORAGE_DTYPES", "CacheConfig", "CacheSettings"]
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_LAYERS = 1024
MAX_CACHE_BYTES = 8 << 30  # refuse a configuration whose K/V storage alone would exceed 8 GiB


class RopeLayout(Protocol):
    """How a model rotates its keys (model.config.Layout), as far as the cache asks."""

    @property
    def rope_neox(self) -> bool: ...


class ModelLayout(Protocol):
    """What `CacheConfig.for_model` reads of a model's config: model.config.ModelConfig satisfies it (the cache does
    not import the model package; mypy checks the match where engine/session_config.py passes a ModelConfig)."""

    @property
    def n_layers(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def n_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def rope_base(self) -> float: ...
    @property
    def rope_bases(self) -> tuple[float, ...]: ...
    @property
    def rope_scaled(self) -> bool: ...
    @property
    def sliding_windows(self) -> tuple[int | None, ...]: ...
    @property
    def layout(self) -> RopeLayout: ...


@dataclass(frozen=True)
class CacheSettings:
    """The cache as a user sets it up: SessionConfig and CacheConfig both extend this. Defaults, bounds and
    help come from the settings table (pagevis/settings.py).

    Construction only freezes the values; `check()` validates them (a GUI builds settings from its
    controls first and shows the first problem). Capacity is max_pages * page_size tokens per layer.
    """

    page_size: int = field_for("page_size")
    max_pages: int = field_for("max_pages")
    dtype: str = field_for("dtype")
    residual: int = field_for("residual")  # int4 / int2: tokens kept in float32 (KIVI's residual window)
    policy: str = field_for("policy")
    policy_params: Mapping[str, Any] = field_for("policy_params")
    key_channels: float = field_for("key_channels")  # ThinK: the share of key channels pruned (key_channels.py)
    disk_pages: int = field_for("disk_pages")  # per layer; 0 = no disk tier. With one, RAM frames cache them
    swap_dir: str | None = field_for("swap_dir")  # None = the system's temporary folder
    select: str = field_for("select")  # which pages a decode query reads: all (exact) or quest (by key bounds)
    select_pages: int = field_for("select_pages")

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy_params", MappingProxyType(dict(self.policy_params)))

    def check(self) -> None:
        """ConfigError for the first bad setting. Nothing here depends on the model's head layout."""
        self._check_settings()
        make_policy(self)  # validates the policy's name and parameters against this budget

    def _check_settings(self) -> None:
        settings.check(self, of=CacheSettings)  # each value against the table's bounds and choices
        if self.disk_pages and self.max_pages < 2:
            raise ConfigError("max_pages", self.max_pages, "at least 2 with a disk tier (one RAM frame for the "
                              "newest page, one to read disk pages into)")
        self._check_key_channels()

    def _check_key_channels(self) -> None:
        """ThinK zeroes channels of float keys in RAM pages: refused with a quantized dtype, a disk tier or quest."""
        if not self.key_channels:
            return
        in_ram = "ThinK zeroes key channels in float pages held in RAM"
        clash = (("dtype", self.dtype, "float32 or float16", in_ram) if is_quantized(self.dtype) else
                 ("disk_pages", self.disk_pages, "0", in_ram) if self.disk_pages else
                 ("select", self.select, "all", in_ram) if self.select == "quest" else
                 ("policy", self.policy, "a policy other than kvzip", "kvzip's reconstruction pass would score "
                  "whole new keys against pruned cached ones") if self.policy == "kvzip" else None)
        if clash is not None:
            name, value, allowed, why = clash
            raise ConfigError(name, value, f"{allowed} with key_channels {self.key_channels:g} ({why})")

    @property
    def tiered(self) -> bool:
        return self.disk_pages > 0

    @property
    def home_frames(self) -> int:
        """RAM frames that keep pages between steps; the rest (half, at least one) take pages read
        from disk. Without a disk tier every frame is a home frame."""
        return self.max_pages - max(1, self.max_pages // 2) if self.tiered else self.max_pages

    @property
    def n_page_ids(self) -> int:
        """Pages a layer can hold: its disk frames with a disk tier, else its RAM frames."""
        return self.disk_pages or self.max_pages

    def cache_settings(self) -> dict[str, Any]:
        """The settings alone, as keyword arguments (for CacheConfig or another CacheSettings)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(CacheSettings)}

    @property
    def capacity(self) -> int:
        """Tokens each layer can hold: its page ids' slots (disk pages with a disk tier, else RAM frames)."""
        return self.n_page_ids * self.page_size

    @property
    def ram_tokens(self) -> int:
        """Tokens the RAM frames hold, max_pages * page_size (the capacity without a disk tier)."""
        return self.max_pages * self.page_size

    @property
    def has_residual(self) -> bool:
        """int4 / int2 (KIVI): a float32 residual window beside the quantized pages (`residual` applies)."""
        return has_residual(self.dtype)

    @property
    def float_in_ram(self) -> bool:
        """Whether K/V are float32 / float16 in RAM pages (no quantized dtype, no disk tier, no quest): what
        rewriting them in place (re-rotation, merging) and kvzip's reconstruction pass need."""
        return not is_quantized(self.dtype) and not self.disk_pages and self.select != "quest"

    @property
    def head_layout(self) -> HeadLayout:
        """Settings alone know no model: the one-head layout a policy is checked against (CacheConfig: the model's)."""
        return HeadLayout()


@dataclass(frozen=True)
class CacheConfig(CacheSettings):
    """The settings plus the model's layout: everything the engine needs to build a cache.

    n_heads is the number of query heads; it must be a multiple of n_kv_heads (grouped-query
    attention; n_kv_heads = 1 is multi-query). Construction validates everything.
    """

    n_layers: int = 1
    n_heads: int = 1
    n_kv_heads: int = 1
    head_dim: int = 64
    rope_base: float = 10000.0  # the model's RoPE base (expected-attention undoes RoPE on the queries it sees)
    # per layer, a sliding window in positions or None (full attention): the model's `sliding_windows`
    sliding_windows: tuple[int | None, ...] | None = None

    @classmethod
    def for_model(cls, settings: CacheSettings, model_config: ModelLayout) -> CacheConfig:
        _check_rope_is_llamas(settings, model_config)
        return cls(**settings.cache_settings(), n_layers=model_config.n_layers, n_heads=model_config.n_heads,
                   n_kv_heads=model_config.n_kv_heads, head_dim=model_config.head_dim,
                   rope_base=float(model_config.rope_base), sliding_windows=model_config.sliding_windows)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_settings()
        check_int("n_layers", self.n_layers, 1, MAX_LAYERS)
        check_int("n_heads", self.n_heads, 1, MAX_HEADS)
        check_int("n_kv_heads", self.n_kv_heads, 1, MAX_HEADS)
        check_int("head_dim", self.head_dim, 1, MAX_HEAD_DIM)
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                "n_heads", self.n_heads, f"a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        self._check_windows()
        if self.total_bytes() > MAX_CACHE_BYTES:
            per_page = self.total_bytes() // self.max_pages
            raise ConfigError(
                "max_pages",
                self.max_pages,
                f"at most {MAX_CACHE_BYTES // per_page} pages with this page size, layer and head "
                f"layout (the K/V storage must fit in {MAX_CACHE_BYTES >> 30} GiB)",
            )
        make_policy(self)

    def _check_windows(self) -> None:
        try:
            windows = check_windows(self.sliding_windows, self.n_layers)
        except ValueError as error:
            raise ConfigError("sliding_windows", self.sliding_windows, str(error)) from None
        if windows is not None and not any(windows):  # all None: no layer is local
            windows = None
        object.__setattr__(self, "sliding_windows", windows)
        if windows is not None and (layout := layout_for(self)) is not None and layout.kivi:
            raise ConfigError("dtype", self.dtype, "float32, float16 or int8 with sliding_windows (int4 / int2 "
                              "key groups span the pages a sliding window frees)")

    @property
    def head_layout(self) -> HeadLayout:
        return HeadLayout(self.n_layers, self.n_heads, self.n_kv_heads, self.head_dim, self.rope_base)

    @property
    def layer_specs(self) -> tuple[LayerSpec, ...]:
        """What each layer holds: every token (global) or a sliding window (local)."""
        return layer_specs(self.sliding_windows, self.n_layers)

    @property
    def hybrid(self) -> bool:
        """Whether some layer keeps a sliding window."""
        return self.sliding_windows is not None

    def page_bytes(self) -> int:
        """K and V of one page of one layer, in bytes (the unit the disk tier moves): with a quantized dtype
        its codes and per-token scales (and zero points), see quant.Layout."""
        layout = layout_for(self)
        if layout is not None:
            return layout.page_bytes()
        return 2 * self.page_size * self.n_kv_heads * self.head_dim * np.dtype(self.dtype).itemsize

    def bytes_per_layer(self) -> int:
        """K/V storage of one layer in RAM, in bytes: the RAM frames' pages, and for int4 / int2 what sits
        beside the pages (`side_bytes`)."""
        return self.max_pages * self.page_bytes() + self.side_bytes()

    def side_bytes(self) -> int:
        """int4 / int2, one layer, one sequence at capacity: each slot's key group (int32), the key groups'
        scales and zero points (one per key group of slots), and the residual window in float32. 0 else."""
        layout = layout_for(self)
        if layout is None or not layout.kivi:
            return 0
        slots = self.capacity
        return (slots * layout.slot_group_bytes() + -(-slots // layout.group) * layout.key_group_bytes()
                + min(slots, layout.window()) * layout.residual_bytes_per_token())

    def kv_bytes_per_token(self) -> float:
        """K/V bytes per token, all layers, of one sequence's cache at capacity (every page, in whichever
        tier, and what sits beside them), over the tokens it holds."""
        return (self.n_layers * (self.n_page_ids * self.page_bytes() + self.side_bytes()) / self.capacity
                - self.pruned_key_bytes_per_token())

    @property
    def kept_key_channels(self) -> int:
        """Key channels per KV head a token keeps: head_dim, less ThinK's pruned ones (key_channels.py)."""
        return self.head_dim - pruned_count(self.head_dim, self.key_channels)

    def pruned_key_bytes_per_token(self) -> int:
        """ThinK: the bytes per token, all layers, that a store of the kept key channels alone saves. The
        arrays here stay full width (the pruned channels are zeros): see key_channels.py."""
        pruned = self.head_dim - self.kept_key_channels
        return self.n_layers * self.n_kv_heads * pruned * np.dtype(self.dtype).itemsize if pruned else 0

    @property
    def quantized(self) -> bool:
        return is_quantized(self.dtype)

    def total_bytes(self) -> int:
        return self.n_layers * self.bytes_per_layer()


def _check_rope_is_llamas(settings: CacheSettings, model_config: ModelLayout) -> None:
    """Re-rotation and expected-attention undo or redo RoPE themselves, as llama rotates: adjacent pairs, one
    base, unscaled. A model that rotates halves (NEOX: Qwen, Gemma), has a base per layer (Gemma 3) or scales its
    angles (rope_freqs, linear scaling) is refused by name."""
    if not (model_config.layout.rope_neox or len(set(model_config.rope_bases)) > 1 or model_config.rope_scaled):
        return
    why = ("a model with llama's RoPE (adjacent pairs, one base, unscaled); this one rotates halves, has a base "
           "per layer or scales its RoPE")
    if settings.policy_params.get("rerotate"):
        raise ConfigError("rerotate", settings.policy_params["rerotate"], f"0 here: re-rotation needs {why}")
    if settings.policy == "expected-attention":
        raise ConfigError("policy", settings.policy, f"another policy here: expected-attention needs {why}")
