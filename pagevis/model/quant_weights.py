"""DecoderWeights whose matrices stay as the GGUF stores them (quantized.py), and which weight format a process uses.

`--weights quantized` (the default): every quantised matrix repacked into row tiles of its own bits (QuantMatrix),
the embedding looked up through the same packed matrix (tied output: one copy); F32/F16/BF16 matrices and every
norm and bias as float32. `--weights float32`: everything dequantised to float32 at load (gguf_loader's path,
with its on-disk cache), multiplied by BLAS as before.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from pagevis.model.errors import ModelLoadError
from pagevis.model.quantized import FLOAT_TYPES, FORMATS, QuantMatrix, file_pages_dropper, pack
from pagevis.model.weights import LayerWeights, DecoderWeights

WEIGHT_FORMATS = ("quantized", "float32")
_format = os.environ.get("PAGEVIS_WEIGHTS", "quantized")


def set_weight_format(name: str) -> None:
    """The format load_model uses when not told (`--weights`)."""
    global _format
    if name not in WEIGHT_FORMATS:
        raise ValueError(f"weight format {name!r}: expected one of {', '.join(WEIGHT_FORMATS)}")
    _format = name


def weight_format() -> str:
    return _format if _format in WEIGHT_FORMATS else "quantized"


class QuantStack:
    """Matrices with the same input side by side (Q, K, V; gate, up) as one (in, sum of out) operand: `x @ stack`.
    Each part is a QuantMatrix or a float32 (in, out) array."""

    __array_ufunc__ = None

    def __init__(self, parts: list) -> None:
        self.parts = parts
        self.shape = (parts[0].shape[0], sum(p.shape[1] for p in parts))

    dtype = np.dtype(np.float32)
    ndim = 2

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:
        return np.concatenate([np.asarray(x, dtype=np.float32) @ part for part in self.parts], axis=-1)


class QuantEmbedding:
    """The (vocab, d_model) embedding as a packed matrix: `embedding[ids]` dequantises those rows."""

    def __init__(self, matrix: QuantMatrix) -> None:
        self.matrix = matrix
        self.shape = (matrix.n_out, matrix.n_in)

    dtype = np.dtype(np.float32)

    @property
    def nbytes(self) -> int:
        return self.matrix.nbytes

    def __getitem__(self, ids: Any) -> np.ndarray:
        scalar = np.ndim(ids) == 0
        rows = self.matrix.rows(np.asarray(ids).reshape(-1))
        return rows[0] if scalar else rows


def quantized_weights(path: Path, tensors: dict[str, Any], dense: Callable[[str], np.ndarray],
                      n_layers: int, parts: tuple[str, ...], optional: dict[str, str],
                      release: Callable[[Any], None] = lambda tensor: None) -> DecoderWeights:
    """The weights with every quantised matrix packed (tensors already checked by name and shape by the loader;
    `dense(name)` dequantises one tensor to float32 in numpy order; `release(tensor)` once it is copied)."""

    def matrix(*names: str) -> Any:
        groups: list[list[str]] = []
        for name in names:  # neighbours of the same quantised type are packed as one matrix
            kind = tensors[name].tensor_type
            if groups and kind in FORMATS and tensors[groups[-1][0]].tensor_type == kind:
                groups[-1].append(name)
            else:
                groups.append([name])
        packed = [_packed(path, [tensors[n] for n in group], dense) for group in groups]
        for name in names:
            release(tensors[name])
        return packed[0] if len(packed) == 1 else QuantStack(packed)

    def vector(name: str) -> np.ndarray:
        values = np.array(dense(name), dtype=np.float32)
        release(tensors[name])
        return values

    # Reading a page of the file maps its neighbours too (fault-around), which each tensor's release leaves
    # behind: after each layer every tensor page still mapped is dropped (a few MB a layer otherwise)
    drop_file_pages = file_pages_dropper([np.asarray(t.data) for t in tensors.values()]) or (lambda: None)
    layers = []
    for i in range(n_layers):
        b = f"blk.{i}."
        names = dict(zip(parts, (b + p + ".weight" for p in parts)))
        layers.append(LayerWeights(
            attn_norm=vector(names["attn_norm"]),
            wqkv=matrix(names["attn_q"], names["attn_k"], names["attn_v"]),
            wo=matrix(names["attn_output"]),
            ffn_norm=vector(names["ffn_norm"]),
            w_gate_up=matrix(names["ffn_gate"], names["ffn_up"]),
            w_down=matrix(names["ffn_down"]),
            **_optional_vectors(optional, b, vector)))
        drop_file_pages()
    embedding_matrix = matrix("token_embd.weight")
    embedding: np.ndarray | QuantEmbedding
    if isinstance(embedding_matrix, QuantMatrix):
        embedding = QuantEmbedding(embedding_matrix)
    else:
        rows = np.ascontiguousarray(embedding_matrix.T)
        embedding, embedding_matrix = rows, rows.T
    output = matrix("output.weight") if "output.weight" in tensors else embedding_matrix
    weights = DecoderWeights(embedding, tuple(layers), vector("output_norm.weight"), output)
    drop_file_pages()
    return weights


def _optional_vectors(optional: dict[str, str], prefix: str, vector: Callable) -> dict[str, np.ndarray]:
    out = {arg: vector(prefix + name) for arg, name in optional.items()}
    if "q_bias" in out:
        out["qkv_bias"] = np.concatenate([out.pop("q_bias"), out.pop("k_bias"), out.pop("v_bias")])
    return out


def _packed(path: Path, tensors: list[Any], dense: Callable[[str], np.ndarray]) -> Any:
    kind = tensors[0].tensor_type
    if kind in FLOAT_TYPES or kind not in FORMATS:  # F32/F16/BF16 (and the K types with no kernel): float32
        if len(tensors) == 1:
            return np.ascontiguousarray(dense(tensors[0].name), dtype=np.float32).T
        rows = [int(np.prod(t.shape[1:])) for t in tensors]
        out = np.empty((sum(rows), int(tensors[0].shape[0])), np.float32)  # filled part by part: no concatenation
        for t, start, n in zip(tensors, np.cumsum([0] + rows), rows):
            out[start:start + n] = dense(t.name)
        return out.T
    n_in = int(tensors[0].shape[0])
    raw = [np.asarray(t.data).reshape(int(np.prod(t.shape[1:])), -1) for t in tensors]
    try:
        return pack(kind, raw, n_in)  # Q, K, V (gate, up) packed one after another into one matrix
    except ValueError as exc:
        raise ModelLoadError(f"{path}: tensor {_member_at_fault(kind, tensors, raw, n_in)}: {exc}") from exc


def _member_at_fault(kind: Any, tensors: list[Any], raw: list[np.ndarray], n_in: int) -> str:
    """The name of the tensor of a fused group (Q, K, V; gate, up) that pack refuses alone (a block scale that is
    not a number): the refusal names the member that holds it, not the group's first. Runs on refusal only."""
    if len(tensors) > 1:
        for tensor, rows in zip(tensors, raw):
            try:
                pack(kind, rows, n_in)
            except ValueError:
                return tensor.name
    return tensors[0].name


def held_bytes(weights: DecoderWeights) -> int:
    """Bytes of weights held: every packed matrix, float32 matrix, norm and bias once (a tied output counted once)."""
    items = [weights.embedding, weights.output_t, weights.output_norm]
    for layer in weights.layers:
        items += [layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down, *layer.vectors()]
    seen: dict[int, int] = {}
    for item in items:
        for part in _parts(item):
            owner = part.base if isinstance(part, np.ndarray) and part.base is not None else part
            seen[id(owner)] = owner.nbytes
    return sum(seen.values())


def _parts(item: Any) -> list:
    if isinstance(item, QuantEmbedding):
        return [item.matrix]
    if isinstance(item, QuantStack):
        return list(item.parts)
    return [item]
