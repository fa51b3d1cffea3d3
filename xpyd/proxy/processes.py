"""``xpyd proxy --workers N``: N proxy processes serving one port, for more than one core::

    parent   -> binds the port (SO_REUSEPORT: a taken port fails here, at once), makes one random worker-names
                key (without a cluster token), starts N children: ``xpyd proxy`` with the same flags but
                --workers, and in their environment PROCESS_ENV="i/N" and NAMES_KEY_ENV (never on the
                command line: ps shows that)
    child i  -> binds the same port with SO_REUSEPORT (the kernel spreads new connections over the N), its
                own event loop, registry watch, health poller and cache index fed by its own KV event streams;
                logs as ``proxy.i``
    SIGTERM / SIGINT to the parent -> SIGTERM to every child (each finishes its requests for a few seconds),
                SIGKILL to any still running after their --drain-timeout and STOP_MARGIN; the parent exits once all
                are gone
    a child exits on its own       -> the others are stopped the same way and the parent exits 1 (whoever
                started it restarts the whole proxy: `xpyd up` does)

Every child dies with the parent, even a SIGKILLed one (``die_with_parent``). What the N share: the workers
(each child holds its own connections and streams to each), the block-hash key and worker names (both derived
from the cluster token; without one, names come from the parent's key): a worker has one name in all of them.
Load, admission limits (--max-concurrent-requests, --max-queue) and the index are per child.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

from xpyd.child import die_with_parent
from xpyd.netaddr import reserve_tcp

log = logging.getLogger("xpyd.proxy")

PROCESS_ENV = "XPYD_PROXY_PROCESS"  # "i/N" in child i of N
NAMES_KEY_ENV = "XPYD_PROXY_NAMES_KEY"  # hex: the worker-names key the children share (no cluster token)
STOP_MARGIN = 10.0  # after SIGTERM, a child's --drain-timeout and then this long (its registry close: 5 s)
MAX_WORKERS = 64


def child_argv(argv: list[str]) -> list[str]:
    """``argv`` (``xpyd proxy``'s arguments) without ``--workers N`` / ``--workers=N``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--workers":
            skip = True
        elif not arg.startswith("--workers="):
            out.append(arg)
    return out


def process_label(environ: dict[str, str] | os._Environ = os.environ) -> str | None:
    """``proxy.i`` in child i of ``xpyd proxy --workers N``; None in a proxy of its own."""
    value = environ.get(PROCESS_ENV)
    if value is None:
        return None
    index, _, _ = value.partition("/")
    return f"proxy.{index}"


def run_processes(n: int, argv: list[str], host: str, port: int, names_key: bool, drain_timeout: float = 5.0) -> int:
    """Start ``n`` children with ``argv`` and wait (see the module's docstring); the exit code. ``names_key``:
    give them one worker-names key (no cluster token)."""
    if not 2 <= n <= MAX_WORKERS:
        raise ValueError(f"--workers must be in 1..{MAX_WORKERS}, got {n}")
    sock = reserve_tcp(host, port, reuse_port=True)  # OSError: taken (by something not in our group)
    env = dict(os.environ)
    if names_key:
        env[NAMES_KEY_ENV] = os.urandom(32).hex()
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (delivered to sigwait below, not ignored)
    waited = {signal.SIGTERM, signal.SIGINT, signal.SIGCHLD}
    children: list[subprocess.Popen] = []
    code = 0
    try:
        for i in range(1, n + 1):
            children.append(subprocess.Popen([sys.executable, "-m", "xpyd", "proxy", *child_argv(argv)],
                                             env={**env, PROCESS_ENV: f"{i}/{n}"}, start_new_session=True,
                                             preexec_fn=die_with_parent))
        signal.pthread_sigmask(signal.SIG_BLOCK, waited)  # (after the children: they inherit the mask)
        log.info("proxy: %d processes on %s:%d (pids %s)", n, host, port, " ".join(str(c.pid) for c in children))
        while True:
            dead = [c for c in children if c.poll() is not None]
            if dead:
                log.error("proxy: process pid %d exited (code %d); stopping the others", dead[0].pid,
                          dead[0].returncode)
                code = 1
                break
            if signal.sigwait(waited) in (signal.SIGTERM, signal.SIGINT):
                break
    finally:
        _stop(children, drain_timeout + STOP_MARGIN)
        sock.close()
    return code


def _stop(children: list[subprocess.Popen], seconds: float) -> None:
    running = [c for c in children if c.poll() is None]
    for c in running:
        c.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + seconds
    for c in running:
        try:
            c.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()
