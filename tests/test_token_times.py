"""The one token-times tracker: TTFT from the arrival, then the gap before each later token; pauses shift."""

from pagevis.token_times import TokenTimes


def test_first_token_is_timed_from_the_arrival_and_later_ones_from_the_token_before():
    times = TokenTimes(10.0)
    assert times.ttft is None
    assert times.token(10.75) == (True, 0.75)
    assert times.token(11.0) == (False, 0.25)
    assert times.token(11.5) == (False, 0.5)
    assert times.ttft == 0.75


def test_a_pause_shifts_every_time_so_it_never_counts():
    times = TokenTimes(0.0)
    times.token(1.0)
    times.shift(5.0)  # paused for five seconds after the first token
    assert times.ttft == 1.0
    assert times.token(6.5) == (False, 0.5)
