"""qwen2: Qwen 2 and Qwen 2.5. Llama's block with a bias on Q, K and V, and NEOX RoPE (llama.cpp's rope type
for qwen2: the converter leaves Q and K unpermuted)."""

from pagevis.model.architectures.base import Architecture
from pagevis.model.config import Layout

LAYOUT = Layout(rope_neox=True, qkv_bias=True)
ARCHITECTURE = Architecture("qwen2", "Qwen 2, Qwen 2.5", lambda value, shape: {"layout": LAYOUT})
