"""The KV event wire format of vLLM and SGLang: decoding (every known variant, bounded) and encoding (vLLM ≥ 0.26).

A message on the PUB socket is three frames: (topic, seq as 8 bytes big-endian, payload). The payload is a
msgpack array ``[ts, events, data_parallel_rank]`` (the rank may be omitted); each event is either

- a map tagged by ``"type"`` (vLLM from 0.24 at the latest — verified in 0.24.0, 0.25.1, 0.34.0 — and SGLang), or
- a positional array whose first element is the tag (vLLM ``array_like`` events: verified in 0.11.0 and 0.18.0).

`decode_payload` sniffs which from the bytes (`sniff_event_encoding`), decodes the whole batch with msgspec into
typed structs (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`; both encodings give the same classes), and
raises `DecodeError` (with a short `reason`) for anything else. Every size is bounded (`Limits`); an unknown
event type does not reject its batch: the event is skipped and reported in `DecodedBatch.unknown`.

`encode_batch` writes exactly the bytes vLLM 0.34.0's `ZmqEventPublisher` writes for the same events (checked
against its recorded frames in tests/test_attach_fixtures.py).
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import Annotated, Any, Union

import msgspec

Hash = Union[int, bytes]  # vLLM: 64 bits of a SHA-256 as an unsigned int, or the digest's bytes; SGLang: int64

MAX_PAYLOAD_BYTES = 64 << 20  # the SUB socket refuses larger messages (ZMQ_MAXMSGSIZE)
MAX_HASH_BYTES = 64
MAX_EVENTS = 1 << 16  # per batch
MAX_BLOCKS = 1 << 16  # per event
MAX_TOKENS = 1 << 22  # per event
MAX_BLOCK_SIZE = 1 << 16
MAX_STRING = 1 << 10
MAX_TOKEN_ID = 2**32 - 1

_HashT = Union[int, Annotated[bytes, msgspec.Meta(max_length=MAX_HASH_BYTES)]]
_Token = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
_Str = Annotated[str, msgspec.Meta(max_length=MAX_STRING)]
_Hashes = Annotated[list[_HashT], msgspec.Meta(max_length=MAX_BLOCKS)]
_Tokens = Annotated[list[_Token], msgspec.Meta(max_length=MAX_TOKENS)]
_BlockSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_SIZE)]
_Lookahead = Annotated[list[Annotated[list[_Token], msgspec.Meta(max_length=MAX_BLOCK_SIZE)]],
                       msgspec.Meta(max_length=MAX_BLOCKS)]
_ExtraKeys = Annotated[list[Any], msgspec.Meta(max_length=MAX_BLOCKS)]

KNOWN_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
# Optional BlockStored fields kept on each block as-is when not None (vLLM 0.34 and SGLang 0.5 names).
STORED_EXTRAS = ("lora_id", "lora_name", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality",
                 "ownership", "session_id", "cache_salt")
# Per-block lists: entry i belongs to block_hashes[i].
STORED_PER_BLOCK = ("extra_keys", "lookahead_token_ids")


class DecodeError(ValueError):
    """A message that is not a valid KV event batch. `reason` is one word for counting."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class _StoredFields(msgspec.Struct, gc=False):
    """BlockStored's fields in vLLM's positional order (the map form names them; the array form is this order)."""

    block_hashes: _Hashes
    parent_block_hash: _HashT | None
    token_ids: _Tokens
    block_size: _BlockSize
    lora_id: int | None = None
    medium: _Str | None = None
    lora_name: _Str | None = None
    extra_keys: _ExtraKeys | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: _Str | None = None
    kv_cache_spec_sliding_window: int | None = None
    # map form only (vLLM 0.34, SGLang): never sent positionally; in both forms so both have the same attributes
    locality: _Str | None = None
    ownership: _Str | None = None
    session_id: _Str | None = None
    lookahead_token_ids: _Lookahead | None = None
    cache_salt: _Str | None = None  # SGLang


class _RemovedFields(msgspec.Struct, gc=False):
    """BlockRemoved's fields in vLLM's positional order."""

    block_hashes: _Hashes
    medium: _Str | None = None
    group_idx: int | None = None


# --- map-tagged events (vLLM ≥ 0.24, SGLang) -------------------------------------------------------------------
class BlockStored(_StoredFields, tag="BlockStored", tag_field="type", kw_only=True, gc=False):
    """Blocks newly cached (or, in vLLM 0.34, reported again when a request reuses them)."""

    parent_block_hash: _HashT | None = None  # may be left out of a map


class BlockRemoved(_RemovedFields, tag="BlockRemoved", tag_field="type", kw_only=True, gc=False):
    locality: _Str | None = None
    ownership: _Str | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]
_Events = Annotated[list[Event], msgspec.Meta(max_length=MAX_EVENTS)]


class _MapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: _Events
    data_parallel_rank: int | None = None


# --- positional events (vLLM array_like, before 0.24) ---------------------------------------------------------
class _StoredArray(_StoredFields, tag="BlockStored", array_like=True, gc=False):
    pass


class _RemovedArray(_RemovedFields, tag="BlockRemoved", array_like=True, gc=False):
    pass


class _ClearedArray(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    pass


_ArrayEvents = Annotated[list[Union[_StoredArray, _RemovedArray, _ClearedArray]], msgspec.Meta(max_length=MAX_EVENTS)]


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: _ArrayEvents
    data_parallel_rank: int | None = None


_MAP_DECODER = msgspec.msgpack.Decoder(_MapBatch)
_ARRAY_DECODER = msgspec.msgpack.Decoder(_ArrayBatch)
_ANY_DECODER = msgspec.msgpack.Decoder()
_ENCODER = msgspec.msgpack.Encoder()


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    """One payload, decoded. `events` hold `BlockStored`/`BlockRemoved`/`AllBlocksCleared` (or their positional
    twins, with the same attribute names); `unknown` names event types skipped; `encoding` is "map" or "array"."""

    ts: float
    events: tuple
    data_parallel_rank: int | None
    encoding: str
    unknown: tuple[str, ...] = ()


def sniff_event_encoding(payload: bytes) -> str | None:
    """"map" or "array" from the first event's msgpack header; None if the batch has no events or is not a
    batch. Reads at most a few header bytes (the batch array, its float ts, the events array)."""
    try:
        pos = _array_header(payload, 0)[1]
        pos = _skip_number(payload, pos)
        count, pos = _array_header(payload, pos)
        if count == 0:
            return None
        first = payload[pos]
    except (IndexError, ValueError):
        return None
    if 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):
        return "map"
    if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):
        return "array"
    return None


def _array_header(data: bytes, pos: int) -> tuple[int, int]:
    head = data[pos]
    if 0x90 <= head <= 0x9F:
        return head & 0x0F, pos + 1
    if head == 0xDC:
        return int.from_bytes(data[pos + 1:pos + 3], "big"), pos + 3
    if head == 0xDD:
        return int.from_bytes(data[pos + 1:pos + 5], "big"), pos + 5
    raise ValueError("not an array")


_NUMBER_WIDTH = {0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9, 0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9}


def _skip_number(data: bytes, pos: int) -> int:
    head = data[pos]
    if head <= 0x7F or head >= 0xE0:
        return pos + 1
    if head in _NUMBER_WIDTH:
        return pos + _NUMBER_WIDTH[head]
    raise ValueError("not a number")


def decode_payload(payload: bytes) -> DecodedBatch:
    """Decode one batch; raise DecodeError (never anything else) if it is not one."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise DecodeError("too_large", f"{len(payload)} bytes")
    encoding = sniff_event_encoding(payload) or "map"
    decoder = _ARRAY_DECODER if encoding == "array" else _MAP_DECODER
    try:
        batch = decoder.decode(payload)
        unknown: tuple[str, ...] = ()
    except msgspec.ValidationError as error:
        batch, unknown = _decode_leniently(payload, encoding, error)
    except (msgspec.DecodeError, RecursionError, MemoryError, OverflowError) as error:
        raise DecodeError("msgpack", str(error)[:200]) from None
    if not math.isfinite(batch.ts):
        raise DecodeError("type", f"ts is {batch.ts}")
    for event in batch.events:
        check_event(event)
    return DecodedBatch(batch.ts, tuple(batch.events), batch.data_parallel_rank, encoding, unknown)


def _decode_leniently(payload: bytes, encoding: str, first_error: Exception) -> tuple[Any, tuple[str, ...]]:
    """The slow path after a validation error: skip events of unknown types (reported), accept SGLang's bigram
    pages (token pairs; the first of each pair is the token at that position); anything else is an error."""
    try:
        raw = _ANY_DECODER.decode(payload)
    except (msgspec.DecodeError, RecursionError, MemoryError, OverflowError) as error:
        raise DecodeError("msgpack", str(error)[:200]) from None
    if not isinstance(raw, list) or not 2 <= len(raw) <= 3 or not isinstance(raw[1], list):
        raise DecodeError("shape", "a batch is [ts, events, data_parallel_rank]")
    kinds = {"BlockStored": _StoredArray, "BlockRemoved": _RemovedArray, "AllBlocksCleared": _ClearedArray} \
        if encoding == "array" else {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved,
                                     "AllBlocksCleared": AllBlocksCleared}
    kept, unknown, forgiven = [], [], False
    for event in raw[1]:
        tag = event.get("type") if isinstance(event, dict) else (event[0] if isinstance(event, list) and event
                                                                 else None)
        if not isinstance(tag, str):
            raise DecodeError("shape", "an event is a map with a \"type\" or an array starting with it")
        if tag not in kinds:
            unknown.append(tag[:64])
            continue
        if tag == "BlockStored":
            forgiven |= _flatten_bigrams(event, encoding)
        try:
            kept.append(msgspec.convert(event, kinds[tag]))
        except msgspec.ValidationError as error:
            raise DecodeError("type", str(error)[:200]) from None
    if not unknown and not forgiven:
        raise DecodeError("type", str(first_error)[:200])  # nothing the lenient path forgives
    try:
        rank = raw[2] if len(raw) == 3 else None
        batch = msgspec.convert([raw[0], [], rank], _MapBatch)
    except msgspec.ValidationError as error:
        raise DecodeError("type", str(error)[:200]) from None
    batch.events = kept
    return batch, tuple(unknown)


def _flatten_bigrams(event: Any, encoding: str) -> bool:
    key: Any = 3 if encoding == "array" else "token_ids"
    try:
        tokens = event[key]
    except (KeyError, IndexError, TypeError):
        return False
    if isinstance(tokens, list) and tokens and all(isinstance(t, list) and len(t) == 2 for t in tokens):
        event[key] = [t[0] for t in tokens]
        return True
    return False


def check_event(event: Any) -> None:
    """The checks msgspec's types cannot express: token count = blocks × block size, per-block lists."""
    if isinstance(event, (BlockStored, _StoredArray)):
        blocks = len(event.block_hashes)
        if event.token_ids and len(event.token_ids) != blocks * event.block_size:  # none: the engine sent none
            raise DecodeError("tokens", f"{len(event.token_ids)} token ids for {blocks} blocks of "
                                        f"{event.block_size}")
        for name in ("extra_keys", "lookahead_token_ids"):
            values = getattr(event, name, None)
            if values is not None and len(values) != blocks:
                raise DecodeError("shape", f"{name} has {len(values)} entries for {blocks} blocks")


def pack_tokens(token_ids: list[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (4 bytes a token: the compact form the state keeps)."""
    packed = array("I", token_ids)
    if packed.itemsize != 4:  # pragma: no cover - every platform pagevis runs on has a 4-byte unsigned int
        raise RuntimeError("array('I') is not 4 bytes here")
    return packed.tobytes()


# --- encoding (vLLM ≥ 0.26, byte for byte) ---------------------------------------------------------------------
# vLLM 0.34.0's own structs, field for field (msgspec writes a struct's map header differently from a dict's, so
# byte-identical output needs structs declared the same way).
class _WireEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _WireStored(_WireEvent, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _WireRemoved(_WireEvent, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _WireCleared(_WireEvent, tag="AllBlocksCleared"):
    pass


class _WireBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


def encode_batch(ts: float, events: list, data_parallel_rank: int | None = 0) -> bytes:
    """The payload vLLM 0.34's publisher sends for these events (`BlockStored`, `BlockRemoved`,
    `AllBlocksCleared` from this module): [ts, events, rank] with map-tagged events, vLLM's required fields
    always present and its optional ones only when not None. SGLang's `cache_salt` is not a vLLM field and is
    not written."""
    wire = []
    for event in events:
        if isinstance(event, (BlockStored, _StoredArray)):
            cls = _WireStored
        elif isinstance(event, (BlockRemoved, _RemovedArray)):
            cls = _WireRemoved
        elif isinstance(event, (AllBlocksCleared, _ClearedArray)):
            cls = _WireCleared
        else:
            raise TypeError(f"not a KV event: {type(event).__name__}")
        wire.append(cls(**{name: getattr(event, name, None) for name in cls.__struct_fields__}))
    return _ENCODER.encode(_WireBatch(float(ts), wire, data_parallel_rank))


def seq_bytes(seq: int) -> bytes:
    """A sequence number as vLLM sends it: 8 bytes big-endian (the replay end marker is -1, signed)."""
    return seq.to_bytes(8, "big", signed=seq < 0)
