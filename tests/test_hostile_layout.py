"""Small GGUF models whose data section breaks one of llama.cpp's rules (gguf.cpp's gguf_init_from_reader), whose
metadata pagevis would have to ignore, or whose numbers are not numbers (issue #44): each is refused before a tensor
is read, in one line naming the tensor or key and the rule. The files are tests/data/hostile/*.gguf, written from
CASES by scripts/make_hostile_files.py (its small Llama model, F32, alignment 32, with one thing changed)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from test_hostile_files import HOSTILE, assert_one_line_refusal, run_cli

from pagevis.model import ModelLoadError, load_model

LAST = "blk.0.ffn_down.weight"  # the small model's last tensor
# file name -> (what it is, the change to the small model, what its refusal says). Changes: ("offset", tensor, bytes
# added), ("offset-of", tensor, other) (the other's offset), ("wrap", tensor) (offset + data start = 2**64),
# ("gap", tensor, bytes) (offset moved and the file grown by as much), ("rows", tensor, factor), ("type", tensor,
# ggml type), ("rename", tensor, new name), ("metadata", {key: value}), ("tensor", {name: (index, value)}) (one F32
# weight replaced), ("big-endian",) (the model written by gguf-py in big-endian byte order).
CASES = {
    "layout-misaligned.gguf": ("blk.0.attn_v.weight's offset moved by 4 bytes",
                               ("offset", "blk.0.attn_v.weight", 4), "is not a multiple of the alignment 32"),
    "layout-overlap.gguf": ("blk.0.attn_v.weight's offset is attn_k's (V read from K's bytes)",
                            ("offset-of", "blk.0.attn_v.weight", "blk.0.attn_k.weight"),
                            "overlap tensor blk.0.attn_k.weight's"),
    "layout-wrap.gguf": ("output_norm.weight's offset + the data section's start = 2**64 (read from byte 0)",
                         ("wrap", "output_norm.weight"), "wraps around 2**64"),
    "layout-past-end.gguf": ("the last tensor's offset 1 MiB further", ("offset", LAST, 1 << 20),
                             "run past the end of the file"),
    "layout-gap.gguf": ("a 32-byte gap before the last tensor (the file grown to hold it)", ("gap", LAST, 32),
                        "where llama.cpp expects"),
    "layout-rows-doubled.gguf": ("the last tensor declares twice its rows", ("rows", LAST, 2),
                                 "run past the end of the file"),
    "layout-type-99.gguf": ("blk.0.attn_q.weight of ggml type 99", ("type", "blk.0.attn_q.weight", 99),
                            "type 99, which is not a ggml type"),
    "layout-q8-row-of-8.gguf": ("blk.0.attn_norm.weight declared Q8_0, a row of 8 elements",
                                ("type", "blk.0.attn_norm.weight", 8), "not whole blocks of 32"),
    "layout-f32-as-f16.gguf": ("blk.0.attn_q.weight's F32 bytes declared F16 (half as many)",
                               ("type", "blk.0.attn_q.weight", 1), "after tensor blk.0.attn_q.weight's 128 bytes"),
    "layout-duplicate-name.gguf": ("two tensors named blk.0.attn_k.weight",
                                   ("rename", "blk.0.attn_v.weight", "blk.0.attn_k.weight"), "named twice"),
    "layout-alignment-3.gguf": ("general.alignment 3", ("metadata", {"general.alignment": 3}),
                                "general.alignment is 3, not a power of two"),
    "layout-alignment-string.gguf": ("general.alignment a string", ("metadata", {"general.alignment": "32"}),
                                     "general.alignment has value type 8"),
    "layout-big-endian.gguf": ("the small model written big-endian by gguf-py", ("big-endian",),
                               "a big-endian GGUF file"),
    "numbers-rope-base-inf.gguf": ("llama.rope.freq_base infinite (it passed `> 1`)",
                                   ("metadata", {"llama.rope.freq_base": float("inf")}),
                                   "metadata key llama.rope.freq_base is inf, expected a finite number"),
    "numbers-rms-eps-inf.gguf": ("llama.attention.layer_norm_rms_epsilon infinite",
                                 ("metadata", {"llama.attention.layer_norm_rms_epsilon": float("inf")}),
                                 "metadata key llama.attention.layer_norm_rms_epsilon is inf, expected a finite number"),
    "numbers-f32-nan-attn-v.gguf": ("a NaN in the F32 blk.0.attn_v.weight (fused with Q and K on load)",
                                    ("tensor", {"blk.0.attn_v.weight": (3, float("nan"))}),
                                    "tensor blk.0.attn_v.weight holds nan at flat index 3"),
    "numbers-f32-inf-ffn-up.gguf": ("an infinity in the F32 blk.0.ffn_up.weight (fused with ffn_gate on load)",
                                    ("tensor", {"blk.0.ffn_up.weight": (5, float("-inf"))}),
                                    "tensor blk.0.ffn_up.weight holds -inf at flat index 5"),
    "numbers-f32-nan-norm.gguf": ("a NaN in output_norm.weight", ("tensor", {"output_norm.weight": (0, float("nan"))}),
                                  "tensor output_norm.weight holds nan at flat index 0"),
    "metadata-embedding-3d.gguf": ("token_embd.weight of 3 dimensions and no vocab_size key (it was read as a "
                                   "vocabulary of 1: 'bos_id ... below 1')", ("embedding-3d",),
                                   "tensor token_embd.weight has 3 dimensions"),
    "metadata-value-length.gguf": ("llama.attention.value_length 16, the key length 4",
                                   ("metadata", {"llama.attention.value_length": 16}),
                                   "metadata key llama.attention.value_length is 16, but the key length"),
    "metadata-expert-count.gguf": ("llama.expert_count 8 on a dense model", ("metadata", {"llama.expert_count": 8}),
                                   "metadata key llama.expert_count is 8: a mixture-of-experts model"),
    "metadata-attention-scale.gguf": ("llama.attention.scale 0.5, a key pagevis does not read",
                                      ("metadata", {"llama.attention.scale": 0.5}),
                                      "metadata key llama.attention.scale is not one pagevis's llama reads"),
}


def tensor_entries(data: bytes) -> dict[str, tuple[int, int, int]]:
    """name -> (where its type field is, its n_dims, where its first dim is), read by gguf-py (not by pagevis)."""
    import tempfile
    from pathlib import Path

    from gguf import GGUFReader

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "m.gguf"
        path.write_bytes(data)
        reader = GGUFReader(path)
        entries = {}
        for tensor in reader.tensors:
            at = tensor.field.offset
            name_length = struct.unpack_from("<Q", data, at)[0]
            n_dims = struct.unpack_from("<I", data, at + 8 + name_length)[0]
            dims_at = at + 12 + name_length
            entries[tensor.name] = (dims_at + 8 * n_dims, n_dims, dims_at)
        return entries, reader.data_offset


def patched(data: bytes, change: tuple) -> bytes:
    """The small model's bytes with a change of the tensor table (CASES)."""
    out = bytearray(data)
    entries, start = tensor_entries(data)
    kind, name, *rest = change
    type_at, n_dims, dims_at = entries[name]
    offset_at = type_at + 4
    offset = struct.unpack_from("<Q", data, offset_at)[0]
    if kind == "offset":
        struct.pack_into("<Q", out, offset_at, offset + rest[0])
    elif kind == "offset-of":
        struct.pack_into("<Q", out, offset_at, struct.unpack_from("<Q", data, entries[rest[0]][0] + 4)[0])
    elif kind == "wrap":
        struct.pack_into("<Q", out, offset_at, (1 << 64) - start)
    elif kind == "gap":
        struct.pack_into("<Q", out, offset_at, offset + rest[0])
        out += bytes(rest[0])
    elif kind == "rows":
        rows_at = dims_at + 8 * (n_dims - 1)
        struct.pack_into("<Q", out, rows_at, struct.unpack_from("<Q", data, rows_at)[0] * rest[0])
    elif kind == "type":
        struct.pack_into("<I", out, type_at, rest[0])
    elif kind == "rename":
        at = out.index(name.encode(), dims_at - 4 - len(name) - 8)
        out[at:at + len(name)] = rest[0].encode()
    else:
        raise ValueError(f"unknown change {kind!r}")
    return bytes(out)


def test_the_cases_are_in_the_hostile_folder():
    made = {p.name for prefix in ("layout", "numbers", "metadata") for p in HOSTILE.glob(f"{prefix}-*.gguf")}
    assert made == set(CASES)


@pytest.mark.parametrize("weights", ["quantized", "float32"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_broken_file_is_refused_naming_the_rule(name, weights):
    with pytest.raises(ModelLoadError) as refused:
        load_model(HOSTILE / name, weights=weights)
    message = str(refused.value)
    assert CASES[name][2] in message and message.count(name) == 1 and "\n" not in message, message


def q8_model(path, nan_scale_in: str, scale: bytes = struct.pack("<H", 0x7E00)) -> None:
    """A small model whose Q, K, V and feed-forward matrices are Q8_0 (gguf-py's quantiser), with the float16 scale
    of one block of one tensor replaced (by a NaN: 0x7E00)."""
    from unittest import mock

    import gguf
    from gguf.quants import quantize

    from model_fixtures import write_llama_gguf
    from pagevis.model.synthetic import SyntheticModel

    original = gguf.GGUFWriter.add_tensor

    def add_tensor(self, name, array, **kwargs):
        if array.ndim == 2:
            array = quantize(np.asarray(array, np.float32), gguf.GGMLQuantizationType.Q8_0)
            kwargs["raw_dtype"] = gguf.GGMLQuantizationType.Q8_0
        return original(self, name, array, **kwargs)

    model = SyntheticModel(n_layers=1, n_heads=2, n_kv_heads=1, head_dim=32, seed=4, vocab_size=256)
    with mock.patch.object(gguf.GGUFWriter, "add_tensor", add_tensor):
        write_llama_gguf(path, model)
    offset = {t.name: int(t.data_offset) for t in gguf.GGUFReader(path).tensors}[nan_scale_in]
    data = bytearray(path.read_bytes())
    data[offset + 34:offset + 36] = scale  # the second block's
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("weights", ["quantized", "float32"])
@pytest.mark.parametrize("member", ["blk.0.attn_v.weight", "blk.0.ffn_up.weight", "blk.0.attn_q.weight"])
def test_a_nan_block_scale_is_refused_naming_its_tensor_not_its_groups_first(tmp_path, member, weights):
    """Q, K, V (gate, up) of one type are packed as one matrix; the refusal names the member whose scale is NaN (it
    named attn_q for attn_v, ffn_gate for ffn_up), on both weight paths."""
    q8_model(tmp_path / "m.gguf", member)
    with pytest.raises(ModelLoadError) as refused:
        load_model(tmp_path / "m.gguf", weights=weights)
    assert f"tensor {member}" in str(refused.value) and "\n" not in str(refused.value)


def test_the_q8_model_loads_without_the_nan(tmp_path):
    """q8_model's file is a valid Q8_0 model but for the scale it breaks: the refusal above is that scale's."""
    q8_model(tmp_path / "m.gguf", "blk.0.attn_v.weight", struct.pack("<e", 0.01))
    assert load_model(tmp_path / "m.gguf").weight_info["types"]["Q8_0"] >= 7


def test_gguf_py_files_pass_the_layout_checks(tmp_path):
    """The checks refuse what breaks a rule, not gguf-py's own files: a small model loads as written, and a tensor
    table with a 64-byte alignment too."""
    import gguf

    from model_fixtures import write_llama_gguf
    from pagevis.model.gguf_file import check_gguf_file

    assert load_model(write_llama_gguf(tmp_path / "m.gguf")).config.n_layers == 2
    writer = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "llama")
    writer.data_alignment = 64
    writer.add_uint32("general.alignment", 64)
    for index, n in enumerate((3, 17, 64)):
        writer.add_tensor(f"t{index}", np.arange(n, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert check_gguf_file(tmp_path / "a.gguf") == (tmp_path / "a.gguf").stat().st_size


@pytest.mark.parametrize("command", ["run", "serve"])
def test_the_command_line_refuses_before_it_starts(command):
    """`pagevis serve` used to start and answer /healthz on such a file; `run` decoded garbage."""
    name = "layout-overlap.gguf"
    extra = ["--max-tokens", "2", "--quiet"] if command == "run" else ["--port", "0"]
    result = run_cli(command, "--model", str(HOSTILE / name), *extra, timeout=60)
    assert_one_line_refusal(result, name)
    assert CASES[name][2] in result.stderr
