"""`pagevis attach --explain` (live: a test publisher on loopback with replay; and --play of the recorded vLLM
0.34.0 stream), its request lines, tokenizers and errors. In process: main() with the output captured."""

import json
import socket

import pytest

from pagevis.attach import BlockRemoved, BlockStored
from pagevis.attach.explain_run import RequestError, request_from
from pagevis.attach.publisher import KVEventPublisher
from pagevis.cli.main import main

from test_explain import tokens_of

FIXTURE = "tests/data/kv_events/vllm-0.34.0.kvev"


def lines(capsys):
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


def write(path, *objects):
    path.write_text("\n".join(o if isinstance(o, str) else json.dumps(o) for o in objects) + "\n")
    return str(path)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_play_a_recording(tmp_path, capsys):
    requests = write(tmp_path / "r.jsonl", {"prompt_token_ids": tokens_of("A", "B", "C", extra=[1])},
                     {"prompt_token_ids": tokens_of("A", "B", "Q")}, "not json", {"prompt": "text"},
                     {"prompt_token_ids": [1], "cache_salt": 3})
    assert main(["attach", "--play", FIXTURE, "--explain", requests, "--headless", "--json"]) == 1
    out = lines(capsys)
    assert [o["index"] for o in out] == [0, 1, 2, 3, 4]
    first = out[0]
    assert (first["tokens"], first["blocks"], first["best"]["rank"]) == (13, 3, None)
    engine = first["engines"][0]
    assert (engine["hit_tokens"], engine["media"], engine["first_miss"]["reason"]) == (12, ["GPU"] * 3,
                                                                                       "partial_block")
    assert out[1]["engines"][0]["first_miss"]["reason"] == "token_differs"
    assert out[2]["error"].startswith("not JSON")
    assert "needs --tokenizer" in out[3]["error"]
    assert out[4]["error"] == "cache_salt: a non-empty string"


def test_live_endpoints_with_replay_and_ranks(tmp_path, capsys):
    ports = [free_port() for _ in range(4)]
    a = KVEventPublisher(f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}", bind=True)
    b = KVEventPublisher(f"tcp://127.0.0.1:{ports[2]}", f"tcp://127.0.0.1:{ports[3]}", bind=True)
    try:
        a.publish([BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=tokens_of("A", "B"),
                               block_size=4, medium="GPU")], ts=1.0)
        a.publish([BlockRemoved(block_hashes=[2], medium="GPU")], ts=4.0)
        b.publish([BlockStored(block_hashes=[8, 9], parent_block_hash=None, token_ids=tokens_of("A", "B"),
                               block_size=4, medium="GPU")], ts=2.0)
        requests = write(tmp_path / "r.jsonl", {"prompt_token_ids": tokens_of("A", "B", extra=[5])})
        assert main(["attach", f"tcp://127.0.0.1:{ports[0]},tcp://127.0.0.1:{ports[1]}",
                     f"tcp://127.0.0.1:{ports[2]},tcp://127.0.0.1:{ports[3]}", "--explain", requests,
                     "--idle-exit", "0.2"]) == 0
    finally:
        a.close()
        b.close()
    (out,) = lines(capsys)
    assert [e["hit_tokens"] for e in out["engines"]] == [4, 8]
    assert out["engines"][0]["first_miss"] | {"block_size": 4} == out["engines"][0]["first_miss"]
    miss = out["engines"][0]["first_miss"]
    assert (miss["reason"], miss["removed_at"], miss["lived_s"]) == ("removed", 4.0, 3.0)
    assert out["best"] == {"endpoint": f"tcp://127.0.0.1:{ports[2]}", "rank": 0}


def test_request_lines():
    class Tok:
        decode = staticmethod(lambda ids: "")
        encode = staticmethod(lambda text: [1, len(text)])
        encode_chat = None

    assert request_from({"prompt": "abc", "lora_name": "ad"}, Tok).tokens == (1, 3)
    for bad, words in (([], "JSON object"), ({"prompt": "a", "messages": []}, "exactly one"),
                       ({"prompt_token_ids": [-1]}, "token ids"), ({"prompt_token_ids": [True]}, "token ids"),
                       ({"messages": [{"role": "user", "content": "hi"}]}, "no chat template"),
                       ({"prompt": ""}, "non-empty")):
        with pytest.raises(RequestError, match=words):
            request_from(bad, Tok)


def test_bad_arguments(tmp_path, capsys):
    for argv, words in ((["--play", FIXTURE, "--explain", str(tmp_path / "none")], "no such file"),
                        (["tcp://127.0.0.1:1", "--explain-log", FIXTURE], "give --play"),
                        (["--play", FIXTURE, "--explain", FIXTURE, "--explain-log", FIXTURE], "not both"),
                        (["--play", FIXTURE, "--explain", FIXTURE, "--duration", "1"], "--duration")):
        assert main(["attach", *argv]) == 2
        assert words in capsys.readouterr().err


def test_explain_log_plays_each_endpoint_at_its_own_time(tmp_path, capsys):
    """Engine b's batch (ts 1) was received after engine a's later one (ts 5): a request b answered at 2 is
    explained with b's block; one it answered at 0.5 without it. A reported count that differs is flagged."""
    from pagevis.attach.events import encode_batch, seq_bytes
    from pagevis.attach.recording import LIVE, Recorder

    def frames(seq, ts, hashes, labels):
        return [b"t", seq_bytes(seq), encode_batch(ts, [BlockStored(block_hashes=hashes, parent_block_hash=None,
                                                                    token_ids=tokens_of(*labels), block_size=4)])]
    path = tmp_path / "r.kvev"
    with Recorder(path, ["tcp://a:5557", "tcp://b:6557"]) as recorder:
        recorder.write(LIVE, 0, 0.0, frames(0, 5.0, [1], "A"))
        recorder.write(LIVE, 1, 0.0, frames(0, 1.0, [7], "A"))
    prompt = tokens_of("A", extra=[1])
    log = write(tmp_path / "log.jsonl", *({"arrival": t, "prompt_token_ids": prompt, "cached_tokens": n,
                                           "kv_events_endpoint": "tcp://*:6557"} for t, n in ((2.0, 4), (0.5, 0),
                                                                                           (0.6, 4))))
    assert main(["attach", "--play", str(path), "--explain-log", log]) == 0
    captured = capsys.readouterr()
    out = [json.loads(line) for line in captured.out.splitlines()]
    assert "1 requests flagged" in captured.err
    assert [(o["served_by"], o["expected"], o["reported"], o["flag"]) for o in out] == [
        ("tcp://b:6557", 4, 4, False), ("tcp://b:6557", 0, 0, False), ("tcp://b:6557", 0, 4, True)]
    assert [e["hit_tokens"] for e in out[0]["engines"]] == [0, 4]  # a's block came at 5
