import math
from dataclasses import dataclass

from pagevis.errors import ConfigError
from pagevis.kvcache.policies.snapkv import SnapKV


@dataclass
class PyramidKV(SnapKV):
    """SnapKV's scoring with a budget per layer that shrinks with depth (lower layers spread their attention,
    upper ones focus it). Layer l holds window + a share of (budget - window), the shares falling linearly
    from 2P - P/beta to P/beta (P = budget - window), so the mean over layers is `budget` tokens. The pool
    (max_pages) must hold layer 0's share; `budget` defaults to the largest mean that fits it."""

    beta: int = 20
    budget: int | None = None
    name = "pyramidkv"
    citation = ("PyramidKV: Cai et al. 2024, Dynamic KV Cache Compression based on Pyramidal Information Funneling, "
                "arXiv:2406.02069 (beta 20; per layer SnapKV selection).")
    reason = "lowest pooled window attention, within the layer's budget"

    def bind_layers(self, n_layers):
        super().bind_layers(n_layers)
        self.beta = self.check_int_param("beta", self.beta, 1, 1000)
        if self.budget is None:
            self.budget = self.window + math.floor((self.capacity - self.window) / (2 - 1 / self.beta))
        self.budget = self.check_int_param("budget", self.budget, self.window + 1, self.capacity)
        self.budgets = layer_budgets(self.budget, self.window, self.beta, n_layers)
        if self.budgets[0] > self.capacity:
            pages = math.ceil(self.budgets[0] / self.page_size)
            raise ConfigError(f"{self.name}.budget", self.budget,
                              f"a mean whose first layer fits the pool: layer 0 needs {self.budgets[0]} tokens "
                              f"({pages} pages), the pool holds {self.capacity}")

    def layer_capacity(self, layer):
        return self.budgets[layer]


def layer_budgets(budget: int, window: int, beta: int, n_layers: int) -> list[int]:
    """Tokens per layer: the window plus a linearly falling share of the rest, mean `budget` (up to rounding,
    at least one token beyond the window)."""
    share = budget - window
    if n_layers == 1:
        return [budget]
    low = share / beta
    high = 2 * share - low
    step = (high - low) / (n_layers - 1)
    return [window + max(1, round(high - layer * step)) for layer in range(n_layers)]


def pool_tokens(budget: int, window: int = SnapKV.window, beta: int = PyramidKV.beta) -> int:
    """The pool a cache needs per layer for a mean of `budget` tokens (layer 0's share)."""
    return layer_budgets(budget, window, beta, 2)[0]
