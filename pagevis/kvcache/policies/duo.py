import json
import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

import numpy as np

from pagevis.kvcache.errors import ConfigError
from pagevis.kvcache.policies.base import EvictionPolicy, bound

CALIBRATION = "calibration/duo-smollm2-135m.json"  # in pagevis.resources; made by scripts/calibrate_duo.py


@lru_cache(maxsize=1)
def shipped_calibration() -> dict:
    """The shipped calibration of SmolLM2-135M's heads (see scripts/calibrate_duo.py): from the installed
    resources, or the source tree's resources/ beside this package (a checkout not installed)."""
    try:
        text = resources.files("pagevis.resources").joinpath(CALIBRATION).read_text("utf-8")
    except (FileNotFoundError, ModuleNotFoundError):
        text = (Path(__file__).resolve().parents[3] / "resources" / CALIBRATION).read_text("utf-8")
    return json.loads(text)


@dataclass
class DuoAttention(EvictionPolicy):
    """Retrieval heads keep every token; streaming heads keep the n_sink first and the `recent` newest.
    Which KV heads stream comes from a calibration shipped for SmolLM2-135M (scripts/calibrate_duo.py: how
    much each head's attention output changes when it sees only sinks and recent tokens, on Chapters II-VI
    of the shipped Pride and Prejudice): the `streaming_pct` percent of all (layer, KV head) pairs whose
    output changes least. Retrieval heads are bounded by the pool: when it is full the oldest non-sink token
    leaves every head. With `budget`, each layer holds n_kv_heads x budget (KV head, token) entries: its
    retrieval heads get the newest tokens that the streaming heads' leave room for (the pool must hold
    the largest layer's). Other models: hand the policy a calibration (`calibrated`)."""

    streaming_pct: int = 50
    n_sink: int = 4
    recent: int = 28
    budget: int | None = None
    per_head = True
    name = "duo"
    citation = ("DuoAttention: Xiao et al. 2024, Efficient Long-Context LLM Inference with Retrieval and Streaming "
                "Heads, arXiv:2410.10819 (heads chosen by a gradient-free calibration, not the paper's trained gates).")
    reason = "oldest non-sink token (the pool is full)"

    def calibrated(self, scores: np.ndarray) -> "DuoAttention":
        """Use these per (layer, KV head) scores (low: streams best) instead of the shipped ones (before bind)."""
        self.calibration = np.asarray(scores, dtype=np.float64)
        return self

    def bind(self, capacity, page_size):
        super().bind(capacity, page_size)
        self.streaming_pct = self.check_int_param("streaming_pct", self.streaming_pct, 0, 100)
        self.n_sink = self.check_int_param("n_sink", self.n_sink, 0, capacity - 1)
        self.recent = self.check_int_param("recent", self.recent, 1, 1 << 20)  # beyond the pool: keeps all it holds

    def bind_heads(self, n_heads, n_kv_heads, head_dim, rope_base):
        super().bind_heads(n_heads, n_kv_heads, head_dim, rope_base)
        scores = getattr(self, "calibration", None)
        if scores is None:
            shipped = shipped_calibration()
            layout = shipped["layout"]
            if (layout["n_layers"], layout["n_kv_heads"]) != (self.n_layers, n_kv_heads):
                if (self.n_layers, n_kv_heads) == (1, 1):  # settings checked without a model: nothing to check
                    scores = np.zeros((1, 1))
                else:
                    raise ConfigError("policy", self.name, f"a model with a calibration: duo's shipped one is for "
                                      f"{shipped['model']} ({layout['n_layers']} layers x {layout['n_kv_heads']} KV "
                                      f"heads), this model has {self.n_layers} x {n_kv_heads}")
            else:
                scores = np.asarray(shipped["scores"], dtype=np.float64)
        if scores.shape != (self.n_layers, n_kv_heads):
            raise ConfigError("duo.calibration", scores.shape, f"scores of shape ({self.n_layers}, {n_kv_heads})")
        n_streaming = round(scores.size * self.streaming_pct / 100)
        self.streaming = np.zeros(scores.shape, dtype=bool)
        self.streaming.flat[np.argsort(scores, axis=None, kind="stable")[:n_streaming]] = True
        self.budgets = [self.capacity] * self.n_layers
        if self.budget is not None:
            self.budget = self.check_int_param("budget", self.budget, 1, self.capacity)
            self.budgets = [self._retrieval_tokens(int(s)) for s in self.streaming.sum(axis=1)]
            if max(self.budgets) > self.capacity:
                layer = int(np.argmax(self.budgets))
                raise ConfigError(f"{self.name}.budget", self.budget,
                                  f"a budget whose largest layer fits the pool: layer {layer} needs "
                                  f"{self.budgets[layer]} tokens ({math.ceil(self.budgets[layer] / self.page_size)} "
                                  f"pages), the pool holds {self.capacity}")

    def _retrieval_tokens(self, n_streaming: int) -> int:
        """Tokens a layer with n_streaming streaming KV heads holds so that all its heads together hold
        n_kv_heads x budget entries (streaming heads n_sink + recent each)."""
        window = self.n_sink + self.recent
        if n_streaming == self.n_kv_heads:
            return window
        return max(window, (self.n_kv_heads * bound(self.budget, "budget") - n_streaming * window) // (self.n_kv_heads - n_streaming))

    def layer_capacity(self, layer):
        return self.budgets[layer] if layer < len(self.budgets) else self.capacity

    def score(self, pages):
        return pages.positions.astype(float)

    def protected(self, pages):
        return (pages.positions >= 0) & (pages.positions < self.n_sink)

    def choose_head_victims(self, pages):
        heads = np.flatnonzero(self.streaming[pages.layer])
        kept = pages.kept()
        if not len(heads) or not kept.any():
            return super().choose_head_victims(pages)
        newest = pages.positions.max()  # the next token takes newest + 1: the window keeps recent - 1 of these
        old = (pages.positions >= self.n_sink) & (pages.positions <= newest + 1 - self.recent)
        drop = kept[heads] & old[None, :]
        rows, slots = np.nonzero(drop)
        order = np.lexsort((heads[rows], pages.positions[slots]))
        return heads[rows][order], slots[order], pages.positions[slots][order].astype(float)
