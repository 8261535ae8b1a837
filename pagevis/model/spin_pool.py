"""A second thread for weight products that needs no waking: a helper waits in numba code (no GIL) on a shared control
array, and every product call (also numba, also without the GIL) shares its tiles with it: every one-row product
(decode), and a prefill's products (`product_rows`: more than quantized.SMALL_BATCH rows of a u4 or i8 matrix, JOB_ROWS
rows a job, each job's tiles cut into ROW_CHUNKS chunks computed by batch_kernels' kernel, as one thread computes them).

The caller writes the product's arguments (its kernel's arrays, as addresses and shapes) into the control array
and publishes a job word (NEXT: the job's tag, its count of chunks, the next chunk to take). Then the caller and
the helper take chunks of tiles by atomic operations on NEXT until none is left: the caller computes its chunks
into the output, the helper its own into a scratch buffer it owns, marking each chunk done (STATE). The caller
copies the helper's chunks in as they are done; one the helper took but has not finished within PATIENCE times the
caller's own time per chunk (its core went to another process) the caller computes itself, and the helper's late
copy is never read. So a product never waits for a descheduled helper, and a helper that is not running costs the
caller one uncontended atomic operation a chunk: it takes every chunk, as one thread would.

The helper's claim is a compare-and-swap on NEXT, tagged with the job, taken only while the job has chunks left:
a claim that succeeds proves the job (its arguments, its arrays, its scratch) is live. It announces the job it
is about to claim in HELPER_SEQ first, so the Python side keeps that job's arrays alive for as long as the helper
may read them (a model freed while the helper is descheduled on one of its chunks).

Between jobs the helper spins (a pause instruction a turn) for SPIN_NS, then sleeps SLEEP_US at a time, and after
IDLE_NS without a job it returns to Python and waits on an Event (no CPU at all) until a product wakes it. It runs
at the lowest priority (nice 19): where another process wants its core it gets almost none of it, so two threads
fall back to about one thread's rate instead of below it (a helper at normal priority spinning on a busy machine
takes time from the caller and from everything else). Each row's arithmetic is the kernel's on one thread
whichever thread computes its tile: the outputs are bit for bit one thread's.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import platform
import threading
import time

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from pagevis.kernel_intrinsics import call_address as _call
from pagevis.kernel_intrinsics import pointer_to
from pagevis.model.matrix_descriptor import DESCRIPTOR, TILES
from pagevis.model.weight_kernels import _put

TILE = 64
# Tiles a chunk: from CHUNK_TILES (a kernel call costs ~0.35-0.45 us: 4-tile chunks cost 4 us more over a 48-tile
# product than one call, 12-tile ones 1.1; smaller products are still cut in two) to MAX_CHUNK_TILES (~30-60 us: a
# chunk the helper is descheduled on costs the caller about twice a chunk's time, whatever the product's size)
CHUNK_TILES, MAX_CHUNK_TILES = 8, 32
MAX_CHUNKS = 256  # Gemma 3's tied logits: 4,096 tiles
# A prefill's job: up to JOB_ROWS rows cut into ROW_CHUNKS chunks of tiles, each computed KERNEL_ROWS rows a kernel call
# (quantized.PREFILL_ROWS: X and the sums stay in cache; a row's result is the same at any count); the helper's scratch
# holds a job's output rows (a SmolLM2 layer's 512-row products, two threads: 64-row jobs of 16 chunks 16.0-17.2 ms,
# 256-row jobs of 8 chunks 12.7; quiet machine, best of 15)
JOB_ROWS, ROW_CHUNKS = 256, 8
PROBE_TILES = 2 * MAX_CHUNK_TILES  # bigger products are not offered to a helper that is not running
PATIENCE = 1.0  # the caller waits for the helper's chunk up to this times its own time a chunk (+ PATIENCE_NS)
PATIENCE_NS = 5_000
SPIN_NS, SLEEP_US, IDLE_NS = 2_000_000, 50, 100_000_000
# after PROBE_AFTER products in a row without the helper (its core is busy elsewhere), only one product in
# PROBE_EVERY is shared, in two halves, until the helper takes one: the others cost the caller nothing more
PROBE_AFTER, PROBE_EVERY = 16, 8
# product_kernel's jobs (several rows) are offered to the helper while its BEAT is at most STALE_NS old: it notes the
# time each turn it spins (~1 us), and before each sleep the time it will be back by (4 SLEEP_US: a sleeping helper
# finds the next job and spins again); else (a descheduled helper notes nothing) only one in PROBE_EVERY, the others
# whole on the caller at no cost
STALE_NS = 20_000
PARKED_SEEN = -2  # product_kernel's answer when the helper was parked

# the control array: words the two threads write often on cache lines of their own; then the job
NEXT, HELPER_SEQ, STOP, PARKED, OWNER = 0, 8, 16, 24, 32
HELPED, TAKEN_OVER, CLOCK, MISSES, BEAT = 40, 41, 42, 43, 44  # chunks the helper computed, chunks the caller took
# back; the clock's id; products in a row the helper took no chunk of; when the helper last spun waiting for a job
STATE = 48  # per chunk: tag << 2 | DONE once the helper's copy is in scratch
# the job's input, tiles a chunk, the helper's scratch; a prefill's block of rows (0: one row), its output's row; the
# kernel a job calls (the matrix family's batch_kernels.rows_kernel: its matrix-vector or rows kernel, or
# product_kernel's: int8_kernels.pool_kernel)
X, CHUNK, SCRATCH, ROWS, STRIDE, JOB_KERNEL = range(STATE + MAX_CHUNKS, STATE + MAX_CHUNKS + 6)
JOB = STATE + MAX_CHUNKS + 6  # the product's matrix descriptor
WORDS = JOB + DESCRIPTOR
DONE, TAKEN, MINE = 1, 2, 3  # a chunk's state: the helper's copy is ready; the caller took it back; the caller's
COUNT_BITS, INDEX_MASK = 16, 0xFFFF

_X86 = platform.machine() in ("x86_64", "AMD64", "i686", "i386")


def _element(context, builder, array_type, array, index):
    return cgutils.get_item_pointer(context, builder, array_type, context.make_array(array_type)(
        context, builder, array), [index])


@intrinsic
def _load(typingctx, ctrl, index):
    """ctrl[index], an atomic (sequentially consistent) read: never hoisted out of a loop."""
    def codegen(context, builder, signature, args):
        return builder.load_atomic(_element(context, builder, signature.args[0], *args), "seq_cst", 8)
    return types.int64(ctrl, types.int64), codegen


@intrinsic
def _store(typingctx, ctrl, index, value):
    def codegen(context, builder, signature, args):
        builder.store_atomic(args[2], _element(context, builder, signature.args[0], args[0], args[1]), "seq_cst", 8)
        return context.get_dummy_value()
    return types.void(ctrl, types.int64, types.int64), codegen


@intrinsic
def _add(typingctx, ctrl, index, value):
    """ctrl[index] += value atomically; returns the value before."""
    def codegen(context, builder, signature, args):
        pointer = _element(context, builder, signature.args[0], args[0], args[1])
        return builder.atomic_rmw("add", pointer, args[2], "seq_cst")
    return types.int64(ctrl, types.int64, types.int64), codegen


@intrinsic
def _swap(typingctx, ctrl, index, expected, value):
    """Compare-and-swap ctrl[index] from expected to value; returns the value found (expected: swapped)."""
    def codegen(context, builder, signature, args):
        pointer = _element(context, builder, signature.args[0], args[0], args[1])
        return builder.extract_value(builder.cmpxchg(pointer, args[2], args[3], "seq_cst", "seq_cst"), 0)
    return types.int64(ctrl, types.int64, types.int64, types.int64), codegen


@intrinsic
def _pause(typingctx):
    """x86's spin-wait hint (pause: the spinning loop leaves the core's pipeline alone); nothing elsewhere."""
    def codegen(context, builder, signature, args):
        if _X86:
            kind = ir.FunctionType(ir.VoidType(), [])
            builder.call(builder.module.declare_intrinsic("llvm.x86.sse2.pause", (), kind), [])
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def _copy_floats(typingctx, target, source, count):
    """count float32 from address source to address target (llvm.memcpy: what a slice assignment copies with, without
    the shape check numba compiles with one, its error message's formatting ~1.7-1.9 s of a first launch)."""
    def codegen(context, builder, signature, args):
        pointer = ir.IntType(8).as_pointer()
        cgutils.raw_memcpy(builder, builder.inttoptr(args[0], pointer), builder.inttoptr(args[1], pointer), args[2], 4)
        return context.get_dummy_value()
    return types.void(types.int64, types.int64, types.int64), codegen


def _libc(builder, name: str, result, *arguments):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(result, list(arguments)), name)


@intrinsic
def _usleep(typingctx, microseconds):
    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        builder.call(_libc(builder, "usleep", i32, i32), [builder.trunc(args[0], i32)])
        return context.get_dummy_value()
    return types.void(types.int64), codegen


@intrinsic
def _clock_ns(typingctx, clock):
    """clock_gettime(clock) in ns (CLOCK_MONOTONIC: its id from Python's time module, held in ctrl[CLOCK])."""
    def codegen(context, builder, signature, args):
        i32, i64 = ir.IntType(32), ir.IntType(64)
        spec = cgutils.alloca_once(builder, ir.ArrayType(i64, 2))
        function = _libc(builder, "clock_gettime", i32, i32, ir.IntType(8).as_pointer())
        builder.call(function, [builder.trunc(args[0], i32), builder.bitcast(spec, ir.IntType(8).as_pointer())])
        seconds = builder.load(builder.gep(spec, [ir.Constant(i32, 0), ir.Constant(i32, 0)]))
        nanoseconds = builder.load(builder.gep(spec, [ir.Constant(i32, 0), ir.Constant(i32, 1)]))
        return builder.add(builder.mul(seconds, ir.Constant(i64, 1_000_000_000)), nanoseconds)
    return types.int64(types.int64), codegen


_f32 = pointer_to(types.float32)


@njit(cache=True, nogil=True, inline="always")
def _compute(ctrl, index, base):
    """Chunk index of the job in ctrl into the output or the scratch at address base (laid out as the output)."""
    t0 = index * ctrl[CHUNK]
    t1 = min(ctrl[JOB + TILES], t0 + ctrl[CHUNK])  # one row: JOB_KERNEL is a matrix-vector kernel
    _call(ctrl[JOB_KERNEL], ctrl.ctypes.data + 8 * JOB, ctrl[X], ctrl[ROWS], t0, t1, base,  # type: ignore[call-arg]
          ctrl[STRIDE])


@njit("void(int64[::1], int64)", cache=True, nogil=True)
def help_job(ctrl, seen):
    """Take chunks of the job seen (a NEXT word) until none is left, each into scratch, marked done."""
    tag = seen >> 32
    word = seen
    job = np.empty(WORDS, np.int64)  # the job's words (X on), copied before each claim: after it, a helper
    # descheduled could read the next job's (its chunk taken back, another posted), whose arrays nothing holds for it
    while (word >> 32) == tag and (word & INDEX_MASK) < ((word >> COUNT_BITS) & INDEX_MASK):
        _store(ctrl, HELPER_SEQ, tag)  # type: ignore[call-arg]  # before the claim: the caller then holds its arrays
        _put(job, X, ctrl[X:])  # a claim that succeeds proves them its job's: no job is posted while a chunk is unclaimed
        if _swap(ctrl, NEXT, word, word + 1) == word:
            index = word & INDEX_MASK
            _compute(job, index, job[SCRATCH])
            _store(ctrl, STATE + index, (tag << 2) | DONE)
            ctrl[HELPED] += 1
        word = _load(ctrl, NEXT)
    _store(ctrl, HELPER_SEQ, -1)  # type: ignore[call-arg]


@njit("int64(int64[::1])", cache=True, nogil=True)
def serve(ctrl):
    """The helper's loop: returns 0 when told to stop, 1 after IDLE_NS without a job (parked: PARKED set)."""
    clock = ctrl[CLOCK]
    idle_from = _clock_ns(clock)  # type: ignore[call-arg, var-annotated]
    while _load(ctrl, STOP) == 0:
        word = _load(ctrl, NEXT)
        if (word & INDEX_MASK) < ((word >> COUNT_BITS) & INDEX_MASK):
            help_job(ctrl, word)
            idle_from = _clock_ns(clock)
            continue
        now = _clock_ns(clock)
        idle = now - idle_from
        if idle < SPIN_NS:
            _store(ctrl, BEAT, now)
            for _ in range(32):
                _pause()
        elif idle < IDLE_NS:  # asleep, but back within a few SLEEP_US: jobs are still worth offering
            _store(ctrl, BEAT, now + 4_000 * SLEEP_US)
            _usleep(SLEEP_US)
        else:
            _store(ctrl, PARKED, 1)
            word = _load(ctrl, NEXT)
            if (word & INDEX_MASK) < ((word >> COUNT_BITS) & INDEX_MASK):  # a job came in between: take it
                _store(ctrl, PARKED, 0)
                continue
            return 1
    return 0


@njit(cache=True, nogil=True, inline="always")
def _copied(ctrl, index, tag, out, scratch, width, n, stride):
    """Whether the helper's chunk index was done: then copied into out (a memcpy a row: single floats ran at 2-4
    GB/s)."""
    if _load(ctrl, STATE + index) != (tag << 2) | DONE:  # type: ignore[call-arg]
        return False
    first, last = index * width, min(stride, (index + 1) * width)
    for i in range(0, n * stride, stride):
        _copy_floats(out.ctypes.data + 4 * (i + first), scratch.ctypes.data + 4 * (i + first), last - first)
    ctrl[STATE + index] = (tag << 2) | MINE
    return True


@njit("void(int64[::1], int64, int64, float32[::1], float32[::1])", cache=True, nogil=True)
def run(ctrl, tag, count, out, scratch):
    """The caller's side of the job just published: chunks taken by atomic add until none is left, computed into out,
    the helper's copied in after each once done, its last when done, or computed here if not done within the patience
    (the caller never waits much longer than a chunk). out and scratch: one row, or ctrl[ROWS] rows of ctrl[STRIDE]."""
    clock, width = ctrl[CLOCK], ctrl[CHUNK] * TILE
    n, stride = max(1, ctrl[ROWS]), out.size // max(1, ctrl[ROWS])
    own, low, mine = 0, 0, (tag << 2) | MINE  # chunks below low are in out (low stops at the helper's current one)
    start = _clock_ns(clock)  # type: ignore[call-arg, var-annotated]
    while True:
        index = _add(ctrl, NEXT, 1) & INDEX_MASK
        if index >= count:
            break
        _compute(ctrl, index, out.ctypes.data)
        own += 1
        ctrl[STATE + index] = mine
        while low < index and (ctrl[STATE + low] == mine or _copied(ctrl, low, tag, out, scratch, width, n, stride)):
            low += 1
    now = _clock_ns(clock)
    deadline = now + PATIENCE_NS + int(PATIENCE * (now - start) / max(own, 1))
    ctrl[MISSES] = ctrl[MISSES] + 1 if own == count else 0
    for index in range(low, count):
        while ctrl[STATE + index] != mine and not _copied(ctrl, index, tag, out, scratch, width, n, stride):
            state = _load(ctrl, STATE + index)
            if _clock_ns(clock) > deadline and _swap(ctrl, STATE + index, state, (tag << 2) | TAKEN) == state:
                _compute(ctrl, index, out.ctypes.data)  # taken back: the helper's copy unread
                ctrl[TAKEN_OVER] += 1
                break
            _pause()


@njit(cache=True, nogil=True, inline="always")
def _post(ctrl, job, tag, x_address, rows, stride, scratch, kernel, chunks):
    """post() of one row (rows 0), or of a block of rows (rows, stride: its output's row) cut into `chunks` chunks
    computed by the C function at kernel: a block's chunk is a block's worth of work, and a helper not running
    claims none (nothing to probe)."""
    tiles = job[TILES]
    if rows:
        chunk = max(1, -(-tiles // chunks), -(-tiles // MAX_CHUNKS))
    elif ctrl[MISSES] > PROBE_AFTER:  # the helper is not running: one small product in PROBE_EVERY offers it half
        if tag % PROBE_EVERY or tiles > PROBE_TILES:
            return 0
        chunk = -(-tiles // 2)
    elif tiles < 2 * CHUNK_TILES:
        chunk = -(-tiles // 2)
    else:  # about 16 chunks, of CHUNK_TILES to MAX_CHUNK_TILES tiles
        chunk = max(min(MAX_CHUNK_TILES, max(CHUNK_TILES, tiles // 16)), -(-tiles // MAX_CHUNKS))
    count = -(-tiles // chunk)
    if count < 2 or _swap(ctrl, OWNER, 0, 1) != 0:  # type: ignore[call-arg]
        return 0
    ctrl[X], ctrl[CHUNK], ctrl[SCRATCH], ctrl[ROWS], ctrl[STRIDE] = x_address, chunk, scratch.ctypes.data, rows, stride
    ctrl[JOB_KERNEL] = kernel
    _put(ctrl, JOB, job)
    ctrl[STATE:STATE + count] = 0  # a late helper's DONE from an earlier job with this tag (2**30 jobs ago) cleared
    _store(ctrl, NEXT, (tag << 32) | (count << COUNT_BITS))  # type: ignore[call-arg]
    return count


@njit("int64(int64[::1], int64[::1], int64, float32[::1], float32[::1], int64)", cache=True, nogil=True)
def post(ctrl, job, tag, x, scratch, kernel):
    """Publish the product of x by the matrix job describes (its family's matrix-vector kernel at address kernel),
    cut into chunks for the caller and the helper: returns the count of chunks (then the caller holds the pool: run()
    next), or 0 if the product is too small to cut or another caller holds the pool."""
    return _post(ctrl, job, tag, x.ctypes.data, 0, 0, scratch, kernel, 0)


@njit("int64(int64[::1], int64[::1], int64, float32[:, ::1], int64, float32[::1], int64)", cache=True, nogil=True)
def post_rows(ctrl, job, tag, x, stride, scratch, kernel):
    """post() of a block of rows x (n, in), whose output rows are stride floats (the output and the scratch laid out
    (n, stride): run() next, with both flattened), computed by the rows kernel at address kernel."""
    return _post(ctrl, job, tag, x.ctypes.data, x.shape[0], stride, scratch, kernel, ROW_CHUNKS)


@njit("void(int64[::1], int64[::1], int64, float32[::1], float32[::1], float32[::1], int64)", cache=True,
      nogil=True)
def product(ctrl, job, tag, x, out, scratch, kernel):
    """out = x times the matrix described by job (matrix_descriptor.describe()), by its family's matrix-vector kernel
    at address kernel, its chunks shared with the helper (alone if the product is too small to cut or another caller
    holds the pool)."""
    count = post(ctrl, job, tag, x, scratch, kernel)
    if count == 0:
        _call(kernel, job.ctypes.data, x.ctypes.data, 1, 0, job[TILES],  # type: ignore[call-arg]
              out.ctypes.data, 0)
        return
    run(ctrl, tag, count, out, scratch)
    _store(ctrl, OWNER, 0)  # type: ignore[call-arg]


@njit("void(int64, int64[::1], int64[::1], int64, float32[:, ::1], float32[:, ::1], float32[::1], int64)",
      cache=True, nogil=True)
def product_rows(kernel, ctrl, job, tag, x, out, scratch, block):
    """out = x (a prefill's rows) times the matrix job describes (u4 or i8: its family's batch_kernels.rows_kernel,
    at address kernel), block rows at a time, each block's chunks of tiles shared with the helper: block i is job
    tag + i."""
    n, n_in, stride = x.shape[0], x.shape[1], out.shape[1]
    for i in range(0, n, block):
        rows = min(block, n - i)
        part = carray(_f32(x.ctypes.data + 4 * i * n_in), (rows, n_in))
        target = carray(_f32(out.ctypes.data + 4 * i * stride), (rows * stride,))
        count = post_rows(ctrl, job, tag + i // block, part, stride, scratch, kernel)
        if count == 0:
            _call(kernel, job.ctypes.data, part.ctypes.data, rows, 0, job[TILES],  # type: ignore[call-arg]
                  target.ctypes.data, stride)
            continue
        run(ctrl, tag + i // block, count, target, scratch)
        _store(ctrl, OWNER, 0)  # type: ignore[call-arg]


@njit("int64(int64[::1], int64[::1], int64, int64[::1], float32[:, ::1], float32[:, ::1], float32[::1], int64, int64, "
      "int64)", cache=True, nogil=True)
def product_kernel(ctrl, job, tag, handle, x, out, scratch, prepare, kernel, chunks):
    """out = the rows x times the matrix job describes, computed by the C function at kernel (rows_kernel's
    signature, given handle's address for its input) over `chunks` chunks of tiles shared with the helper, after the
    C function at prepare made the handle's input of x (called as prepare(job, handle, rows, x, 0, 0, 0)): the int8
    decode rows of several sequences (int8_kernels.quantise_kernel quantises the rows into the handle's arrays,
    once for both threads; pool_kernel multiplies them). Offered to the helper only while it spins (BEAT), or as one
    probe in PROBE_EVERY; returns PARKED_SEEN if the helper is parked (the caller wakes it: whole here meanwhile),
    else the job the helper announced last (HELPER_SEQ: the caller holds this job's arrays while it may read them)."""
    rows = x.shape[0]
    _call(prepare, job.ctypes.data, handle.ctypes.data, rows, x.ctypes.data, 0, 0, 0)  # type: ignore[call-arg]
    parked = _load(ctrl, PARKED) != 0
    if parked:
        _store(ctrl, PARKED, 0)
        chunks = 1
    elif tag % PROBE_EVERY and _clock_ns(ctrl[CLOCK]) - _load(ctrl, BEAT) > STALE_NS:
        chunks = 1  # the helper is not spinning: whole here (count 0)
    count = _post(ctrl, job, tag, handle.ctypes.data, rows, out.shape[1], scratch, kernel, chunks)
    if count == 0:
        _call(kernel, job.ctypes.data, handle.ctypes.data, rows, 0, job[TILES], out.ctypes.data,
              out.shape[1])
    else:
        run(ctrl, tag, count, carray(_f32(out.ctypes.data), (out.size,)), scratch)
        _store(ctrl, OWNER, 0)
    return PARKED_SEEN if parked else _load(ctrl, HELPER_SEQ)


@njit("void(int64[::1], int64[::1], int64, int64[::1], float32[::1], float32[::1], int64, int64)", cache=True,
      nogil=True)
def items(ctrl, job, tag, handle, out, scratch, kernel, count):
    """The C function at kernel (rows_kernel's signature, given handle's address as its input) over `count` items
    of job[TILES] // count tiles each, one item a chunk shared with the helper: item i is out's floats [i, i + 1) *
    out.size // count, written only by the call that computes it (batched decode attention's sequences); job[TILES]
    a multiple of count, at most MAX_CHUNKS items shared."""
    if count > MAX_CHUNKS or _post(ctrl, job, tag, handle.ctypes.data, 1, out.size, scratch, kernel, count) == 0:
        _call(kernel, job.ctypes.data, handle.ctypes.data, 1, 0, job[TILES], out.ctypes.data,  # type: ignore[call-arg]
              out.size)
        return
    run(ctrl, tag, count, out, scratch)
    _store(ctrl, OWNER, 0)  # type: ignore[call-arg]


def new_control() -> np.ndarray:
    """A control array with no job: the clock's id, no helper job announced."""
    ctrl = np.zeros(WORDS, np.int64)
    ctrl[HELPER_SEQ], ctrl[CLOCK] = -1, time.CLOCK_MONOTONIC
    return ctrl


class SpinPool:
    """The helper thread and its control array; product() is called from one thread at a time or several (a
    second caller while one holds the pool computes alone)."""

    def __init__(self, niceness: int = 19) -> None:
        self.ctrl = new_control()
        # never freed: a helper still in numba code while the interpreter ends (close() timed out: its core went
        # elsewhere) reads STOP from it, not from freed memory (1.4 KB, once a pool)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(self.ctrl))
        self.scratch = np.empty(0, np.float32)
        self.tag = 0
        self.held: tuple | None = None  # (tag, what its addresses point into) while the helper may still read them
        self.wake = threading.Event()
        self.niceness = niceness
        self.thread = threading.Thread(target=self._loop, name="pagevis-weights", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        try:  # Linux: a thread's own niceness (its id as a process id); elsewhere the process keeps its own
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.niceness)
        except (AttributeError, OSError):
            pass
        while serve(self.ctrl):  # parked after a while without a job: wait for a product to wake it
            self.wake.wait()
            self.wake.clear()

    def product(self, kernel: int, job: np.ndarray, arrays: tuple, x: np.ndarray, out: np.ndarray) -> None:
        """out (the matrix's tiles' rows) = x times the packed matrix that job describes (arrays: what it points
        into), by its family's matrix-vector kernel at address kernel (quantized.family_kernel), its chunks shared
        with the helper."""
        tag = self._ready(out.size)
        product(self.ctrl, job, tag, x, out, self.scratch, kernel)
        self._hold(tag, (job, arrays, x, self.scratch))

    def _ready(self, size: int) -> int:
        """Wake a parked helper, make the scratch hold size floats; the next job's tag (tag << 32 stays positive)."""
        if self.ctrl[PARKED]:
            self.ctrl[PARKED] = 0
            self.wake.set()
        if self.scratch.size < size:
            self.scratch = np.empty(size, np.float32)
        self.tag = self.tag % (1 << 30) + 1
        return self.tag

    def _hold(self, first: int, arrays: tuple) -> None:
        """Keep the arrays of the jobs tagged first..self.tag alive while the helper may still read them (its core
        went elsewhere mid-chunk)."""
        keep = self.ctrl[HELPER_SEQ]
        if first <= keep <= self.tag:
            self.held = (int(keep), arrays)
        elif keep < 0:
            self.held = None
        # else: an earlier job, held since it ended (or a claim that fails: never read)

    def product_rows(self, kernel: int, job: np.ndarray, arrays: tuple, x: np.ndarray, out: np.ndarray,
                     block: int = JOB_ROWS) -> None:
        """out (n, the matrix's tiles' rows) = x (n, in) times the packed u4 or i8 matrix that job describes, by its
        family's rows kernel at address kernel (quantized.rows_kernel), block rows a job, each job's tiles shared
        with the helper (product_rows)."""
        first = self._ready(min(block, len(x)) * out.shape[1])
        self.tag = first + (len(x) - 1) // block
        product_rows(kernel, self.ctrl, job, first, x, out, self.scratch, block)
        self._hold(first, (job, arrays, x, self.scratch))

    def product_kernel(self, kernel: int, prepare: int, job: np.ndarray, arrays: tuple, handle: np.ndarray,
                       x: np.ndarray, out: np.ndarray, chunks: int) -> None:
        """out (rows, the matrix's tiles' rows) = the rows x times the matrix job describes, by the C function at
        kernel after the one at prepare made handle's input of x, its tiles in `chunks` chunks shared with the
        helper (product_kernel; arrays: what job and handle point into, held while the helper may read them). The
        pool's bookkeeping (_ready, _hold) in a few Python operations: this runs ~120 times a batched step."""
        if self.scratch.size < out.size:
            self.scratch = np.empty(out.size, np.float32)
        self.tag = tag = self.tag % (1 << 30) + 1
        seen = product_kernel(self.ctrl, job, tag, handle, x, out, self.scratch, prepare, kernel, chunks)
        if seen == tag:
            self.held = (tag, (job, arrays, handle, self.scratch))
        elif seen == PARKED_SEEN:
            self.wake.set()
        elif seen < 0:
            self.held = None

    def items(self, kernel: int, job: np.ndarray, handle: np.ndarray, arrays: tuple, out: np.ndarray,
              count: int) -> None:
        """out (flat) = the C function at kernel over `count` items (items(): each computed whole by one thread,
        the helper's into the scratch, copied in); arrays: what handle points into, held while the helper may read
        them."""
        tag = self._ready(out.size)
        items(self.ctrl, job, tag, handle, out, self.scratch, kernel, count)
        self._hold(tag, (job, handle, arrays, self.scratch))

    def stats(self) -> tuple[int, int]:
        """(chunks the helper computed, chunks the caller took back from it) so far."""
        return int(self.ctrl[HELPED]), int(self.ctrl[TAKEN_OVER])

    def close(self, timeout: float = 2.0) -> bool:
        """Stop the helper; True once its thread has ended."""
        self.ctrl[STOP] = 1
        self.wake.set()
        self.thread.join(timeout)
        return not self.thread.is_alive()


_pools: list[SpinPool] = []


def new_pool(niceness: int = 19) -> SpinPool:
    pool = SpinPool(niceness)
    _pools.append(pool)
    return pool


@atexit.register
def _close_all() -> None:
    for pool in _pools:
        pool.close(0.5)
