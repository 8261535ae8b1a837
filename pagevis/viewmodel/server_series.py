"""The Server window's numbers, Qt-free: every step of one side of the simulated server (SideSeries), or the
same columns from consecutive scrapes of a running `pagevis serve`'s /metrics (MetricsSeries), which its plots and
A/B summary read."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from pagevis.attach.metrics import fetch, totals

THROUGHPUT_WINDOW = 10.0  # server seconds the throughput is averaged over
COUNTERS = {"generated": "pagevis_generation_tokens", "prompt": "pagevis_prompt_tokens",
            "hits": "pagevis_prefix_cache_hits", "queries": "pagevis_prefix_cache_queries",
            "preemptions": "pagevis_preemptions", "ttft_sum": "pagevis_time_to_first_token_seconds_sum",
            "ttft_count": "pagevis_time_to_first_token_seconds_count",
            "itl_sum": "pagevis_inter_token_latency_seconds_sum",
            "itl_count": "pagevis_inter_token_latency_seconds_count"}
GAUGES = {"running": "pagevis_requests_running", "waiting": "pagevis_requests_waiting",
          "kv_usage": "pagevis_kv_cache_usage_ratio"}


class _Column:
    """A growing NumPy column (amortised doubling)."""

    def __init__(self, dtype=np.float64):
        self._data = np.zeros(64, dtype)
        self.n = 0

    def append(self, value) -> None:
        if self.n == len(self._data):
            self._data = np.concatenate([self._data, np.zeros_like(self._data)])
        self._data[self.n] = value
        self.n += 1

    @property
    def values(self) -> np.ndarray:
        return self._data[: self.n]


class SideSeries:
    """Every step's numbers of one side, as its ServerSteps gave them."""

    COLUMNS = ("t", "engine", "tokens_out", "generated", "prefill", "decode", "pages_used", "reserved", "pool",
               "hits", "queries", "itl", "completed", "preemptions", "step", "rejected")

    def __init__(self, side: str):
        self.side = side
        self.columns = {name: _Column() for name in self.COLUMNS}
        self.ttft_t, self.ttft = _Column(), _Column()

    def __len__(self) -> int:
        return self.columns["t"].n

    def add(self, step) -> None:
        c = self.columns
        for name, value in (("t", step.t1), ("engine", step.record is not None), ("tokens_out", step.tokens_out),
                            ("generated", step.generated), ("prefill", step.prefill_tokens),
                            ("decode", step.decode_tokens), ("pages_used", step.pages_used),
                            ("reserved", step.reserved_pages), ("pool", step.pool_pages),
                            ("hits", step.prefix_hits), ("queries", step.prefix_queries),
                            ("itl", np.mean(step.itl) if step.itl else np.nan), ("completed", step.completed),
                            ("preemptions", step.preemptions), ("step", step.step),
                            ("rejected", step.rejected)):
            c[name].append(value)
        for value in step.ttft:
            self.ttft_t.append(step.t1)
            self.ttft.append(value)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.columns[name].values

    def throughput(self, window: float = THROUGHPUT_WINDOW) -> tuple[np.ndarray, np.ndarray]:
        """Tokens generated per server second over the last `window` seconds, at the end of each step."""
        return throughput(self["t"], self["generated"], window)

    def hit_rate(self) -> np.ndarray:
        """The engine's prefix-cache hit rate so far (hit tokens / looked-up prompt tokens), in %."""
        queries = self["queries"]
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(queries > 0, 100.0 * self["hits"] / np.maximum(queries, 1), np.nan)

    def summary(self) -> dict[str, float]:
        """The numbers of the A/B table, over the whole run so far."""
        if not len(self):
            return {}
        t = float(self["t"][-1])
        generated = float(self["generated"][-1])
        return {"time": t, "completed": float(self["completed"][-1]), "generated": generated,
                "throughput": generated / t if t > 0 else 0.0,
                "ttft_mean": float(np.mean(self.ttft.values)) if self.ttft.n else np.nan,
                "itl_mean": float(np.nanmean(self["itl"])) if np.isfinite(self["itl"]).any() else np.nan,
                "peak_pages": float(self["pages_used"].max()), "peak_reserved": float(self["reserved"].max()),
                "pool": float(self["pool"][-1]), "preemptions": float(self["preemptions"][-1]),
                "rejected": float(self["rejected"][-1]),
                "hit_rate": float(self.hit_rate()[-1]) if np.isfinite(self.hit_rate()[-1]) else 0.0}



@dataclass(frozen=True)
class ServeSample:
    """One scrape of `pagevis serve`'s /metrics: its counters (since it started) and gauges, summed over labels."""

    time: float  # time.monotonic() of the scrape
    generated: float
    prompt: float
    hits: float
    queries: float
    preemptions: float
    ttft_sum: float
    ttft_count: float
    itl_sum: float
    itl_count: float
    running: float
    waiting: float
    kv_usage: float  # 0..1


def parse_serve_metrics(text: str, when: float | None = None) -> ServeSample:
    """The sample a /metrics text of `pagevis serve` gives (ValueError if it is not Prometheus text); a metric
    that is absent counts 0."""
    found = totals(text, skip=("_created", "_bucket"))
    values = {key: found.get(name, 0.0) for key, name in {**COUNTERS, **GAUGES}.items()}
    return ServeSample(time.monotonic() if when is None else when, **values)


def scrape_serve(url: str, timeout: float = 2.0) -> ServeSample:
    return parse_serve_metrics(fetch(url, timeout))


class MetricsSeries:
    """The Server window's plot columns, from consecutive scrapes (the same names as SideSeries): time since the
    first scrape, tokens generated since then, KV usage in % (pool 100), the prefix cache's counters since then,
    and per interval between two scrapes the mean inter-token latency and the mean time to first token of the
    requests that got their first token in it. What the metrics do not hold (a contiguous reservation) is NaN."""

    percent = True  # KV usage is a share of the server's pools, not pages of one pool

    def __init__(self, side: str = "A"):
        self.side = side
        self.samples: list[ServeSample] = []

    def __len__(self) -> int:
        return len(self.samples)

    def add(self, sample: ServeSample) -> None:
        if self.samples and sample.generated < self.samples[-1].generated:  # the server restarted: start again
            self.samples = []
        self.samples.append(sample)

    def _column(self, name: str) -> np.ndarray:
        return np.array([getattr(s, name) for s in self.samples], dtype=np.float64)

    def _interval_mean(self, total: str, count: str) -> tuple[np.ndarray, np.ndarray]:
        sums, counts = np.diff(self._column(total)), np.diff(self._column(count))
        with np.errstate(invalid="ignore", divide="ignore"):
            means = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
        return np.concatenate([[np.nan], means]) if len(self.samples) else means, np.concatenate([[0], counts])

    def __getitem__(self, name: str) -> np.ndarray:
        if not self.samples:
            return np.zeros(0)
        first = self.samples[0]
        if name == "t":
            return self._column("time") - first.time
        if name in ("generated", "hits", "queries", "preemptions"):
            return self._column(name) - getattr(first, name)
        if name == "pages_used":
            return 100.0 * self._column("kv_usage")
        if name == "pool":
            return np.full(len(self.samples), 100.0)
        if name == "reserved":
            return np.full(len(self.samples), np.nan)
        if name == "itl":
            return self._interval_mean("itl_sum", "itl_count")[0]
        if name in ("running", "waiting"):
            return self._column(name)
        raise KeyError(name)

    @property
    def ttft_t(self):
        means, counts = self._interval_mean("ttft_sum", "ttft_count")
        return _Values(self["t"][counts > 0] if len(self.samples) else np.zeros(0))

    @property
    def ttft(self):
        means, counts = self._interval_mean("ttft_sum", "ttft_count")
        return _Values(means[counts > 0] if len(self.samples) else np.zeros(0))

    def throughput(self, window: float = 10.0) -> tuple[np.ndarray, np.ndarray]:
        return throughput(self["t"], self["generated"], window)  # the same computation, over these columns

    def hit_rate(self) -> np.ndarray:
        queries = self["queries"]
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(queries > 0, 100.0 * self["hits"] / np.maximum(queries, 1), np.nan)


class _Values:
    """What ServerPlots reads of SideSeries' TTFT columns (`.values`, `.n`)."""

    def __init__(self, values: np.ndarray):
        self.values, self.n = values, len(values)


def throughput(t: np.ndarray, generated: np.ndarray, window: float) -> tuple[np.ndarray, np.ndarray]:
    """Tokens generated per second over the last `window` seconds, at each time of `t` (`generated`: the
    tokens generated by then)."""
    if not len(t):
        return t, t
    j = np.searchsorted(t, t - window, side="right") - 1  # the last step that ended a window ago
    t_from = np.where(j >= 0, t[np.maximum(j, 0)], 0.0)
    g_from = np.where(j >= 0, generated[np.maximum(j, 0)], 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return t, np.where(t > t_from, (generated - g_from) / (t - t_from), 0.0)
