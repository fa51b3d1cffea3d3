"""The child-process sides of `xpyd bench transfer` and the helper that runs them in pairs.

Each measurement between two processes is a receiver and a sender, spawned by ``_run_pair`` and joined by
a ``multiprocessing.Pipe`` for control messages only (descriptors, ports, "finished"); the payload moves
through the backend under test or a TCP loopback socket. Every child reports ("ok", result) or
("error", message) to the parent on its own pipe; ``_run_pair`` stops both processes when either fails or
the phase times out. The sender fills its buffer with ``_pattern``; the receiver checks what landed with
``_check_landed``. Orchestration, the memcpy baseline and the report live in ``transfer_bench``.

By default both sides run on 127.0.0.1. A ``Place`` puts a side elsewhere: its address (what it binds and
advertises) and, optionally, a network namespace (``/run/netns/NAME``, e.g. a host of scripts/netbed.py)
the child enters before anything else, so the payload crosses a real link between two "hosts" while
the control pipe still joins the processes.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import multiprocessing.connection
import os
import socket
import sys
import time
import traceback
from typing import Any, Callable, NamedTuple

MiB = 1 << 20
WARMUP = 1
OP_TIMEOUT = 60.0  # any single wait inside a child process (peer message, transfer, socket I/O)
_PATTERN_SEED = 20240601
_PATTERN_BLOCK = 4099  # a prime, so the pattern never lines up with chunk or page boundaries
_RECV_FILL = 0x55
RTT_WARMUP = 20  # untimed ping-pongs first (the first also waits out the receiver's byte check)
RTT_SAMPLES = 300  # timed 1-byte round trips: ~30 ms at ~100 us each, plenty for a median and a p10
LOOPBACK = "127.0.0.1"
_CLONE_NEWNET = 0x40000000


class Place(NamedTuple):
    """Where one side of a measurement runs: the address it binds (and advertises), and the network
    namespace it enters first (None: the parent's)."""

    host: str = LOOPBACK
    netns: str | None = None


def enter_netns(name: str) -> None:
    """Move the calling thread (a child's only one, just spawned) into network namespace ``name``
    (``ip netns`` names it under /run/netns; needs root). Threads it starts later inherit it."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"invalid network namespace name {name!r}")
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if hasattr(os, "setns"):  # Python 3.12+
            os.setns(fd, _CLONE_NEWNET)
            return
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name!r}: {os.strerror(err)}")
    finally:
        os.close(fd)


def format_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _split(size: int, regions: int) -> list[tuple[int, int]]:
    """[0, size) as ``regions`` contiguous (offset, length) pairs of near-equal length."""
    base, extra = divmod(size, regions)
    out, off = [], 0
    for i in range(regions):
        length = base + (i < extra)
        out.append((off, length))
        off += length
    return out


def _pattern(n: int):
    import numpy as np

    block = np.random.default_rng(_PATTERN_SEED).integers(0, 256, _PATTERN_BLOCK, dtype=np.uint8)
    return np.resize(block, n)


def _check_landed(buf, n: int, what: str) -> None:
    import numpy as np

    if not np.array_equal(buf[:n], _pattern(n)):
        bad = int(np.argmax(buf[:n] != _pattern(n)))
        raise RuntimeError(f"{what}: received bytes differ from the sent ones (first at offset {bad})")


# -- child processes ---------------------------------------------------------------


def _peer_recv(conn, what: str, timeout: float = OP_TIMEOUT):
    if not conn.poll(timeout):
        raise TimeoutError(f"no {what} from the peer process within {timeout:g}s")
    try:
        return conn.recv()
    except EOFError:
        raise RuntimeError(f"the peer process exited before sending {what}") from None


def _child(fn: Callable, role: str, result_conn, peer_conn, kwargs: dict, netns: str | None = None) -> None:
    """Run ``fn(peer_conn, **kwargs)`` (in network namespace ``netns`` if given); report ("ok", result)
    or ("error", message) to the parent."""
    try:
        if netns is not None:
            enter_netns(netns)
        out = fn(peer_conn, **kwargs)
        result_conn.send(("ok", out))
    except BaseException as e:  # report everything, including KeyboardInterrupt, then exit
        print(f"xpyd bench transfer: {role} process failed:", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        try:
            result_conn.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
    finally:
        peer_conn.close()
        result_conn.close()


def _backend_buffer(b, size: int, fill):
    """A numpy array of ``size`` bytes for ``b`` to register: from the backend when it places its own
    memory (shm: a shared-memory segment), else ordinary process memory."""
    import numpy as np

    allocate = getattr(b, "allocate", None)
    if allocate is None:
        return np.array(fill(size), dtype=np.uint8)
    buf = np.frombuffer(allocate(size), dtype=np.uint8)
    buf[:] = fill(size)
    return buf


def _backend_receiver(peer, *, backend: str, kwargs: dict, max_size: int, sizes: list[int], reps: int,
                      regions: int, host: str | None = None) -> dict:
    import numpy as np

    from xpyd.transfer import Region, make_backend
    from xpyd.transfer.auth import new_secret

    b = make_backend(backend, **(kwargs if host is None else {**kwargs, "host": host}))
    try:
        buf = np.full(max_size, _RECV_FILL, dtype=np.uint8)  # receivers write into ordinary memory
        desc = b.register(memoryview(buf))
        tokens, secrets = [], {}  # (a worker sends each transfer's secret in its pull, over the signal plane)
        for size in sizes:
            dst = [Region(o, n) for o, n in _split(size, regions)]
            for i in range(reps):
                tid = f"bench-{size}-{i}"
                secrets[tid] = new_secret()
                tokens.append(b.expect(tid, dst, secret=secrets[tid]))
        peer.send(("ready", desc.to_dict(), secrets))
        msg = _peer_recv(peer, "the sender's 'finished'", OP_TIMEOUT * len(tokens))
        if msg != "finished":
            raise RuntimeError(f"unexpected message from the sender: {msg!r:.100}")
        for t in tokens:
            if not t.wait(OP_TIMEOUT) or not t.done():
                raise RuntimeError(f"receiver token {t!r} did not finish DONE")
        _check_landed(buf, max(sizes), f"{backend} backend")
        return {"tokens_done": len(tokens), "copy_threads": getattr(b, "copy_threads", None)}
    finally:
        b.close()


def _backend_sender(peer, *, backend: str, kwargs: dict, max_size: int, sizes: list[int], reps: int,
                    regions: int, host: str | None = None) -> dict:
    from xpyd.transfer import BackendDescriptor, Region, make_backend

    b = make_backend(backend, **(kwargs if host is None else {**kwargs, "host": host}))
    try:
        buf = _backend_buffer(b, max_size, _pattern)
        b.register(memoryview(buf))
        msg = _peer_recv(peer, "the receiver's descriptor")
        if not (isinstance(msg, tuple) and msg[0] == "ready"):
            raise RuntimeError(f"unexpected message from the receiver: {msg!r:.100}")
        peer_desc, secrets = BackendDescriptor.from_dict(msg[1]), msg[2]
        times: dict[int, list[float]] = {}
        for size in sizes:
            rs = [Region(o, n) for o, n in _split(size, regions)]
            samples = []
            for i in range(reps):
                t0 = time.perf_counter()
                tid = f"bench-{size}-{i}"
                token = b.send(tid, rs, peer_desc, rs, secret=secrets[tid])
                finished = token.wait(OP_TIMEOUT)
                dt = time.perf_counter() - t0
                if not finished:
                    raise TimeoutError(f"transfer of {format_size(size)} not finished within {OP_TIMEOUT:g}s")
                if not token.done():
                    raise RuntimeError(f"transfer of {format_size(size)} failed: {token.error}")
                samples.append(dt)
            times[size] = samples[WARMUP:]
        peer.send("finished")
        return {"times": times}
    finally:
        b.close()


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    pos = 0
    while pos < len(view):
        n = sock.recv_into(view[pos:])
        if n == 0:
            raise ConnectionError("peer closed the socket mid-transfer")
        pos += n


def _send_exact(sock: socket.socket, view: memoryview) -> None:
    pos = 0
    while pos < len(view):
        pos += sock.sendmsg([view[pos:]])


def _echo_pings(sock: socket.socket, count: int) -> None:
    """The receiver's half of ``_ping_pong``: echo ``count`` 1-byte pings, one at a time."""
    byte = bytearray(1)
    for _ in range(count):
        if sock.recv_into(byte) != 1:
            raise ConnectionError("sender closed the socket during the ping-pong")
        sock.sendall(byte)


def _ping_pong(sock: socket.socket, count: int) -> list[float]:
    """Seconds per 1-byte round trip, ``count`` of them, each blocking on the peer's echo.

    No payload to copy, so this is the floor any design pays when a transfer waits for one message to
    the other process and one back (wake-up, syscalls, interpreter): at small sizes that, not the copy,
    bounds GB/s. Measured on the already connected TCP_NODELAY socket so nothing else differs.
    """
    byte = bytearray(b"\x02")
    samples = []
    for _ in range(count):
        t0 = time.perf_counter()
        sock.sendall(byte)
        if sock.recv_into(byte) != 1:
            raise ConnectionError("receiver closed the socket instead of echoing the ping")
        samples.append(time.perf_counter() - t0)
    return samples


def _socket_receiver(peer, *, max_size: int, sizes: list[int], reps: int, host: str | None = None) -> dict:
    import numpy as np

    family = socket.AF_INET6 if ":" in (host or LOOPBACK) else socket.AF_INET
    with socket.create_server((host or LOOPBACK, 0), family=family) as srv:
        srv.settimeout(OP_TIMEOUT)
        peer.send(("ready", srv.getsockname()[:2]))
        sock, _ = srv.accept()
    with sock:
        sock.settimeout(OP_TIMEOUT)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = np.full(max_size, _RECV_FILL, dtype=np.uint8)
        view = memoryview(buf)
        for size in sizes:
            for _ in range(reps):
                _recv_exact(sock, view[:size])
                sock.sendall(b"\x01")
        _check_landed(buf, max(sizes), "socket baseline")
        _echo_pings(sock, RTT_WARMUP + RTT_SAMPLES)
    return {}


def _socket_sender(peer, *, max_size: int, sizes: list[int], reps: int, host: str | None = None) -> dict:
    msg = _peer_recv(peer, "the receiver's address")
    if not (isinstance(msg, tuple) and msg[0] == "ready"):
        raise RuntimeError(f"unexpected message from the receiver: {msg!r:.100}")
    buf = _pattern(max_size)
    view = memoryview(buf)
    ack = bytearray(1)
    times: dict[int, list[float]] = {}
    with socket.create_connection(tuple(msg[1]), timeout=OP_TIMEOUT,
                                  source_address=(host, 0) if host else None) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for size in sizes:
            samples = []
            for _ in range(reps):
                t0 = time.perf_counter()
                _send_exact(sock, view[:size])
                if sock.recv_into(ack) != 1:
                    raise ConnectionError("receiver closed the socket instead of acknowledging")
                samples.append(time.perf_counter() - t0)
            times[size] = samples[WARMUP:]
        rtt = _ping_pong(sock, RTT_WARMUP + RTT_SAMPLES)[RTT_WARMUP:]
    return {"times": times, "rtt_samples_s": rtt}


def _run_pair(what: str, receiver: Callable, sender: Callable, kwargs: dict, timeout: float,
              places: dict[str, Place] | None = None) -> dict:
    """Run ``receiver`` and ``sender`` in two spawned processes joined by a Pipe; their results by role.

    ``places`` (by role) puts a side in a network namespace and passes it ``host=`` its address.

    Raises RuntimeError if either fails or exits without a result, TimeoutError after ``timeout``
    seconds; both processes are gone when this returns or raises.
    """
    ctx = mp.get_context("spawn")
    peer_r, peer_s = ctx.Pipe()
    procs, pending, own = [], {}, [peer_r, peer_s]
    try:
        for role, fn, peer in (("receiver", receiver, peer_r), ("sender", sender, peer_s)):
            res_parent, res_child = ctx.Pipe(duplex=False)
            own += [res_parent, res_child]
            place = (places or {}).get(role)
            args = (fn, role, res_child, peer, kwargs if place is None else {**kwargs, "host": place.host},
                    None if place is None else place.netns)
            p = ctx.Process(target=_child, args=args,
                            name=f"xpyd-bench-{what}-{role}", daemon=True)
            p.start()
            procs.append(p)
            res_child.close()  # so a child that dies shows up as EOF on res_parent
            pending[res_parent] = (role, p)
        peer_r.close()  # so a child sees EOF when its peer dies
        peer_s.close()
        results: dict[str, Any] = {}
        errors: list[str] = []
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            ready = mp.connection.wait(list(pending), timeout=max(0.0, remaining))
            if not ready:
                if errors:  # the other process had its second to report why; stop it
                    break
                roles = " and ".join(role for role, _ in pending.values())
                raise TimeoutError(f"{what}: no result from the {roles} process within {timeout:g}s")
            for conn in ready:
                role, p = pending.pop(conn)
                try:
                    status, payload = conn.recv()
                except EOFError:
                    p.join(2)
                    status, payload = "error", f"exited without a result (exit code {p.exitcode})"
                if status == "ok":
                    results[role] = payload
                    continue
                errors.append(f"the {role} process failed: {payload}")
                # give the other process a moment to report its own error (often the cause)
                deadline = min(deadline, time.monotonic() + 1.0)
        if errors:
            # "the peer process exited" is a consequence; put the root cause first
            errors.sort(key=lambda e: "peer process exited" in e or "exited without a result" in e)
            raise RuntimeError(f"{what}: " + "; ".join(errors))
        return results
    finally:
        for p in procs:
            p.join(2 if not pending else 0)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(2)
            if p.is_alive():
                p.kill()
                p.join(2)
        for c in own:
            c.close()
