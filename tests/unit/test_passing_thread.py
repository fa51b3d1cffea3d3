"""The worker does its start-up torch work in a thread that ends, so the engine's OpenMP team is the only one.

libgomp keeps a team of OpenMP threads per thread that ran a parallel region and throttles spin-waiting
once a process holds more OpenMP threads than cores; a second team (the main thread's, from loading and
warm-up) made every decode step pay futex wake-ups (57 vs 28 ms on two threads).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from xpyd.worker.main import in_passing_thread


def test_result_and_exception_come_back_from_a_thread_that_has_ended():
    seen = []

    def work():
        seen.append(threading.current_thread())
        return 42

    assert in_passing_thread(work) == 42
    assert seen[0] is not threading.main_thread() and not seen[0].is_alive()

    def fail():
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        in_passing_thread(fail)


# One process, two phases: the work in a passing thread first (its OpenMP team must be gone afterwards),
# then the same work on the main thread (the contrast: its team stays). Each phase prints its thread counts.
_PROBE = textwrap.dedent("""
    import os, time, torch
    from xpyd.worker.main import in_passing_thread
    torch.set_num_threads(2)
    tasks = lambda: len(os.listdir("/proc/self/task"))
    def parallel_work():
        a = torch.randn(1500, 1500)
        return float((a @ a).sum())
    before = tasks()
    in_passing_thread(parallel_work)
    deadline = time.monotonic() + 10  # the ended thread's OpenMP threads exit on their own, soon after
    while tasks() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    print("passing", before, tasks())
    before = tasks()
    parallel_work()
    print("main", before, tasks())
""")


@pytest.fixture(scope="module")
def thread_counts() -> dict[str, tuple[int, int]]:
    """Threads of the probe process before and after each phase."""
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120,
                         env={"OMP_WAIT_POLICY": "PASSIVE", "PATH": "/usr/bin:/bin"}, check=True).stdout
    return {where: (int(before), int(after)) for where, before, after in map(str.split, out.splitlines())}


@pytest.mark.parametrize("where", ["passing", "main"])
def test_openmp_threads_of_start_up_work_are_gone_afterwards(thread_counts, where):
    before, after = thread_counts[where]
    if where == "passing":
        assert after == before  # the loader thread and its OpenMP team are gone
    else:
        assert after > before  # the contrast: work on the main thread leaves its team behind
