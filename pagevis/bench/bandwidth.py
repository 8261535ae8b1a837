"""Measuring decode speed against the memory-bandwidth floor.

A decode step reads every weight once, so tokens/s can be no better than
read bandwidth / weight bytes per token (the "bandwidth floor"). The read bandwidth is the best of a
weight-sized float32 matrix-vector product (what a decode step does) and a plain reduction, on the
BLAS threads decoding uses. A copy is no floor: it reads and writes every byte, so bytes/s of a copy
counted once is about half what reading alone reaches. Run `python -m pagevis.bench.bandwidth`.
"""

from __future__ import annotations

import time

import numpy as np

from pagevis.model.blas_threads import set_blas_threads
from pagevis.model.dense import DenseAttention
from pagevis.model.decoder import DecoderModel

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


def measure_read_bandwidth(nbytes: int = COPY_BYTES, repeats: int = 3, columns: int = 2048) -> dict[str, float]:
    """Bytes per second read by a float32 matrix-vector product over an nbytes matrix (BLAS, on the threads
    set by set_blas_threads) and by a sum over the same array (NumPy, one thread); best of repeats each.

    'read' is the larger: the fastest way we know to stream the bytes, so a decode step that reads
    nbytes of weights cannot beat nbytes / read.
    """
    rows = max(nbytes // (4 * columns), 1)
    matrix = np.ones((rows, columns), dtype=np.float32)  # np.ones touches the pages: no page fault timed
    vector = np.ones(columns, dtype=np.float32)
    out = np.empty(rows, dtype=np.float32)
    gemv = reduce = np.inf
    for _ in range(repeats):
        start = time.perf_counter()
        np.matmul(matrix, vector, out=out)
        gemv = min(gemv, time.perf_counter() - start)
        start = time.perf_counter()
        np.add.reduce(matrix, axis=None)
        reduce = min(reduce, time.perf_counter() - start)
    size = matrix.nbytes
    return {"gemv": size / gemv, "reduce": size / reduce, "read": size / min(gemv, reduce)}


def shape_read_rates(model: DecoderModel, repeats: int = 5) -> list[dict]:
    """Read bandwidth of one row (a decode step) through each weight shape the model multiplies, as the
    forward does it (its plan's kernel for one row over the stored (in, out) view, or the packed format's own
    kernel for weights kept as the GGUF stores them) and, for float32 weights, as a plain contiguous gemv over
    the same (out, in) array: on some CPUs the shape and orientation matter more than the square probe of
    measure_read_bandwidth shows. Best of `repeats`, each over every matrix of that shape."""
    from pagevis.model.matmul import matmul

    by_shape: dict[tuple[int, int], list[np.ndarray]] = {}
    for w in model.weights.matrices():
        by_shape.setdefault(w.shape, []).append(w)
    rows = []
    for shape, matrices in by_shape.items():
        x = np.ones((1, shape[0]), dtype=np.float32)
        nbytes = sum(w.nbytes for w in matrices)
        packed = not isinstance(matrices[0], np.ndarray)  # kept as the GGUF stores them: its own kernel, no gemv
        forward = plain = np.inf
        for _ in range(repeats):
            start = time.perf_counter()
            for w in matrices:
                x @ w if packed else matmul(x, w, model.plan)
            forward = min(forward, time.perf_counter() - start)
            if packed:
                continue
            start = time.perf_counter()
            for w in matrices:
                np.matmul(w.T, x[0])  # (out, in) C-contiguous times a vector: BLAS sgemv, no transpose
            plain = min(plain, time.perf_counter() - start)
        rows.append({"shape": f"{shape[0]}x{shape[1]}", "matrices": len(matrices), "mb": nbytes / 1e6,
                     "kernel": matrices[0].fmt if packed else str(model.plan.kernel(shape, 1)),
                     "forward_gb_s": nbytes / forward / 1e9, "gemv_gb_s": None if packed else nbytes / plain / 1e9})
    return rows


def weight_bytes_per_token(model: DecoderModel) -> int:
    """Bytes of float32 weights one decode step reads."""
    return model.weights.nbytes_per_token()


def measure_decode_speed(model: DecoderModel, n_tokens: int = 32, prompt_length: int = 16) -> float:
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
    from pagevis.model.gguf_loader import load_model

    start = time.perf_counter()
    model = load_model()
    load_seconds = time.perf_counter() - start
    per_token = weight_bytes_per_token(model)
    copy = measure_copy_bandwidth()
    print(f"model            {model.config.name}")
    print(f"load time        {load_seconds:.2f} s")
    print(f"copy             {copy / 1e9:.2f} GB/s (each byte counted once; not a floor)")
    print(f"weights/token    {per_token / 1e6:.1f} MB")
    for label, threads in (("default BLAS threads", None), ("one BLAS thread", 1)):
        if threads:
            set_blas_threads(threads)
        read = measure_read_bandwidth(per_token)
        floor = read["read"] / per_token
        speed = measure_decode_speed(model)
        print(f"{label}: read {read['read'] / 1e9:.2f} GB/s (gemv {read['gemv'] / 1e9:.2f}, sum "
              f"{read['reduce'] / 1e9:.2f}) -> floor {floor:.1f} tokens/s; decode {speed:.1f} tokens/s "
              f"({speed / floor:.2f} of the floor)")


if __name__ == "__main__":
    main()
