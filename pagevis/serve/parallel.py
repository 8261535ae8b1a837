"""The OpenAI `n` parameter: n samples of one prompt as parallel sampling over one shared pool (the
prompt is computed once and its pages shared; each sample copies the partial last page on first write),
decoded with continuous batching. Sample i uses seed + i. Not streamed."""

from __future__ import annotations

from ..decoding import Engine, run
from ..decoding.batch import BatchConfig
from ..engine import CacheFullError

MAX_N = 16


def generate_n(model, session, n: int, stops: list[str], metrics=None) -> tuple[list[tuple[str, str]], dict]:
    """[(text, finish_reason)] per sample and the usage, for the prompt and config of `session` (a
    DecodeSession built only to validate and encode the request)."""
    from .openai_api import StopMatcher

    batch = Engine(model, session.config, BatchConfig(max_seqs=n))
    ids = batch.submit_parallel(session.prompt_ids, n)
    try:
        run(batch)
    except CacheFullError:  # policy 'none' and a full cache: the samples end where they are ("length")
        pass
    finally:
        batch.close()
    choices = []
    for seq_id in ids:
        matcher = StopMatcher(stops)
        text, hit = matcher.push(batch.text(seq_id))
        text += "" if hit else matcher.flush()
        seq = batch.requests[seq_id]
        choices.append((text, "stop" if hit or seq.stop_reason == "eos" else "length"))
    generated = sum(len(batch.requests[s].generated) for s in ids)
    if metrics is not None:
        metrics.count_batch(batch, len(session.prompt_ids), generated)
    usage = {"prompt_tokens": len(session.prompt_ids), "completion_tokens": generated,
             "total_tokens": len(session.prompt_ids) + generated}
    return choices, usage
