"""qwen3: Qwen 3 (dense). No QKV bias; RMSNorm over each head of Q and K before RoPE; NEOX RoPE. Its head_dim
(attention.key_length, 128) is not d_model / n_heads."""

from pagevis.model.architectures.base import Architecture
from pagevis.model.config import Layout

LAYOUT = Layout(rope_neox=True, qk_norm=True)
ARCHITECTURE = Architecture("qwen3", "Qwen 3", lambda value, shape: {"layout": LAYOUT})
