"""One line per step that says what the cache did, for one layer (Qt-free):

    step 18: cache full → sinks evicted position 7 'AI' from page 0 slot 7; wrote position 67 there · next 'the'
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from pagevis.kvcache import EventKind
from pagevis.kvcache.event_array import in_layer
from pagevis.viewmodel.run_list import run_list

MAX_NAMED = 3  # evictions named one by one; more are summarised


def narrate(record, layer: int, text: Callable[[int], str], policy: str) -> str:
    events = in_layer(record.events, layer)
    writes = [e for e in events if e.kind is EventKind.WRITE]
    evictions = [e for e in events if e.kind is EventKind.EVICT]
    allocated = [e.page for e in events if e.kind is EventKind.ALLOCATE]
    slid = [e.page for e in events if e.kind is EventKind.SLIDE]
    released = [e.page for e in events if e.kind is EventKind.RELEASE and e.page not in slid]
    parts = []
    reconstructed = in_layer(record.events, -1)
    reconstructed = [e for e in reconstructed if e.kind is EventKind.RECONSTRUCT]
    if reconstructed:
        parts.append(_compressed(reconstructed[0], events, layer, record.events))
    elif evictions:
        parts.append(f"cache full → {policy} evicted {_evicted(evictions, text)}")
    if record.kind == "prefill" and len(writes) > 1:
        pages = sorted({e.page for e in writes})
        parts.append(f"prefill wrote {len(writes)} prompt tokens (positions {run_list([e.position for e in writes])}) "
                     f"into page{'s' if len(pages) > 1 else ''} {run_list(pages)}")
    elif writes:
        write = writes[-1]
        evicted_here = any((e.page, e.slot) == (write.page, write.slot) for e in evictions)
        where = "there" if evicted_here and len(evictions) == 1 else f"into page {write.page} slot {write.slot}"
        if evicted_here:
            where += _mixed(record, layer, write.page)
        parts.append(f"wrote position {write.position} {text(write.position)!r} {where}")
    if allocated:
        parts.append(f"took free page{'s' if len(allocated) > 1 else ''} {run_list(allocated)}")
    if slid:
        parts.append(f"page{'s' if len(slid) > 1 else ''} {run_list(slid)} slid out of the window")
    if released:
        parts.append(f"page{'s' if len(released) > 1 else ''} {run_list(released)} emptied and freed")
    line = f"step {record.step}: " + "; ".join(parts) if parts else f"step {record.step}"
    if record.next_token >= 0:
        line += f" · next {record.next_text!r}"
    return line


def _mixed(record, layer: int, page: int) -> str:
    """' (page 1 now holds 5–7, 16)' when a token-level policy's write into the slot it evicted leaves the page
    holding positions that are not one run: vLLM's pages never do that (only oldest-page behaves like vLLM)."""
    if record.tiers is not None:  # slot maps are RAM frames there, not page ids
        return ""
    held = record.slot_maps[layer][page]
    held = np.sort(held[held >= 0])
    if held.size < 2 or held[-1] - held[0] == held.size - 1:
        return ""
    return f" (page {page} now holds {run_list(held.tolist())})"


def _evicted(evictions, text) -> str:
    if len(evictions) <= MAX_NAMED:
        return ", ".join(f"position {e.position} {text(e.position)!r} from page {e.page} slot {e.slot}"
                         for e in evictions)
    pages = sorted({e.page for e in evictions})
    return (f"{len(evictions)} tokens (positions {run_list([e.position for e in evictions])}) from "
            f"page{'s' if len(pages) > 1 else ''} {run_list(pages)}")


def _compressed(reconstruct, events, layer: int, every_layer) -> str:
    """kvzip's step: its reconstruction pass, then what each KV head of this layer kept of the prompt (the KV
    heads: those any layer's mask events name)."""
    written = sum(1 for e in events if e.kind is EventKind.WRITE)
    masked: dict[int, int] = {}
    for e in events:
        if e.kind is EventKind.MASK:
            masked[e.detail] = masked.get(e.detail, 0) + 1
    heads = max((e.detail for e in every_layer if e.kind is EventKind.MASK), default=-1) + 1
    kept = ", ".join(str(written - masked.get(head, 0)) for head in range(heads))
    return (f"{reconstruct.policy} {reconstruct.reason} → compressed: layer {layer}'s KV heads keep {kept} of "
            f"{written} tokens" if heads else f"{reconstruct.policy} {reconstruct.reason} → layer {layer} keeps all "
            f"{written} tokens")
