"""Measuring decode speed against the memory-bandwidth floor.

A decode step reads every weight once, so tokens/s can be no better than about
copy bandwidth / weight bytes per token (the "bandwidth floor"). Run `python -m pagevis.model.speed`.
"""

from __future__ import annotations

import time

import numpy as np

from .blas_threads import set_blas_threads
from .dense import DenseAttention
from .llama import LlamaModel

COPY_BYTES = 512 << 20


def measure_copy_bandwidth(nbytes: int = COPY_BYTES, repeats: int = 3) -> float:
    """Bytes per second np.copyto moves between two float32 arrays of nbytes (best of repeats).

    Counts each byte once (the array size), though the copy both reads and writes it.
    """
    source = np.ones(nbytes // 4, dtype=np.float32)
    target = np.zeros_like(source)  # np.zeros/ones touch the pages, so page faults are not timed
    best = np.inf
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def weight_bytes_per_token(model: LlamaModel) -> int:
    """Bytes of float32 weights one decode step reads."""
    return model.weights.nbytes_per_token()


def measure_decode_speed(model: LlamaModel, n_tokens: int = 32, prompt_length: int = 16) -> float:
    """Decode steps per second (one token per forward, DenseAttention), after a short prefill."""
    attention = DenseAttention(model.config)
    prompt = np.arange(prompt_length, dtype=np.int64) % model.config.vocab_size
    logits = model.forward(prompt, np.arange(prompt_length), attention)
    position = prompt_length
    start = time.perf_counter()
    for _ in range(n_tokens):
        token = np.array([int(np.argmax(logits))])
        logits = model.forward(token, np.array([position]), attention)
        position += 1
    return n_tokens / (time.perf_counter() - start)


def main() -> None:
    from .gguf_loader import load_model

    start = time.perf_counter()
    model = load_model()
    load_seconds = time.perf_counter() - start
    bandwidth = measure_copy_bandwidth()
    per_token = weight_bytes_per_token(model)
    floor = bandwidth / per_token
    speed = measure_decode_speed(model)
    set_blas_threads(1)
    single_thread_speed = measure_decode_speed(model)
    print(f"model            {model.config.name}")
    print(f"load time        {load_seconds:.2f} s")
    print(f"copy bandwidth   {bandwidth / 1e9:.2f} GB/s")
    print(f"weights/token    {per_token / 1e6:.1f} MB")
    print(f"bandwidth floor  {floor:.1f} tokens/s")
    print(f"decode speed     {speed:.1f} tokens/s ({speed / floor:.2f} of the floor), default BLAS threads")
    print(f"                 {single_thread_speed:.1f} tokens/s ({single_thread_speed / floor:.2f} of the floor), "
          f"one BLAS thread")


if __name__ == "__main__":
    main()
