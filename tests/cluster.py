"""Start real xpyd processes (workers, proxy) on free loopback ports, for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from xpyd.child import die_with_parent
from xpyd.netaddr import http_url, is_ipv6


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if is_ipv6(host) else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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

    def start(self, name: str, argv: list[str], url: str) -> Proc:
        log = self.workdir / f"{name}.log"
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
        popen = subprocess.Popen([sys.executable, "-m", "xpyd", *argv], stdout=log.open("wb"),
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
               host: str = "127.0.0.1") -> tuple[Cluster, dict[str, str]]:
    """Prefill + decode workers and a proxy, all on ``host``; returns the cluster and its URLs."""
    c = Cluster(workdir)
    pp, ps, dp, dk, xp = (free_port(host) for _ in range(5))
    common = ["--model", model, "--dtype", dtype, "--threads", "1", "--batch-size", str(batch_size),
              "--max-model-len", str(max_model_len), "--host", host, *(extra or [])]
    urls = {"prefill": http_url(host, pp), "decode": http_url(host, dp), "proxy": http_url(host, xp)}
    c.start("prefill", ["prefill", *common, "--port", str(pp), "--signal-port", str(ps)], urls["prefill"])
    c.start("decode", ["decode", *common, "--port", str(dp), "--kv-port", str(dk)], urls["decode"])
    try:
        c.wait_healthy()
        c.start("proxy", ["proxy", "--host", host, "--port", str(xp), "--prefill", urls["prefill"], "--decode", urls["decode"]],
                urls["proxy"])
        c.wait_healthy()
    except BaseException:
        c.stop()
        raise
    return c, urls
