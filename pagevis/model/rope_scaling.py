"""RoPE scaling as llama.cpp reads it from a GGUF file's metadata (src/llama-model.cpp, load_hparams; and
src/llama-context.cpp, where the context takes it up):

- `<arch>.rope.scaling.type` is one of none, linear, yarn, longrope; when absent it is "linear". Another name
  fails an assertion in llama.cpp; here it is refused with one line.
- the factor is `<arch>.rope.scaling.factor`, or the older `<arch>.rope.scale_linear` when that key is absent;
  llama.cpp's freq_scale is 1 / factor, and a factor of 0 (or none at all) means 1.
- type none never scales, whatever the factor ("never scale if scaling type is none").
- linear (with ext_factor 0, as llama.cpp sets it for every type but yarn): ggml_rope_ext turns position p of
  pair i by p * freq_scale * base**(-2i/d), i.e. the positions are divided by the factor; Hugging Face's
  rope_type "linear" divides inv_freq by the same factor. Llama 3's rope_freqs divisors apply on top.
- yarn and longrope change more than the angles (attention factor, ramps, per-dimension factor lists) and are
  refused, as is `<arch>.rope.scaling.attn_factor` other than 1 (it scales the rotated Q and K).

Gemma 3's sliding-window layers are never scaled (llama.cpp sets rope_freq_scale_train_swa = 1 for it): the
architecture says which layers take the factor (architectures/gemma3.py).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

from pagevis.model.errors import ModelLoadError

LLAMA_CPP_TYPES = ("none", "linear", "yarn", "longrope")  # llama.cpp's LLAMA_ROPE_SCALING_TYPES
SUPPORTED = ("none", "linear")
DEFAULT_TYPE = "linear"  # llama.cpp's default when the file does not say


def linear_factor(path: Path, arch: str, value: Callable[..., Any]) -> float:
    """The factor every RoPE position is divided by (1.0: unscaled), or ModelLoadError naming the key.

    value(key, kind, default) reads `<arch>.<key>` checked for its kind (gguf_loader.metadata_value)."""
    kind = value("rope.scaling.type", "str", DEFAULT_TYPE)
    if kind not in SUPPORTED:
        known = "llama.cpp's" if kind in LLAMA_CPP_TYPES else "not one of llama.cpp's"
        raise ModelLoadError(f"{path}: {arch}.rope.scaling.type is {kind!r} ({known}); pagevis computes "
                             f"{' and '.join(SUPPORTED)} (Llama 3's scaling as the rope_freqs tensor)")
    attn_factor = value("rope.scaling.attn_factor", "number", 1.0)
    if attn_factor != 1:
        raise ModelLoadError(f"{path}: {arch}.rope.scaling.attn_factor is {attn_factor!r}; pagevis computes RoPE "
                             "with an attention factor of 1 only")
    key = "rope.scaling.factor"
    factor = value(key, "number", None)
    if factor is None:
        key = "rope.scale_linear"
        factor = value(key, "number", 0.0)
    if not (math.isfinite(factor) and factor >= 0):
        raise ModelLoadError(f"{path}: {arch}.{key} is {factor!r}, expected a positive number "
                             "(0 or absent: no scaling)")
    return 1.0 if kind == "none" or factor == 0 else float(factor)
