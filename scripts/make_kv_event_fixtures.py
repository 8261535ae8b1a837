"""Record KV event frames from vLLM's and SGLang's own publisher code into tests/data/kv_events/.

For each source this downloads the wheel (`pip download --no-deps`; nothing is installed), takes the module that
defines the events and `ZmqEventPublisher` out of it, and loads it with its engine-internal imports replaced by
small stand-ins (a config dataclass, a logger, the network helpers, the ExternalBlockHash alias; for SGLang its
runtime context and network address class). Then one scripted block-pool workload (WORKLOAD: 7 scheduler steps:
stores, branches, removals, a block stored again, a CPU copy, a clear, a remove of a block never stored) is
published through the real publisher on an ipc endpoint with a 5-step replay buffer; a SUB socket records the
live frames, and a DEALER asks the replay ROUTER for everything from seq 0 (it has seqs 2-6) and from seq 4.

Written per source: NAME.kvev (pagevis's recording format: the frames exactly as received; receive times 0)
and NAME.expected.json (the resident blocks after all 7 steps, and after steps 2-6 only, computed here by a
plain dict reference that shares no code with pagevis.attach). Timestamps are fixed, so a rerun writes the
same bytes (tests/test_attach_fixtures.py checks the committed files decode to the expected state).

    python scripts/make_kv_event_fixtures.py [--wheels DIR] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import hashlib
import importlib.util
import json
import logging
import subprocess
import sys
import tempfile
import time
import types
import zipfile
from pathlib import Path

import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pagevis.attach.recording import LIVE, REPLAY, Recorder  # noqa: E402

OUT = ROOT / "tests" / "data" / "kv_events"
SOURCES = {
    # name: (pip requirement, module inside the wheel, what the source is)
    "vllm-0.34.0": ("vllm==0.34.0", "vllm/distributed/kv_events.py", "vLLM 0.34.0: map events, replay with topic"),
    "vllm-0.25.1": ("vllm==0.25.1", "vllm/distributed/kv_events.py",
                    "vLLM 0.25.1: map events, replay without topic"),
    "vllm-0.11.0": ("vllm==0.11.0", "vllm/distributed/kv_events.py",
                    "vLLM 0.11.0: positional (array_like) events, replay without topic"),
    "sglang-0.5.23": ("sglang==0.5.23", "sglang/srt/disaggregation/kv_events.py",
                      "SGLang 0.5.23: map events, its medium names, cache_salt, bigram pages"),
}
TOPIC = "kv-events"
BUFFER_STEPS = 5
BLOCK = 4
TS0 = 1_700_000_000.0
REPLAY_STARTS = (0, 4)


def block_hash(label: str, flavour: str) -> int | bytes:
    digest = hashlib.sha256(label.encode()).digest()
    if flavour == "bytes":
        return digest
    if flavour == "int64":  # SGLang's hash_str_to_int64: signed
        return int.from_bytes(digest[:8], "big", signed=True)
    return int.from_bytes(digest[-8:], "big")  # vLLM's maybe_convert_block_hash: 64 unsigned bits


def tokens(labels: list[str]) -> list[int]:
    return [(ord(label[0]) * 100 + i) for label in labels for i in range(BLOCK)]


# (kind, labels, parent label, options); the medium is "GPU" unless set (SGLang's CPU tier is "CPU_PINNED").
WORKLOAD = [
    [("store", ["X"], None, {})],
    [("clear",), ("store", ["A", "B", "C"], None, {})],
    [("store", ["D"], "C", {"session_id": "s1", "group_idx": 0}),
     ("store", ["E", "F"], "B", {"extra_keys": [None, ["salt"]], "lora_name": "ad", "lora_id": 3})],
    [("remove", ["F"], None, {}), ("remove", ["E"], None, {})],
    [("store", ["E"], "B", {}), ("store", ["A"], None, {"medium": "CPU"})],
    [("store", ["G", "H"], None, {"bytes": True}), ("remove", ["D"], None, {"group_idx": 0})],
    [("store", ["J"], "G", {"bytes": True, "bigram": True}), ("remove", ["A"], None, {"medium": "CPU"}),
     ("remove", ["Z"], None, {})],
]


def reference(steps: list) -> dict:
    """Resident blocks after `steps`, by a dict per medium: {medium: {hash label: (parent label, tokens)}}."""
    media: dict[str, dict] = {}
    for step in steps:
        for kind, *rest in step:
            if kind == "clear":
                media = {}
                continue
            labels, parent, options = rest
            tier = media.setdefault(options.get("medium", "GPU"), {})
            for label in labels:
                if kind == "store":
                    tier.setdefault(label, (parent, tokens([label])))
                    parent = label
                else:
                    tier.pop(label, None)
    return media


# --- stand-ins for the engines' internal imports --------------------------------------------------------------
def vllm_stand_ins() -> dict[str, types.ModuleType]:
    @dataclasses.dataclass
    class KVEventsConfig:
        enable_kv_cache_events: bool = False
        publisher: str = "null"
        endpoint: str = "tcp://*:5557"
        replay_endpoint: str | None = None
        buffer_steps: int = 10_000
        hwm: int = 100_000
        max_queue_size: int = 100_000
        topic: str = ""

    def unused(*args, **kwargs):
        raise NotImplementedError("a stand-in: the fixtures bind ipc endpoints")

    modules = {name: types.ModuleType(name) for name in (
        "vllm", "vllm.config", "vllm.config.kv_events", "vllm.logger", "vllm.utils", "vllm.utils.network_utils",
        "vllm.v1", "vllm.v1.core", "vllm.v1.core.kv_cache_utils")}
    modules["vllm.config.kv_events"].KVEventsConfig = KVEventsConfig
    modules["vllm.logger"].init_logger = logging.getLogger
    for name in ("get_ip", "get_tcp_uri", "is_valid_ipv6_address", "split_zmq_path"):
        setattr(modules["vllm.utils.network_utils"], name, unused)
    modules["vllm.v1.core.kv_cache_utils"].ExternalBlockHash = bytes | int
    return modules


def sglang_stand_ins() -> dict[str, types.ModuleType]:
    modules = {name: types.ModuleType(name) for name in (
        "sglang", "sglang.srt", "sglang.srt.runtime_context", "sglang.srt.utils", "sglang.srt.utils.network")}

    def get_parallel():
        raise NotImplementedError("a stand-in: the fixtures make the publisher directly")

    class NetworkAddress:  # only describe_local_source and the tcp parsers use it; the fixtures do not
        @classmethod
        def parse(cls, text):
            raise NotImplementedError("a stand-in")

    modules["sglang.srt.runtime_context"].get_parallel = get_parallel
    modules["sglang.srt.utils.network"].NetworkAddress = NetworkAddress
    return modules


def load_module(source: Path, name: str, stand_ins: dict[str, types.ModuleType]) -> types.ModuleType:
    saved = {key: sys.modules.get(key) for key in stand_ins}
    sys.modules.update(stand_ins)
    try:
        spec = importlib.util.spec_from_file_location(name, source)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        for key, value in saved.items():
            if value is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = value


def wheel_module(requirement: str, member: str, wheels: Path) -> str:
    name = requirement.split("==")[0]
    found = sorted(wheels.glob(f"{name}-{requirement.split('==')[1]}-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(wheels),
                        requirement], check=True)
        found = sorted(wheels.glob(f"{name}-{requirement.split('==')[1]}-*.whl"))
    with zipfile.ZipFile(found[0]) as wheel:
        return wheel.read(member).decode("utf-8")


# --- driving a publisher --------------------------------------------------------------------------------------
def make_events(module: types.ModuleType, step: list, source: str) -> list:
    sglang = source.startswith("sglang")
    flavour = "int64" if sglang else "uint64"
    events = []
    for kind, *rest in step:
        if kind == "clear":
            events.append(module.AllBlocksCleared())
            continue
        labels, parent, options = rest
        options = dict(options)
        hash_flavour = "bytes" if options.pop("bytes", False) and source == "vllm-0.34.0" else flavour
        bigram = options.pop("bigram", False) and sglang
        medium = options.pop("medium", "GPU")
        if sglang and medium == "CPU":
            medium = module.StorageMedium.CPU  # "CPU_PINNED"
        hashes = [block_hash(label, hash_flavour) for label in labels]
        cls = module.BlockStored if kind == "store" else module.BlockRemoved
        fields = {"block_hashes": hashes, "medium": medium}
        if kind == "store":
            ids = tokens(labels)
            fields.update(parent_block_hash=None if parent is None else block_hash(parent, hash_flavour),
                          token_ids=[(t, t + 1) for t in ids] if bigram else ids, block_size=BLOCK)
            if sglang:
                fields["cache_salt"] = "salt-1"
        fields.update(options)
        known = set(cls.__struct_fields__)
        kwargs = {k: v for k, v in fields.items() if k in known}
        for required in cls.__struct_fields__[:len(cls.__struct_fields__) - len(cls.__struct_defaults__)]:
            kwargs.setdefault(required, None)
        events.append(cls(**kwargs))
    return events


def record_source(name: str, wheels: Path) -> None:
    requirement, member, description = SOURCES[name]
    text = wheel_module(requirement, member, wheels)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kv_events.py"
        path.write_text(text, encoding="utf-8")
        stand_ins = sglang_stand_ins() if name.startswith("sglang") else vllm_stand_ins()
        module = load_module(path, f"fixture_{name.replace('-', '_').replace('.', '_')}", stand_ins)
        endpoint, replay_endpoint = f"ipc://{folder}/pub", f"ipc://{folder}/replay"
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        sub.connect(endpoint)
        rank = {"attn_dp_rank": 0} if name.startswith("sglang") else {"data_parallel_rank": 0}
        publisher = module.ZmqEventPublisher(endpoint=endpoint, replay_endpoint=replay_endpoint,
                                             buffer_steps=BUFFER_STEPS, topic=TOPIC, **rank)
        time.sleep(0.5)  # the subscription reaches the PUB socket (ZMQ's slow joiner)
        live = []
        try:
            for seq, step in enumerate(WORKLOAD):
                batch = module.KVEventBatch(ts=TS0 + seq, events=make_events(module, step, name))
                publisher.publish(batch)
                live.append(sub.recv_multipart() if sub.poll(5000) else None)
            if None in live:
                raise SystemExit(f"{name}: a live message did not arrive; run again")
            replies = []
            for start in REPLAY_STARTS:
                dealer = ctx.socket(zmq.DEALER)
                dealer.connect(replay_endpoint)
                dealer.send_multipart([b"", start.to_bytes(8, "big")])
                while True:
                    if not dealer.poll(5000):
                        raise SystemExit(f"{name}: the replay from {start} did not end")
                    frames = dealer.recv_multipart()[1:]  # drop the empty delimiter
                    replies.append(frames)
                    if frames[-2] == (-1).to_bytes(8, "big", signed=True):
                        break
                dealer.close(linger=0)
        finally:
            publisher.shutdown()
            atexit.unregister(publisher.shutdown)  # SGLang registers it; a second call only logs a warning
            sub.close(linger=0)
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {"source": description, "requirement": requirement, "module": member, "topic": TOPIC,
            "buffer_steps": BUFFER_STEPS, "replay_starts": list(REPLAY_STARTS)}
    with Recorder(OUT / f"{name}.kvev", [endpoint.replace(folder, "FIXTURE")], meta) as recorder:
        for frames in live:
            recorder.write(LIVE, 0, 0.0, frames)
        for frames in replies:
            recorder.write(REPLAY, 0, 0.0, frames)
    write_expected(name)
    print(f"{name}: {len(live)} live messages, {len(replies)} replay replies -> {OUT / (name + '.kvev')}")


def write_expected(name: str) -> None:
    sglang = name.startswith("sglang")

    def as_json(media: dict) -> dict:
        out = {}
        for medium, blocks in media.items():
            medium = "CPU_PINNED" if sglang and medium == "CPU" else medium
            rows = []
            for label, (parent, ids) in sorted(blocks.items()):
                bytes_hash = label in "GHJ" and name == "vllm-0.34.0"
                flavour = "bytes" if bytes_hash else ("int64" if sglang else "uint64")
                encode = (lambda h: h.hex() if isinstance(h, bytes) else h)
                rows.append({"label": label, "hash": encode(block_hash(label, flavour)),
                             "parent": None if parent is None else encode(block_hash(parent, flavour)),
                             "tokens": ids})
            out[medium] = rows
        return out

    expected = {"batches": len(WORKLOAD), "final": as_json(reference(WORKLOAD)),
                "from_seq_2": as_json(reference(WORKLOAD[2:]))}
    (OUT / f"{name}.expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, default=Path.home() / ".cache" / "pagevis" / "wheels",
                        help="where the downloaded wheels are kept (default ~/.cache/pagevis/wheels)")
    parser.add_argument("--only", nargs="*", choices=sorted(SOURCES), help="record only these sources")
    args = parser.parse_args()
    args.wheels.mkdir(parents=True, exist_ok=True)
    for name in args.only or SOURCES:
        record_source(name, args.wheels)


if __name__ == "__main__":
    main()
