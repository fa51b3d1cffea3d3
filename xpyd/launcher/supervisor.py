"""Child processes of `xpyd up`, supervised the way Kubernetes keeps a pod's containers running.

A child started with ``restart=True`` (a worker) that exits on its own is started again with the same
command line after a back-off that doubles from ``backoff`` up to ``max_backoff``; one that keeps dying
soon after each start (``max_fast_crashes`` times in a row, each within ``fast_crash`` seconds of its
start) is given up on, and so is a child started with ``restart=False`` (the proxy) the first time it
exits: `check` raises `GiveUp` and the caller stops the cluster. Every child runs in its own session and
dies with this process (``die_with_parent``), so nothing outlives `xpyd up`. A child the caller ``drain``s (the
planner scaling a role down) gets SIGTERM, finishes its work as a worker does on SIGTERM, and is forgotten when
it exits: never restarted.

    RUNNING -> BACKOFF (exited) -> RUNNING (restarted) ...;  RUNNING | BACKOFF -> DRAINING -> gone;  any -> STOPPED
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from enum import Enum

from xpyd.child import die_with_parent


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    backoff: float = 1.0  # seconds before the first restart
    max_backoff: float = 30.0
    fast_crash: float = 60.0  # an exit this soon after a start counts as a crash loop step
    max_fast_crashes: int = 5  # give up after this many in a row

    def __post_init__(self) -> None:
        if not 0 <= self.backoff <= self.max_backoff:
            raise ValueError(f"the restart back-off must be 0 <= --restart-backoff ({self.backoff:g}) <= "
                             f"--max-restart-backoff ({self.max_backoff:g})")
        if self.fast_crash <= 0 or self.max_fast_crashes < 1:
            raise ValueError("fast_crash must be > 0 and max_fast_crashes >= 1")


class ChildState(str, Enum):
    RUNNING = "running"
    BACKOFF = "backoff"  # exited; waiting to be started again
    DRAINING = "draining"  # told to stop (SIGTERM): finishing its work; forgotten once it exits
    STOPPED = "stopped"


class GiveUp(RuntimeError):
    """A child the cluster cannot go on without: the proxy exited, or a worker crash-loops."""


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str] | None
    restart: bool
    proc: subprocess.Popen | None = None
    state: ChildState = ChildState.STOPPED
    started_at: float = 0.0
    restarts: int = 0
    fast_crashes: int = 0  # consecutive exits soon after a start
    next_start: float = 0.0
    last_exit: str = ""


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


@dataclass
class Supervisor:
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    log: object = None  # callable(str); default: print to stderr
    command: tuple[str, ...] = (sys.executable, "-m", "xpyd")  # what a child runs, before its argv
    children: dict[str, Child] = field(default_factory=dict)

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None, restart: bool = True) -> Child:
        """Start ``python -m xpyd *argv`` (``command`` + ``argv``) as child ``name``."""
        child = Child(name, list(argv), env, restart)
        self.children[name] = child
        self._start(child, time.monotonic())
        return child

    def dead(self) -> list[str]:
        """Children that are not running now (exited and not restarted yet; not those draining)."""
        return [c.name for c in self.children.values()
                if c.state is not ChildState.DRAINING and (c.proc is None or c.proc.poll() is not None)]

    def drain(self, name: str) -> None:
        """Ask child ``name`` to stop (SIGTERM) and let it finish; it is not restarted, and is forgotten once it
        has exited (``check``)."""
        child = self.children[name]
        if child.state is ChildState.RUNNING and child.proc is not None and child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
        child.state = ChildState.DRAINING
        self._say(f"{name} draining (SIGTERM: it finishes its requests, then exits)")

    def check(self, now: float | None = None) -> None:
        """Notice exits, restart what is due; `GiveUp` when the cluster cannot go on."""
        now = time.monotonic() if now is None else now
        for child in list(self.children.values()):
            if child.state is ChildState.DRAINING:
                if child.proc is None or child.proc.poll() is not None:
                    del self.children[child.name]
                    self._say(f"{child.name} drained ({describe_exit(child.proc.returncode) if child.proc else 'never started'})")
                continue
            if child.state is ChildState.RUNNING and child.proc.poll() is not None:
                self._exited(child, now)
            if child.state is ChildState.BACKOFF and now >= child.next_start:
                self._start(child, now)
                self._say(f"{child.name} restarted (restart {child.restarts}, pid {child.proc.pid})")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every running child, wait up to ``timeout`` for all of them, then SIGKILL the rest."""
        running = [c for c in self.children.values() if c.proc is not None and c.proc.poll() is None]
        for c in running:
            c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for c in running:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
        for c in self.children.values():
            c.state = ChildState.STOPPED

    def _start(self, child: Child, now: float) -> None:
        cmd = [*self.command, *child.argv]
        child.proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=die_with_parent, env=child.env)
        child.state = ChildState.RUNNING
        child.started_at = now

    def _exited(self, child: Child, now: float) -> None:
        child.last_exit = describe_exit(child.proc.returncode)
        if not child.restart:
            child.state = ChildState.STOPPED
            raise GiveUp(f"{child.name} exited unexpectedly ({child.last_exit})")
        ran = now - child.started_at
        child.fast_crashes = child.fast_crashes + 1 if ran < self.policy.fast_crash else 0
        if child.fast_crashes >= self.policy.max_fast_crashes:
            child.state = ChildState.STOPPED
            raise GiveUp(f"{child.name} exited {child.fast_crashes} times in a row within "
                         f"{self.policy.fast_crash:g}s of starting (last: {child.last_exit}); see its log above")
        delay = min(self.policy.max_backoff, self.policy.backoff * 2 ** max(0, child.fast_crashes - 1))
        child.state = ChildState.BACKOFF
        child.next_start = now + delay
        child.restarts += 1
        self._say(f"{child.name} exited unexpectedly ({child.last_exit}) after {ran:.1f}s; "
                  f"restarting it in {delay:g}s (the others keep serving)")

    def _say(self, text: str) -> None:
        if self.log is not None:
            self.log(text)
        else:
            print(f"xpyd up: {text}", file=sys.stderr, flush=True)
