"""pagevis: watch a real language model decode with its KV cache in fixed-size pages."""

__version__ = "0.1.0"
