"""Why a prompt hits or misses each engine's prefix cache, and which engine it should go to (no sockets, no Qt).

`explain(engines, request, detokenize=None)` reads each engine's rebuilt pool (`EngineState`, state.py; the
caller holds the fleet's lock) and answers, per engine, what that engine will report as cached for the request
and where the rest misses:

- The engine's own rule (vLLM's `get_computed_blocks`, SGLang's radix match, `pagevis serve`'s `match_prefix`):
  only full blocks are cached, and the hit stops one token short of the prompt, so that the last prompt token is
  computed: at most (len(prompt) - 1) // block_size blocks.
- Matching: block hashes are engine-specific (vLLM seeds them per process), so a prompt block matches a resident
  block under the block matched before it (None for the first) with the same token ids and the same extra keys
  (vLLM's block extra keys: the LoRA name on every block, the cache salt on the first, multimodal and
  prompt-embedding keys; SGLang's `cache_salt` field). A block sent without token ids (vLLM's offloading events
  before their token ids were filled in) can match only by its hash: when a block with tokens and the same hash
  is or was resident in that engine.
- The first miss, with its reason: `token_differs` (a cached continuation agrees up to `position`), `removed`
  (it was stored, then removed: when, and how long it lived), `extra_keys` (the same tokens are cached under other
  keys: `which`), `partial_block` (the prompt's tail is shorter than a block), `capped` (every full block is
  cached, but the last prompt token is computed, so the last block's hit is given up), `never_stored`.
- `best`: the longest hit, then more of it on GPU, then the fewest blocks in use (resident, every medium);
  `ranking` orders them all.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from pagevis.attach.report import hash_json
from pagevis.attach.state import GPU, EngineState

Detokenize = Callable[[Sequence[int]], str]
MEDIUM_ORDER = ("GPU", "CPU", "CPU_PINNED", "STORAGE", "DISK", "EXTERNAL")


@dataclass(frozen=True)
class ExplainRequest:
    tokens: tuple[int, ...]
    cache_salt: str | None = None
    lora_name: str | None = None


@dataclass(frozen=True)
class Engine:
    """One engine to explain against: its endpoint, data-parallel rank and rebuilt state."""

    endpoint: str
    rank: int | None
    state: EngineState


def explain(engines: Sequence[Engine], request: ExplainRequest, detokenize: Detokenize | None = None,
            index: int = 0, with_path: bool = False) -> dict:
    """The JSON object of one request (see the module docstring); engines in the order given. `with_path`: each
    engine's matched blocks' hashes too (`path`, JSON hashes: what the window highlights)."""
    results = [explain_engine(e.state, request, detokenize, with_path) for e in engines]
    for engine, result in zip(engines, results):
        result["endpoint"], result["rank"] = engine.endpoint, engine.rank
    order = sorted(range(len(results)), key=lambda i: (-results[i]["hit_tokens"], -results[i]["media"].count(GPU),
                                                       results[i]["blocks_in_use"], i))
    sizes = [r["block_size"] for r in results if r["block_size"]]
    return {"index": index, "tokens": len(request.tokens),
            "blocks": len(request.tokens) // sizes[0] if sizes else None,
            "engines": [{"endpoint": r.pop("endpoint"), "rank": r.pop("rank"), **r} for r in results],
            "best": {"endpoint": engines[order[0]].endpoint, "rank": engines[order[0]].rank} if order else None,
            "ranking": [{"endpoint": engines[i].endpoint, "rank": engines[i].rank,
                         "hit_tokens": results[i]["hit_tokens"]} for i in order]}


def explain_engine(state: EngineState, request: ExplainRequest, detokenize: Detokenize | None = None,
                   with_path: bool = False) -> dict:
    """hit_tokens, hit_blocks, media (per hit block), first_miss, block_size, blocks_in_use of one engine."""
    tokens, size = list(request.tokens), state.block_size
    in_use = state.resident_blocks
    result: dict[str, Any] = {"hit_tokens": 0, "hit_blocks": 0, "media": [], "first_miss": None,
                              "block_size": size, "blocks_in_use": in_use}
    if state.tokenless_blocks:
        result["tokenless_blocks"] = state.tokenless_blocks  # stored without token ids: they match by hash only
    if with_path:
        result["path"] = []
    if size is None:
        result["first_miss"] = {"reason": "never_stored", "block": 0, "position": 0,
                                "detail": "this engine has stored no blocks"}
        return result
    groups = _groups(state)
    pool = _Pool(state, groups[0] if groups else None)
    full, cap = len(tokens) // size, max(0, (len(tokens) - 1) // size)
    parent, media, path = None, [], []
    miss = None
    for i in range(full):
        packed = array("I", tokens[i * size:(i + 1) * size]).tobytes()
        found = _match(pool, parent, packed, _wanted(request, i))
        if found is None:
            miss = _diagnose(pool, parent, packed, request, i, size, detokenize)
            break
        parent = found
        path.append(hash_json(found))
        media.append(_best_medium(pool.media_holding(found)))
    hit = min(len(media), cap)
    if miss is None:
        if full * size < len(tokens):
            miss = {"reason": "partial_block", "block": full, "position": full * size,
                    "tail_tokens": len(tokens) - full * size}
        elif hit < len(media):
            miss = {"reason": "capped", "block": hit, "position": hit * size,
                    "detail": "every full block is cached; the engine computes the last prompt token, so the hit "
                              "stops a block short"}
    if miss is not None:
        miss["block_size"] = size
    result.update(hit_tokens=hit * size, hit_blocks=hit, media=media[:hit], first_miss=miss)
    if with_path:
        result["path"] = path
    return result


class _Pool:
    """What the explainer asks of one engine's state, over every tier (medium) of one KV cache group. It reads
    the state's columns directly (the same package; the caller holds the fleet's lock)."""

    def __init__(self, state: EngineState, group: int | None):
        self.state, self.group = state, group
        self.tiers = [t for t in state._tier_list if t.group == group]

    def same_tokens(self, parent: Any, packed: bytes) -> list[tuple]:
        """(hash, medium, extras) of each resident block under `parent` (None: first blocks) with these tokens
        (the tiers' index: no walk over the siblings)."""
        s, found = self.state, []
        for tier in self.tiers:
            for slot in tier.child_slots(parent, packed, s._parent_of, s._tokens_of):
                found.append((s._hash_of[slot], tier.medium, s._extra_of[slot]))
        return found

    def closest_sibling(self, parent: Any, packed: bytes) -> tuple[tuple | None, int, int]:
        """The resident block under `parent` whose tokens agree longest with `packed` from its start: ((hash,
        medium, tokens), tokens agreed) or (None, -1) without one with tokens; and how many have no tokens. One
        walk over the siblings (the only one the explainer makes, at a miss)."""
        s, best, agree, tokenless = self.state, None, -1, 0
        head = packed[:4]
        for tier in self.tiers:
            child = tier.heads.get(parent, -1)
            while child >= 0:
                tokens = s._tokens_of[child]
                if not tokens:
                    tokenless += 1
                elif best is None or tokens[:4] == head:  # the others agree on no token
                    same = _agreed(tokens, packed)
                    if same > agree:
                        best, agree = (s._hash_of[child], tier.medium, tokens), same
                child = s._next[child]
        return best, agree, tokenless

    def removed_child(self, parent: Any, packed: bytes) -> list[tuple]:
        """(hash, medium, removal ts, store ts, extras) of each remembered removed block with these tokens."""
        found = []
        for tier in self.tiers:
            for block_hash in tier.removed_hashes(parent, packed):
                ts, _, _, stored, extras = tier.removed_at[block_hash]
                found.append((block_hash, tier.medium, ts, stored, extras))
        return found

    def media_holding(self, block_hash: Any) -> list[str]:
        return [t.medium for t in self.tiers if block_hash in t.slot_of]


def _groups(state: EngineState) -> list:
    return sorted({t.group for t in state._tier_list}, key=lambda g: (g is not None, g or 0))


def _wanted(request: ExplainRequest, index: int) -> dict:
    return {"lora_name": request.lora_name, "cache_salt": request.cache_salt if index == 0 else None}


def block_keys(extras: Any, first: bool) -> dict:
    """A block's extra keys, by name, from its event's fields: `lora_name`, `cache_salt` (SGLang's field; vLLM's
    first block's extra keys after the LoRA name and multimodal keys), `multimodal`, `prompt_embeds`, `other`."""
    extras = extras or {}
    keys = list(extras.get("extra_keys") or ())
    strings = [k for k in keys if isinstance(k, str)]
    lora, salt = extras.get("lora_name"), extras.get("cache_salt")
    if lora is not None and strings and strings[0] == lora:
        strings.pop(0)
    elif lora is None and strings and (not first or extras.get("lora_id") is not None or len(strings) > 1):
        lora = strings.pop(0)  # a LoRA name in the keys, from an engine that did not send lora_name
    if first and strings and salt is None:
        salt = strings.pop()
    return {"lora_name": lora, "cache_salt": salt,
            "multimodal": [k for k in keys if isinstance(k, (list, tuple))] or None,
            "prompt_embeds": sum(isinstance(k, (bytes, bytearray)) for k in keys) or None,
            "other": strings or None}


def _key_differences(extras: Any, wanted: dict, first: bool) -> list[str]:
    keys = block_keys(extras, first)
    names = [name for name in ("lora_name", "cache_salt") if keys[name] != wanted[name]]
    return names + [name for name in ("multimodal", "prompt_embeds", "other") if keys[name]]


def _agreed(a: bytes, b: bytes) -> int:
    """Tokens (4 bytes each) two packed blocks share from their start."""
    n = min(len(a), len(b)) // 4
    return next((i for i in range(n) if a[4 * i:4 * i + 4] != b[4 * i:4 * i + 4]), n)


def _match(pool: _Pool, parent: Any, packed: bytes, wanted: dict) -> Any:
    """The hash of the block that continues `parent` with these tokens and keys, resident in some medium."""
    first = parent is None
    for block_hash, _, extras in pool.same_tokens(parent, packed):
        if not _key_differences(extras, wanted, first):
            return block_hash
    for block_hash, _, _, _, extras in pool.removed_child(parent, packed):  # a copy without tokens may be held
        if not _key_differences(extras, wanted, first) and pool.media_holding(block_hash):
            return block_hash
    return None


def _diagnose(pool: _Pool, parent: Any, packed: bytes, request: ExplainRequest, index: int, size: int,
              detokenize: Detokenize | None) -> dict:
    start = index * size
    miss: dict[str, Any] = {"block": index, "position": start}
    wanted = _wanted(request, index)
    for block_hash, medium, extras in pool.same_tokens(parent, packed):  # resident, under other keys
        which = _key_differences(extras, wanted, parent is None)
        keys = block_keys(extras, parent is None)
        return {"reason": "extra_keys", **miss, "which": which, "medium": medium, "hash": hash_json(block_hash),
                "cached": {name: keys[name] for name in which}, "requested": {name: wanted.get(name) for name in which}}
    removed = [r for r in pool.removed_child(parent, packed)
               if not _key_differences(r[4], wanted, parent is None)]
    if removed:
        block_hash, medium, removed_ts, stored_ts, _ = max(removed, key=lambda r: r[2])
        last = pool.state._last_ts
        return {"reason": "removed", **miss, "medium": medium, "hash": hash_json(block_hash),
                "removed_at": removed_ts, "lived_s": removed_ts - stored_ts,
                "ago_s": None if last is None else last - removed_ts}
    prompt = _unpack(packed)
    best, agree, tokenless = pool.closest_sibling(parent, packed)
    if best is not None and (agree > 0 or parent is not None):
        block_hash, medium, cached = best[0], best[1], _unpack(best[2])
        found = {"reason": "token_differs", **miss, "position": start + agree, "medium": medium,
                 "hash": hash_json(block_hash), "cached_tokens": cached, "prompt_tokens": prompt,
                 "cached_token": cached[agree] if agree < len(cached) else None,
                 "prompt_token": prompt[agree] if agree < len(prompt) else None}
        if detokenize is not None:
            found["cached_text"], found["prompt_text"] = detokenize(cached), detokenize(prompt)
            found["agreed_text"] = detokenize(prompt[:agree])
        return found
    miss = {"reason": "never_stored", **miss}
    if tokenless:
        miss["tokenless_siblings"] = tokenless  # blocks here without token ids: only their hashes could match
    return miss


def _unpack(packed: bytes) -> list[int]:
    values = array("I")
    values.frombytes(packed)
    return values.tolist()


def _best_medium(media: list[str]) -> str | None:
    return min(media, key=lambda m: MEDIUM_ORDER.index(m) if m in MEDIUM_ORDER else len(MEDIUM_ORDER)) \
        if media else None
