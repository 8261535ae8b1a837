"""The policies' compiled scoring kernels (kernels.py), imported on first use rather than with the policies: importing
numba costs ~0.3 s and `import pagevis` (the notebook API, the CLI's help) must not pay it before a session evicts."""

from __future__ import annotations

from types import ModuleType


def kernels() -> ModuleType:
    """pagevis.kvcache.policies.kernels, imported (its kernels loaded from numba's cache, or compiled) the first
    time a policy scores."""
    from pagevis.kvcache.policies import kernels as module

    return module
