"""The disk tier: what the swap file holds, what moved (against a brute-force simulation of the
replacement rule), SmolLM2 decoding through two RAM frames, and the swap folder's errors and clean-up."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from model_fixtures import smollm2  # noqa: F401 - a fixture
from pagevis.engine import DecodeSession, SessionConfig
from pagevis.kvcache import CacheConfig, ConfigError, EventKind, KVCacheManager
from pagevis.kvcache.disk_tier import DiskTier
from pagevis.kvcache.quantized_pages import QuantizedPages
from pagevis.kvcache.ram_tier import RamTier
from pagevis.kvcache.store import FloatPages

N_KV, HEAD_DIM, N_HEADS = 2, 4, 4


def tiered(page_size=4, ram=3, disk=12, policy="none", select="all", select_pages=2, swap_dir=None):
    return KVCacheManager.single(CacheConfig(page_size=page_size, max_pages=ram, disk_pages=disk, n_layers=1,
                                    n_heads=N_HEADS, n_kv_heads=N_KV, head_dim=HEAD_DIM, policy=policy,
                                    select=select, select_pages=select_pages, swap_dir=swap_dir))


def decode(cache, n_tokens, seed=0, on_step=None):
    """Append and attend one token a step; return K/V by position."""
    rng = np.random.default_rng(seed)
    stored = {}
    for position in range(n_tokens):
        k = rng.standard_normal((1, N_KV, HEAD_DIM)).astype(np.float32)
        v = rng.standard_normal((1, N_KV, HEAD_DIM)).astype(np.float32)
        stored[position] = (k[0], v[0])
        cache.step = position
        cache.admission.ensure_room(0, 1)
        cache.append(0, 0, k, v, np.array([position]))
        q = (2 * rng.standard_normal((1, N_HEADS, HEAD_DIM))).astype(np.float32)
        cache.attend(0, 0, q, np.array([position]))
        if on_step:
            on_step(position)
    return stored


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_store_holds_its_tier_and_the_frames_attention_reads_are_the_tiers(dtype, tmp_path):
    """A layer's store is its pages' kind (float or quantized) holding a tier object: RAM only, or with a swap file
    a disk tier; the frame arrays the store shows are the tier's own, and only the disk tier moves pages."""
    for disk in (0, 12):
        cache = KVCacheManager.single(CacheConfig(page_size=4, max_pages=3, disk_pages=disk, dtype=dtype, n_layers=1,
                                                  n_heads=N_HEADS, n_kv_heads=N_KV, head_dim=HEAD_DIM, policy="sinks",
                                                  swap_dir=str(tmp_path)))
        store = cache.stores[0]
        assert type(store) is (QuantizedPages if dtype == "int8" else FloatPages)
        assert type(store.tier) is (DiskTier if disk else RamTier) and store.tiered == bool(disk)
        for name in ("bias", "frame_positions", "frame_of", "page_in"):
            assert getattr(store, name) is getattr(store.tier, name)
        decode(cache, 30)
        assert store.high_water == store.tier.high_water <= 3
        moved = cache.take_counts()[0]
        assert (moved.faults > 0 and moved.swapped_out > 0) if disk else (moved.faults == moved.swapped_out == 0)
        cache.close()


def test_disk_file_holds_exactly_the_pages_swapped_out():
    cache = tiered(policy="oldest")  # evicts once 12 pages are full, so pages are also read back and refilled
    written = set()

    def collect(_):
        for event in cache.take_events():
            if event.kind is EventKind.SWAP_OUT and event.reason == "written":
                written.add(event.page)

    stored = decode(cache, 70, on_step=collect)
    store, ps = cache.stores[0], cache.config.page_size
    page_bytes = cache.config.page_bytes()
    with open(store.tier.swap.path, "rb") as file:
        data = file.read()
    assert written and len(data) >= (max(written) + 1) * page_bytes
    for page in range(cache.config.disk_pages):
        block = np.frombuffer(data[page * page_bytes: (page + 1) * page_bytes], np.float32)
        if page not in written:
            assert not block.any(), f"page {page} was never swapped out but the file holds data for it"
            continue
        k, v = block.reshape(2, N_KV, ps, HEAD_DIM)
        if store.frame_of[page] < 0:  # only on disk: the file is the page
            for slot in range(ps):
                position = store.positions[page * ps + slot]
                if position >= 0:
                    np.testing.assert_array_equal(k[:, slot], stored[position][0])
                    np.testing.assert_array_equal(v[:, slot], stored[position][1])
        elif not store.tier.dirty[page]:  # a clean copy in RAM equals the file
            frame = store.frame_of[page]
            np.testing.assert_array_equal(k, store.k[:, frame])
            np.testing.assert_array_equal(v, store.v[:, frame])
    cache.close()
    assert not os.path.exists(store.tier.swap.path)


class BruteForceLRU:
    """The replacement rule as the docs state it, on plain sets and dicts: new pages go to RAM (home
    frames), the home page read least recently (then the older) leaves, written only if it changed
    since its last write; disk pages are read for every query; quest keeps a page it read in RAM if a
    home page was not read this step."""

    def __init__(self, home_frames, page_size):
        self.home_frames, self.page_size = home_frames, page_size
        self.home: set[int] = set()
        self.last_read, self.born, self.dirty = {}, {}, {}

    def counts(self, step, new_page, read, promote):
        c = dict(hits=0, faults=0, swapped_out=0, writes=0)
        if new_page is not None:
            if len(self.home) == self.home_frames:
                self.swap_out(min(self.home, key=self.age), c)
            self.home.add(new_page)
            self.born[new_page], self.dirty[new_page], self.last_read[new_page] = len(self.born), True, step
        hits = read & self.home
        faults = sorted(read - self.home)
        c["hits"], c["faults"] = len(hits), len(faults)
        for page in read:
            self.last_read[page] = step
        for page in faults if promote else ():
            if len(self.home) == self.home_frames:
                idle = [p for p in self.home if self.last_read[p] < step]
                if not idle:
                    continue
                self.swap_out(min(idle, key=self.age), c)
            self.home.add(page)
        return c

    def age(self, page):
        return (self.last_read[page], self.born[page])

    def swap_out(self, page, c):
        self.home.remove(page)
        c["swapped_out"] += 1
        if self.dirty[page]:
            c["writes"] += 1
            self.dirty[page] = False


@pytest.mark.parametrize("select,ram", [("all", 3), ("all", 6), ("quest", 3), ("quest", 5)])
def test_fault_and_swap_counts_equal_a_brute_force_simulation(select, ram):
    cache = tiered(page_size=2, ram=ram, disk=40, select=select, select_pages=3)
    brute = BruteForceLRU(cache.config.home_frames, 2)
    page_bytes = cache.config.page_bytes()
    table = cache.block_table(0, 0)

    def check(step):
        read = set(table) if cache.read_slots(0)[0] is None else set((cache.read_slots(0)[0] // 2).tolist())
        if select == "all":
            assert read == set(table)
        else:
            assert len(read) == min(3, len(table)) and table[-1] in read
        new_page = table[-1] if step % 2 == 0 else None
        expected = brute.counts(step, new_page, read, promote=select == "quest")
        got = cache.take_counts()[0]
        assert (got.hits, got.faults, got.swapped_out) == (expected["hits"], expected["faults"],
                                                           expected["swapped_out"]), f"step {step}"
        assert got.bytes_read == expected["faults"] * page_bytes
        assert got.bytes_written == expected["writes"] * page_bytes

    decode(cache, 70, on_step=check)
    cache.close()


@pytest.mark.slow
def test_smollm2_with_two_ram_frames_decodes_what_the_full_cache_does(smollm2):  # noqa: F811
    prompt = "The three primary colours are"
    full = DecodeSession(smollm2, prompt, SessionConfig(page_size=4, max_pages=32, policy="none",
                                                        max_new_tokens=10, chat=False, record_layers=()))
    disk = DecodeSession(smollm2, prompt, SessionConfig(page_size=4, max_pages=2, disk_pages=32, policy="none",
                                                        max_new_tokens=10, chat=False, record_layers=()))
    list(full.run())
    records = list(disk.run())
    assert disk.generated == full.generated
    faults = sum(int(r.tiers.count("faults").sum()) for r in records)
    assert faults > 0 and all(r.tiers.count("hits").max() <= 1 for r in records)  # one home frame
    disk.cache.close()


def test_a_swap_folder_that_cannot_be_written_is_a_clear_error(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    with pytest.raises(ConfigError, match=r"swap_dir = .*file.* a folder where pagevis can write"):
        tiered(swap_dir=str(not_a_folder))
    with pytest.raises(ConfigError, match="swap_dir"):
        tiered(swap_dir="/proc/pagevis-cannot-write-here")


SCRIPT = textwrap.dedent("""
    import json, os, resource, signal, sys, time
    import numpy as np
    from pagevis.engine import DecodeSession, ModelSpec, SessionConfig
    mode, swap_dir = sys.argv[1], sys.argv[2]
    model = ModelSpec(kind="synthetic", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16).load()
    config = SessionConfig(page_size=4, max_pages=2, disk_pages=64, policy="none", max_new_tokens=200,
                           chat=False, swap_dir=swap_dir)
    session = DecodeSession(model, "a prompt", config)
    if mode == "full":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over the size limit: EFBIG instead of a core dump
        resource.setrlimit(resource.RLIMIT_FSIZE, (20 * 1024, 20 * 1024))
        state = lambda: [len(session.records), len(session.generated), session.next_position,
                         [s.resident for s in session.cache.stores], [len(t) for t in getattr(session.cache.sequences.get(session.seq_id), 'block_tables', [])]]
        try:
            while True:
                before = state()
                session.step()
        except OSError as error:
            print(json.dumps({"error": str(error), "before": before, "after": state(),
                              "events": len(session.cache.events)}))
        sys.exit(0)
    if mode == "error":
        session.step()
        raise RuntimeError("boom")
    if mode == "interrupt":
        session.step()
        print("ready", flush=True)
        time.sleep(60)
    for _ in range(20):
        session.step()
""")


def run_script(mode, swap_dir, **kwargs):
    return subprocess.run([sys.executable, "-c", SCRIPT, mode, str(swap_dir)], capture_output=True, text=True,
                          timeout=120, **kwargs)


def test_a_full_swap_folder_fails_before_the_step_changes_anything(tmp_path):
    done = run_script("full", tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert "cannot take" in result["error"] and "--swap-dir" in result["error"]
    assert result["before"][0] > 0  # the steps before it survive
    assert result["after"] == result["before"] and result["events"] == 0, "the failed step changed the session"
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mode", ["normal", "error"])
def test_no_swap_file_is_left_after_an_exit_or_an_error(tmp_path, mode):
    done = run_script(mode, tmp_path)
    assert done.returncode == (0 if mode == "normal" else 1), done.stderr
    assert os.listdir(tmp_path) == []


def test_no_swap_file_is_left_after_ctrl_c(tmp_path):
    process = subprocess.Popen([sys.executable, "-c", SCRIPT, "interrupt", str(tmp_path)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        assert len(os.listdir(tmp_path)) == 1  # the swap folder exists while the session runs
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert "KeyboardInterrupt" in err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quest_reads_the_pages_with_the_highest_key_bounds(seed):
    """The selection against the definition: per query head, u(page) = Σᵢ max(qᵢ·minᵢ, qᵢ·maxᵢ) over
    the page's keys (an upper bound of every q·k on it); shares = softmax over pages; a page is worth its
    largest share; the newest page plus the k-1 worth most."""
    from pagevis.kvcache.reader import quest_pages

    rng = np.random.default_rng(seed)
    cache = tiered(page_size=4, ram=3, disk=20, select="quest", select_pages=5)
    keys = {}
    for position in range(70):
        k = rng.standard_normal((1, N_KV, HEAD_DIM)).astype(np.float32)
        keys[position] = k[0]
        cache.admission.ensure_room(0, 1)
        cache.append(0, 0, k, k, np.array([position]))
    store, table = cache.stores[0], np.array(cache.block_table(0, 0))
    q = (2 * rng.standard_normal((1, N_HEADS, HEAD_DIM))).astype(np.float32)
    group = N_HEADS // N_KV
    bounds = np.zeros((len(table), N_HEADS))
    for i, page in enumerate(table):
        held = [p for p in store.positions[page * 4: page * 4 + 4] if p >= 0]
        page_keys = np.stack([keys[p] for p in held]).astype(np.float64)  # (tokens, n_kv, d)
        for h in range(N_HEADS):
            qh = q[0, h].astype(np.float64)
            lo, hi = page_keys[:, h // group].min(axis=0), page_keys[:, h // group].max(axis=0)
            bounds[i, h] = np.sum(np.maximum(qh * lo, qh * hi))
            assert np.all(page_keys[:, h // group] @ qh <= bounds[i, h] + 1e-5), "not an upper bound"
    shares = np.exp(bounds / 2 - (bounds / 2).max(axis=0))  # scaled by 1/sqrt(d), d = 4
    shares /= shares.sum(axis=0)
    worth = shares.max(axis=1)
    expected = set(table[np.argsort(-worth[:-1])[:4]].tolist()) | {int(table[-1])}
    assert set(quest_pages(store, table, q, 5).tolist()) == expected
    cache.close()


def test_no_swap_file_is_left_after_sigterm(tmp_path):
    process = subprocess.Popen([sys.executable, "-c", SCRIPT, "interrupt", str(tmp_path)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGTERM
    assert os.listdir(tmp_path) == []
