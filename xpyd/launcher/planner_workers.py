"""The planner's ``Workers`` on Kubernetes (`xpyd planner`), one per ``--mode``:

- ``Deployments`` (scale): the fleet is the prefill and decode Deployments' replicas (spec.replicas, read at
  each interval); a start is a scale-up by one, a drain a scale-down by one (Kubernetes picks the pod and sends
  it SIGTERM; an xpyd worker then leaves etcd, finishes what it holds and exits). With ``urls`` (``xpyd planner
  --pod-deletion-cost``) it first gives each of the role's running pods a deletion cost: the requests its worker
  held at the last scrape (the worker whose address is the pod's IP), so the ReplicaSet takes the least busy
  one (a pod whose worker was not scraped costs the most: nobody knows what it holds).
- ``DesiredReplicas`` (metrics): the fleet is the count the planner wants and publishes for an autoscaler
  (``xpyd_planner_desired_replicas``), which makes the Deployments follow; it starts from the workers the proxy
  knows (``seed``: after a restart the planner goes on from the fleet that runs, not from a default).

The planner's tick runs in a thread of its own (the fleet model takes CPU seconds: the event loop keeps answering
/health and /metrics); ``Deployments`` runs each API call on the event loop that owns the client and waits for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine, Mapping
from urllib.parse import urlsplit

from xpyd.launcher.kube import DELETION_COST, KubeError, Pod, ScaleClient
from xpyd.launcher.planner_loop import WorkersError
from xpyd.planner.controller import Fleet, Role
from xpyd.planner.observe import PROXY, Scrape

__all__ = ["DesiredReplicas", "Deployments"]

WORKERS_GAUGE = "xpyd_proxy_workers"  # the proxy's workers by role and health
UNKNOWN_COST = 2**31 - 1  # a pod whose worker's load is unknown: deleted last (the annotation is an int32)


class Deployments:
    def __init__(self, client: ScaleClient, names: Mapping[Role, str], loop: asyncio.AbstractEventLoop,
                 urls: Callable[[Role], list[str]] | None = None) -> None:
        """``names``: each role's Deployment; ``loop``: the (running) loop the client belongs to; ``urls``: the
        registered workers' addresses of a role (given: pods get deletion costs before a drain)."""
        self._client = client
        self._names = dict(names)
        self._loop = loop
        self._urls = urls
        self._counts: dict[Role, int] = {}

    def fleet(self) -> Fleet:
        self._counts = {role: self._call(self._client.replicas(self._names[role])) for role in Role}
        return Fleet(self._counts[Role.PREFILL], self._counts[Role.DECODE])

    def start(self, role: Role) -> str:
        return self._set(role, self._counts[role] + 1)

    def drain(self, role: Role, busy: Callable[[str], float | None] = lambda name: None) -> str | None:
        """One replica fewer: Kubernetes picks which pod, by the deletion costs set here first when ``urls`` was
        given (``busy(url)``: the requests a worker held at the last scrape)."""
        if self._counts[role] <= 1:
            return None
        first = self._rank(role, busy) if self._urls is not None else ""
        return self._set(role, self._counts[role] - 1) + first

    def _rank(self, role: Role, busy: Callable[[str], float | None]) -> str:
        """Each running pod's deletion cost set to its worker's load; what the decision's log says of it."""
        pods = [p for p in self._call(self._pods(role), calls=2) if p.running and p.ip]
        by_ip = {urlsplit(u).hostname: u for u in self._urls(role)}
        costs = {}
        for pod in pods:
            load = busy(by_ip[pod.ip]) if pod.ip in by_ip else None
            costs[pod.name] = UNKNOWN_COST if load is None else min(UNKNOWN_COST - 1, round(load))
        for name, cost in costs.items():
            self._call(self._client.annotate(name, DELETION_COST, str(cost)))
        if not costs:
            return " (no running pod to rank)"
        least = min(costs, key=costs.get)
        return f" (deleted first: {least}, {costs[least] if costs[least] < UNKNOWN_COST else 'unknown'} requests)"

    async def _pods(self, role: Role) -> list[Pod]:
        return await self._client.pods(await self._client.selector(self._names[role]))

    def _set(self, role: Role, replicas: int) -> str:
        name, before = self._names[role], self._counts[role]
        self._counts[role] = self._call(self._client.scale(name, replicas))
        return f"{name} {before} -> {self._counts[role]} replicas"

    def _call(self, call: Coroutine, calls: int = 1):
        """What ``call`` (``calls`` API calls one after another) returns, run on the client's loop."""
        future = asyncio.run_coroutine_threadsafe(call, self._loop)
        try:
            return future.result(calls * self._client.config.timeout_s + 1)
        except KubeError as e:
            raise WorkersError(str(e)) from None
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise WorkersError(f"the Kubernetes API did not answer within {self._client.config.timeout_s:g}s")


class DesiredReplicas:
    def __init__(self) -> None:
        self._counts: dict[Role, int] | None = None

    @property
    def seeded(self) -> bool:
        return self._counts is not None

    def seed(self, proxy_metrics: str) -> None:
        """The first time: each role's count from the proxy's ``xpyd_proxy_workers`` (up and down, at least one);
        ValueError if the text is not Prometheus'."""
        if self._counts is not None:
            return
        scrape = Scrape.parse(0.0, {PROXY: proxy_metrics})
        self._counts = {role: max(1, round(scrape.total(WORKERS_GAUGE, PROXY, role=role.value))) for role in Role}

    def fleet(self) -> Fleet:
        if self._counts is None:
            raise WorkersError("no fleet yet: the proxy's worker counts were not read")
        return Fleet(self._counts[Role.PREFILL], self._counts[Role.DECODE])

    def start(self, role: Role) -> str:
        return self._set(role, self.fleet().count(role) + 1)

    def drain(self, role: Role, busy: Callable[[str], float | None] = lambda name: None) -> str | None:
        n = self.fleet().count(role)
        return self._set(role, n - 1) if n > 1 else None

    def _set(self, role: Role, n: int) -> str:
        before = self._counts[role]
        self._counts[role] = n
        return f"desired {role.value} replicas {before} -> {n}"
