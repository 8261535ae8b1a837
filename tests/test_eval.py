"""`pagevis eval` and lm-eval itself against pagevis serve: a multiple-choice task through lm-eval's
local-completions with tokenizer_backend=remote scores each choice as a dense forward does; the needle set
hides its code where it says; the command prints its table and draws its plots; bad flags get one line."""

from __future__ import annotations

import numpy as np
import pytest
from serve_fixtures import SYNTH, running_server

from pagevis.eval.tasks import MC, NEEDLE, Needle, needle_docs, task_config

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'pagevis[eval]')")


def dense_loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    from pagevis.engine.sampling import log_softmax
    from pagevis.model import DenseAttention

    ids = context + continuation
    logits = model.forward(np.array(ids), np.arange(len(ids)), DenseAttention(model.config), all_logits=True)
    return float(sum(log_softmax(logits[p - 1])[ids[p]] for p in range(len(context), len(ids))))


@pytest.mark.slow
def test_lm_eval_multiple_choice_scores_each_choice_as_a_dense_forward(tmp_path):
    model = SYNTH.load()
    with running_server() as server:
        results = lm_eval.simple_evaluate(
            model="local-completions", tasks=[task_config(MC, tmp_path, model.tokenizer, Needle())], limit=3,
            model_args={"base_url": server.url + "/v1/completions", "model": "synthetic",
                        "tokenizer_backend": "remote", "tokenized_requests": True, "max_length": 256},
            log_samples=True, bootstrap_iters=0, verbosity="WARNING",
            task_manager=lm_eval.tasks.TaskManager(include_defaults=False))
    samples = results["samples"][MC]
    assert len(samples) == 3 and results["results"][MC]["acc,none"] in (0, 1 / 3, 2 / 3, 1)
    encode = model.tokenizer.encode
    for sample in samples:
        assert len(sample["arguments"]) == 4  # four choices, one request each
        for (context, continuation), response in zip(sample["arguments"], sample["resps"], strict=True):
            whole, head = encode(context + continuation), encode(context)
            expected = dense_loglikelihood(model, head, whole[len(head):])
            assert response[0][0] == pytest.approx(expected, abs=1e-4)
        best = int(np.argmax([r[0][0] for r in sample["resps"]]))
        assert sample["acc"] == float(best == sample["target"])


def test_the_needle_is_where_the_document_says():
    tokenizer = SYNTH.load().tokenizer  # one token per byte: lengths are exact
    docs = needle_docs(tokenizer, Needle(lengths=(200, 400), depths=(0.0, 0.5, 1.0), samples=2))
    assert len(docs) == 12
    for doc in docs:
        code = doc["choices"][doc["answer"]].strip(" .")
        assert len(set(doc["choices"])) == 4 and f"The secret code is {code}." in doc["context"]
        assert abs(len(tokenizer.encode(doc["context"])) - doc["length"]) <= 1
        sentence = f" The secret code is {code}. "
        haystack = doc["context"].split("\n\nQuestion")[0]
        assert abs(haystack.index(sentence) / (len(haystack) - len(sentence)) - doc["depth"]) < 0.02
    with pytest.raises(ValueError, match="needle length 40"):
        needle_docs(tokenizer, Needle(lengths=(40,)))


@pytest.mark.slow
def test_pagevis_eval_prints_the_table_and_draws_the_plots(tmp_path, capsys):
    from pagevis.cli.main import main

    prefix = tmp_path / "eval"
    code = main(["eval", "--model", "synthetic", "--tasks", f"{MC},{NEEDLE}", "--policies", "sinks",
                 "--budgets", "32", "--page-size", "8", "--limit", "2", "--max-length", "160",
                 "--needle-lengths", "128", "--needle-depths", "0,1", "--needle-samples", "1", "--concurrency", "4",
                 "--plot", str(prefix), "--quiet"])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    assert lines[1].startswith("policy") and lines[3].startswith("full cache") and lines[4].startswith("sinks")
    assert f"{MC} acc" in lines[1] and f"{NEEDLE} acc" in lines[1]
    for name in (MC, NEEDLE, "needle"):
        assert (tmp_path / f"eval-{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("flags, words", [
    (["--budgets", "30"], "--budgets: 30 is not a positive multiple of --page-size 16"),
    (["--policies", "quest"], "--policies: quest is a compare row"),
    (["--needle-depths", "0,2"], "--needle-depths '0,2': expected numbers from 0 to 1"),
    (["--tasks", ","], "--tasks: give at least one task"),
    (["--dtypes", "int3"], "--dtypes: unknown dtype 'int3'"),
    (["--concurrency", "0"], "--concurrency 0: must be from 1 to 64"),
    (["--max-length", "256", "--needle-lengths", "256"], "--needle-lengths 256: must be from 32 to 240"),
])
def test_bad_flags_get_one_line(flags, words, capsys):
    from pagevis.cli.main import main

    assert main(["eval", "--model", "synthetic", "--no-files", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_a_task_lm_eval_does_not_have_is_one_line(capsys):  # indexes lm-eval's registry: 10-30 s
    from pagevis.cli.main import main

    assert main(["eval", "--model", "synthetic", "--no-files", "--tasks", "hellaswagg"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--tasks: lm-eval has no task 'hellaswagg' (did you mean hellaswag" in err and len(err.splitlines()) == 1


def test_an_eval_server_gives_a_request_naming_no_cache_the_rows_cache():
    """lm-eval's requests name no cache: the row's configuration must be what the server gives them (a server
    that gave them a full cache of its own would make every row the full cache's)."""
    from pagevis.eval.run import Configuration, Plan, full_cache, server_settings
    from pagevis.serve.sessions import session_config

    model = SYNTH.load()
    plan = Plan(tasks=(MC,), configurations=(), page_size=8, max_length=64)
    row = session_config(server_settings(model, SYNTH, plan, Configuration("sinks", 32, "int8")), {})
    assert (row.policy, row.max_pages, row.page_size, row.dtype) == ("sinks", 4, 8, "int8")
    full = session_config(server_settings(model, SYNTH, plan, full_cache(plan)), {})
    assert (full.policy, full.max_pages * full.page_size) == ("none", 80)
