from dataclasses import dataclass

from pagevis.kvcache.policies.base import EvictionPolicy


@dataclass
class Sinks(EvictionPolicy):
    """Keep the first n_sink tokens of the sequence (attention sinks), otherwise evict the oldest. A sliding-window
    layer (Gemma 3's local ones) still drops the sinks with its window: the window is the layer's, not the policy's."""

    n_sink: int = 4
    name = "sinks"
    citation = "StreamingLLM: Xiao et al. 2023, Efficient Streaming Language Models with Attention Sinks, arXiv:2309.17453."
    reason = "oldest non-sink token"

    def bind(self, capacity, page_size):
        super().bind(capacity, page_size)
        self.n_sink = self.check_int_param("n_sink", self.n_sink, 0, capacity - 1)

    def score(self, pages):
        return pages.positions.astype(float)

    def protected(self, pages):
        return (pages.positions >= 0) & (pages.positions < self.n_sink)
