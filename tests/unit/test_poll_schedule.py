"""The decode side's status-poll schedule: hold polls back until a prefill could be done."""

import pytest

from xpyd.decode_worker.poll_schedule import PollSchedule


def test_unknown_peer_is_polled_at_once():
    s = PollSchedule()
    assert s.start_at("p:1", arrival=10.0, prompt_tokens=1000) == 10.0


def test_starts_at_margin_times_the_fastest_recent_rate():
    s = PollSchedule(margin=0.8, window=4)
    s.observe("p:1", arrival=0.0, ready_at=0.2, prompt_tokens=200)  # 1 ms/token
    s.observe("p:1", arrival=1.0, ready_at=1.5, prompt_tokens=100)  # 5 ms/token (it was queued)
    assert s.start_at("p:1", arrival=2.0, prompt_tokens=100) == pytest.approx(2.0 + 0.8 * 0.001 * 100)
    assert s.start_at("p:2", arrival=2.0, prompt_tokens=100) == 2.0  # per peer


def test_window_forgets_old_speeds():
    s = PollSchedule(margin=1.0, window=2)
    s.observe("p", 0.0, 0.1, 100)  # 1 ms/token, then two slower ones push it out
    s.observe("p", 0.0, 0.3, 100)
    s.observe("p", 0.0, 0.2, 100)
    assert s.start_at("p", 0.0, 100) == pytest.approx(0.2)


def test_forget_and_bad_observations():
    s = PollSchedule()
    s.observe("p", 5.0, 4.0, 100)  # ready before arrival: ignored
    s.observe("p", 0.0, 1.0, 0)  # no prompt tokens: ignored
    assert s.start_at("p", 3.0, 100) == 3.0
    s.observe("p", 0.0, 1.0, 100)
    s.forget("p")
    assert s.start_at("p", 3.0, 100) == 3.0
    with pytest.raises(ValueError):
        PollSchedule(margin=1.5)
    with pytest.raises(ValueError):
        PollSchedule(window=0)
