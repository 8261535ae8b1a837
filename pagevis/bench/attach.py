"""`python -m pagevis.bench.attach [--quick]`: how fast KV events apply headless, and the memory 1 M resident
blocks take. Prints a table; asserts nothing (targets from issue 20: ≥ 200k events/s, ≤ 1 GB RSS at 1 M blocks).

Rows:
- feed: frames → parse → msgspec decode → EngineState, in one thread (what `pagevis attach --headless` does per
  message after the socket), for a vLLM-like mix: each step stores 4 chains of 1-block BlockStored events and
  removes as many old blocks (BlockRemoved of one block each, as vLLM's block pool emits them), 1,000 resident.
- zmq: the same frames sent by a thread over a PUB socket on ipc, received by an Attacher (both in this process,
  so they share the GIL and the 2 cores with the sender).
- rss: a fresh process stores 1 M blocks of 16 tokens (chains of 32) and reports VmRSS before and after, and how
  long `EngineState.snapshot()` takes then, with the block columns and without (what a window pays per frame).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time

from pagevis.attach.events import BlockRemoved, BlockStored, encode_batch


def workload(batches: int, events_per_batch: int = 16, block_size: int = 16) -> list[list[bytes]]:
    """Pre-encoded messages: each batch stores events_per_batch / 2 single blocks (chained) and removes as many."""
    frames, next_hash, live = [], 1, []
    half = events_per_batch // 2
    tokens = list(range(block_size))
    for seq in range(batches):
        events: list = []
        parent = None
        for _ in range(half):
            events.append(BlockStored(block_hashes=[next_hash], parent_block_hash=parent, token_ids=tokens,
                                      block_size=block_size, medium="GPU", lora_name=None))
            live.append(next_hash)
            parent, next_hash = next_hash, next_hash + 1
        while len(live) > 1000:
            events.append(BlockRemoved(block_hashes=[live.pop(0)], medium="GPU"))
        frames.append([b"kv-events", seq.to_bytes(8, "big"), encode_batch(1000.0 + seq * 0.01, events)])
    return frames


def count_events(frames: list[list[bytes]]) -> int:
    from pagevis.attach.events import decode_payload

    return sum(len(decode_payload(f[2]).events) for f in frames)


def bench_feed(frames: list[list[bytes]], events: int) -> tuple[float, float]:
    """Events per wall-clock second and per CPU second of this thread (the second is what the work costs; the
    first also counts the time other processes held the core)."""
    from pagevis.attach.feed import EndpointFeed
    from pagevis.attach.state import EngineState

    state = EngineState("bench")
    feed = EndpointFeed(state, topic=b"kv-events")
    began, began_cpu = time.perf_counter(), time.thread_time()
    for message in frames:
        feed.on_live(message)
    elapsed, cpu = time.perf_counter() - began, time.thread_time() - began_cpu
    assert state.counters().decode_errors == 0 and state.counters().batches == len(frames)
    return events / elapsed, events / cpu


def bench_zmq(frames: list[list[bytes]], events: int) -> float:
    import zmq

    from pagevis.attach.subscriber import Attacher, Source

    with tempfile.TemporaryDirectory() as folder:
        endpoint = f"ipc://{folder}/pub"
        ctx = zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        pub.set_hwm(0)
        pub.bind(endpoint)
        attacher = Attacher([Source(endpoint, None, "kv-events")])
        attacher.start()
        time.sleep(0.3)
        state = attacher.fleet.engines[0]

        def send() -> None:
            for message in frames:
                pub.send_multipart(message)
        sender = threading.Thread(target=send)
        began = time.perf_counter()
        sender.start()
        deadline = began + 120
        while state.counters().batches < len(frames) and time.perf_counter() < deadline:
            attacher.poll(0.05)
        elapsed = time.perf_counter() - began
        sender.join()
        received = state.counters().batches
        attacher.close()
        pub.close(linger=0)
    if received < len(frames):
        print(f"(zmq: {received} of {len(frames)} messages arrived)")
    return events * received / len(frames) / elapsed


def rss_child(blocks: int, block_size: int) -> None:
    """In a fresh process: VmRSS before and after storing `blocks` blocks (printed as two numbers)."""
    import gc

    from pagevis.attach.events import DecodedBatch
    from pagevis.attach.state import EngineState

    def rss() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))

    state = EngineState("rss", None)
    gc.collect()
    before = rss()
    chain, per_event = 32, 32
    tokens = list(range(block_size)) * per_event
    h = 1 << 63  # 64-bit hashes, like vLLM's
    seq = 0
    while state.resident_blocks < blocks:
        event = BlockStored(block_hashes=list(range(h, h + per_event)), parent_block_hash=None,
                            token_ids=tokens, block_size=block_size, medium="GPU")
        h += per_event + chain
        state.apply_batch(seq, DecodedBatch(float(seq), (event,), 0, "map"))
        seq += 1
    gc.collect()
    after = rss()
    began = time.perf_counter()
    state.snapshot(blocks=True)
    full = time.perf_counter() - began
    began = time.perf_counter()
    state.snapshot(blocks=False)
    light = time.perf_counter() - began
    print(before, after, state.resident_blocks, full, light)


def bench_rss(blocks: int, block_size: int = 16) -> tuple[float, float, int, float, float]:
    out = subprocess.run([sys.executable, "-m", "pagevis.bench.attach", "--rss-child", str(blocks),
                          str(block_size)], capture_output=True, text=True, check=True, timeout=600)
    before, after, resident, full, light = out.stdout.split()[-5:]
    return int(before) / 2**20, int(after) / 2**20, int(resident), float(full), float(light)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m pagevis.bench.attach",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs (a smoke test of the bench)")
    parser.add_argument("--rss-child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_child:
        rss_child(*args.rss_child)
        return 0
    batches = 2_000 if args.quick else 20_000
    frames = workload(batches)
    events = count_events(frames)
    wall, cpu = bench_feed(frames, events)
    rows = [("feed: decode + apply, 1 thread", f"{wall:,.0f} events/s ({cpu:,.0f} per CPU second)", "≥ 200,000")]
    rows.append(("zmq: ipc PUB → Attacher (same process)", f"{bench_zmq(frames, events):,.0f} events/s", "-"))
    blocks = 100_000 if args.quick else 1_000_000
    before, after, resident, full, light = bench_rss(blocks)
    rows.append((f"rss: {resident:,} resident blocks x 16 tokens", f"{after:,.0f} MiB ({after - before:,.0f} MiB "
                 f"for the blocks, {(after - before) * 2**20 / resident:,.0f} B/block)", "≤ 1,024 MiB"))
    rows.append((f"snapshot of {resident:,} blocks: with blocks / without", f"{1000 * full:,.0f} ms / "
                 f"{1000 * light:,.1f} ms", "-"))
    print(f"{events:,} events in {batches:,} batches; Python {sys.version.split()[0]}, {os.cpu_count()} cores")
    print_targets(rows, 46)
    return 0


def print_targets(rows: list[tuple[str, str, str]], result_width: int) -> None:
    """(measure, result, target) rows as an aligned table."""
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'result':<{result_width}}  target")
    for name, value, target in rows:
        print(f"{name:<{width}}  {value:<{result_width}}  {target}")


if __name__ == "__main__":
    sys.exit(main())
