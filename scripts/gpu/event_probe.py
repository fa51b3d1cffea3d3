"""How fast another process learns that a CUDA event it got through IPC has completed, on this GPU.

The cuda_ipc backend's receiver waits for the sender's forward (an interprocess CUDA event the sender
recorded behind it) before it copies. This measures the ways it could wait, between two processes on one
GPU: the parent runs a ~2 ms kernel (``torch.cuda._sleep``), records an interprocess event behind it, sends its
handle and spins on ``query()`` to note when the device passed it (``t_done``); the child opens the handle,
waits by one method and notes when it woke (``t_wake``). Both clocks are ``time.perf_counter_ns``
(CLOCK_MONOTONIC: one clock for every process of a host). Printed per method: the median and p90 of
``t_wake - t_done`` over ``--reps`` events, and the host cost of making, exporting and opening an event.

Methods: ``sync`` (``Event.synchronize``: the driver spins, the GIL released), ``sync-blocking`` (the
same on an event made with ``blocking=True``: the driver sleeps), ``query-sleep0`` / ``query-50us`` (a
Python loop of ``query()`` and ``time.sleep``), ``stream`` (the child's stream waits on the event on the
device, records its own event behind it, and synchronises that).

``--orphan``: what a waiter sees when the process that recorded the event is killed (SIGKILL) while the
kernel before the event still runs: does ``synchronize()`` return, and when; what ``query()`` says.

    python scripts/gpu/event_probe.py [--reps 30] [--orphan]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap
import time

CHILD = textwrap.dedent("""
    import json, sys, time
    import torch
    torch.cuda.init()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    stream = torch.cuda.Stream()
    own = torch.cuda.Event()
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        t0 = time.perf_counter_ns()
        ev = torch.cuda.Event.from_ipc_handle(dev, bytes.fromhex(cmd["h"]))
        opened = time.perf_counter_ns() - t0
        print(json.dumps({"opened": opened}), flush=True)
        m = cmd["m"]
        if m.startswith("sync"):
            ev.synchronize()
        elif m == "query-sleep0":
            while not ev.query():
                time.sleep(0)
        elif m == "query-50us":
            while not ev.query():
                time.sleep(50e-6)
        else:  # stream
            stream.wait_event(ev)
            own.record(stream)
            own.synchronize()
        wake = time.perf_counter_ns()
        print(json.dumps({"wake": wake}), flush=True)
""")

ORPHAN = textwrap.dedent("""
    import sys, time
    import torch
    ev = torch.cuda.Event(blocking=True, interprocess=True)
    torch.cuda._sleep(int(sys.argv[1]))  # ~2 s
    ev.record()
    print(bytes(ev.ipc_handle()).hex(), flush=True)
    time.sleep(60)
""")


def orphan(torch, cycles: int) -> None:
    import os
    import signal
    import threading

    child = subprocess.Popen([sys.executable, "-c", ORPHAN, str(cycles)], stdout=subprocess.PIPE, text=True)
    handle = bytes.fromhex(child.stdout.readline().strip())
    ev = torch.cuda.Event.from_ipc_handle(torch.device("cuda", 0), handle)
    result = {}

    def wait() -> None:
        t0 = time.monotonic()
        try:
            ev.synchronize()
            result["returned"] = time.monotonic() - t0
        except Exception as e:
            result["raised"] = f"{type(e).__name__}: {e}"[:300]

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    time.sleep(0.2)
    print(f"orphan: query() before the kill: {ev.query()}", flush=True)
    killed = time.monotonic()
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    waiter.join(20)
    print(f"orphan: the waiter {result or 'is still waiting after 20 s'} "
          f"({time.monotonic() - killed:.2f} s after the kill)", flush=True)
    try:
        print(f"orphan: query() after: {ev.query()}", flush=True)
    except Exception as e:
        print(f"orphan: query() after raised {type(e).__name__}: {str(e)[:200]}", flush=True)
    sys.stdout.flush()
    os._exit(0)


METHODS = ("sync", "sync-blocking", "query-sleep0", "query-50us", "stream")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sleep-cycles", type=int, default=4_000_000, help="torch.cuda._sleep cycles (~2 ms)")
    ap.add_argument("--orphan", action="store_true", help="kill the recording process while the waiter waits")
    args = ap.parse_args()
    import torch

    if args.orphan:
        orphan(torch, args.sleep_cycles * 1000)

    torch.cuda.init()
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, bufsize=1)
    assert child.stdout.readline().strip() == "ready"
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    out = {}
    for m in METHODS:
        lags, made, opened = [], [], []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            ev = torch.cuda.Event(interprocess=True, blocking=(m == "sync-blocking"))
            handle = ev.ipc_handle()  # (creates the event)
            made.append(time.perf_counter_ns() - t0)
            torch.cuda._sleep(args.sleep_cycles)  # the "forward", then the event behind it, then the handle out
            ev.record()
            child.stdin.write(json.dumps({"h": bytes(handle).hex(), "m": m}) + "\n")
            child.stdin.flush()
            opened.append(json.loads(child.stdout.readline())["opened"])
            while not ev.query():
                pass
            done = time.perf_counter_ns()
            wake = json.loads(child.stdout.readline())["wake"]
            lags.append((wake - done) / 1e3)
        lags.sort()
        out[m] = {"lag_us_p50": statistics.median(lags), "lag_us_p90": lags[int(0.9 * (len(lags) - 1))],
                  "lag_us_min": lags[0], "make_export_us_p50": statistics.median(made) / 1e3,
                  "open_us_p50": statistics.median(opened) / 1e3}
        print(f"{m:14s} wake lag p50 {out[m]['lag_us_p50']:8.1f} us  p90 {out[m]['lag_us_p90']:8.1f}  "
              f"min {out[m]['lag_us_min']:8.1f}   make+export {out[m]['make_export_us_p50']:7.1f} us  "
              f"open {out[m]['open_us_p50']:7.1f} us", flush=True)
    child.stdin.close()
    child.wait(timeout=30)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
