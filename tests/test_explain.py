"""The explainer (pagevis/attach/explain.py) against hand-built event streams and against a toy vLLM block pool
written here from vLLM's rules (hash chains with extra keys, LRU eviction, the hit capped below the prompt's
length): the explainer matches by token ids and parent chains and never sees the toy's hash function, so its
hit_tokens agreeing with the toy's own hash lookup for random workloads checks the two independently."""

import hashlib
import random
from collections import OrderedDict

import pytest

from pagevis.attach import BlockRemoved, BlockStored, EngineState
from pagevis.attach.events import DecodedBatch
from pagevis.attach.explain import Engine, ExplainRequest, block_keys, explain, explain_engine
from pagevis.attach.feed import EndpointFeed
from pagevis.attach.playback import Playback
from pagevis.attach.recording import read_recording

BS = 4


class ToyVllm:
    """A prefix-caching block pool by vLLM's rules: block hash = H(parent hash, tokens, extra keys), extra keys
    = (lora name on every block) + (cache salt on the first); the hit is the longest run of cached blocks within
    (n - 1) // block_size; new full blocks are stored (one BlockStored per request, vLLM's parent semantics);
    above `capacity` cached blocks, the least recently used go (one BlockRemoved each)."""

    def __init__(self, capacity, seed):
        self.capacity, self.seed = capacity, seed
        self.cached = OrderedDict()  # hash -> True, least recently used first

    def keys(self, index, salt, lora):
        keys = ([lora] if lora else []) + ([salt] if index == 0 and salt else [])
        return keys or None

    def hashes(self, tokens, salt=None, lora=None):
        out, parent = [], self.seed
        for i in range(len(tokens) // BS):
            parent = hashlib.sha256(repr((parent, tokens[i * BS:(i + 1) * BS], self.keys(i, salt, lora))).encode())
            parent = int.from_bytes(parent.digest()[:8], "big")
            out.append(parent)
        return out

    def hit(self, tokens, salt=None, lora=None):
        n = 0
        for h in self.hashes(tokens, salt, lora)[:(len(tokens) - 1) // BS]:
            if h not in self.cached:
                break
            n += 1
        return n * BS

    def run(self, tokens, salt=None, lora=None):
        """Serve one request; returns (cached tokens, the events it caused). Every full block after the hit is
        stored again (vLLM registers a recomputed block even when its hash is cached: a reuse report)."""
        hashes, hit = self.hashes(tokens, salt, lora), self.hit(tokens, salt, lora) // BS
        events = []
        if hit < len(hashes):
            events.append(BlockStored(
                block_hashes=hashes[hit:], parent_block_hash=hashes[hit - 1] if hit else None,
                token_ids=tokens[hit * BS:len(hashes) * BS], block_size=BS, medium="GPU", lora_name=lora,
                extra_keys=[self.keys(i, salt, lora) for i in range(hit, len(hashes))] if (salt or lora) else None))
        for h in reversed(hashes):  # vLLM frees a request's blocks tail first: its first block is evicted last
            self.cached[h] = True
            self.cached.move_to_end(h)
        while len(self.cached) > self.capacity:
            old, _ = self.cached.popitem(last=False)
            events.append(BlockRemoved(block_hashes=[old], medium="GPU"))
        return hit * BS, events


def apply(state, events, seq, ts=0.0):
    state.apply_batch(seq, DecodedBatch(ts, tuple(events), 0, "map"))


def tokens_of(*labels, extra=()):
    return [ord(label) * 100 + i for label in labels for i in range(BS)] + list(extra)


def test_random_workloads_agree_with_the_toy_engines_own_lookup():
    rng = random.Random(7)
    hits = removals = 0
    for trial in range(6):
        toy, state = ToyVllm(capacity=rng.choice((6, 12, 40)), seed=rng.getrandbits(32)), EngineState("toy")
        systems = [[rng.randrange(50) for _ in range(rng.choice((3, 8, 13)))] for _ in range(3)]
        for seq in range(60):
            prompt = rng.choice(systems) + [rng.randrange(50) for _ in range(rng.randrange(0, 9))]
            if rng.random() < 0.2 and len(prompt) > 2:
                prompt[rng.randrange(len(prompt))] = 99  # a changed word
            salt = rng.choice((None, None, "t1", "t2"))
            lora = rng.choice((None, None, None, "ad"))
            result = explain_engine(state, ExplainRequest(tuple(prompt), salt, lora))
            assert result["hit_tokens"] == toy.hit(prompt, salt, lora), (trial, seq)
            assert result["hit_blocks"] * BS == result["hit_tokens"] and len(result["media"]) == result["hit_blocks"]
            cached, events = toy.run(prompt, salt, lora)
            assert cached == result["hit_tokens"]
            hits += cached > 0
            removals += sum(isinstance(e, BlockRemoved) for e in events)
            apply(state, events, seq, ts=float(seq))
    assert hits > 100 and removals > 100  # the workloads hit and evict (measured: printed by -s)


@pytest.fixture
def pool():
    """A, B, C stored as one chain; B2 (B with its third token changed) under A; D under C removed at ts 5;
    a salted S first block; a block stored without token ids."""
    state = EngineState("e")
    apply(state, [BlockStored(block_hashes=[1, 2, 3], parent_block_hash=None, token_ids=tokens_of("A", "B", "C"),
                              block_size=BS, medium="GPU")], 0, ts=1.0)
    b2 = tokens_of("B")
    b2[2] = 7
    apply(state, [BlockStored(block_hashes=[22], parent_block_hash=1, token_ids=b2, block_size=BS),
                  BlockStored(block_hashes=[4], parent_block_hash=3, token_ids=tokens_of("D"), block_size=BS),
                  BlockStored(block_hashes=[9], parent_block_hash=None, token_ids=tokens_of("S"), block_size=BS,
                              extra_keys=[["tenant-1"]])], 1, ts=2.0)
    apply(state, [BlockRemoved(block_hashes=[4])], 2, ts=5.0)
    return state


def why(state, tokens, **kw):
    return explain_engine(state, ExplainRequest(tuple(tokens), **kw), lambda ids: " ".join(map(str, ids)))


def test_each_reason(pool):
    hit = why(pool, tokens_of("A", "B", "C", extra=[5]))
    assert (hit["hit_tokens"], hit["media"], hit["first_miss"]["reason"]) == (12, ["GPU"] * 3, "partial_block")
    assert hit["first_miss"]["tail_tokens"] == 1 and hit["first_miss"]["position"] == 12
    changed = tokens_of("A", "B", "C", extra=[5])
    changed[7] = 555
    miss = why(pool, changed)["first_miss"]
    assert (miss["reason"], miss["block"], miss["position"]) == ("token_differs", 1, 7)
    assert miss["cached_token"] == 6603 and miss["prompt_token"] == 555  # against B, which agrees longest
    assert miss["cached_text"] == "6600 6601 6602 6603" and miss["agreed_text"] == "6600 6601 6602"
    removed = why(pool, tokens_of("A", "B", "C", "D", extra=[1]))
    assert removed["hit_tokens"] == 12
    m = removed["first_miss"]
    assert (m["reason"], m["block"], m["removed_at"], m["lived_s"]) == ("removed", 3, 5.0, 3.0)
    short = why(pool, tokens_of("A")[:3])
    assert (short["hit_tokens"], short["first_miss"]["reason"]) == (0, "partial_block")
    capped = why(pool, tokens_of("A", "B"))
    assert (capped["hit_tokens"], capped["first_miss"]["reason"], capped["first_miss"]["block"]) == (4, "capped", 1)
    never = why(pool, tokens_of("Z", "A"))
    assert (never["hit_tokens"], never["first_miss"]["reason"]) == (0, "never_stored")


def test_salt_and_lora_keys(pool):
    salted = why(pool, tokens_of("S", extra=[1]), cache_salt="tenant-1")
    assert salted["hit_tokens"] == 4
    other = why(pool, tokens_of("S", extra=[1]), cache_salt="tenant-2")["first_miss"]
    assert (other["reason"], other["which"], other["cached"], other["requested"]) == (
        "extra_keys", ["cache_salt"], {"cache_salt": "tenant-1"}, {"cache_salt": "tenant-2"})
    unsalted = why(pool, tokens_of("A", extra=[1]), cache_salt="tenant-1")["first_miss"]
    assert (unsalted["reason"], unsalted["which"]) == ("extra_keys", ["cache_salt"])
    lora = why(pool, tokens_of("A", extra=[1]), lora_name="ad")["first_miss"]
    assert (lora["reason"], lora["which"]) == ("extra_keys", ["lora_name"])
    assert block_keys({"extra_keys": ["ad", ["img", 3], "s"], "lora_name": "ad"}, True) == {
        "lora_name": "ad", "cache_salt": "s", "multimodal": [["img", 3]], "prompt_embeds": None, "other": None}
    assert block_keys({"extra_keys": ["ad"]}, False)["lora_name"] == "ad"
    assert block_keys({"cache_salt": "x"}, True)["cache_salt"] == "x"  # SGLang's field


def test_blocks_without_token_ids_match_by_hash_only():
    state = EngineState("e")
    apply(state, [BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=tokens_of("A", "B"),
                              block_size=BS)], 0, ts=1.0)
    apply(state, [BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[], block_size=BS,
                              medium="CPU"), BlockRemoved(block_hashes=[2])], 1, ts=2.0)
    result = why(state, tokens_of("A", "B", extra=[3]))
    assert (result["hit_tokens"], result["media"], result["tokenless_blocks"]) == (8, ["GPU", "CPU"], 2)
    apply(state, [BlockStored(block_hashes=[7], parent_block_hash=None, token_ids=[], block_size=BS)], 2)
    assert why(state, tokens_of("Q", "B"))["first_miss"]["tokenless_siblings"] == 2  # CPU block 1, GPU block 7


def test_best_prefers_the_longest_hit_then_gpu_then_the_least_loaded():
    def engine(name, stores):
        state = EngineState(name)
        for seq, (hashes, parent, labels, medium) in enumerate(stores):
            apply(state, [BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens_of(*labels),
                                      block_size=BS, medium=medium)], seq)
        return state

    a = engine("a", [([1], None, "A", "GPU")])
    b = engine("b", [([5], None, "A", "CPU")])
    c = engine("c", [([3], None, "A", "GPU"), ([8], None, "X", "GPU")])
    d = engine("d", [([3, 4], None, "AB", "GPU")])
    engines = [Engine("tcp://a", 0, a), Engine("tcp://b", 0, b), Engine("tcp://c", 0, c)]
    out = explain(engines, ExplainRequest(tuple(tokens_of("A", "B"))))
    assert [r["endpoint"] for r in out["ranking"]] == ["tcp://a", "tcp://c", "tcp://b"]
    assert out["best"] == {"endpoint": "tcp://a", "rank": 0} and out["blocks"] == 2 and out["tokens"] == 8
    assert [e["endpoint"] for e in out["engines"]] == ["tcp://a", "tcp://b", "tcp://c"]
    longer = explain(engines + [Engine("tcp://d", 1, d)], ExplainRequest(tuple(tokens_of("A", "B", "C"))))
    assert longer["best"] == {"endpoint": "tcp://d", "rank": 1}
    empty = explain([Engine("x", None, EngineState("x"))], ExplainRequest((1, 2)))
    assert empty["engines"][0]["first_miss"]["reason"] == "never_stored" and empty["blocks"] is None


def test_the_recorded_vllm_stream():
    """vLLM 0.34.0's own publisher (tests/data/kv_events): A-B-C, E under B (stored with LoRA 'ad' at seq 2,
    removed at 3, stored again plainly at 4), F under B (LoRA 'ad', removed at 3), 4-token blocks."""
    from pathlib import Path

    playback = Playback(read_recording(Path(__file__).parent / "data" / "kv_events" / "vllm-0.34.0.kvev"))
    playback.seek(len(playback))
    state = playback.fleet.engines[0]
    assert isinstance(playback.feeds[0], EndpointFeed)
    ts0 = 1_700_000_000.0
    assert why(state, tokens_of("A", "B", "C", extra=[1]))["hit_tokens"] == 12
    assert why(state, tokens_of("A", "B", "E", extra=[1]))["hit_tokens"] == 12
    f = why(state, tokens_of("A", "B", "F", extra=[1]), lora_name="ad")
    assert f["hit_tokens"] == 0 and f["first_miss"]["reason"] == "extra_keys"  # A and B carry no LoRA
    plain_f = why(state, tokens_of("A", "B", "F", extra=[1]))["first_miss"]
    assert (plain_f["reason"], plain_f["block"]) == ("token_differs", 2)  # F was stored with LoRA keys
    changed = tokens_of("A", "B", extra=[1])
    changed[2] = 1
    assert why(state, changed)["first_miss"]["position"] == 2
    assert why(state, tokens_of("A", "B", "C"))["first_miss"]["reason"] == "capped"
    assert why(state, tokens_of("X", extra=[1]))["first_miss"]["reason"] == "never_stored"  # cleared at seq 1
    assert state.counters().last_ts == ts0 + 6


def test_a_cache_salt_starts_pagevis_own_hash_chain_elsewhere():
    """kvcache: the same tokens under another salt (or none) share no page; under the same salt, every full page
    below the last token."""
    import numpy as np

    from pagevis.kvcache import CacheConfig, KVCacheManager

    config = CacheConfig(page_size=4, max_pages=16, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=4, policy="none")
    cache, tokens = KVCacheManager(config, pool_pages=64), list(range(13))
    kv = np.random.default_rng(0).standard_normal((13, 1, 4)).astype(np.float32)
    cache.add_sequence(0)
    assert cache.match_prefix(0, tokens, cache_salt="t1") == 0
    cache.extend(0, tokens)
    cache.append(0, 0, kv, kv, np.arange(13))
    cache.commit(0)
    cache.free(0)
    for seq, salt, hit in ((1, "t1", 12), (2, "t2", 0), (3, None, 0)):
        cache.add_sequence(seq)
        assert cache.match_prefix(seq, tokens + [1], cache_salt=salt) == hit


def test_the_removed_memory_is_bounded_and_indexed_on_first_use():
    """removed_memory bounds what can be explained as `removed`; the index by (parent, tokens) is built on the
    first question, then kept through removals, re-stores and forgetting; a salted and an unsalted first block
    with the same tokens are both found."""
    from pagevis.attach import StateLimits
    from pagevis.attach.events import decode_payload, encode_batch

    state = EngineState("e", StateLimits(removed_memory=3))
    plain = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=tokens_of("A"), block_size=BS)
    salted = BlockStored(block_hashes=[2], parent_block_hash=None, token_ids=tokens_of("A"), block_size=BS,
                         extra_keys=[["s"]])
    apply(state, [plain, salted], 0, ts=1.0)
    apply(state, [BlockRemoved(block_hashes=[1, 2])], 1, ts=2.0)
    assert why(state, tokens_of("A", extra=[1]))["first_miss"]["reason"] == "removed"  # the index is built here
    assert why(state, tokens_of("A", extra=[1]), cache_salt="s")["first_miss"]["reason"] == "removed"
    apply(state, [plain], 2, ts=3.0)  # stored again: a hit, not a removal
    assert why(state, tokens_of("A", extra=[1]))["hit_tokens"] == 4
    for seq, label in enumerate("BCDE", start=3):  # four more removals: the salted block is forgotten
        apply(state, [BlockStored(block_hashes=[seq * 10], parent_block_hash=None, token_ids=tokens_of(label),
                                  block_size=BS), BlockRemoved(block_hashes=[seq * 10])], seq, ts=float(seq))
    apply(state, [BlockRemoved(block_hashes=[1])], 9, ts=9.0)
    assert why(state, tokens_of("A", extra=[1]), cache_salt="s")["first_miss"]["reason"] == "never_stored"
    assert why(state, tokens_of("A", extra=[1]))["first_miss"]["reason"] == "removed"
    assert why(state, tokens_of("B", extra=[1]))["first_miss"]["reason"] == "never_stored"  # forgotten too
    tokenless = BlockStored(block_hashes=[5], parent_block_hash=None, token_ids=[], block_size=BS, medium="CPU")
    assert decode_payload(encode_batch(1.0, [tokenless])).events[0].token_ids == []  # accepted: no token ids sent
