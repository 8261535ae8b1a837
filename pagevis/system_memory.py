"""How much memory this machine can still give: the bound for what a file or a flag may make pagevis allocate."""

from __future__ import annotations

import os


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else free physical pages, lowered to what an address-space limit
    (ulimit -v) leaves this process; None if nothing is known."""
    physical = _physical_available()
    limited = _address_space_left()
    known = [value for value in (physical, limited) if value is not None]
    return min(known) if known else None


def _address_space_left() -> int | None:
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft == resource.RLIM_INFINITY:
            return None
        with open("/proc/self/statm", encoding="ascii") as statm:
            used = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        return max(0, soft - used)
    except (ImportError, OSError, ValueError, IndexError):
        return None


def _physical_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def fits(nbytes: int, share: float = 0.8) -> bool:
    """Would `nbytes` more fit in `share` of the memory available now (True when that is unknown)?"""
    available = available_bytes()
    return available is None or nbytes <= share * available


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"
