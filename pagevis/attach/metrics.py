"""`--metrics URL`: an engine's Prometheus /metrics, scraped and parsed with prometheus_client's parser.

`scrape(url)` → `MetricsSample` with vLLM's gauges (`vllm:num_requests_running`, `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc`, older `vllm:gpu_cache_usage_perc`) and counters (`vllm:prefix_cache_hits`,
`vllm:prefix_cache_queries`), each summed over its label sets (engines, models); None when absent.
`MetricsHistory` keeps the last samples and turns counters into a prefix hit rate between two scrapes.
SGLang's `sglang:` names are read too where they mean the same (num_running_reqs, num_queue_reqs,
token_usage, cache_hit_rate). The window calls `scrape` on a worker thread; nothing here imports Qt.
"""

from __future__ import annotations

import math
import time
import urllib.request
from collections import deque
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

MAX_BYTES = 8 << 20
NAMES = {
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs"),
    "waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
    "prefix_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
    "prefix_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "hit_rate": ("sglang:cache_hit_rate",),
}


@dataclass(frozen=True)
class MetricsSample:
    time: float  # time.monotonic() of the scrape
    running: float | None
    waiting: float | None
    kv_usage: float | None  # 0..1
    prefix_hits: float | None  # counters, since the engine started
    prefix_queries: float | None
    hit_rate: float | None  # an engine's own gauge (SGLang); vLLM's comes from MetricsHistory


def totals(text: str, skip: tuple[str, ...] = ("_created", "_bucket", "_count", "_sum")) -> dict[str, float]:
    """Each metric's value summed over its label sets, counters named without "_total"; samples whose names end
    in `skip` are left out (ValueError if it is not Prometheus text)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith(skip) or not math.isfinite(sample.value):
                continue
            name = sample.name[:-6] if sample.name.endswith("_total") else sample.name
            out[name] = out.get(name, 0.0) + sample.value
    return out


def parse(text: str, when: float | None = None) -> MetricsSample:
    """The sample a /metrics text gives (ValueError if it is not Prometheus text)."""
    found = totals(text)
    values = {key: next((found[n] for n in names if n in found), None) for key, names in NAMES.items()}
    return MetricsSample(time.monotonic() if when is None else when, **values)


def fetch(url: str, timeout: float = 2.0) -> str:
    """The text at `url`; OSError when it does not answer, ValueError beyond MAX_BYTES."""
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - a URL the user gave
        body = response.read(MAX_BYTES + 1)
    if len(body) > MAX_BYTES:
        raise ValueError(f"{url}: more than {MAX_BYTES} bytes of metrics")
    return body.decode("utf-8", errors="replace")


def scrape(url: str, timeout: float = 2.0) -> MetricsSample:
    """GET `url` and parse it; OSError / ValueError when the engine does not answer with Prometheus text."""
    return parse(fetch(url, timeout))


class MetricsHistory:
    def __init__(self, capacity: int = 3600):
        self.samples: deque[MetricsSample] = deque(maxlen=capacity)

    def add(self, sample: MetricsSample) -> None:
        self.samples.append(sample)

    def hit_rate(self) -> float | None:
        """Prefix cache hits / queries between the last two samples (vLLM's counters), else the engine's gauge."""
        if len(self.samples) >= 2:
            a, b = self.samples[-2], self.samples[-1]
            if None not in (a.prefix_hits, a.prefix_queries, b.prefix_hits, b.prefix_queries):
                queries = b.prefix_queries - a.prefix_queries
                if queries > 0:
                    return (b.prefix_hits - a.prefix_hits) / queries
        return self.samples[-1].hit_rate if self.samples else None
