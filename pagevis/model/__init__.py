"""The language model: GGUF loading (architectures: llama, qwen2, qwen3, gemma3, see architectures.py), the
file's own tokenizer and chat template, and a forward pass that leaves attention (and so the KV cache) to its
caller. NumPy (Numba for the quantized weight kernels), with tokenizers and jinja2 for the tokenizer; no Qt, no
torch."""

from pagevis.model.blas_threads import set_blas_threads
from pagevis.model.byte_tokenizer import ByteTokenizer
from pagevis.model.gguf_tokenizer import GGUFTokenizer
from pagevis.model.config import ModelConfig
from pagevis.model.dense import DenseAttention
from pagevis.model.errors import ModelConfigError, ModelLoadError
from pagevis.model.gguf_loader import load_model
from pagevis.model.interface import AttendFn, Model
from pagevis.model.decoder import DecoderModel
from pagevis.model.locate import default_model_path
from pagevis.model.tokenizer import IncrementalDecoder, Tokenizer

__all__ = [
    "AttendFn", "ByteTokenizer", "GGUFTokenizer", "DenseAttention", "IncrementalDecoder",
    "DecoderModel", "Model", "ModelConfig", "ModelConfigError", "ModelLoadError", "Tokenizer",
    "default_model_path", "load_model", "set_blas_threads",
]
