from dataclasses import dataclass

from pagevis.kvcache.errors import CacheFullError
from pagevis.kvcache.policies.base import EvictionPolicy


@dataclass
class NoEviction(EvictionPolicy):
    """Never evict: when every page is full, appending fails with CacheFullError."""

    name = "none"
    evicts = False
    citation = "Full cache, as in vLLM without preemption (Kwon et al. 2023, arXiv:2309.06180)."

    def score(self, pages):
        return pages.positions.astype(float)

    def choose_victims(self, pages):
        raise CacheFullError(
            f"the cache is full: layer {pages.layer} holds {self.capacity} tokens "
            f"({self.capacity // self.page_size} pages x {self.page_size}) and policy 'none' never "
            f"evicts; raise max_pages or choose an evicting policy"
        )
