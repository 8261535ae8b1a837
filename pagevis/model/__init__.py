"""The language model: GGUF loading, tokenizer, and a forward pass that leaves attention (and so
the KV cache) to its caller. NumPy only."""

from .blas_threads import set_blas_threads
from .byte_tokenizer import ByteTokenizer
from .bpe import BPETokenizer
from .config import ModelConfig
from .dense import DenseAttention
from .errors import ModelConfigError, ModelLoadError
from .gguf_loader import load_model
from .interface import AttendFn, Model
from .llama import LlamaModel
from .locate import default_model_path
from .tokenizer import IncrementalDecoder, Tokenizer

__all__ = [
    "AttendFn", "BPETokenizer", "ByteTokenizer", "DenseAttention", "IncrementalDecoder",
    "LlamaModel", "Model", "ModelConfig", "ModelConfigError", "ModelLoadError", "Tokenizer",
    "default_model_path", "load_model", "set_blas_threads",
]
