"""Start real xpyd processes (workers, proxy) on free loopback ports, for tests."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from xpyd.child import die_with_parent
from xpyd.netaddr import http_url, is_ipv6


def free_port(host: str = "127.0.0.1") -> int:
    """A free port on ``host`` for a server a test starts (below the ephemeral range: `free_port_run`)."""
    return free_port_run(1, host)


def has_ipv6_loopback() -> bool:
    """True if this machine can listen on ``::1`` (containers without IPv6 cannot)."""
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            return True
    except OSError:
        return False


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    url: str

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class Cluster:
    workdir: Path
    procs: list[Proc] = field(default_factory=list)

    def start(self, name: str, argv: list[str], url: str, env: dict[str, str] | None = None,
              wrap: Sequence[str] = ()) -> Proc:
        """Start ``python -m xpyd *argv`` (``env``: variables added to this process's environment; ``wrap``:
        a command that runs it, e.g. ``ip netns exec NS``)."""
        log = self.workdir / f"{name}.log"
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1", **(env or {}))
        popen = subprocess.Popen([*wrap, sys.executable, "-m", "xpyd", *argv], stdout=log.open("wb"),
                                 stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                 preexec_fn=die_with_parent)  # (no orphans if pytest is killed)
        p = Proc(name, popen, log, url)
        self.procs.append(p)
        return p

    def wait_healthy(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        pending = list(self.procs)
        while pending:
            for p in list(pending):
                if p.popen.poll() is not None:
                    raise RuntimeError(f"{p.name} exited with {p.popen.returncode}:\n{p.tail()}")
                if http_ok(p.url + "/health"):
                    pending.remove(p)
            if time.monotonic() > deadline:
                raise RuntimeError("not healthy in time: " + ", ".join(f"{p.name}:\n{p.tail()}" for p in pending))
            time.sleep(0.2)

    def stop(self) -> None:
        for p in self.procs:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.popen.wait(15)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()


def start_1p1d(workdir: Path, model: str, dtype: str = "float32", batch_size: int = 8,
               max_model_len: int = 512, extra: list[str] | None = None,
               host: str = "127.0.0.1", prefill_extra: list[str] | None = None) -> tuple[Cluster, dict[str, str]]:
    """Prefill + decode workers and a proxy, all on ``host``; returns the cluster and its URLs.
    ``extra``: options of both workers; ``prefill_extra``: the prefill worker's own."""
    c = Cluster(workdir)
    pp, ps, dp, dk, xp = (free_port(host) for _ in range(5))
    common = ["--model", model, "--dtype", dtype, "--threads", "1", "--batch-size", str(batch_size),
              "--max-model-len", str(max_model_len), "--host", host, *(extra or [])]
    urls = {"prefill": http_url(host, pp), "decode": http_url(host, dp), "proxy": http_url(host, xp)}
    c.start("prefill", ["prefill", *common, *(prefill_extra or []), "--port", str(pp), "--signal-port", str(ps)],
            urls["prefill"])
    c.start("decode", ["decode", *common, "--port", str(dp), "--kv-port", str(dk)], urls["decode"])
    try:
        # (started with the workers: a static proxy serves, and answers /health, only once every listed
        # worker answered its /xpyd/info)
        c.start("proxy", ["proxy", "--host", host, "--port", str(xp), "--prefill", urls["prefill"], "--decode", urls["decode"]],
                urls["proxy"])
        c.wait_healthy()
    except BaseException:
        c.stop()
        raise
    return c, urls


# --- `xpyd up` as a child process -------------------------------------------------------------

STARTUP = 120.0  # generous: a worker's start-up time on a busy 2-core machine


def wait_until(predicate, timeout: float, what: str) -> None:
    """Wait for ``predicate()`` to hold (polled every 0.1 s); fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g}s"
        time.sleep(0.1)


class PortAllocator:
    """Port runs for the servers tests start, below the ephemeral range (32768-60999 on Linux, so no
    outgoing connection takes one before its server binds it). One allocator serves a whole test process
    and never hands out a port twice, so two runs taken one after the other (a prefill range and a decode
    range, five ports of one cluster) cannot overlap, though nothing listens on them yet. Each process
    walks up from its own random start, and a run is handed out only if every port of it can be bound
    now (another process's servers are skipped)."""

    LOW, HIGH = 20000, 32000

    def __init__(self, seed: int | None = None, worker: str | None = None, workers: str | None = None) -> None:
        # Under pytest-xdist each test process walks its own slice of the range, so two never hand out one port.
        worker = os.environ.get("PYTEST_XDIST_WORKER", "") if worker is None else worker
        workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") if workers is None else workers
        if worker.startswith("gw") and int(workers) > 1:
            width = (self.HIGH - self.LOW) // int(workers)
            self.LOW = self.LOW + width * int(worker[2:])
            self.HIGH = self.LOW + width
        self._next = random.Random(seed).randrange(self.LOW, self.HIGH)
        self._given: set[int] = set()
        self._lock = threading.Lock()

    def take(self, n: int, host: str = "127.0.0.1") -> int:
        """The first port p of a run p .. p+n-1 that no earlier call returned and that is bindable now."""
        if not 1 <= n <= 64:
            raise ValueError(f"a run of {n} ports")
        with self._lock:
            for _ in range((self.HIGH - self.LOW) // 2):
                p = self._next
                self._next = p + n if p + 2 * n <= self.HIGH else self.LOW
                if p + n > self.HIGH:
                    continue
                run = range(p, p + n)
                if self._given.isdisjoint(run) and all(bindable(q, host) for q in run):
                    self._given.update(run)
                    return p
        raise RuntimeError(f"no free run of {n} ports in {self.LOW}-{self.HIGH}")


PORTS = PortAllocator()


def free_port_run(n: int, host: str = "127.0.0.1") -> int:
    """A port p with p .. p+n-1 all free on ``host`` and none of them handed out before in this process
    (`PortAllocator`)."""
    return PORTS.take(n, host)


def bindable(port: int, host: str = "127.0.0.1") -> bool:
    """Can a new server listen on ``host:port`` (as a restarted xpyd would, with SO_REUSEADDR)?"""
    with socket.socket(socket.AF_INET6 if is_ipv6(host) else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def up_child_pid(up_pid: int, role: str, port: int) -> int:
    """The pid of `xpyd up`'s child serving ``role`` on HTTP ``port``."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) != up_pid or role.encode() not in argv:
            continue
        i = argv.index(b"--port")
        if argv[i + 1] == str(port).encode():
            return int(d.name)
    raise LookupError(f"no {role} child on port {port}")


def _option(argv: Sequence[str], name: str, default: int) -> int:
    return int(argv[argv.index(name) + 1]) if name in argv else default


class UpProcess:
    """`xpyd up` on free ports (prefill and decode port runs with room for its workers, at least 2 each)."""

    def __init__(self, model: Path, log: Path, *extra: str) -> None:
        x, y = (max(2, _option(extra, f"--{role}", 1)) for role in ("prefill", "decode"))
        self.port, self.pp, self.dp = free_port_run(1), free_port_run(2 * x), free_port_run(2 * y)
        self.log = log
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "xpyd", "up", "--model", str(model), "--port", str(self.port),
             "--prefill-port", str(self.pp), "--decode-port", str(self.dp), "--dtype", "float32",
             "--threads", "1", *extra],
            stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent)
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers = {role: _option(extra, f"--{role}", 1) for role in ("prefill", "decode")}
        if "--colocated" in extra:
            self.workers = {}

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self) -> None:
        """Until `xpyd up` says it is ready and its proxy routes to every worker it started (with etcd, a
        worker the proxy has not seen yet gets no request: load would pile on the others)."""
        wait_until(lambda: self.proc.poll() is not None or "Press Ctrl-C to stop" in self.text(), 2 * STARTUP,
                   "xpyd up ready")
        assert self.proc.poll() is None, self.text()[-3000:]
        if self.workers:
            wait_until(lambda: self.routed() == self.workers, STARTUP, f"the proxy routing to {self.workers}")

    def routed(self) -> dict[str, int]:
        """UP workers per role, as the proxy's /cluster lists them."""
        with urllib.request.urlopen(self.url + "/cluster", timeout=5) as r:
            workers = json.loads(r.read())["workers"]
        up = [w["role"] for w in workers if w["health"] == "up"]
        return {role: up.count(role) for role in self.workers}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def start_pd_and_colocated(c: Cluster, options: Sequence[str], prefill: Sequence[str] = (),
                           colocated: Sequence[str] = (), pd_proxy: Sequence[str] = (),
                           co_proxy: Sequence[str] = (), decode: Sequence[str] = ()) -> dict[str, str]:
    """1P1D with its proxy, and a colocated worker with its proxy, all started with ``options`` (and each the
    extra options given): their URLs as prefill, decode, colocated, pd (the P/D proxy) and co (the colocated
    one), once all are healthy. The caller stops ``c``."""
    pp, ps, dp, dk, xp, wp, cp = (free_port() for _ in range(7))
    urls = {"prefill": f"http://127.0.0.1:{pp}", "decode": f"http://127.0.0.1:{dp}",
            "colocated": f"http://127.0.0.1:{wp}", "pd": f"http://127.0.0.1:{xp}", "co": f"http://127.0.0.1:{cp}"}
    c.start("prefill", ["prefill", *options, *prefill, "--port", str(pp), "--signal-port", str(ps)], urls["prefill"])
    c.start("decode", ["decode", *options, *decode, "--port", str(dp), "--kv-port", str(dk)], urls["decode"])
    c.start("colocated", ["colocated", *options, *colocated, "--port", str(wp)], urls["colocated"])
    # (the proxies start with the workers: each serves, and answers /health, only once its workers answered
    # their /xpyd/info)
    c.start("pd-proxy", ["proxy", "--port", str(xp), "--prefill", urls["prefill"], "--decode", urls["decode"],
                         *pd_proxy], urls["pd"])
    c.start("colocated-proxy", ["proxy", "--port", str(cp), "--colocated", urls["colocated"], *co_proxy], urls["co"])
    c.wait_healthy()
    return urls


def post_json(url: str, path: str, body: dict, status: int = 200, headers: dict | None = None):
    """POST ``body``; its JSON answer (``status`` expected), or a stream's events (data lines that are objects)."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            got, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        got, raw = e.code, e.read()
    assert got == status, (got, raw[:500])
    if not body.get("stream") or status != 200:
        return json.loads(raw)
    return [json.loads(ln[6:]) for ln in raw.decode().splitlines() if ln.startswith("data: {")]
