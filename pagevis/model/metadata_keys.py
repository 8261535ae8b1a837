"""Every `<arch>.` metadata key of a GGUF file is honoured or refused, never ignored (issue #44).

The keys an architecture reads are the ones config_from_metadata, rope_scaling.linear_factor and the architecture's
own settings() ask for (recorded as they ask; for every architecture: block_count, context_length,
embedding_length, feed_forward_length, attention.head_count, attention.head_count_kv, attention.key_length,
attention.layer_norm_rms_epsilon, rope.freq_base, rope.dimension_count, vocab_size, rope.scaling.type / factor /
attn_factor, rope.scale_linear; Gemma 3 adds attention.sliding_window). A few more are honoured by checking that
they say what pagevis computes anyway (SAME_AS_HEAD_DIM, DENSE) or say nothing about the computation
(DESCRIPTIVE). Any other `<arch>.` key is refused by name: llama.cpp reads it, and running the file while
ignoring it would compute something other than what the file describes (an attention.scale, a logit soft-cap,
experts, ...). Keys outside `<arch>.` (general.*, tokenizer.*) are read where they are used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagevis.model.errors import ModelLoadError

# pagevis's attention uses one head size for keys and values (and the same in sliding-window layers)
SAME_AS_HEAD_DIM = ("attention.value_length", "attention.key_length_swa", "attention.value_length_swa")
# a mixture of experts: pagevis runs dense feed-forward blocks only
DENSE = ("expert_count", "expert_used_count", "expert_shared_count")
# what llama.cpp reads only for what pagevis refuses anyway (YaRN), or not at all, or (the old rope.scale_linear)
# only when rope.scaling.factor is absent, as rope_scaling.linear_factor does
DESCRIPTIVE = ("rope.scaling.original_context_length", "rope.scaling.finetuned", "tensor_data_layout",
               "rope.scale_linear")


def check_every_key_honoured(path: Path, arch: str, metadata: dict[str, Any], read: set[str],
                             head_dim: int) -> None:
    """ModelLoadError naming the first `<arch>.` key whose value pagevis would ignore."""
    prefix = f"{arch}."
    for key in sorted(k for k in metadata if k.startswith(prefix)):
        name, value = key[len(prefix):], metadata[key]
        if name in read or name in DESCRIPTIVE:
            continue
        if name in SAME_AS_HEAD_DIM:
            if value != head_dim:
                raise ModelLoadError(f"{path}: metadata key {key} is {value!r}, but the key length (head size) is "
                                     f"{head_dim}; pagevis's attention uses one head size for keys and values")
            continue
        if name in DENSE:
            if value not in (0, None):
                raise ModelLoadError(f"{path}: metadata key {key} is {value!r}: a mixture-of-experts model; "
                                     f"pagevis runs dense {arch} models only")
            continue
        raise ModelLoadError(f"{path}: metadata key {key} is not one pagevis's {arch} reads (ignoring its value "
                             f"{_shown(value)} would compute something other than what the file describes)")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "…"
