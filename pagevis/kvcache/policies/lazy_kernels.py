"""The policies' compiled scoring kernels (kernels.py), imported on first use rather than with the policies: importing
numba costs ~0.3 s and `import pagevis` (the notebook API, the CLI's help) must not pay it before a session evicts."""

from __future__ import annotations

from types import ModuleType

from pagevis.kernel_loader import import_kernels


def kernels() -> ModuleType:
    """pagevis.kvcache.policies.kernels, imported the first time a policy scores (kernel_loader.import_kernels: under
    the compile lock). Its kernels have no signatures: each is loaded from numba's cache, or compiled, at its first
    call."""
    return import_kernels("pagevis.kvcache.policies.kernels", "the policies' scoring kernels")
