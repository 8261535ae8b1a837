"""`pagevis bench serve`'s workload in the bare engine: what one and eight clients' requests cost the engine alone (no
HTTP, no event loop, no engine thread), so a level's c8/c1 can be read against the engine's own on the same kind of
requests.

The engine is set up as the server sets up its default pool (serve's defaults: pages of 16, policy none, a full
cache per request, the pool of --max-cache-tokens, --max-running, --token-budget, --max-chunk). One client: two
users, one request at a time (a user's first turn, then the returning turn with the answer it got). Eight: eight
users in lockstep, as the bench's eight clients run (their first turns submitted together and run to the end, then
their returning turns). The users are the ones the bench's level sent the server (serving_workload.Users with that
level's tag), so the engine alone gets the same prompts; its own prefix cache holds the system prompts (warmed first,
as the server is) and what the level's own requests leave. Tokens/s is the wall clock over the level.
"""

from __future__ import annotations

import statistics
import time

from pagevis.bench.serving_workload import SYSTEM_PROMPTS, Users, first_turn
from pagevis.simserver.workload import returning_turn

BARE_LEVELS = (1, 8)


def bare_engine(model, int8_rows: str | None = None, dtype: str | None = None):
    """An Engine as `pagevis serve` makes its default pool's (engines.Engines._start with serve's defaults;
    int8_rows, dtype: serve's --int8-rows and --dtype, None for their defaults)."""
    import dataclasses

    from pagevis.engine import Engine, SamplingConfig
    from pagevis.engine.batch import BatchConfig
    from pagevis.serve.settings import ServeSettings

    settings = ServeSettings() if int8_rows is None else ServeSettings(int8_rows=int8_rows)
    defaults = settings.defaults if dtype is None else dataclasses.replace(settings.defaults, dtype=dtype)
    page_size = defaults.page_size
    config = dataclasses.replace(defaults, max_pages=settings.full_cache_pages(page_size),
                                 sampling=SamplingConfig(mode="greedy"))  # the bench's requests: temperature 0
    batch = BatchConfig(max_seqs=settings.max_seqs, pool_pages=settings.pool_pages_for(page_size),
                        token_budget=settings.token_budget, int8_rows=settings.int8_rows)
    return Engine(model, config, batch, max_chunk=settings.max_chunk)


class BareClients:
    """One engine, warmed with each system prompt's first request; `level(c, tag)` runs c clients' users on it."""

    def __init__(self, model, max_tokens: int, seed: int = 0, int8_rows: str | None = None,
                 dtype: str | None = None) -> None:
        from pagevis.engine import run

        self.model, self.max_tokens, self.seed = model, max_tokens, seed
        self.engine = bare_engine(model, int8_rows, dtype)
        self.answers: dict[tuple[int, str], str] = {}
        warm = [self._submit(first_turn(system, "Hello?"), 4) for system in range(len(SYSTEM_PROMPTS))]
        run(self.engine)
        for seq in warm:
            self.engine.forget(seq)

    def _submit(self, messages: list[dict], max_tokens: int) -> int:
        ids = list(self.model.tokenizer.encode_chat(messages))
        return self.engine.submit(ids, max_new_tokens=max_tokens, ignore_eos=True)

    def _streamed(self, generated: list[int]) -> str:
        """The text a client of the server gets for these tokens (openai_api.Generation.pieces: an incremental
        decoder fed every token but the end-of-sequence ones)."""
        eos, decoder = self.model.config.eos_ids, self.model.tokenizer.incremental_decoder()
        return "".join(decoder.feed(t) for t in generated if t not in eos) + decoder.flush()

    def level(self, clients: int, tag: str, round_index: int = 0) -> dict:
        """`clients` clients' users (two each, as the bench's levels send 2 x the concurrency requests): output
        tokens/s by the wall clock, and the prompt rows the engine fed per output token."""
        from pagevis.engine import run

        users = Users(self.seed + round_index, tag)
        people = [users.next() for _ in range(2 if clients == 1 else clients)]
        groups = [people] if clients > 1 else [[person] for person in people]
        tokens, prompt_rows = 0, 0

        def count(record) -> None:
            nonlocal prompt_rows
            prompt_rows += sum(s.n_tokens for s in record.seqs if s.feeds_prompt)

        started = time.perf_counter()
        for group in groups:
            for turn in (0, 1):
                seqs = []
                for system, question, follow_up in group:
                    messages = first_turn(system, question)
                    if turn:
                        messages = returning_turn(messages, self.answers.pop((system, question)), follow_up)
                    seqs.append(self._submit(messages, self.max_tokens))
                run(self.engine, on_step=count)
                for (system, question, _), seq in zip(group, seqs, strict=True):
                    if not turn:  # the answer the user returns with: its text as the server streams it (no eos)
                        self.answers[(system, question)] = self._streamed(self.engine.requests[seq].generated)
                    tokens += len(self.engine.requests[seq].generated)
                    self.engine.forget(seq)
        seconds = time.perf_counter() - started
        return {"concurrency": clients, "output_tokens": tokens, "seconds": seconds,
                "output_throughput": tokens / seconds, "prompt_rows_per_output_token": prompt_rows / tokens}


def bare_over(levels: list[dict], served: dict) -> dict:
    """The engine alone's 8 over 1 clients (medians over its rounds), and the server's c8/c1 over it."""
    def median(clients: int) -> float:
        return statistics.median(level["output_throughput"] for level in levels if level["concurrency"] == clients)

    out = {"bare_c8_over_c1": median(8) / median(1)}
    if "c8_over_c1" in served:
        out["served_over_bare"] = served["c8_over_c1"] / out["bare_c8_over_c1"]
    return out


def format_bare(level: dict) -> str:
    return (f"  engine alone, c={level['concurrency']}: {level['output_throughput']:.1f} output tok/s, "
            f"{level['prompt_rows_per_output_token']:.2f} prompt rows per output token")
