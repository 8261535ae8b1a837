"""Releasing numba's linking IR of loaded kernels (resident.release_linking_modules): a compile that calls a released
kernel parses it again and links it; the kernels run as before."""

from __future__ import annotations

from numba import njit

from pagevis.model.resident import release_linking_modules


def test_a_kernel_whose_linking_ir_was_released_still_links_into_a_later_compile():
    @njit(cache=False)
    def inner(x):
        return 2 * x + 1

    assert inner(3) == 7
    library = next(iter(inner.overloads.values())).library
    library._get_module_for_linking()  # parsed, as a kernel loaded from numba's cache (or saved to it) keeps it
    assert library._shared_module is not None
    assert release_linking_modules([inner]) == 1
    assert library._shared_module is None and inner(4) == 9  # released; still runs

    @njit(cache=False)
    def outer(x):
        return inner(x) * 10

    assert outer(3) == 70  # linked inner: its IR parsed again from the kept bitcode
    assert library._shared_module is not None
    assert release_linking_modules([inner]) == 1
