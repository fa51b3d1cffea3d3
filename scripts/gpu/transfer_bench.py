"""KV of a 4,096-token prompt moved prefill -> decode through the cuda_ipc backend, next to a device copy.

Two processes on one GPU (this one sends, a child receives), each with a Llama-3-8B-shaped KV pool
(32 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks: 128 KiB of KV per token, 2 MiB per block).
A 4,096-token prompt's 256 blocks (512 MiB) move through the real backend objects (``make_backend``),
as a prefill worker sends them: ``send()`` is called right after the forward that writes the KV was
enqueued, here a ``--forward-ms`` kernel (``torch.cuda._sleep``) on the sender's stream. The time that
counts is from the moment the KV is ready (the device passed the end of that forward: an event recorded
behind it, waited for by this process) to the receiver's DONE (its token final: bytes landed and fenced,
the sender's abort board checked) and to the sender's DONE (the Reply read); median of ``--reps``
transfers, for two placements: both sides' blocks contiguous (one run, one copy) and scattered (random
blocks, coalesced runs). One more row sends with an idle GPU (no forward to hide behind): ``send()`` to
DONE, the whole control plane exposed.

The baseline is a plain device-to-device copy of the same 512 MiB inside this process, timed with CUDA
events in the same run. Rates are counted as the issue counts a copy: bytes read + bytes written (2x the
payload), for the copy and for the transfer alike.

Scattered placements are copied several ways on the receiver, over the same placements: one launch of the
Triton copy kernel over all pieces in each of its launch geometries (``cuda_ipc_kernel.VARIANTS``; what
``CudaOps`` does with more than ``FEW_PIECES`` pieces, ``DEFAULT_VARIANT`` unless told), then
``torch._foreach_copy_``, and one ``copy_`` per piece. Each row reports the times above and the data path
alone (the receiver's copies, CUDA events around them), and a breakdown of where the time goes: both sides'
``Stamps`` (perf_counter_ns, one clock for both processes), stage by stage, from the KV being ready. The
"copy kernel alone" rows time each variant in this process over the same scattered placements, ``--reps``
prepared launches back to back between two CUDA events: the kernel's own rate.

    python scripts/gpu/transfer_bench.py [--reps 10] [--pool-blocks 1024] [--forward-ms 5]

CUDA only; about 30 s on an H200 (most of it the child's start and Triton's first compile).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import textwrap
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LAYERS, KV_HEADS, HEAD_DIM, ELEM, BLOCK = 32, 8, 128, 2, 16
TOKEN_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * ELEM  # 131,072
BLOCK_BYTES = TOKEN_BYTES * BLOCK  # 2 MiB
PROMPT = 4096

RECEIVER = textwrap.dedent("""
    import json, sys, threading, time
    import torch
    from xpyd.transfer import cuda_ipc_device, cuda_ipc_kernel, make_backend
    from xpyd.transfer.base import Region
    from xpyd.transfer.cuda_ipc_stamps import Stamps
    nbytes = int(sys.argv[1])
    pool = torch.zeros(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    backend = make_backend("cuda_ipc", io_timeout=60.0)
    print(json.dumps(backend.register(pool).to_dict()), flush=True)
    backend.stamps = Stamps()
    runs = backend._ops._runs  # (what CudaOps picked for many pieces: the kernel, or foreach without Triton)
    kernel = runs is not cuda_ipc_kernel.copy_runs_foreach
    tokens, watched = {}, {}

    def watch(tid, event):  # when this process learns that the sender's forward ended (a thread asleep on it)
        event.synchronize()
        watched[tid] = time.perf_counter_ns()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "mode":  # how the receiver copies many pieces
            mode = cmd["mode"]
            cuda_ipc_device.FEW_PIECES = 1 << 40 if mode == "copy_" else 2
            if mode == "foreach" or (mode in cuda_ipc_kernel.VARIANTS and not kernel):
                backend._ops._runs = cuda_ipc_kernel.copy_runs_foreach
            elif mode in cuda_ipc_kernel.VARIANTS:
                backend._ops._runs = cuda_ipc_kernel.Runs(mode)
            out = {"runs": backend._ops._runs.__name__}
        elif cmd["op"] == "watch":
            event = torch.cuda.Event.from_ipc_handle(torch.device("cuda", 0), bytes.fromhex(cmd["h"]))
            threading.Thread(target=watch, args=(cmd["id"], event), daemon=True).start()
            out = {}
        elif cmd["op"] == "expect":
            tokens[cmd["id"]] = backend.expect(cmd["id"], [Region(*r) for r in cmd["dst"]],
                                               secret=bytes.fromhex(cmd["secret"]))
            out = {}
        else:  # "check": the first and last bytes of each dst run, to prove the bytes landed; the stamps
            tok = tokens.pop(cmd["id"])
            tok.wait(60)
            flat = pool.view(torch.uint8)
            stages, device_s = backend.stamps.take(cmd["id"])
            out = {"state": tok.state().name, "error": tok.error, "stages": stages, "device_s": device_s,
                   "watched": watched.pop(cmd["id"], None),
                   "sample": [int(flat[o]) ^ int(flat[o + n - 1]) for o, n in cmd["dst"]]}
        print(json.dumps(out), flush=True)
    backend.close()
""")

# the stages of a transfer in causal order (each side's clock is CLOCK_MONOTONIC: one clock for both)
ORDER = [("sender", "send", "send() called (forward enqueued)"), ("sender", "offered", "Offer written"),
         ("receiver", "claimed", "offer read, MAC checked, claimed"),
         ("receiver", "opened", "handles open, board mapped"), ("receiver", "prepared", "copy prepared"),
         ("bench", "ready", "the forward done: KV ready (watchers)"), ("receiver", "ready", "receiver woke (sender's event)"),
         ("receiver", "launching", "stream set up (wait, start event)"), ("receiver", "enqueued", "copies enqueued"),
         ("receiver", "synced", "copy stream synced"), ("receiver", "done", "board checked: receiver DONE"),
         ("sender", "done", "Reply read: sender DONE")]


def runs(blocks: list[int]) -> list[tuple[int, int]]:
    """Byte runs of ``blocks`` (sorted), adjacent ones coalesced, as the workers' ``byte_ranges``."""
    out: list[list[int]] = []
    for b in sorted(blocks):
        if out and out[-1][0] + out[-1][1] == b * BLOCK_BYTES:
            out[-1][1] += BLOCK_BYTES
        else:
            out.append([b * BLOCK_BYTES, BLOCK_BYTES])
    return [(o, n) for o, n in out]


def sleep_cycles(torch, ms: float) -> int:
    """The ``torch.cuda._sleep`` argument that keeps the device busy for about ``ms`` milliseconds."""
    if ms <= 0:
        return 0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # (warm)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return max(1, int(10_000_000 * ms / start.elapsed_time(end)))


def device_copy_seconds(torch, nbytes: int, reps: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return statistics.median(times)


LABEL = {"foreach": ", _foreach_copy_", "copy_": ", one copy_ per piece"}


def paths(variants: tuple[str, ...], default: str) -> list[tuple[str, str]]:
    """Contiguous, then scattered through each kernel variant (the default first), foreach and copy_."""
    kernels = (default,) + tuple(v for v in variants if v != default)
    return [("contiguous", default)] + [("scattered", v) for v in kernels + ("foreach", "copy_")]


def kernel_alone(torch, nbytes: int, placements, reps: int) -> list[tuple[str, float, int]]:
    """Each copy kernel variant over the scattered placements in this process: ``reps`` launches back to
    back between two CUDA events; (label, seconds per launch, programs per launch)."""
    from xpyd.transfer import cuda_ipc_kernel
    from xpyd.transfer.base import Region
    from xpyd.transfer.cuda_ipc import piece_table

    if cuda_ipc_kernel.why_unavailable(torch.device("cuda")):
        return []
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    out = []
    tables = [piece_table([Region(*r) for r in s], [Region(*r) for r in d]) for s, d in placements]
    for variant in cuda_ipc_kernel.VARIANTS:
        runs = cuda_ipc_kernel.Runs(variant)
        launches = [runs.prepare(dst, src, table) for table in tables]  # (tables uploaded before timing)
        programs = launches[0]()  # compile
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(reps):
            launches[i % len(launches)]()
        end.record()
        end.synchronize()
        out.append((f"copy kernel alone, {variant} ({programs} programs, x{reps})",
                    start.elapsed_time(end) / 1e3 / reps, programs))
    del src, dst
    return out


def host_costs(torch, nbytes: int, n: int = 200) -> list[tuple[str, float]]:
    """What the steps a transfer chains cost on this host's CPU, in this process, median of ``n`` (seconds):
    a hand-off between two threads (a SimpleQueue, as ``send()`` to the sender thread) and a message
    between two threads over TCP loopback (as each control message), each one way (half a round trip);
    a CUDA event recorded on an idle stream and waited for (as the sender's mark); the host time of the
    call that enqueues one device copy of ``nbytes`` (as the receiver's contiguous copy)."""
    import socket
    import threading
    from queue import SimpleQueue

    out = []
    there, back = SimpleQueue(), SimpleQueue()

    def echo_queue() -> None:
        while (item := there.get()) is not None:
            back.put(item)

    def timed(step) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            step()
            times.append(time.perf_counter_ns() - t0)
        return statistics.median(times) / 1e9

    worker = threading.Thread(target=echo_queue, daemon=True)
    worker.start()
    out.append(("thread hand-off (SimpleQueue), one way", timed(lambda: (there.put(1), back.get())) / 2))
    there.put(None)
    worker.join()
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
        for sock in (client, peer):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def echo_socket() -> None:
            while data := peer.recv(64):
                peer.sendall(data)

        worker = threading.Thread(target=echo_socket, daemon=True)
        worker.start()
        out.append(("TCP loopback message between threads, one way",
                    timed(lambda: (client.sendall(b"x"), client.recv(64))) / 2))
        client.close()
        worker.join()
        peer.close()
    if torch.cuda.is_available():
        def mark() -> None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream())
            event.synchronize()

        out.append(("CUDA event created, recorded, waited for (idle GPU)", timed(mark)))
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        times = []
        for _ in range(10):
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            dst.copy_(src, non_blocking=True)
            times.append(time.perf_counter_ns() - t0)
        torch.cuda.synchronize()
        out.append((f"enqueue one copy_ of {nbytes >> 20} MiB (host time of the call)", statistics.median(times) / 1e9))
        del src, dst
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--pool-blocks", type=int, default=1024, help="blocks in each side's pool (2 MiB each)")
    ap.add_argument("--forward-ms", type=float, default=5.0, help="the forward send() follows (a sleep kernel)")
    ap.add_argument("--spin", action="store_true", help="the sender's events make their waiter spin, not sleep")
    args = ap.parse_args()
    import torch

    from xpyd.transfer import cuda_ipc_device

    cuda_ipc_device.BLOCKING_MARKS = not args.spin

    from xpyd.transfer import cuda_ipc_kernel, make_backend
    from xpyd.transfer.auth import new_secret
    from xpyd.transfer.base import BackendDescriptor, Region
    from xpyd.transfer.cuda_ipc import pieces
    from xpyd.transfer.cuda_ipc_device import FEW_PIECES
    from xpyd.transfer.cuda_ipc_stamps import Stamps

    if not torch.cuda.is_available():
        raise SystemExit("transfer_bench needs a CUDA GPU")
    prompt_blocks = PROMPT // BLOCK
    if args.pool_blocks < 2 * prompt_blocks:
        raise SystemExit(f"--pool-blocks must be at least {2 * prompt_blocks}")
    nbytes = args.pool_blocks * BLOCK_BYTES
    payload = prompt_blocks * BLOCK_BYTES
    pool = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    pool.view(torch.uint8).copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda"))

    child = subprocess.Popen([sys.executable, "-c", RECEIVER, str(nbytes)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=ROOT)

    def ask(**cmd) -> dict:
        child.stdin.write(json.dumps(cmd) + "\n")
        child.stdin.flush()
        line = child.stdout.readline()
        if not line:
            raise SystemExit(f"the receiver process exited ({child.poll()})")
        return json.loads(line)

    sender = make_backend("cuda_ipc", io_timeout=60.0)
    sender.register(pool)
    sender.stamps = Stamps()
    rng = np.random.default_rng(0)
    scattered = [(runs(rng.choice(args.pool_blocks, prompt_blocks, replace=False).tolist()),
                  runs(rng.choice(args.pool_blocks, prompt_blocks, replace=False).tolist()))
                 for _ in range(args.reps + 1)]  # the same placements for every way of copying them
    contiguous = [(runs(list(range(prompt_blocks))), runs(list(range(prompt_blocks))))] * (args.reps + 1)
    rows, breakdowns, first_open = [], {}, None
    try:
        line = child.stdout.readline()
        if not line:
            raise SystemExit(f"the receiver process exited ({child.poll()})")
        peer = BackendDescriptor.from_dict(json.loads(line))
        host = pool.view(torch.uint8).cpu().numpy()  # the sender's bytes, for the receiver's check
        cycles = sleep_cycles(torch, args.forward_ms)
        for placement, mode, forward in [(p, m, cycles) for p, m in paths(cuda_ipc_kernel.VARIANTS,
                                                                           cuda_ipc_kernel.DEFAULT_VARIANT)] + \
                [("contiguous", cuda_ipc_kernel.DEFAULT_VARIANT, 0)]:
            how = ask(op="mode", mode=mode)["runs"]
            times, device, stages = [], [], []
            for rep, (src, dst) in enumerate(scattered if placement == "scattered" else contiguous):
                tid, secret = f"{placement}-{mode}-{forward}-{rep}", new_secret()
                ask(op="expect", id=tid, dst=dst, secret=secret.hex())
                torch.cuda.synchronize()
                if forward:
                    torch.cuda._sleep(forward)  # the forward that writes the KV ...
                ready = torch.cuda.Event(blocking=True, interprocess=True)  # (a waiter sleeps)
                ready.record()
                tok = sender.send(tid, [Region(*r) for r in src], peer, [Region(*r) for r in dst], secret=secret)
                ask(op="watch", id=tid, h=bytes(ready.ipc_handle()).hex())  # (the receiver's process watches too)
                ready.synchronize()  # ... has finished on the device: the KV is ready
                t_ready = time.perf_counter_ns()
                tok.wait(60)
                if tok.state().name != "DONE":
                    raise SystemExit(f"transfer {tid} {tok.state().name}: {tok.error}")
                check = ask(op="check", id=tid, dst=dst)
                flat = np.concatenate([host[o: o + n] for o, n in src])
                want, at = [], 0
                for _, n in dst:
                    want.append(int(flat[at]) ^ int(flat[at + n - 1]))
                    at += n
                if check["state"] != "DONE" or check["sample"] != want:
                    raise SystemExit(f"transfer {tid}: the receiver saw {check['state']}, bytes "
                                     f"{'right' if check['sample'] == want else 'WRONG'}")
                both = {"sender": sender.stamps.take(tid)[0], "receiver": check["stages"],
                        "bench": {"ready": min(t_ready, check["watched"] or t_ready)}}
                if first_open is None:  # the connection's first offer opens the sender's handle
                    first_open = (both["receiver"]["opened"] - both["receiver"]["claimed"]) / 1e6
                if rep:  # the first one (of each path) is not timed
                    # the KV is ready when the device passed the forward: the earlier of the two processes'
                    # wake-ups on an event behind it says so (each ~1 us late, when its thread is free to)
                    start = both["bench"]["ready"] if forward else both["sender"]["send"]
                    times.append(((both["receiver"]["done"] - start) / 1e9, (both["sender"]["done"] - start) / 1e9))
                    device.append(check["device_s"])
                    stages.append({(side, stage): ns - start for side, row in both.items() for stage, ns in row.items()})
            n = len(list(pieces([Region(*r) for r in src], [Region(*r) for r in dst])))
            how = f"{n} copies" if n <= FEW_PIECES or mode == "copy_" else f"{n} pieces, {how}"
            label = f"cuda_ipc, {placement}{LABEL.get(mode, '')} ({how})"
            if not forward:
                label = f"cuda_ipc, {placement}, idle GPU: send() to DONE ({how})"
            rows.append((label, statistics.median(t[0] for t in times), statistics.median(t[1] for t in times),
                         statistics.median(device)))
            breakdowns[label] = {key: statistics.median(s[key] for s in stages) / 1e6 for key in stages[0]}
        t = device_copy_seconds(torch, payload, args.reps)
    finally:
        sender.close()
        child.stdin.close()
        child.wait(30)
    alone = kernel_alone(torch, nbytes, scattered[1:], args.reps)
    costs = host_costs(torch, payload)
    report(torch.cuda.get_device_name(), args.reps, payload, rows, t, breakdowns, first_open, alone, costs,
           args.forward_ms)


def report(name: str, reps: int, payload: int, rows, copy_s: float, breakdowns, first_open: float,
           alone=(), costs=(), forward_ms: float = 0.0) -> None:
    print(f"\n{name}: {PROMPT}-token prompt, Llama-3-8B KV shape ({TOKEN_BYTES // 1024} KiB/token), "
          f"{payload >> 20} MiB; median of {reps}; send() right behind a {forward_ms:g} ms forward; the "
          f"receiver {'sleeps' if __import__('xpyd.transfer.cuda_ipc_device').transfer.cuda_ipc_device.BLOCKING_MARKS else 'spins'} on the sender's event")
    copy_rw = 2 * payload / copy_s

    def rate(t: float) -> str:
        return f"{t * 1e3:7.3f} {2 * payload / t / 1e9:7.0f} {2 * payload / t / copy_rw:5.0%}"

    print(f"{'path':66} {'KV ready -> receiver DONE':>21} {'-> sender DONE':>21} {'data path alone':>21}")
    print(f"{'':66} {'ms  r+w GB/s    vs':>21} {'ms  r+w GB/s    vs':>21} {'ms  r+w GB/s    vs':>21}")
    for label, recv_t, send_t, dev in rows:
        print(f"{label:66} {rate(recv_t)} {rate(send_t)} {rate(dev)}")
    print(f"{'device copy, one process (copy_, CUDA events)':66} {'':21} {'':21} {rate(copy_s)}")
    for label, dev, _ in alone:
        print(f"{label:66} {'':21} {'':21} {rate(dev)}")
    print("KV ready: the forward send() follows has finished on the device (the earlier of this process's and the\n"
          "receiver's wake-up on an event behind it); receiver DONE: its token final (bytes landed and fenced, the sender's board checked); sender\n"
          "DONE: the Reply read. The idle-GPU row counts from send() instead (no forward: the control plane is\n"
          "exposed). data path alone: the receiver's copies, CUDA events around them. r+w: bytes read + written\n"
          "(2x the payload), as a device copy's bandwidth is counted; vs: / the device copy.")
    for label, stages in breakdowns.items():
        print(f"\nwhere the time goes, {label} (ms since the KV was ready, or since send() when idle; median)")
        prev = None
        listed = {(side, stage) for side, stage, _ in ORDER}
        extra = [(side, stage, "(a finer step of the copy)") for side, stage in stages if (side, stage) not in listed]
        known = [row for row in ORDER if (row[0], row[1]) in stages]
        for side, stage, what in sorted(known + extra, key=lambda row: stages[(row[0], row[1])]):
            at = stages[(side, stage)]
            step = "" if prev is None else f"{at - prev:+8.3f}"
            print(f"  {side:9} {stage:15} {what:36} {at:8.3f} {step}")
            prev = at
    print(f"\nfirst offer of the connection: opening the sender's handle took {first_open:.3f} ms (not timed above)")
    if costs:
        print("\nhost costs of the steps a transfer chains (this process, median):")
        for what, seconds in costs:
            print(f"  {what:62} {seconds * 1e6:8.1f} us")


if __name__ == "__main__":
    main()
