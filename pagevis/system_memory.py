"""How much memory this machine can still give: the bound for what a file or a flag may make pagevis allocate."""

from __future__ import annotations

import os


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else free physical pages; None if neither is known."""
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
