"""POST /v1/attention: one query attended over given keys and values by the paged engine itself.

The keys and values are written into a page pool (a one-layer cache manager that never evicts, positions
0..T-1) and the query, at position T, attends over it through the cache's own `attend`: the code path
every decode step of the app takes, not a second implementation.
"""

from __future__ import annotations

import math

import numpy as np
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagevis.kvcache import CacheConfig, KVCacheManager
from pagevis.kvcache.config import MAX_HEAD_DIM, MAX_PAGE_SIZE
from pagevis.serve.errors import ApiError

MAX_KEYS = 16384  # T
MAX_HEADS = 256

Vector = list[float]
Matrix = list[list[float]]
Tensor3 = list[list[list[float]]]


class AttentionRequest(BaseModel):
    """A single head: query (d,), keys and values (T, d). With heads: query (n_heads, d), keys and
    values (T, n_kv_heads, d); n_heads must be a multiple of n_kv_heads (grouped-query attention)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, json_schema_extra={"examples": [
        {"query": [1.0, 0.0], "keys": [[1.0, 0.0], [0.0, 1.0]], "values": [[1.0, 2.0], [3.0, 4.0]]}]})

    query: Vector | Matrix = Field(description="(d,) or (n_heads, d)")
    keys: Matrix | Tensor3 = Field(description="(T, d) or (T, n_kv_heads, d)")
    values: Matrix | Tensor3 = Field(description="same shape as keys")
    page_size: int = Field(16, ge=1, le=MAX_PAGE_SIZE, description="tokens per page of the pool")
    return_weights: bool = Field(False, description="also return the attention weights over the T keys")


class AttentionResponse(BaseModel):
    output: list[float] | list[list[float]] = Field(description="(d,) or (n_heads, d), like the query")
    pages_used: int
    page_size: int
    n_keys: int
    weights: list[float] | list[list[float]] | None = Field(None, description="(T,) or (n_heads, T)")


def checked_arrays(request: AttentionRequest) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """(q (n_heads, d), k, v (T, n_kv_heads, d)) as float32, and whether the request had heads; or a 422
    naming the field whose shape is wrong."""
    query = _rectangular("query", request.query)
    keys = _rectangular("keys", request.keys)
    values = _rectangular("values", request.values)
    headed = query.ndim == 2
    if keys.ndim != query.ndim + 1:
        raise ApiError(422, f"keys: shape {keys.shape} does not go with query shape {query.shape}: expected "
                            f"{'(T, n_kv_heads, d)' if headed else '(T, d)'}", param="keys")
    if values.shape != keys.shape:
        raise ApiError(422, f"values: shape {values.shape} differs from keys' {keys.shape}", param="values")
    if not headed:
        query, keys, values = query[None], keys[:, None], values[:, None]
    n_heads, d = query.shape
    n_keys, n_kv, key_d = keys.shape
    if key_d != d:
        raise ApiError(422, f"keys: head dimension {key_d} differs from the query's {d}", param="keys")
    _bound("query", "head dimension d", d, MAX_HEAD_DIM)
    _bound("keys", "number of keys T", n_keys, MAX_KEYS)
    _bound("query", "number of query heads", n_heads, MAX_HEADS)
    _bound("keys", "number of KV heads", n_kv, MAX_HEADS)
    if n_heads % n_kv:
        raise ApiError(422, f"query: {n_heads} query heads do not divide into {n_kv} KV heads (grouped-query "
                            "attention needs n_heads to be a multiple of n_kv_heads)", param="query")
    return (query.astype(np.float32), keys.astype(np.float32), values.astype(np.float32), headed)


def paged_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, page_size: int):
    """Write k, v at positions 0..T-1 into a page pool and attend q (n_heads, d) from position T.
    Returns (output (n_heads, d), weights by key position (n_heads, T), pages used)."""
    n_keys, n_kv, d = k.shape
    config = CacheConfig(page_size=page_size, max_pages=math.ceil(n_keys / page_size), n_layers=1,
                         n_heads=q.shape[0], n_kv_heads=n_kv, head_dim=d, policy="none")
    cache = KVCacheManager.single(config, prefix_caching=False)
    cache.append(0, 0, k, v, np.arange(n_keys, dtype=np.int64))
    result = cache.attend(0, 0, q[None], np.array([n_keys], dtype=np.int64))
    slots = cache.slot_positions(0)
    resident = slots >= 0
    weights = np.zeros((q.shape[0], n_keys), dtype=np.float32)
    weights[:, slots[resident]] = result.weights[0][:, resident]
    return result.output[0], weights, len(cache.block_table(0, 0))


def answer(request: AttentionRequest) -> AttentionResponse:
    q, k, v, headed = checked_arrays(request)
    output, weights, pages = paged_attention(q, k, v, request.page_size)
    if not headed:
        output, weights = output[0], weights[0]
    return AttentionResponse(output=output.tolist(), pages_used=pages, page_size=request.page_size,
                             n_keys=k.shape[0], weights=weights.tolist() if request.return_weights else None)


def answer_json(body: bytes) -> bytes:
    """Parse, check, attend and encode in one go (in a worker thread). Pydantic parses the JSON bytes
    itself, about 3x faster than json.loads followed by validation of the Python lists."""
    try:
        request = AttentionRequest.model_validate_json(body)
    except ValidationError as error:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in error.errors()]) from None
    return answer(request).model_dump_json(exclude_none=True).encode()


def _rectangular(name: str, value: list) -> np.ndarray:
    """The nested list as an array, or a 422 pointing at the first row whose length differs."""
    _check_lengths(name, value)
    return np.asarray(value, dtype=np.float64)


def _check_lengths(name: str, value: list) -> None:
    shape, probe = [], value
    while isinstance(probe, list):
        if not probe:
            raise ApiError(422, f"{name}: an empty list where numbers are expected", param=name)
        shape.append(len(probe))
        probe = probe[0]

    def walk(path: str, node: list, depth: int) -> None:
        if len(node) != shape[depth]:
            raise ApiError(422, f"{path}: ragged list: {len(node)} entries where the first row at this depth "
                                f"has {shape[depth]}", param=name)
        if depth + 1 < len(shape):
            for i, child in enumerate(node):
                walk(f"{path}[{i}]", child, depth + 1)

    walk(name, value, 0)


def _bound(field: str, what: str, value: int, high: int) -> None:
    if value > high:
        raise ApiError(422, f"{field}: {what} = {value} is over this server's limit of {high}", param=field)
