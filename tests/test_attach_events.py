"""Decoding every variant of the payload, and refusing what is not one (each a DecodeError with a reason)."""

import msgspec
import pytest

from pagevis.attach.events import BlockStored, DecodeError, decode_payload, encode_batch, sniff_event_encoding

enc = msgspec.msgpack.encode


def test_positional_events_with_and_without_trailing_fields():
    old = enc([1.5, [["BlockStored", [1, 2], None, [5, 6, 7, 8], 2, None, "GPU"],
                     ["BlockRemoved", [2], "GPU"], ["AllBlocksCleared"]], 0])
    batch = decode_payload(old)
    assert batch.encoding == "array" and [type(e).__name__ for e in batch.events] == [
        "_StoredArray", "_RemovedArray", "_ClearedArray"]
    assert batch.events[0].token_ids == [5, 6, 7, 8] and batch.events[0].medium == "GPU"
    later = enc([1.5, [["BlockStored", [1], 9, [5], 1, None, "GPU", "lora", [["k"]], 0, "full", None, "extra"]]])
    event = decode_payload(later).events[0]
    assert (event.parent_block_hash, event.lora_name, event.group_idx, event.kv_cache_spec_kind) == (9, "lora", 0,
                                                                                                   "full")
    assert decode_payload(later).data_parallel_rank is None


def test_unknown_types_are_skipped_in_both_encodings():
    for payload in (enc([1.0, [["BlockPinned", [1]], ["BlockRemoved", [2], "GPU"]], 0]),
                    enc([1.0, [{"type": "BlockPinned"}, {"type": "BlockRemoved", "block_hashes": [2]}], 0])):
        batch = decode_payload(payload)
        assert batch.unknown == ("BlockPinned",) and len(batch.events) == 1 and batch.events[0].block_hashes == [2]


def test_sglang_bigram_pages_keep_the_first_token_of_each_pair():
    payload = enc([1.0, [{"type": "BlockStored", "block_hashes": [-3], "parent_block_hash": None,
                          "token_ids": [[7, 8], [8, 9]], "block_size": 2, "lora_id": None, "medium": "CPU_PINNED",
                          "cache_salt": "s"}], 0])
    event = decode_payload(payload).events[0]
    assert (event.token_ids, event.block_hashes, event.medium, event.cache_salt) == ([7, 8], [-3], "CPU_PINNED", "s")


def test_hashes_ints_and_bytes_within_bounds():
    ok = encode_batch(1.0, [BlockStored(block_hashes=[2**64 - 1, -2**63, b"\x01" * 32], token_ids=[0, 0, 0],
                                       block_size=1)])
    assert decode_payload(ok).events[0].block_hashes == [2**64 - 1, -2**63, b"\x01" * 32]
    with pytest.raises(DecodeError):
        decode_payload(enc([1.0, [{"type": "BlockStored", "block_hashes": [b"x" * 65], "token_ids": [1],
                                   "block_size": 1}]]))


@pytest.mark.parametrize("payload, reason", [
    (b"", "msgpack"),
    (enc("text"), "shape"),
    (enc([1.0]), "shape"),
    (enc(["x", []]), "type"),
    (enc([1.0, [{"no": "type"}]]), "shape"),
    (enc([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2, 3], "block_size": 2}]]), "tokens"),
    (enc([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [2**32], "block_size": 1}]]), "type"),
    (enc([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 1,
                 "extra_keys": [None, None]}]]), "shape"),
    (enc([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "x" * 2000}]]), "type"),
    (enc([float("inf"), []]), "type"),
    (b"\x93\xcb" + b"\x00" * 8 + b"\xdd\x7f\xff\xff\xff", "msgpack"),
])
def test_what_is_not_a_batch(payload, reason):
    with pytest.raises(DecodeError) as error:
        decode_payload(payload)
    assert error.value.reason == reason


def test_a_field_appended_to_the_batch_is_ignored():
    # msgspec's array_like: extra trailing fields are ignored, so a future batch field does not break attach
    assert decode_payload(enc([1.0, [], 0, "future"])).data_parallel_rank == 0


def test_sniffing_reads_only_headers():
    assert sniff_event_encoding(enc([1.0, [{"type": "AllBlocksCleared"}]])) == "map"
    assert sniff_event_encoding(enc([1, [["AllBlocksCleared"]]])) == "array"
    assert sniff_event_encoding(enc([1.0, []])) is None
    assert sniff_event_encoding(b"\x93") is None and sniff_event_encoding(b"") is None
