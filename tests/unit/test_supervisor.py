"""`xpyd up`'s supervisor with real child processes (tiny Python programs instead of workers)."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from xpyd.launcher.supervisor import ChildState, GiveUp, RestartPolicy, Supervisor, describe_exit

# A child that sleeps for argv[0] seconds, then exits with code argv[1].
CHILD = (sys.executable, "-c", "import sys, time; time.sleep(float(sys.argv[1])); sys.exit(int(sys.argv[2]))")


def _supervisor(**policy) -> tuple[Supervisor, list[str]]:
    said: list[str] = []
    return Supervisor(RestartPolicy(**policy), log=said.append, command=CHILD), said


def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def _check_until(sup: Supervisor, predicate, timeout: float = 10.0) -> None:
    def step() -> bool:
        sup.check()
        return predicate()
    _wait(step, timeout)


def test_a_worker_that_exits_is_restarted_with_the_same_command_line():
    sup, said = _supervisor(backoff=0.05)
    child = sup.spawn("decode 0", ["0.05", "3"])
    first = child.proc.pid
    try:
        _check_until(sup, lambda: child.restarts == 1 and child.state is ChildState.RUNNING)
        assert child.proc.pid != first
        assert child.proc.args[-2:] == ["0.05", "3"]
        assert any("decode 0 exited unexpectedly (exit code 3)" in s and "restarting it in 0.05s" in s for s in said)
        assert any(s.startswith("decode 0 restarted (restart 1") for s in said)
    finally:
        sup.stop()


def test_a_crash_loop_is_given_up_on_after_max_fast_crashes():
    sup, said = _supervisor(backoff=0.01, max_backoff=0.04, fast_crash=30, max_fast_crashes=3)
    child = sup.spawn("prefill 0", ["0", "1"])
    try:
        with pytest.raises(GiveUp, match=r"prefill 0 exited 3 times in a row within 30s of starting \(last: exit code 1\)"):
            _check_until(sup, lambda: False)
        assert child.restarts == 2 and child.state is ChildState.STOPPED
        delays = [s.split("restarting it in ")[1].split("s ")[0] for s in said if "restarting it in" in s]
        assert delays == ["0.01", "0.02"]  # the back-off doubles
    finally:
        sup.stop()


def test_a_child_that_ran_long_enough_starts_a_new_count():
    sup, _ = _supervisor(backoff=5, max_backoff=5, fast_crash=30, max_fast_crashes=2)
    child = sup.spawn("decode 0", ["0", "1"])
    try:
        _wait(lambda: child.proc.poll() is not None)
        sup.check(now=child.started_at + 1)  # a fast crash: 1 of 2
        assert child.fast_crashes == 1 and child.state is ChildState.BACKOFF
        sup.check(now=child.next_start)  # restarted
        _wait(lambda: child.proc.poll() is not None)
        sup.check(now=child.started_at + 31)  # ran 31 s: not a fast crash, so no give-up
        assert child.fast_crashes == 0 and child.state is ChildState.BACKOFF
    finally:
        sup.stop()


def test_the_proxy_exiting_stops_the_cluster():
    sup, _ = _supervisor()
    sup.spawn("proxy", ["0", "0"], restart=False)
    try:
        with pytest.raises(GiveUp, match=r"proxy exited unexpectedly \(exit code 0\)"):
            _check_until(sup, lambda: False)
    finally:
        sup.stop()


def test_a_killed_worker_is_reported_by_signal_and_stop_ends_every_child():
    sup, said = _supervisor(backoff=0.05)
    a = sup.spawn("decode 0", ["60", "0"])
    b = sup.spawn("decode 1", ["60", "0"])
    os.kill(a.proc.pid, signal.SIGKILL)
    _check_until(sup, lambda: a.restarts == 1 and a.state is ChildState.RUNNING)
    assert any("decode 0 exited unexpectedly (killed by SIGKILL)" in s for s in said)
    assert b.restarts == 0 and b.proc.poll() is None  # the other one kept running
    procs = [a.proc, b.proc]
    sup.stop(timeout=5)
    assert all(p.poll() is not None for p in procs)
    assert sup.dead() == ["decode 0", "decode 1"]


def test_describe_exit_and_policy_checks():
    assert describe_exit(-9) == "killed by SIGKILL" and describe_exit(2) == "exit code 2"
    with pytest.raises(ValueError):
        RestartPolicy(backoff=5, max_backoff=1)
    with pytest.raises(ValueError):
        RestartPolicy(max_fast_crashes=0)


def test_a_drained_worker_gets_sigterm_is_not_restarted_and_is_forgotten_once_it_exits():
    sup, said = _supervisor(backoff=0.05)
    child = sup.spawn("decode 1", ["30", "0"])  # (SIGTERM ends it: a worker finishes its work, then exits)
    other = sup.spawn("decode 0", ["30", "0"])
    try:
        sup.drain("decode 1")
        assert child.state is ChildState.DRAINING and "decode 1" not in sup.dead()
        _check_until(sup, lambda: "decode 1" not in sup.children)
        assert child.proc.returncode == -signal.SIGTERM and child.restarts == 0
        assert any(s.startswith("decode 1 drained (killed by SIGTERM)") for s in said)
        assert other.state is ChildState.RUNNING and list(sup.children) == ["decode 0"]
    finally:
        sup.stop()
