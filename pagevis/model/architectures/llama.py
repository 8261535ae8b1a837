"""llama: SmolLM2, Llama 2, Llama 3.x. Adjacent-pair RoPE (the converter permutes Q and K), SwiGLU. Llama 3's
rope scaling reaches the GGUF as the rope_freqs tensor, read by the loader for any architecture."""

from pagevis.model.architectures.base import Architecture

ARCHITECTURE = Architecture("llama", "SmolLM2, Llama 2, Llama 3.x", lambda value, shape: {})
