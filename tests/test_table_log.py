"""Records' block tables as changes: every step's tables come back exactly, and the log grows with what
changed, not with steps x table length."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pagevis.engine.table_log import TableLog


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3), st.integers(1, 120))
def test_every_step_comes_back_exactly(seed, n_layers, n_steps):
    rng = np.random.default_rng(seed)
    log = TableLog(n_layers)
    tables = [[] for _ in range(n_layers)]
    expected, views, changed = [], [], 0
    for step in range(n_steps):
        for table in tables:
            for _ in range(rng.integers(0, 3)):
                op = rng.integers(0, 4)
                if op == 0 or not table:
                    table.append(int(rng.integers(0, 500)))  # a page allocated
                elif op == 1:
                    table.pop(int(rng.integers(0, len(table))))  # a page released
                elif op == 2:
                    table[int(rng.integers(0, len(table)))] = int(rng.integers(0, 500))  # copied on write
                changed += 1
        expected.append(tuple(tuple(t) for t in tables))
        views.append(log.record(step, tables))
    for step in rng.permutation(n_steps):  # any order: the view rebuilds its step from checkpoints
        assert tuple(views[step]) == expected[step] == views[step]
        assert views[step][-1] == expected[step][-1]


def test_a_growing_table_costs_its_changes_not_steps_times_length():
    log = TableLog(1)
    table = []
    for step in range(20_000):  # a long decode: one page every 16 steps, 1,250 pages at the end
        if step % 16 == 0:
            table.append(step // 16)
        log.record(step, [table])
    copies = sum(len(range(step // 16 + 1)) for step in range(20_000))  # what one copy per step held
    assert log.entries() <= 4 * 1250 < copies / 1000
    assert log.table(0, 19_999) == tuple(range(1250)) and log.table(0, 31) == (0, 1)


def test_request_tokens_in_is_a_slice_of_tokens():
    """Request.tokens_in and n_tokens (the scheduler's per-step reads) agree with slicing the whole token list."""
    from pagevis.engine.request import Request
    from pagevis.engine.sampling import Sampler, SamplingConfig

    request = Request(0, (5, 6, 7), Sampler(SamplingConfig()), 10)
    request.generated = [8, 9]
    assert request.n_tokens == len(request.tokens) == 5
    for start in range(6):
        for stop in range(start, 8):
            assert request.tokens_in(start, stop) == request.tokens[start:stop], (start, stop)
