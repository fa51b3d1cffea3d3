"""`xpyd planner`: the online planner as a service of its own, for Kubernetes (the chart's planner Deployment).

Every ``--planner-interval``::

    the proxy's /metrics (--proxy-url, with $XPYD_API_KEY when set) and each registered worker's (etcd: their
    prompt and output lengths) -> PlannerLoop.tick, in a thread (the fleet model takes CPU seconds: /health and
    /metrics stay answered) -> --mode scale:   the prefill and decode Deployments' replicas (the scale subresource)
                               --mode metrics: the desired replicas, for an HPA or KEDA to act on
    -> xpyd_planner_desired_replicas{role} on its own /metrics; its state to etcd (the proxy's /cluster)

Nothing it reaches is trusted to answer: every call has a timeout, a failure skips the interval or is recorded
with the decision, and the service goes on (no crash loop). SIGTERM/SIGINT: the tick under way ends, the state is
deleted from etcd, it exits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from xpyd.discovery.base import RegistryError
from xpyd.discovery.etcd import EtcdRegistry
from xpyd.discovery.etcd_common import split_endpoint
from xpyd.discovery.planner_etcd import PlannerPublisher
from xpyd.discovery.planner_state import PlannerMode
from xpyd.discovery.types import Role as WorkerRole
from xpyd.launcher.kube import KubeConfig, ScaleClient, check_name
from xpyd.launcher.planner_loop import PlannerLoop, PlannerLoopConfig
from xpyd.launcher.planner_options import add_planner_tuning, planner_parts
from xpyd.launcher.planner_publish import state_ttl
from xpyd.launcher.planner_workers import Deployments, DesiredReplicas
from xpyd.model.sim.profile import SimProfile, default_profile, shipped_profile, shipped_profiles
from xpyd.netaddr import host_port
from xpyd.planner.controller import Controller, Decision, Role
from xpyd.planner.observe import PROXY
from xpyd.worker.config import WorkerConfig

log = logging.getLogger("xpyd.planner")

MODES = (PlannerMode.SCALE.value, PlannerMode.METRICS.value)
DEFAULT_PORT = 8300
STOP_WAIT_S = 60.0  # the longest a stop waits for the tick under way


@dataclass(frozen=True, slots=True)
class PlannerServiceConfig:
    mode: PlannerMode
    proxy_url: str
    etcd: str | None = None  # the planner's state for /cluster, and the workers' /metrics
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    deployments: dict[Role, str] = field(default_factory=dict)  # --mode scale: each role's Deployment
    namespace: str | None = None  # ... in this namespace (None: the pod's own)
    kube_timeout_s: float = 5.0
    scrape_timeout_s: float = 5.0
    api_key: str | None = field(default=None, repr=False)  # the proxy's
    pod_deletion_cost: bool = False  # --mode scale: rank a role's pods by load before a drain (needs --etcd)

    def __post_init__(self) -> None:
        if self.mode not in (PlannerMode.SCALE, PlannerMode.METRICS):
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, got {self.mode.value!r}")
        if not self.proxy_url.startswith(("http://", "https://")):
            raise ValueError(f"--proxy-url must be http://HOST:PORT, got {self.proxy_url!r}")
        if self.etcd is not None:
            split_endpoint(self.etcd)
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.mode is PlannerMode.SCALE:
            for role in Role:
                if role not in self.deployments:
                    raise ValueError(f"--mode scale needs --{role.value}-deployment NAME")
                check_name(self.deployments[role], f"--{role.value}-deployment")
        if self.pod_deletion_cost and (self.mode is not PlannerMode.SCALE or self.etcd is None):
            raise ValueError("--pod-deletion-cost needs --mode scale and --etcd (the workers' addresses and loads)")
        for flag, v in (("--kube-timeout", self.kube_timeout_s), ("--scrape-timeout", self.scrape_timeout_s)):
            if not (math.isfinite(v) and 0 < v <= 300):
                raise ValueError(f"{flag} must be in (0, 300] s, got {v!r}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=MODES, required=True,
                   help="scale: set the prefill and decode Deployments' replicas through the Kubernetes API "
                        "(in-cluster service account; RBAC: get and patch on their deployments/scale); metrics: only "
                        "expose the desired replicas (xpyd_planner_desired_replicas{role}) for an HPA or KEDA")
    p.add_argument("--proxy-url", required=True, metavar="URL",
                   help="the proxy whose /metrics the planner reads (with $XPYD_API_KEY when it is set)")
    p.add_argument("--etcd", default=None, metavar="HOST:PORT",
                   help="the cluster's etcd: the planner writes its target and decisions there (the proxy's "
                        "/cluster shows them) and reads the workers' /metrics (their prompt and output lengths)")
    p.add_argument("--host", default="127.0.0.1", help="address of its /metrics and /health (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port of its /metrics and /health ({DEFAULT_PORT})")
    g = p.add_argument_group("the planner (as `xpyd up --planner`)")
    add_planner_tuning(g)
    g.add_argument("--sim-profile", default=None, metavar="FILE|NAME",
                   help="the timing profile the fleet model uses: a JSON file (`xpyd bench calibrate` on the "
                        f"workers' engine), a shipped one ({', '.join(shipped_profiles())}); default: the built-in")
    g.add_argument("--batch-size", type=int, default=WorkerConfig(role="decode").batch_size,
                   help="the decode workers' --batch-size (the fleet model's decode batch)")
    g.add_argument("--scrape-timeout", type=float, default=5.0, metavar="S", help="per /metrics read (5)")
    k = p.add_argument_group("--mode scale: the Kubernetes API")
    for role in Role:
        k.add_argument(f"--{role.value}-deployment", default=None, metavar="NAME",
                       help=f"the {role.value} workers' Deployment")
    k.add_argument("--namespace", default=None, help="their namespace (default: the planner pod's own)")
    k.add_argument("--kube-timeout", type=float, default=5.0, metavar="S", help="per API call (5)")
    k.add_argument("--pod-deletion-cost", action="store_true",
                   help="before a drain, give each of the role's pods a deletion cost (the requests its worker "
                        "holds) so the least busy goes; needs list and patch on pods (the chart's "
                        "planner.podDeletionCost) and --etcd")


def config_from_args(args: argparse.Namespace) -> PlannerServiceConfig:
    names = {role: getattr(args, f"{role.value}_deployment") for role in Role}
    return PlannerServiceConfig(
        PlannerMode(args.mode), args.proxy_url.rstrip("/"), args.etcd, args.host, args.port,
        {role: n for role, n in names.items() if n is not None}, args.namespace, args.kube_timeout,
        args.scrape_timeout, os.environ.get("XPYD_API_KEY") or None, args.pod_deletion_cost)


def load_profile(name: str | None) -> SimProfile:
    if name is None or name == "builtin":
        return default_profile()
    return shipped_profile(name) if name in shipped_profiles() else SimProfile.load(name)


class PlannerGauges:
    """The planner's own /metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._desired = Gauge("xpyd_planner_desired_replicas", "Workers of a role the planner wants now (an HPA or "
                              "KEDA target: AverageValue 1 makes replicas = this)", ("role",), registry=self.registry)
        decisions = Counter("xpyd_planner_decisions", "Decisions to start or drain workers, by role and direction",
                            ("role", "direction"), registry=self.registry)
        self._decisions = {(r, d): decisions.labels(r.value, d) for r in Role for d in ("up", "down")}

    def update(self, loop: PlannerLoop, decisions: list[Decision]) -> None:
        if loop.target is not None:
            for role in Role:
                self._desired.labels(role.value).set(loop.target.count(role))
        for d in decisions:
            self._decisions[(d.role, "up" if d.delta > 0 else "down")].inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Scraper:
    """The proxy's and the registered workers' Prometheus texts (``fetch``: on the event loop)."""

    def __init__(self, config: PlannerServiceConfig, session: aiohttp.ClientSession,
                 registry: EtcdRegistry | None) -> None:
        self._config = config
        self._session = session
        self._registry = registry
        self._registry_up = False

    async def fetch(self) -> dict[str, str]:
        """OSError when the proxy's cannot be read (the interval is skipped); a worker's that cannot is left out."""
        key = self._config.api_key
        texts = {PROXY: await self._text(self._config.proxy_url, {"Authorization": f"Bearer {key}"} if key else {})}
        urls = await self._worker_urls()
        got = await asyncio.gather(*(self._text(u, {}) for u in urls), return_exceptions=True)
        texts.update({u: t for u, t in zip(urls, got) if isinstance(t, str)})
        return texts

    async def _text(self, url: str, headers: dict[str, str]) -> str:
        try:
            async with self._session.get(url + "/metrics", headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=self._config.scrape_timeout_s)) as r:
                if r.status != 200:
                    raise OSError(f"{url}/metrics: HTTP {r.status}")
                return (await r.content.read(16 << 20)).decode(errors="replace")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise OSError(f"{url}/metrics: {type(e).__name__}: {e}") from None

    async def _worker_urls(self) -> list[str]:
        if self._registry is None:
            return []
        if not self._registry_up:
            try:
                await self._registry.start()
                self._registry_up = True
            except RegistryError as e:
                log.warning("no worker metrics this interval (prompt and output lengths: defaults): %s", e)
                return []
        return [w.http_url for role in WorkerRole for w in self._registry.workers(role)]


def _threadsafe(loop: asyncio.AbstractEventLoop, timeout_s: float, make):
    """A blocking call, for the tick's thread, of the coroutine ``make()`` on ``loop``."""
    def call():
        future = asyncio.run_coroutine_threadsafe(make(), loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise OSError(f"no answer within {timeout_s:g}s") from None
    return call


@dataclass(frozen=True, slots=True)
class PlannerParts:
    """What `run` checked before anything starts: the controller and the loop's config."""

    controller: Controller
    loop: PlannerLoopConfig


async def serve(config: PlannerServiceConfig, parts: PlannerParts, stop: asyncio.Event) -> None:
    """Plan and serve /metrics and /health until ``stop`` is set."""
    loop = asyncio.get_running_loop()
    session = aiohttp.ClientSession()
    registry = EtcdRegistry(config.etcd, start_timeout=2.0) if config.etcd else None
    publisher = PlannerPublisher(config.etcd, state_ttl(parts.loop.interval_s)) if config.etcd else None
    kube = ScaleClient(KubeConfig.in_cluster(config.namespace, config.kube_timeout_s)) \
        if config.mode is PlannerMode.SCALE else None
    runner: web.AppRunner | None = None
    try:
        desired = DesiredReplicas() if kube is None else None
        if kube is not None:
            await kube.open()
        urls = None
        if config.pod_deletion_cost and registry is not None:
            def urls(role: Role) -> list[str]:
                return [w.http_url for w in registry.workers(WorkerRole(role.value))]
        workers = Deployments(kube, config.deployments, loop, urls) if kube is not None else desired
        fetch = _threadsafe(loop, 4 * config.scrape_timeout_s, Scraper(config, session, registry).fetch)

        def scrape() -> dict[str, str]:
            texts = fetch()
            if desired is not None:
                desired.seed(texts[PROXY])
            return texts

        planner = PlannerLoop(parts.controller, workers, scrape, parts.loop, lambda line: log.info("%s", line))
        gauges = PlannerGauges()
        plan = asyncio.create_task(_plan(planner, gauges, publisher, stop), name="planner")
        runner = web.AppRunner(_app(gauges, plan, config), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, config.host, config.port).start()
        log.info("planner (--mode %s) for %s on http://%s/metrics", config.mode.value, config.proxy_url,
                 host_port(config.host, config.port))
        await asyncio.wait({plan, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
        stop.set()
        await asyncio.wait({plan}, timeout=STOP_WAIT_S)  # (the tick under way ends: it uses what closes below)
    finally:
        if runner is not None:
            await runner.cleanup()
        if publisher is not None:
            await publisher.clear()
            await publisher.close()
        for closing in (kube, registry):
            if closing is not None:
                await closing.close()
        await session.close()


async def _plan(planner: PlannerLoop, gauges: PlannerGauges, publisher: PlannerPublisher | None,
                stop: asyncio.Event) -> None:
    while not stop.is_set():
        now = time.monotonic()
        if planner.due(now):
            try:
                decisions = await asyncio.to_thread(planner.tick, now)
            except Exception:  # noqa: BLE001 - a bug in one interval must not end the planning
                log.exception("the planner's interval failed")
                decisions = []
            gauges.update(planner, decisions)
            if publisher is not None:
                await publisher.publish(planner.state())
        try:
            await asyncio.wait_for(stop.wait(), max(0.05, planner.next_at - time.monotonic()))
        except TimeoutError:
            pass


def _app(gauges: PlannerGauges, plan: asyncio.Task, config: PlannerServiceConfig) -> web.Application:
    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=gauges.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(_request: web.Request) -> web.Response:
        ok = not plan.done()  # (its loop ended: a bug; the probe restarts the pod)
        return web.json_response({"status": "ok" if ok else "stopped", "mode": config.mode.value},
                                 status=200 if ok else 503)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    return app


async def _main(config: PlannerServiceConfig, parts: PlannerParts) -> None:
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await serve(config, parts, stop)


def parts_from_args(args: argparse.Namespace, mode: PlannerMode) -> PlannerParts:
    """The planner the flags describe; ValueError naming a wrong one."""
    profile = load_profile(args.sim_profile)
    return PlannerParts(*planner_parts(args, profile, args.batch_size, mode, "xpyd planner"))


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        parts = parts_from_args(args, config.mode)
        if config.mode is PlannerMode.SCALE:
            KubeConfig.in_cluster(config.namespace, config.kube_timeout_s)  # (not in a pod: said now)
    except ValueError as e:
        print(f"xpyd planner: error: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_main(config, parts))
    except OSError as e:  # the port is taken
        print(f"xpyd planner: error: {e}", file=sys.stderr)
        return 1
    return 0
