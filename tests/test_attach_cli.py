"""`pagevis attach --headless --json` end to end in a subprocess against a test publisher on loopback; recording
and playback; the metrics scraper; block text; bad arguments. Every subprocess is bounded in time."""

import json
import subprocess
import sys
import threading
import time

import pytest

from metrics_endpoint import metrics_endpoint

from pagevis.attach import BlockRemoved, BlockStored
from pagevis.attach.metrics import MetricsHistory, parse, scrape
from pagevis.attach.playback import Playback
from pagevis.attach.publisher import KVEventPublisher
from pagevis.attach.recording import Recorder, RecordingError, read_recording
from pagevis.cli.main import main

TOPIC = "kv-events"


def stored(hashes, parent=None, medium="GPU"):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, block_size=2, medium=medium,
                       token_ids=[h * 10 + i for h in hashes for i in range(2)])


def wait_for_line(stream, text, timeout):
    lines, found = [], threading.Event()

    def read():
        for line in stream:
            lines.append(line)
            if text in line:
                found.set()
                return
    threading.Thread(target=read, daemon=True).start()
    assert found.wait(timeout), "".join(lines)
    return "".join(lines)


def attach(*args):
    return subprocess.Popen([sys.executable, "-m", "pagevis", "attach", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_headless_json_end_to_end_with_two_engines(tmp_path):
    a = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic=TOPIC)
    b = KVEventPublisher("tcp://127.0.0.1:*", None, topic=TOPIC)
    try:
        a.publish([stored([1, 2, 3]), stored([7], medium="CPU")], ts=1.0)  # before the attach: from replay
        a.publish([BlockRemoved(block_hashes=[3], medium="GPU")], ts=2.0)
        state_file, record = tmp_path / "state.json", tmp_path / "stream.kvev"
        process = attach(f"{a.endpoint},{a.replay_endpoint}", b.endpoint, "--topic", TOPIC, "--headless", "--json",
                         "--idle-exit", "2", "--save-state", str(state_file), "--record", str(record))
        first_err = wait_for_line(process.stderr, "rebuilt from", timeout=30)  # it has replayed and subscribed
        time.sleep(1.0)  # the subscription reaches the PUB sockets (a subprocess: nothing to probe)
        a.publish([stored([4], parent=2)], ts=3.0)
        b.publish([stored([1, 2])], ts=3.0)
        out, err = process.communicate(timeout=60)
        err = first_err + err
    finally:
        if process.poll() is None:
            process.kill()
        a.close()
        b.close()
    assert process.returncode == 0, err
    summary = json.loads(out)
    assert summary == {"endpoints": [
        {"endpoint": a.endpoint, "replay": a.replay_endpoint, "batches": 3, "last_seq": 2, "replayed_batches": 2,
         "gaps_unrecovered": 0, "decode_errors": 0, "events": {"BlockStored": 3, "BlockRemoved": 1,
                                                               "AllBlocksCleared": 0},
         "resident_blocks": {"GPU": 3, "CPU": 1}},
        {"endpoint": b.endpoint, "replay": None, "batches": 1, "last_seq": 0, "replayed_batches": 0,
         "gaps_unrecovered": 0, "decode_errors": 0, "events": {"BlockStored": 1, "BlockRemoved": 0,
                                                               "AllBlocksCleared": 0},
         "resident_blocks": {"GPU": 2}}], "shared_blocks": 2}
    assert "rebuilt from 2 replayed batches (seqs 0-1; the whole history)" in err
    saved = json.loads(state_file.read_text())
    assert saved["endpoints"][1] == {"endpoint": b.endpoint, "blocks": [
        {"hash": 1, "parent": None, "medium": "GPU", "tokens": [10, 11]},
        {"hash": 2, "parent": 1, "medium": "GPU", "tokens": [20, 21]}]}
    assert {(x["hash"], x["medium"]) for x in saved["endpoints"][0]["blocks"]} == {
        (1, "GPU"), (2, "GPU"), (4, "GPU"), (7, "CPU")}
    # the recording plays back to the same state, through the same feeds
    playback = Playback(read_recording(record))
    playback.seek(len(playback))
    snap = playback.fleet.snapshot()
    assert [e.counters.batches for e in snap.engines] == [3, 1] and snap.shared_blocks == 2
    playback.seek(0)
    assert playback.fleet.engines[0].counters().batches == 2  # the replay at attach comes before any message


def test_recordings_are_checked(tmp_path):
    path = tmp_path / "r.kvev"
    with Recorder(path, ["tcp://x:1"], {"topic": "t"}) as recorder:
        recorder.write(1, 0, 0.5, [b"t", b"\x00" * 8, b"\x92\xcb" + b"\x00" * 8 + b"\x90"])
    data = path.read_bytes()
    assert len(read_recording(path).records) == 1
    path.write_bytes(data[:-3])
    assert read_recording(path).truncated and not read_recording(path).records
    for broken in (b"NOPE" + data[4:], data[:12] + b"\x09\x00" + data[14:]):
        path.write_bytes(broken)
        with pytest.raises(RecordingError):
            read_recording(path)
    header_end = data.index(b"}", 18) + 1
    path.write_bytes(data[:header_end] + b"\x07" + data[header_end + 1:])  # record kind 7
    with pytest.raises(RecordingError):
        read_recording(path)


VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} %d
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} %d
"""


def test_metrics_are_parsed_and_scraped():
    first, second = parse(VLLM_METRICS % (100, 40), 0.0), parse(VLLM_METRICS % (300, 190), 1.0)
    assert (first.running, first.waiting, first.kv_usage, first.prefix_queries) == (4.0, 2.0, 0.25, 100.0)
    history = MetricsHistory()
    history.add(first)
    history.add(second)
    assert history.hit_rate() == 0.75

    with metrics_endpoint(lambda: VLLM_METRICS % (10, 5)) as url:
        sample = scrape(url, timeout=5)
        assert (sample.running, sample.prefix_hits) == (4.0, 5.0)


def test_block_text_from_a_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from pagevis.attach.tokens import load_detokenizer

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    model = tokenizers.models.WordLevel(vocab, unk_token="[UNK]")
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.decoder = tokenizers.decoders.WordPiece()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    assert load_detokenizer(path)([1, 2, 99]) == "hello world"


def test_block_text_from_the_shipped_gguf():
    from pagevis.attach.tokens import load_detokenizer
    from pagevis.model.locate import default_model_path

    decode = load_detokenizer(default_model_path())
    assert decode([19556, 905]).strip() != ""


@pytest.mark.parametrize("args, message", [
    ([], "at least one ENDPOINT"),
    (["localhost:5557", "--headless"], "tcp://"),
    (["tcp://h:1", "--json"], "go with --headless"),
    (["tcp://h:1", "--headless", "--dp-size", "0"], "--dp-size"),
    (["tcp://h:1", "--headless", "--duration", "1", "--idle-exit", "1"], "not allowed with"),
    (["tcp://h:1", "--headless", "--tokenizer", "/nonexistent.json"], "no such file"),
    (["--play", "/nonexistent.kvev", "--headless"], "--play"),
])
def test_bad_arguments_are_one_line(args, message, capsys):
    assert main(["attach", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize("signal_number", [2, 15])  # SIGINT (Ctrl-C), SIGTERM
def test_a_signal_ends_a_headless_run_with_its_summary(signal_number):
    publisher = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic=TOPIC)
    try:
        publisher.publish([stored([1])], ts=1.0)
        process = attach(f"{publisher.endpoint},{publisher.replay_endpoint}", "--headless", "--json")
        try:
            wait_for_line(process.stderr, "rebuilt from", timeout=30)
            process.send_signal(signal_number)
            out, _ = process.communicate(timeout=30)
        finally:
            if process.poll() is None:
                process.kill()
    finally:
        publisher.close()
    assert process.returncode == 0
    assert json.loads(out)["endpoints"][0]["resident_blocks"] == {"GPU": 1}
