"""The disk tier's files: one swap file per layer in a private folder, removed when the cache closes or the
process exits (not after SIGKILL: below).

Pages move with os.preadv / os.pwritev between the swap file and RAM frames, not through np.memmap:
a page in RAM is n_kv_heads separate (page_size, head_dim) blocks of the pool, which preadv/pwritev
scatter and gather in one system call with no extra copy; every byte moved is counted by us, not
decided by the kernel's paging; the RAM budget stays exactly the pool of frames (a mapping would
make the page cache part of the process); and a full disk is an OSError at a call we control, where
a mapped write on a full file system is a SIGBUS that kills the process. Disk space for a page is
reserved (posix_fallocate) when the page is allocated, before a step changes anything, so a step
never fails half-way for lack of space.

The folder is a fresh `pagevis-swap-*` directory (under --swap-dir, or the system's temporary
folder). It is removed by `close()`, by a finalizer when the cache is garbage collected, and at
interpreter exit (normal exit, an exception, or Ctrl-C, which Python turns into KeyboardInterrupt);
creating one makes SIGTERM an ordinary exit too, unless the program handles SIGTERM itself (SIGKILL
cannot be caught: its folder stays).
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import tempfile
import threading
import weakref

import numpy as np

from pagevis.errors import ConfigError

IOV_MAX = 1024


class SwapSpaceError(OSError):
    """The swap folder cannot take more pages (full, over a size limit, or failing)."""


class SwapSpace:
    """A private folder holding one swap file per layer."""

    def __init__(self, n_layers: int, page_bytes: int, parent: str | None = None):
        try:
            if parent is not None and not os.path.isdir(parent):
                raise FileNotFoundError(errno.ENOENT, "no such folder", parent)
            self.path = tempfile.mkdtemp(prefix="pagevis-swap-", dir=parent)
        except OSError as error:
            raise ConfigError("swap_dir", parent or tempfile.gettempdir(),
                              f"a folder where pagevis can write ({error.strerror or error})") from None
        exit_on_sigterm()  # a killed process unwinds and removes its swap folder too
        self.files: list[SwapFile] = []
        self._fds: list[int] = []  # closed by the finalizer before it removes the folder
        self._finalizer = weakref.finalize(self, _remove, self.path, self._fds)
        try:
            for layer in range(n_layers):
                swap = SwapFile(os.path.join(self.path, f"layer-{layer:03d}.kv"), page_bytes)
                self.files.append(swap)
                self._fds.append(swap.fd)
        except OSError as error:
            self.close()
            raise ConfigError("swap_dir", parent or tempfile.gettempdir(),
                              f"a folder where pagevis can write ({error.strerror or error})") from None

    def close(self) -> None:
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def file_bytes(self) -> int:
        return sum(os.fstat(f.fd).st_blocks * 512 for f in self.files) if not self.closed else 0


class SwapFile:
    """One layer's pages on disk: page p at offset p * page_bytes, K (n_kv, page_size, head_dim) then V."""

    def __init__(self, path: str, page_bytes: int):
        self.path = path
        self.page_bytes = page_bytes
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.reserved = 0  # pages [0, reserved) have disk space allocated

    def reserve(self, n_pages: int) -> None:
        """Make sure pages [0, n_pages) have disk blocks, or raise SwapSpaceError naming the folder."""
        if n_pages <= self.reserved:
            return
        try:
            os.posix_fallocate(self.fd, self.reserved * self.page_bytes, (n_pages - self.reserved) * self.page_bytes)
        except OSError as error:
            need = (n_pages - self.reserved) * self.page_bytes
            raise SwapSpaceError(
                error.errno, f"the swap folder {os.path.dirname(self.path)} cannot take {need} more bytes "
                f"({error.strerror}); free space there, choose another --swap-dir, or lower --disk-pages") from None
        self.reserved = n_pages

    def write(self, page: int, buffers: list[np.ndarray]) -> int:
        return _all_io(os.pwritev, self.fd, buffers, page * self.page_bytes, self.page_bytes)

    def read(self, first_page: int, buffers: list[np.ndarray]) -> int:
        """Read consecutive pages starting at first_page into `buffers` (their blocks, in order)."""
        return _all_io(os.preadv, self.fd, buffers, first_page * self.page_bytes,
                       len(buffers) * buffers[0].nbytes)


def _all_io(call, fd: int, buffers: list[np.ndarray], offset: int, expected: int) -> int:
    done = 0
    block = buffers[0].nbytes  # every block of a page has the same size
    for start in range(0, len(buffers), IOV_MAX):
        chunk = buffers[start: start + IOV_MAX]
        size = len(chunk) * block
        moved = call(fd, chunk, offset + done)
        if moved != size:  # a short transfer on a regular file means the disk failed us
            raise SwapSpaceError(errno.EIO, f"swap file moved {moved} of {size} bytes at offset {offset + done}")
        done += moved
    if done != expected:
        raise SwapSpaceError(errno.EIO, f"swap file moved {done} of {expected} bytes")
    return done


def _remove(path: str, fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    shutil.rmtree(path, ignore_errors=True)


def exit_on_sigterm() -> None:
    """Let SIGTERM unwind like Ctrl-C (so swap folders are removed), if nobody else handles it."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_exit)


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)
