"""The full-cache oracle: the same token stream through a cache that never evicts, compared per step."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from pagevis.kvcache import CacheConfig, KVCacheManager
from pagevis.engine.step_record import OracleStep
from pagevis.engine.sampling import log_softmax


class FullCacheOracle:
    def __init__(self, model, bounded: CacheConfig, max_tokens: int, record_layers: tuple[int, ...] = ()):
        """record_layers: the layers whose per-head lost attention each step reports (OracleStep.lost_by_head)."""
        pages = math.ceil(max_tokens / bounded.page_size)
        # float32 and whole keys: the oracle is the full cache at full precision, so a quantized, float16 or
        # channel-pruned (ThinK) cache's KL includes what its storage loses
        config = dataclasses.replace(bounded, max_pages=pages, policy="none", policy_params={}, disk_pages=0,
                                     select="all", dtype="float32", key_channels=0.0)
        self.model = model
        self.cache = KVCacheManager.single(config, prefix_caching=False)
        self._bounded: KVCacheManager | None = None
        self._bounded_seq = 0
        self._lost: list[float] = []
        self.record_layers = tuple(record_layers)
        self.lost_by_head = np.zeros((bounded.n_layers, bounded.n_heads), dtype=np.float32)  # at the last step
        self.recall = np.full(bounded.n_layers, np.nan, dtype=np.float32)  # per layer, at the last step

    def reset(self) -> None:
        """Start over (the bounded session restarted)."""
        self.cache.reset()

    def catch_up(self, token_ids, upto: int) -> None:
        """Feed the tokens before position `upto` that the full cache lacks (the bounded session took them
        from the prefix cache)."""
        have = self.cache.n_tokens(0)  # (a local layer holds fewer)
        if have < upto:
            ids = np.asarray(token_ids[have:upto], dtype=np.int64)
            self._bounded = None
            self.model.forward(ids, np.arange(have, upto, dtype=np.int64), self._write_only)
            self.cache.take_events()

    def _write_only(self, layer, q, k, v, positions):
        self.cache.append(0, layer, k, v, positions)
        return self.cache.attend(0, layer, q, positions).output

    def step(self, tokens: np.ndarray, positions: np.ndarray, bounded: KVCacheManager, bounded_seq: int,
             bounded_logits: np.ndarray, chosen: int) -> OracleStep:
        """Feed the step's tokens and compare the next-token distributions; `chosen` is the token
        that comes next (sampled, or the prompt's own mid-prefill)."""
        self._bounded, self._bounded_seq, self._lost = bounded, bounded_seq, []
        self.cache.step = bounded.step
        full_logits = self.model.forward(tokens, positions, self._attend)
        self.cache.take_events()
        full = log_softmax(full_logits)
        part = log_softmax(bounded_logits)
        return OracleStep(
            kl=float(np.sum(np.exp(full) * (full - part))),
            top1_agree=bool(np.argmax(full) == np.argmax(part)),
            logprob_bounded=float(part[chosen]), logprob_full=float(full[chosen]),
            lost_attention=float(np.mean(self._lost)),
            lost_by_head=(tuple(map(tuple, self.lost_by_head[list(self.record_layers)].tolist()))
                          if self.record_layers else None),
        )

    def _attend(self, layer, q, k, v, positions):
        self.cache.append(0, layer, k, v, positions)
        result = self.cache.attend(0, layer, q, positions)
        # The last query's attention, by slot of the full cache, on positions the bounded layer lacks (per
        # query head: a per-head policy's KV head may have dropped tokens the others keep).
        bounded_cache = self._bounded
        assert bounded_cache is not None  # _attend runs only inside step, which sets it
        bounded = bounded_cache.frames(layer).positions
        full_positions = self.cache.slot_positions(layer)
        evicted = (full_positions >= 0) & ~np.isin(full_positions, bounded[bounded >= 0])
        keep = bounded_cache.head_keep(self._bounded_seq, layer)
        weights = result.weights[-1]
        if keep is None:
            lost = weights[:, evicted].sum(axis=-1)
        else:
            held = [bounded[(bounded >= 0) & head] for head in keep]
            gone = np.stack([(full_positions >= 0) & ~np.isin(full_positions, h) for h in held])
            lost = (weights * np.repeat(gone, len(weights) // len(keep), axis=0)).sum(axis=-1)
        self.lost_by_head[layer] = lost
        self._lost.append(float(lost.mean()))
        # Recall: the share of that attention on the tokens the bounded layer actually read.
        read_slots = bounded_cache.read_slots(self._bounded_seq)[layer]
        read = bounded[bounded >= 0] if read_slots is None else bounded[read_slots]
        covered = np.isin(full_positions, read[read >= 0])
        self.recall[layer] = float(result.weights[-1][:, covered].sum(axis=-1).mean())
        return result.output
