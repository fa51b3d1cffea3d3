"""The cuda_ipc receiver's per-connection copying thread (``cuda_ipc_copier.Copier``)."""

from __future__ import annotations

import threading

from xpyd.transfer.cuda_ipc_copier import Copier


def test_jobs_run_in_order_on_one_thread_and_the_outcome_comes_back():
    copier = Copier("t")
    seen = []
    try:
        for i in range(3):
            assert copier.run(lambda i=i: seen.append((i, threading.current_thread().name)) or f"r{i}",
                              lambda: None, 0.01) == (True, f"r{i}")
        assert [i for i, _ in seen] == [0, 1, 2] and {name for _, name in seen} == {"t"}
        assert copier.run(lambda: 1 / 0, lambda: None, 0.01) == (True, "device error: division by zero")
    finally:
        copier.close()


def test_giving_up_returns_at_once_while_the_job_still_runs():
    copier = Copier("t")
    release, asked = threading.Event(), []
    try:
        def give_up():
            asked.append(1)
            return "aborted" if len(asked) >= 2 else None

        assert copier.run(release.wait, give_up, 0.01) == (False, "aborted")
        assert len(asked) == 2 and not release.is_set()  # (the job is still waiting)
    finally:
        release.set()
        copier.close()


def test_a_job_that_ends_as_give_up_says_why_keeps_its_own_outcome():
    copier = Copier("t")
    try:
        gate = threading.Event()

        def work():
            gate.wait()
            return None

        def give_up():
            gate.set()  # the job ends now, before run() looks again
            threading.Event().wait(0.05)
            return "too late"

        assert copier.run(work, give_up, 0.01) == (True, None)
    finally:
        copier.close()
