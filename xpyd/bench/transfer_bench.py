"""`xpyd bench transfer`: a transfer backend between two processes, next to baselines from the same run.

Three measurements, one after the other, on the same machine and buffers of the same sizes:

- backend: two spawned processes, each with its own backend (``make_backend(name)``) and a registered
  buffer of the largest size. The receiver ``expect``s every transfer up front and sends its descriptor
  through a ``multiprocessing.Pipe`` (control only; the payload never goes through it). The sender
  times each ``send()`` until its token is DONE, i.e. the receiver acknowledged that every byte landed.
  Each transfer moves the first ``size`` bytes, split into ``regions`` contiguous regions on both sides
  (1 region is the KV-pool case: a request's KV is one contiguous slot).
- memcpy: ``np.copyto`` between two preallocated buffers in this process (cache-hot; small sizes are
  copied several times per sample to get above timer noise).
- socket: two spawned processes on TCP loopback (TCP_NODELAY, kernel-default buffers); the sender
  ``sendmsg``s a memoryview of its buffer, the receiver ``recv_into``s a preallocated buffer and
  returns a 1-byte ack, which ends the sample (the same "all bytes landed" point as the backend's ack).
  After the sized transfers the same connection does a 1-byte ping-pong (a few untimed, then 300 timed
  round trips): ``socket_rtt_s``, the cost of one message to the other process and one back.

``round_trip_bound`` = memcpy / (memcpy + round trip) per size: the best backend/memcpy ratio a design
that waits for one cross-process round trip per transfer can reach, even if its copy is as fast as this
run's memcpy. At 1 MiB the copy takes tens of us and the round trip about as long or longer, so a
backend/memcpy well below 1 there is the round trip, not the copy; at large sizes the bound nears 1.

Every size gets one untimed warm-up transfer (connection setup, first-touch page faults), then
``repeats`` timed ones. GB/s is decimal: 1e9 bytes / the median seconds. The receivers check the bytes
that landed against the sender's pattern at the end.

``--sender ADDR[@NETNS]`` / ``--receiver ADDR[@NETNS]`` run a side elsewhere than 127.0.0.1: it binds and
advertises ADDR, inside network namespace NETNS if given (root; e.g. two hosts of scripts/netbed.py), so
the backend and the socket baseline cross the same real link (scripts/bench_netbed.py does this over a
shaped one).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from typing import Any, Callable, Sequence

from xpyd.bench.transfer_procs import (
    _RECV_FILL,
    RTT_SAMPLES,
    WARMUP,
    Place,
    _backend_receiver,
    _backend_sender,
    _pattern,
    _run_pair,
    _socket_receiver,
    _socket_sender,
    format_size,
)

MiB = 1 << 20
DEFAULT_SIZES = (1 * MiB, 16 * MiB, 64 * MiB)
DEFAULT_REPEATS = 5
_MEMCPY_MIN_BYTES = 4 * MiB  # bytes copied per memcpy sample at least (inner loop for small sizes)
_MEMCPY_MAX_LOOPS = 1000

# Constructor keywords for the backends when both ends are on this host.
_BACKEND_KWARGS: dict[str, dict[str, Any]] = {"tcp": {"host": "127.0.0.1"}, "shm": {"host": "127.0.0.1"},
                                               "auto": {"host": "127.0.0.1"}}
# Backends whose receiver copies (shm's copy threads, ``xpyd.transfer.parallel_copy``).
_COPYING = {"shm", "auto"}
# Backends that cannot move bytes between two processes.
_IN_PROCESS_ONLY = {"fake": "the 'fake' backend only moves bytes inside one process (FakeNetwork)"}

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": MiB, "MB": MiB, "MIB": MiB,
          "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


# -- sizes ----------------------------------------------------------------------


def parse_size(text: str) -> int:
    """'64K' / '1M' / '1MiB' / '1048576' -> bytes (K, M, G are binary: KiB, MiB, GiB)."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(text))
    unit = m and m.group(2).upper()
    if not m or unit not in _UNITS:
        raise ValueError(f"invalid size {text!r}; use e.g. 65536, 64K, 1M, 1G (binary units)")
    n = int(m.group(1)) * _UNITS[unit]
    if n <= 0:
        raise ValueError(f"size {text!r} must be > 0")
    return n


def parse_sizes(text: str) -> list[int]:
    """'1M,16M,64M' -> [1048576, 16777216, 67108864]."""
    parts = [p for p in str(text).split(",") if p.strip()]
    if not parts:
        raise ValueError("no sizes given; use e.g. 1M,16M,64M")
    return [parse_size(p) for p in parts]


def _sizes_arg(text: str) -> list[int]:
    try:
        return parse_sizes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_place(text: str) -> Place:
    """'10.77.1.2' / '10.77.1.2@xnb-bed-b' / '::1' -> Place(address, network namespace or None)."""
    host, sep, netns = str(text).partition("@")
    host = host.strip().strip("[]")
    if not host or (sep and not netns.strip()) or "/" in netns:
        raise ValueError(f"invalid side {text!r}; use ADDR or ADDR@NETNS, e.g. 10.77.1.2@xnb-bed-b")
    return Place(host, netns.strip() or None)


def _place_arg(text: str) -> Place:
    try:
        return parse_place(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# -- measurements ----------------------------------------------------------------------


def _memcpy_times(sizes: list[int], reps: int) -> dict[int, tuple[list[float], int]]:
    """Seconds per copy (repeats samples after the warm-up) and inner loops per sample, by size."""
    import numpy as np

    src = _pattern(max(sizes))
    dst = np.full(len(src), _RECV_FILL, dtype=np.uint8)
    out = {}
    for size in sizes:
        a, b = src[:size], dst[:size]
        loops = min(_MEMCPY_MAX_LOOPS, max(1, math.ceil(_MEMCPY_MIN_BYTES / size)))
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(loops):
                np.copyto(b, a)
            samples.append((time.perf_counter() - t0) / loops)
        out[size] = (samples[WARMUP:], loops)
    if not np.array_equal(dst, src):
        raise RuntimeError("memcpy baseline: copy differs from the source")
    return out


def _check_backend(backend: str, copy_threads: int | None = None) -> dict:
    from xpyd.transfer import make_backend

    if backend in _IN_PROCESS_ONLY:
        raise ValueError(f"cannot benchmark backend {backend!r} between two processes: "
                         f"{_IN_PROCESS_ONLY[backend]}")
    kwargs = dict(_BACKEND_KWARGS.get(backend, {}))
    if backend in _COPYING:  # the receiver's copy threads: as asked, else the backend's default, recorded
        if copy_threads is not None and (type(copy_threads) is not int or not 1 <= copy_threads <= 16):
            raise ValueError(f"copy_threads must be an int in 1..16, got {copy_threads!r}")
        from xpyd.transfer.parallel_copy import default_threads

        kwargs["copy_threads"] = copy_threads or default_threads()
    elif copy_threads is not None:
        raise ValueError(f"--copy-threads applies to {' and '.join(sorted(_COPYING))} only, not {backend!r}")
    make_backend(backend, **kwargs).close()  # unknown name / missing dependency: fail here, clearly
    return kwargs


def _host_info() -> dict:
    import numpy as np

    info = {"platform": platform.platform(), "machine": platform.machine(), "python": platform.python_version(),
            "numpy": np.__version__, "cpu_count": os.cpu_count()}
    try:
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        info["loadavg_1m"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    return info


def _describe(place: Place) -> str:
    return place.host + (f"@{place.netns}" if place.netns else "")


def _gbps(size: int, seconds: float) -> float:
    return size / seconds / 1e9


def _round_trip_bound(memcpy_s: float, rtt_s: float) -> float:
    """The best backend/memcpy ratio for a transfer that copies at memcpy speed and also waits one round
    trip: time memcpy_s + rtt_s instead of memcpy_s."""
    return memcpy_s / (memcpy_s + rtt_s)


def _p10(samples: Sequence[float]) -> float:
    """The 10th percentile (the fast end, less scheduler noise than the median, unlike min not one outlier)."""
    return statistics.quantiles(samples, n=10, method="inclusive")[0]


def measure(
    backend: str = "tcp",
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = DEFAULT_REPEATS,
    *,
    regions: int = 1,
    copy_threads: int | None = None,
    timeout: float | None = None,
    progress: Callable[[str], None] | None = None,
    sender: Place | None = None,
    receiver: Place | None = None,
) -> dict:
    """Measure ``backend`` between two processes plus memcpy and raw-socket baselines; a JSON-able dict.

    ``sizes`` are bytes per transfer, ``repeats`` timed transfers per size (after one warm-up),
    ``regions`` regions per transfer, ``timeout`` seconds for each two-process phase (default: from
    the sizes), ``sender`` / ``receiver`` where each side runs (default: 127.0.0.1 in this namespace; the
    socket baseline runs there too). Raises ValueError for bad arguments or an unknown backend, RuntimeError/TimeoutError
    if a phase fails (its processes are stopped first).
    """
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"backend must be a non-empty str, got {backend!r}")
    sizes = list(sizes)
    if not sizes or any(type(s) is not int or s <= 0 for s in sizes):
        raise ValueError(f"sizes must be positive ints (bytes), got {sizes!r:.200}")
    if type(repeats) is not int or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if type(regions) is not int or regions < 1 or regions > min(sizes):
        raise ValueError(f"regions must be an int in 1..{min(sizes)} (the smallest size), got {regions!r}")
    reps = WARMUP + repeats
    if timeout is None:  # generous: spawning + 3 copies of everything at >= 20 MB/s
        timeout = 60.0 + 3 * reps * sum(sizes) / 20e6
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0, got {timeout!r}")
    say = progress or (lambda _msg: None)
    kwargs = _check_backend(backend, copy_threads)
    places = None if sender is None and receiver is None else {"sender": sender or Place(),
                                                                "receiver": receiver or Place()}
    sides = {role: (places or {}).get(role, Place())._asdict() for role in ("sender", "receiver")}
    where = ("TCP loopback" if places is None else
             f"TCP {_describe(places['sender'])} -> {_describe(places['receiver'])}")
    max_size = max(sizes)
    host = _host_info()

    say(f"memcpy: {len(sizes)} sizes x {repeats} repeats")
    memcpy = _memcpy_times(sizes, reps)
    say(f"socket: {where} between two processes")
    sock = _run_pair("socket baseline", _socket_receiver, _socket_sender,
                     {"max_size": max_size, "sizes": sizes, "reps": reps}, timeout, places)
    say(f"{backend}: backend between two processes, {regions} region(s) per transfer")
    back = _run_pair(f"{backend} backend", _backend_receiver, _backend_sender,
                     {"backend": backend, "kwargs": kwargs, "max_size": max_size, "sizes": sizes, "reps": reps,
                      "regions": regions}, timeout, places)

    rtt_s = sock["sender"]["rtt_samples_s"]
    rtt_med = statistics.median(rtt_s)
    results = []
    for size in sizes:
        b_s = back["sender"]["times"][size]
        s_s = sock["sender"]["times"][size]
        m_s, loops = memcpy[size]
        b_med, s_med, m_med = statistics.median(b_s), statistics.median(s_s), statistics.median(m_s)
        gbps, sock_gbps, mem_gbps = _gbps(size, b_med), _gbps(size, s_med), _gbps(size, m_med)
        results.append({
            "size_bytes": size,
            "gbps": gbps,
            "memcpy_gbps": mem_gbps,
            "socket_gbps": sock_gbps,
            "backend_vs_socket": gbps / sock_gbps,
            "backend_vs_memcpy": gbps / mem_gbps,
            "regions": regions,
            "best_gbps": _gbps(size, min(b_s)),
            "memcpy_best_gbps": _gbps(size, min(m_s)),
            "socket_best_gbps": _gbps(size, min(s_s)),
            "median_s": b_med,
            "min_s": min(b_s),
            "memcpy_median_s": m_med,
            "socket_median_s": s_med,
            "samples_s": b_s,
            "memcpy_samples_s": m_s,
            "socket_samples_s": s_s,
            "memcpy_loops_per_sample": loops,
            "round_trip_bound": _round_trip_bound(m_med, rtt_med),
        })
    return {
        "backend": backend,
        "results": results,
        "units": "GB/s = 1e9 bytes / median seconds (decimal GB); best_* use the fastest repeat",
        "repeats": repeats,
        "warmup": WARMUP,
        "regions": regions,
        "backend_kwargs": kwargs,
        "receiver_copy_threads": back["receiver"].get("copy_threads"),
        "host": host,
        "sides": sides,
        "socket_path": where,
        "socket_rtt_s": rtt_med,
        "socket_rtt_p10_s": _p10(rtt_s),
        "method": {
            "backend": f"two spawned processes, make_backend({backend!r}) each, a registered buffer of "
                       f"{max_size} B each; receiver expect()s, sender times send() -> token DONE (receiver "
                       f"acked all bytes); {regions} contiguous region(s) per transfer; control over a Pipe",
            "memcpy": "numpy.copyto between two preallocated buffers in one process (cache-hot)",
            "socket": f"two spawned processes, {where}, TCP_NODELAY, kernel-default buffers; sendmsg of a "
                      "memoryview, recv_into a preallocated buffer, timed until a 1-byte ack",
            "verified": "the receivers compare the bytes that landed with the sender's pattern",
            "round_trip_bound": f"memcpy_median_s / (memcpy_median_s + socket_rtt_s), socket_rtt_s the median of "
                                f"{RTT_SAMPLES} 1-byte ping-pongs on the socket baseline's connection: the best "
                                f"backend/memcpy a design that waits for one cross-process round trip per "
                                f"transfer can reach with this run's memcpy",
        },
    }


# -- CLI ------------------------------------------------------------------------------------


def format_table(report: dict) -> str:
    name = report["backend"]
    head = ["size", f"{name} GB/s", "memcpy GB/s", "socket GB/s", f"{name}/socket", f"{name}/memcpy", "bound"]
    rows = [[format_size(r["size_bytes"]), f"{r['gbps']:.2f}", f"{r['memcpy_gbps']:.2f}",
             f"{r['socket_gbps']:.2f}", f"{r['backend_vs_socket']:.2f}", f"{r['backend_vs_memcpy']:.3f}",
             f"{r['round_trip_bound']:.3f}"]
            for r in report["results"]]
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    lines = [
        f"transfer backend {name!r} between two processes; {report['regions']} region(s) per transfer; "
        + (f"{report['backend_kwargs']['copy_threads']} copy thread(s); "
           if "copy_threads" in report.get("backend_kwargs", {}) else "") +
        f"median of {report['repeats']} repeats after {report['warmup']} warm-up; GB/s = 1e9 bytes/s",
        " | ".join(h.rjust(w) for h, w in zip(head, widths)),
        "-+-".join("-" * w for w in widths),
    ]
    lines += [" | ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    path = report.get("socket_path", "TCP loopback")
    lines.append(f"round trip (1-byte ping-pong, two Python processes, {path}): "
                 f"median {report['socket_rtt_s'] * 1e6:.1f} us, p10 {report['socket_rtt_p10_s'] * 1e6:.1f} us")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="tcp", help="transfer backend to measure (default: tcp)")
    parser.add_argument("--sizes", type=_sizes_arg, default="1M,16M,64M",
                        help="comma-separated bytes per transfer; K/M/G are KiB/MiB/GiB (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                        help="timed transfers per size, after one warm-up (default: %(default)s)")
    parser.add_argument("--copy-threads", type=int, default=None, metavar="N",
                        help="shm/auto: threads the receiver copies one large (>= 8 MiB) piece with "
                             "(default: the backend's, 2 on a machine with 2+ cores; recorded in the JSON)")
    parser.add_argument("--regions", type=int, default=1,
                        help="contiguous regions per transfer; 1 is the KV-pool case (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds allowed for each two-process phase (default: from the sizes)")
    parser.add_argument("--sender", type=_place_arg, default=None, metavar="ADDR[@NETNS]",
                        help="where the sending side runs: the address it binds, in network namespace NETNS "
                             "if given (root; default: 127.0.0.1 here)")
    parser.add_argument("--receiver", type=_place_arg, default=None, metavar="ADDR[@NETNS]",
                        help="where the receiving side runs, likewise (the socket baseline uses the same two)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON to PATH")


def run(args: argparse.Namespace) -> int:
    sizes = getattr(args, "sizes", None) or list(DEFAULT_SIZES)
    if isinstance(sizes, str):
        sizes = parse_sizes(sizes)
    try:
        report = measure(
            backend=getattr(args, "backend", "tcp"),
            sizes=sizes,
            repeats=getattr(args, "repeats", DEFAULT_REPEATS),
            regions=getattr(args, "regions", 1),
            copy_threads=getattr(args, "copy_threads", None),
            timeout=getattr(args, "timeout", None),
            sender=getattr(args, "sender", None),
            receiver=getattr(args, "receiver", None),
            progress=lambda msg: print(f"bench transfer: {msg}", file=sys.stderr, flush=True),
        )
    except ValueError as e:
        print(f"xpyd bench transfer: error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError, OSError, ImportError) as e:
        print(f"xpyd bench transfer: failed: {e}", file=sys.stderr)
        return 1
    print(format_table(report), flush=True)
    path = getattr(args, "json", None)
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        print(f"wrote {path}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="xpyd bench transfer", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
