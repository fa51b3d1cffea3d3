"""The online planner's loop: `xpyd up --planner` (local worker processes) and `xpyd planner` (Kubernetes).

Every ``interval_s`` (``tick``)::

    the proxy's /metrics (a Prometheus text) -> Scrape -> with the one before: the interval (``observe``)
    -> Controller.decide(now, interval, the fleet now: ``Workers.fleet``) -> each Decision:
         +n: start n workers of its role (``Workers.start``)
         -1: drain one worker of the role (``Workers.drain``: it leaves etcd, finishes what it holds, its
             streams move on through the proxy's migration, and it exits)
    -> every decision logged with its reason, kept among the last ``MAX_DECISIONS`` (``state``: what the
       proxy's /cluster shows, through etcd) and written as a JSON line to ``decisions_file``

What ``Workers`` are: `xpyd up`'s child processes (``SupervisedWorkers``, below), Kubernetes Deployments' replicas
or a desired count for an autoscaler (``planner_workers``: `xpyd planner`). A scrape that fails (the
proxy restarting, a timeout) or a fleet that cannot be read (``WorkersError``) skips the interval; a start or drain
that fails is logged and recorded with its error; the controller's hysteresis and dwell time
(``xpyd.planner.controller``) keep it from flapping.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from xpyd.discovery.planner_state import MAX_DECISIONS, DecisionRecord, PlannerMode, PlannerState, Target
from xpyd.discovery.types import Role as WorkerRole
from xpyd.planner.controller import Controller, Decision, Fleet, Role
from xpyd.planner.observe import Lengths, Scrape, observe


@dataclass(frozen=True, slots=True)
class PlannerLoopConfig:
    interval_s: float = 15.0  # between two scrapes (an interval the controller judges)
    decisions_file: Path | None = None  # JSON lines, one per decision
    defaults: Lengths = Lengths()  # prompt and output lengths until the workers' metrics say
    mode: PlannerMode = PlannerMode.LOCAL  # what its workers are (shown on /cluster)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ValueError(f"--planner-interval must be > 0 s, got {self.interval_s!r}")


class WorkersError(RuntimeError):
    """The fleet could not be read or changed (an API that did not answer, refused, or answered nonsense)."""


class Workers(Protocol):
    """The cluster's workers as the planner moves them; each method may raise ``WorkersError``."""

    def fleet(self) -> Fleet: ...
    def start(self, role: Role) -> str: ...  # the started worker's name
    # the draining worker's name (None: none to drain); ``busy(name)``: the requests a worker holds by the last
    # scrape (None: unknown), for a Workers that can choose which one drains
    def drain(self, role: Role, busy: Callable[[str], float | None] = lambda name: None) -> str | None: ...


class PlannerLoop:
    def __init__(self, controller: Controller, workers: Workers, scrape: Callable[[], dict[str, str]],
                 config: PlannerLoopConfig, say: Callable[[str], None],
                 clock: Callable[[], float] = time.time) -> None:
        """``scrape()``: source name -> Prometheus text (the proxy's under "proxy"); it may raise OSError or
        ValueError (the interval is skipped). ``clock``: the Unix time decisions are stamped with."""
        self._controller = controller
        self._workers = workers
        self._scrape = scrape
        self.config = config
        self._say = say
        self._clock = clock
        self._last: Scrape | None = None
        self._next = 0.0
        self.recent: deque[DecisionRecord] = deque(maxlen=MAX_DECISIONS)  # the last decisions, oldest first
        self.target: Fleet | None = None  # the fleet after the last interval's decisions
        self.updated_at = 0.0  # Unix time of the last interval judged

    def due(self, now: float) -> bool:
        return now >= self._next

    @property
    def next_at(self) -> float:
        """When the next interval is due (the ``now`` of ``tick``'s clock)."""
        return self._next

    def tick(self, now: float) -> list[Decision]:
        """Judge the interval that ended now, if one is due; the decisions it acted on."""
        if not self.due(now):
            return []
        self._next = now + self.config.interval_s
        try:
            scrape = Scrape.parse(now, self._scrape())
        except (OSError, ValueError) as e:
            self._say(f"planner: no metrics this interval ({type(e).__name__}: {e})")
            return []
        last, self._last = self._last, scrape
        if last is None:
            return []
        interval = observe(last, scrape, self.config.defaults)
        try:
            fleet = self._workers.fleet()
        except WorkersError as e:
            self._say(f"planner: the fleet is unknown this interval ({e})")
            return []
        decisions = self._controller.decide(now, interval, fleet)
        for note in self._controller.notes:
            self._say(f"planner: held: {note}")
        counts = {role: fleet.count(role) for role in Role}
        for d in decisions:
            counts[d.role] += self._act(d)
        self.target = Fleet(counts[Role.PREFILL], counts[Role.DECODE])
        self.updated_at = self._clock()
        return decisions

    def state(self) -> PlannerState:
        """What /cluster shows of this planner."""
        c = self._controller.config
        target = None if self.target is None else Target(self.target.prefill, self.target.decode)
        return PlannerState(self.config.mode, c.slo.describe(), c.max_workers, self.config.interval_s,
                            self.updated_at, target, tuple(self.recent))

    def _busy(self, name: str) -> float | None:
        return self._last.busy(name) if self._last is not None else None

    def _act(self, d: Decision) -> int:
        """Start or drain as ``d`` says; the change made (0 when it failed)."""
        names: list[str] = []
        error = None
        try:
            if d.delta > 0:
                for _ in range(d.delta):
                    names.append(self._workers.start(d.role))
            else:
                for _ in range(-d.delta):
                    if (name := self._workers.drain(d.role, self._busy)) is not None:
                        names.append(name)
        except WorkersError as e:
            error = str(e)
        done = len(names) if d.delta > 0 else -len(names)
        if d.delta > 0:
            what = f"started {', '.join(names)}" if names else "started nothing"
        else:
            what = f"draining {', '.join(names) or 'nothing'}"
        self._say(f"planner: {d.role.value} {d.delta:+d} -> {d.target}: {what}; {d.reason}"
                  + (f" (failed: {error})" if error else ""))
        self.recent.append(DecisionRecord.of(self._clock(), WorkerRole(d.role.value), d.delta, d.target, d.reason,
                                             names, error))
        if self.config.decisions_file is not None:
            with self.config.decisions_file.open("a") as f:
                f.write(json.dumps({**d.as_dict(), "workers": names, **({"error": error} if error else {})}) + "\n")
        return done


class SupervisedWorkers:
    """`xpyd up`'s workers of each role, as the planner starts and drains them (``spawn(role, i)`` starts worker
    ``i`` of a role on its i-th port pair and names it)."""

    def __init__(self, cluster, spawn: Callable[[str, int], str], prefill: int, decode: int,
                 port_free: Callable[[Role, int], bool]) -> None:
        self._cluster = cluster
        self._spawn = spawn
        self._port_free = port_free
        self._names = {Role.PREFILL: [f"prefill {i}" for i in range(prefill)],
                       Role.DECODE: [f"decode {j}" for j in range(decode)]}
        self._next = {Role.PREFILL: prefill, Role.DECODE: decode}

    def fleet(self) -> Fleet:
        return Fleet(len(self._names[Role.PREFILL]), len(self._names[Role.DECODE]))

    def start(self, role: Role) -> str:
        i = self._next[role]
        while not self._port_free(role, i):  # (a drained worker's ports may still be in use: the next pair)
            i += 1
        self._next[role] = i + 1
        name = self._spawn(role.value, i)
        self._names[role].append(name)
        return name

    def drain(self, role: Role, busy: Callable[[str], float | None] = lambda name: None) -> str | None:
        """The least busy worker of ``role`` by the last scrape (its streams are the fewest to finish or move; on
        a tie, or unknown, the newest) starts draining."""
        names = self._names[role]
        if len(names) <= 1:
            return None
        loads = [busy(n) for n in names]
        known = [(load, -i) for i, load in enumerate(loads) if load is not None]
        i = -min(known)[1] if known else len(names) - 1
        name = names.pop(i)
        self._cluster.drain(name)
        return name
