"""A decoding session: a model, a paged cache and a sampler, advanced one step at a time.

Each call to `step()` returns one StepRecord. The prompt enters the cache in prefill chunks that fit in
the free slots (so a prompt longer than the cache is evicted from like any other text); decode steps
then feed one sampled token at a time. With `oracle` on, the same token stream also runs through a
full cache that never evicts, and every record carries the comparison.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from ..engine import CacheConfig, CacheSettings, ConfigError, EventKind, PagedKVCache
from .. import settings
from ..errors import check_int
from ..settings import field_for
from .oracle import FullCacheOracle
from .record import StepRecord, TierStep
from .sampling import Sampler, SamplingConfig

MAX_NEW_TOKENS = settings.MAX_NEW_TOKENS

StepHook = Callable[[StepRecord], None]


@dataclass(frozen=True)
class SessionConfig(CacheSettings):
    """The cache settings (inherited from CacheSettings) plus how to decode; defaults, bounds and help in
    the settings table (pagevis/settings.py)."""

    max_new_tokens: int = field_for("max_new_tokens")
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    oracle: bool = field_for("oracle")
    chat: bool = field_for("chat")  # wrap the prompt in the model's chat template
    special: bool = field_for("special")  # without chat: control-token text becomes control tokens (opt-in)
    record_layers: tuple[int, ...] | None = field_for("record_layers")  # layers records keep; None = all

    def __post_init__(self) -> None:
        super().__post_init__()
        settings.check(self, ("max_new_tokens",))

    def cache_config(self, model_config) -> CacheConfig:
        return CacheConfig.for_model(self, model_config)


class DecodeSession:
    def __init__(self, model, prompt: str, config: SessionConfig | None = None,
                 prompt_ids: list[int] | None = None):
        self.model = model
        self.config = config or SessionConfig()
        self.cache_config = self.config.cache_config(model.config)
        n_layers = model.config.n_layers
        layers = tuple(range(n_layers)) if self.config.record_layers is None else tuple(self.config.record_layers)
        for layer in layers:
            check_int("record_layers", layer, 0, n_layers - 1)
        self.record_layers = layers
        self.prompt = prompt
        if prompt_ids is None:
            prompt_ids = encode_prompt(model, prompt, self.config.chat, self.config.special)
        self.prompt_ids = tuple(prompt_ids)
        if not self.prompt_ids:
            raise ConfigError("prompt", prompt, "text that encodes to at least one token")
        self.cache = PagedKVCache(self.cache_config)
        self.sampler = Sampler(self.config.sampling)
        self.oracle = (FullCacheOracle(model, self.cache_config, len(self.prompt_ids) + self.config.max_new_tokens)
                       if self.config.oracle else None)
        self.records: list[StepRecord] = []
        self.generated: list[int] = []  # sampled tokens, in order
        self.stop_reason: str | None = None
        self._fed = 0  # prompt tokens already in the cache
        self._evictions = 0
        self._last_weights: dict[int, np.ndarray] = {}
        self._hooks: list[StepHook] = []

    # --- observers -----------------------------------------------------------------------------------
    def add_hook(self, hook: StepHook) -> None:
        """Call hook(record) on the stepping thread after every step (metrics, progress, servers...)."""
        self._hooks.append(hook)

    def remove_hook(self, hook: StepHook) -> None:
        self._hooks.remove(hook)

    # --- state ---------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    @property
    def next_position(self) -> int:
        return self._fed + max(len(self.generated) - 1, 0)

    def text(self) -> str:
        """The generated text so far (not the prompt, not the end-of-sequence token that stopped it)."""
        ids = self.generated[:-1] if self.stop_reason == "eos" else self.generated
        return decode_ids(self.model, ids)

    def token_text(self, token_id: int) -> str:
        return token_text(self.model, token_id)

    # --- stepping ------------------------------------------------------------------------------------
    def run(self) -> Iterator[StepRecord]:
        while not self.done:
            yield self.step()

    def step(self) -> StepRecord:
        """Advance one step. Raises CacheFullError (policy 'none') before changing anything."""
        if self.done:
            raise RuntimeError(f"the session has finished ({self.stop_reason}); reset to decode again")
        started = time.perf_counter()
        if self._fed < len(self.prompt_ids):
            room = self.cache.free_slots()
            chunk = max(1, min(len(self.prompt_ids) - self._fed, room, self.cache.max_chunk() or room))
            tokens = self.prompt_ids[self._fed: self._fed + chunk]
            positions = np.arange(self._fed, self._fed + chunk, dtype=np.int64)
            kind = "prefill"
        else:
            tokens = (self.generated[-1],)
            positions = np.array([self.next_position], dtype=np.int64)
            kind = "decode"
        self.cache.ensure_room(len(tokens))
        self.cache.step = len(self.records)
        token_array = np.asarray(tokens, dtype=np.int64)

        logits = self.model.forward(token_array, positions, self._attend)
        forward_done = time.perf_counter()
        if kind == "prefill":
            self._fed += len(tokens)
        last_chunk = kind == "decode" or self._fed == len(self.prompt_ids)
        next_token = self.sampler.sample(logits) if last_chunk else -1
        sampled = time.perf_counter()

        oracle_step = None
        if self.oracle is not None:
            # Mid-prefill the next token is known (the prompt's), so the comparison is teacher-forced.
            scored = next_token if last_chunk else self.prompt_ids[self._fed]
            oracle_step = self.oracle.step(token_array, positions, self.cache, logits, scored)
        oracle_done = time.perf_counter()

        if next_token >= 0:
            self.generated.append(next_token)
            if next_token in self.model.config.eos_ids:
                self.stop_reason = "eos"
            elif len(self.generated) >= self.config.max_new_tokens:
                self.stop_reason = "max_new_tokens"
        record = self._record(kind, tokens, positions, next_token, oracle_step)
        finished = time.perf_counter()
        record.timings.update(forward=forward_done - started, sample=sampled - forward_done,
                              oracle=oracle_done - sampled, record=finished - oracle_done,
                              total=finished - started)
        self.records.append(record)
        for hook in self._hooks:
            hook(record)
        return record

    def _attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                positions: np.ndarray) -> np.ndarray:
        self.cache.append(layer, k, v, positions)
        result = self.cache.attend(layer, q, positions)
        self._last_weights[layer] = (result.weights[-1], result.slots)
        return result.output

    def _record(self, kind, tokens, positions, next_token, oracle_step) -> StepRecord:
        events = tuple(self.cache.take_events())
        self._evictions += sum(1 for e in events if e.kind is EventKind.EVICT)
        cfg = self.cache_config
        policy = self.cache.policy
        shape = (cfg.max_pages, cfg.page_size)
        slot_maps, protected, scores = [], [], []
        for view, store in zip(self.cache.views, self.cache.stores, strict=True):
            # per RAM slot: the flat slot (page id * page size + slot) of the page it holds, -1 if none
            held = (store.page_in[:, None] * cfg.page_size + np.arange(cfg.page_size)).ravel()
            held = np.where(np.repeat(store.page_in >= 0, cfg.page_size), held, -1)
            empty = held < 0
            slot_maps.append(store.frame_slot_map())
            protected.append(np.where(empty, False, policy.protected(view)[held]).reshape(shape))
            score = np.where(view.occupied(), policy.score(view), np.nan)
            scores.append(np.where(empty, np.nan, score[held]).reshape(shape))
        attention = []
        for layer in self.record_layers:
            weights = np.zeros((cfg.n_heads, cfg.capacity), dtype=np.float16)
            last, slots = self._last_weights[layer]
            if slots is None:
                weights[:, : last.shape[1]] = last
            else:
                weights[:, slots] = last
            attention.append(weights)
        first = self.cache.stores[0]
        tiers = None
        if cfg.tiered or self.cache.select_pages is not None:
            tiers = TierStep(
                counts=np.array([c.as_tuple() for c in self.cache.take_counts()], dtype=np.int64),
                page_maps=np.array([self.cache.stores[layer].positions.reshape(cfg.n_page_ids, cfg.page_size)
                                    for layer in self.record_layers], dtype=np.int32
                                   ).reshape(len(self.record_layers), cfg.n_page_ids, cfg.page_size),
                block_frames=tuple(tuple(int(s.frame_of[p]) for p in table) for s, table in
                                   zip(self.cache.stores, self.cache.sequence.block_tables, strict=True)),
                recall=None if self.oracle is None else self.oracle.recall)
        return StepRecord(
            step=len(self.records), kind=kind, token_ids=tuple(int(t) for t in tokens),
            positions=tuple(int(p) for p in positions), next_token=int(next_token),
            next_text=self.token_text(next_token) if next_token >= 0 else "",
            slot_maps=np.stack(slot_maps).astype(np.int32), protected=np.stack(protected),
            scores=np.stack(scores).astype(np.float32),
            block_tables=tuple(tuple(table) for table in self.cache.sequence.block_tables),
            events=events, attention_layers=self.record_layers, attention=tuple(attention),
            timings={}, resident_tokens=first.resident, pages_used=self.cache.sequence.n_pages(0),
            evictions_total=self._evictions, oracle=oracle_step, tiers=tiers,
        )


# The tokenizer is the model package's; these keep the session's few uses of it in one place.
def encode_prompt(model, prompt: str, chat: bool, special: bool = False) -> list[int]:
    """The prompt's ids: in the chat template (the prompt stays text), or raw (control tokens only if `special`)."""
    tokenizer = model.tokenizer
    if chat:
        return list(tokenizer.encode_chat([{"role": "user", "content": prompt}]))
    return list(tokenizer.encode(prompt, special=special))


def decode_ids(model, ids) -> str:
    return model.tokenizer.decode(list(ids))


def token_text(model, token_id: int) -> str:
    return model.tokenizer.token_text(int(token_id))
