"""`xpyd planner --mode scale`'s Kubernetes client (``xpyd.launcher.kube``), its ``Deployments`` workers and the
service around them (``planner_service.serve``, in process) against a fake API server on a real socket: an aiohttp
app serving the scale subresource of two Deployments as the API server does (GET and PATCH
.../deployments/{name}/scale, a bearer token, a merge patch, Status objects for refusals), and their pods (a list by
label selector, a merge patch of annotations) for deletion costs.

There is no Kubernetes here: what a real API server does beyond this (admission, RBAC evaluation, the Deployment
controller acting on the new replicas) is not exercised.
"""

from __future__ import annotations

import asyncio
import json
from argparse import Namespace
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.cluster import free_port
from xpyd.discovery.planner_state import PlannerMode
from xpyd.launcher import planner_service
from xpyd.launcher.kube import DELETION_COST, MERGE_PATCH, KubeConfig, KubeError, ScaleClient
from xpyd.launcher.planner_loop import PlannerLoop, PlannerLoopConfig, WorkersError
from xpyd.launcher.planner_workers import Deployments
from xpyd.planner.controller import Controller, Fleet, PlannerConfig, Role
from xpyd.planner.online_model import Prediction
from xpyd.planner.slo import PlanSLO
from xpyd.proxy.metrics import Outcome, ProxyMetrics

NS = "serving"
TOKEN = "sa-token-1"
NAMES = {Role.PREFILL: "demo-xpyd-prefill", Role.DECODE: "demo-xpyd-decode"}


class FakeAPI:
    """The scale subresource of some Deployments; every request seen is kept (method, path, content type, body)."""

    def __init__(self, replicas: dict[str, int]) -> None:
        self.replicas = dict(replicas)
        self.token = TOKEN
        self.seen: list[tuple[str, str, str | None, dict | None]] = []
        self.delay = 0.0  # seconds before answering
        self.forbid_patch = False
        self.reply: bytes | None = None  # answer this instead (status 200)
        self.pods: dict[str, dict] = {}  # name -> {"labels", "ip", "phase", "deleting", "annotations"}
        self.forbid_pods = False

    def app(self) -> web.Application:
        app = web.Application()
        path = "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"
        app.router.add_get(path, self.handle)
        app.router.add_patch(path, self.handle)
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self.list_pods)
        app.router.add_patch("/api/v1/namespaces/{ns}/pods/{name}", self.patch_pod)
        return app

    def _pods_refused(self, request: web.Request, verb: str) -> web.Response | None:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return _status(401, "Unauthorized", "Unauthorized")
        if self.forbid_pods:
            return _status(403, "Forbidden", f'pods is forbidden: User "system:serviceaccount:{NS}:planner" cannot '
                                             f'{verb} resource "pods"')
        return None

    async def list_pods(self, request: web.Request) -> web.Response:
        self.seen.append(("GET", f"{request.path}?labelSelector={request.query.get('labelSelector')}", None, None))
        if (refused := self._pods_refused(request, "list")) is not None:
            return refused
        wanted = dict(kv.split("=") for kv in request.query["labelSelector"].split(","))
        items = [{"metadata": {"name": name, **({"deletionTimestamp": "2026-11-29T00:00:00Z"} if p["deleting"] else {}),
                               "labels": p["labels"], "annotations": p["annotations"]},
                  "status": {"phase": p["phase"], **({"podIP": p["ip"]} if p["ip"] else {})}}
                 for name, p in self.pods.items() if wanted.items() <= p["labels"].items()]
        return web.json_response({"kind": "PodList", "apiVersion": "v1", "items": items})

    async def patch_pod(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen.append(("PATCH", request.path, request.headers.get("Content-Type"), body))
        if (refused := self._pods_refused(request, "patch")) is not None:
            return refused
        name = request.match_info["name"]
        if name not in self.pods:
            return _status(404, "NotFound", f'pods "{name}" not found')
        self.pods[name]["annotations"].update(body["metadata"]["annotations"])
        return web.json_response({"kind": "Pod", "metadata": {"name": name}})

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        self.seen.append((request.method, request.path, request.headers.get("Content-Type"), body))
        await asyncio.sleep(self.delay)
        ns, name = request.match_info["ns"], request.match_info["name"]
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return _status(401, "Unauthorized", "Unauthorized")
        if ns != NS or name not in self.replicas:
            return _status(404, "NotFound", f'deployments.apps "{name}" not found')
        if request.method == "PATCH":
            if self.forbid_patch:
                return _status(403, "Forbidden", f'deployments.apps "{name}" is forbidden: User '
                                                 f'"system:serviceaccount:{NS}:planner" cannot patch resource '
                                                 f'"deployments/scale"')
            if request.headers.get("Content-Type") not in (MERGE_PATCH, "application/strategic-merge-patch+json"):
                return _status(415, "UnsupportedMediaType", "the body of the request was in an unknown format")
            replicas = body.get("spec", {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                return _status(422, "Invalid", "spec.replicas: Invalid value")
            self.replicas[name] = replicas
        if self.reply is not None:
            return web.Response(body=self.reply, content_type="application/json")
        n = self.replicas[name]
        scale = {"kind": "Scale", "apiVersion": "autoscaling/v1",
                 "metadata": {"name": name, "namespace": ns, "resourceVersion": "123"},
                 "spec": {"replicas": n} if n else {}, "status": {"replicas": n, "selector": f"app=x,component={name.rsplit('-', 1)[1]}"}}
        return web.json_response(scale)


def _status(code: int, reason: str, message: str) -> web.Response:
    return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
                              "reason": reason, "code": code}, status=code)


@pytest.fixture
async def api(tmp_path: Path):
    fake = FakeAPI({NAMES[Role.PREFILL]: 1, NAMES[Role.DECODE]: 2})
    runner = web.AppRunner(fake.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    client = ScaleClient(KubeConfig(f"http://127.0.0.1:{port}", NS, token, timeout_s=1.0))
    await client.open()
    try:
        yield fake, client, token
    finally:
        await client.close()
        await runner.cleanup()


async def test_replicas_are_read_and_set_with_the_token_and_a_merge_patch(api):
    fake, client, _ = api
    assert await client.replicas(NAMES[Role.DECODE]) == 2
    assert await client.scale(NAMES[Role.DECODE], 3) == 3 and fake.replicas[NAMES[Role.DECODE]] == 3
    assert await client.scale(NAMES[Role.PREFILL], 0) == 0  # (a Scale of 0 leaves spec.replicas out)
    path = f"/apis/apps/v1/namespaces/{NS}/deployments/{NAMES[Role.DECODE]}/scale"
    assert fake.seen[:2] == [("GET", path, None, None), ("PATCH", path, MERGE_PATCH, {"spec": {"replicas": 3}})]


async def test_the_token_is_read_again_before_each_call(api):
    fake, client, token = api
    fake.token = "sa-token-2"  # (the kubelet rotated it)
    with pytest.raises(KubeError, match="HTTP 401"):
        await client.replicas(NAMES[Role.PREFILL])
    token.write_text("sa-token-2")
    assert await client.replicas(NAMES[Role.PREFILL]) == 1


async def test_refusals_say_what_was_asked_and_why(api):
    fake, client, _ = api
    with pytest.raises(KubeError, match=r"GET /apis/apps/v1/namespaces/serving/deployments/nope/scale: HTTP 404: "
                                        r"NotFound: deployments.apps \"nope\" not found"):
        await client.replicas("nope")
    fake.forbid_patch = True
    with pytest.raises(KubeError, match=r"HTTP 403: Forbidden: .*cannot patch.*the chart's Role"):
        await client.scale(NAMES[Role.DECODE], 5)
    assert fake.replicas[NAMES[Role.DECODE]] == 2


@pytest.mark.parametrize("reply", [b"<html>proxy error</html>", b'{"kind": "Deployment", "spec": {"replicas": 2}}',
                                   b'{"kind": "Scale", "spec": {"replicas": "two"}}',
                                   b'{"kind": "Scale", "spec": {"replicas": -1}}'])
async def test_an_answer_that_is_not_a_scale_is_an_error(api, reply: bytes):
    fake, client, _ = api
    fake.reply = reply
    with pytest.raises(KubeError, match="not a Scale"):
        await client.replicas(NAMES[Role.DECODE])


async def test_a_server_that_does_not_answer_in_time_is_an_error(api):
    fake, client, _ = api
    fake.delay = 3.0
    with pytest.raises(KubeError, match="TimeoutError: no answer within 1s"):
        await client.replicas(NAMES[Role.DECODE])


async def test_nothing_listening_is_an_error(tmp_path: Path):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    client = ScaleClient(KubeConfig("http://127.0.0.1:9", NS, token, timeout_s=1.0))
    await client.open()
    try:
        with pytest.raises(KubeError, match="GET .*: ClientConnectorError"):
            await client.replicas(NAMES[Role.DECODE])
    finally:
        await client.close()


def test_in_cluster_config_comes_from_the_pods_environment_and_service_account(tmp_path: Path):
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    with pytest.raises(ValueError, match="no service account token"):
        KubeConfig.in_cluster(environ=env, account=tmp_path)
    for name, text in (("token", TOKEN), ("ca.crt", "CA"), ("namespace", "serving\n")):
        (tmp_path / name).write_text(text)
    config = KubeConfig.in_cluster(environ=env, account=tmp_path)
    assert (config.api_url, config.namespace, config.token_file, config.ca_file) == (
        "https://10.96.0.1:443", "serving", tmp_path / "token", tmp_path / "ca.crt")
    assert KubeConfig.in_cluster("other", environ={**env, "KUBERNETES_SERVICE_HOST": "fd00::1"},
                                 account=tmp_path).api_url == "https://[fd00::1]:443"
    with pytest.raises(ValueError, match="not in a Kubernetes pod"):
        KubeConfig.in_cluster(environ={}, account=tmp_path)
    with pytest.raises(ValueError, match="namespace"):
        KubeConfig.in_cluster("Not_A_Namespace", environ=env, account=tmp_path)


# --- the planner's workers: the Deployments, from the tick's thread ------------------------------


async def test_the_fleet_is_the_deployments_replicas_and_changes_are_scale_patches(api):
    fake, client, _ = api
    workers = Deployments(client, NAMES, asyncio.get_running_loop())
    assert await asyncio.to_thread(workers.fleet) == Fleet(1, 2)
    assert await asyncio.to_thread(workers.start, Role.PREFILL) == "demo-xpyd-prefill 1 -> 2 replicas"
    assert await asyncio.to_thread(workers.drain, Role.DECODE) == "demo-xpyd-decode 2 -> 1 replicas"
    assert await asyncio.to_thread(workers.drain, Role.DECODE) is None  # (never under one)
    assert fake.replicas == {NAMES[Role.PREFILL]: 2, NAMES[Role.DECODE]: 1}
    fake.replicas[NAMES[Role.DECODE]] = 4  # (someone ran kubectl scale: the next interval sees it)
    assert await asyncio.to_thread(workers.fleet) == Fleet(2, 4)
    fake.forbid_patch = True
    with pytest.raises(WorkersError, match="HTTP 403"):
        await asyncio.to_thread(workers.start, Role.DECODE)
    fake.delay = 3.0
    with pytest.raises(WorkersError, match="no answer within 1s"):
        await asyncio.to_thread(workers.fleet)


class Capacity:
    """Each prefill worker takes 2 requests/s, each decode worker 1."""

    def predict(self, prefill: int, decode: int, load) -> Prediction:
        rate = load.rate_per_s
        prefill_met = 1.0 if rate <= 2 * prefill else 0.5
        return Prediction(prefill_met, min(prefill_met, 1.0 if rate <= decode else 0.5))


async def test_the_planner_scales_the_deployments_and_records_what_the_api_refused(api):
    fake, client, _ = api
    metrics, said = ProxyMetrics(), []
    config = PlannerConfig(slo=PlanSLO.parse("ttft=2s,itl=200ms,attainment=0.9"), max_workers=8, dwell_s=0)
    loop = PlannerLoop(Controller(config, Capacity()), Deployments(client, NAMES, asyncio.get_running_loop()),
                       lambda: {"proxy": metrics.render()[0].decode()}, PlannerLoopConfig(10.0), said.append)
    await asyncio.to_thread(loop.tick, 0.0)
    for _ in range(30):  # 3 requests/s: 2 prefill and 3 decode workers needed
        metrics.request("/v1/completions").end(Outcome.OK)
    decisions = await asyncio.to_thread(loop.tick, 10.0)
    assert [(d.role, d.delta, d.target) for d in decisions] == [(Role.PREFILL, 1, 2), (Role.DECODE, 1, 3)]
    assert fake.replicas == {NAMES[Role.PREFILL]: 2, NAMES[Role.DECODE]: 3}
    assert [m for m, *_ in fake.seen] == ["GET", "GET", "PATCH", "PATCH"]
    assert [d.workers for d in loop.state().decisions] == [("demo-xpyd-prefill 1 -> 2 replicas",),
                                                           ("demo-xpyd-decode 2 -> 3 replicas",)]
    fake.forbid_patch = True
    for _ in range(60):  # 6 requests/s: more of both, refused
        metrics.request("/v1/completions").end(Outcome.OK)
    await asyncio.to_thread(loop.tick, 20.0)
    assert fake.replicas == {NAMES[Role.PREFILL]: 2, NAMES[Role.DECODE]: 3}
    state = loop.state()
    assert state.target.prefill == 2 and state.target.decode == 3
    assert all("HTTP 403" in d.error for d in state.decisions[2:]) and len(state.decisions) == 4
    assert json.dumps(state.to_dict())


# --- `xpyd planner --mode scale`, in process: the service's loop, thread and API calls together ----------------


async def test_the_scale_mode_service_patches_the_deployments_and_serves_its_gauges(api, monkeypatch):
    fake, client, _ = api
    monkeypatch.setattr(planner_service.KubeConfig, "in_cluster",
                        lambda namespace, timeout: client.config)  # (no pod here: the fake API server instead)
    metrics = ProxyMetrics()

    async def proxy_metrics(_request: web.Request) -> web.Response:
        for _ in range(20):  # 20 requests between two reads: more than 1P2D meets a 1 ms TTFT for
            metrics.request("/v1/completions").end(Outcome.OK)
        return web.Response(body=metrics.render()[0], content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", proxy_metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    proxy = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    port = free_port()
    config = planner_service.PlannerServiceConfig(PlannerMode.SCALE, proxy, port=port, deployments=NAMES,
                                                  kube_timeout_s=1.0)
    args = Namespace(slo="ttft=1ms,itl=1ms", max_workers=5, planner_interval=0.5, planner_dwell=600.0,
                     planner_decisions=None, sim_profile=None, batch_size=8)
    stop = asyncio.Event()
    parts = planner_service.parts_from_args(args, PlannerMode.SCALE)
    serving = asyncio.create_task(planner_service.serve(config, parts, stop))
    try:
        async with aiohttp.ClientSession() as http:
            deadline = asyncio.get_running_loop().time() + 60
            while fake.replicas != {NAMES[Role.PREFILL]: 2, NAMES[Role.DECODE]: 3}:
                assert asyncio.get_running_loop().time() < deadline, fake.replicas
                await asyncio.sleep(0.2)
            async with http.get(f"http://127.0.0.1:{port}/health") as r:
                assert r.status == 200 and (await r.json())["mode"] == "scale"
            async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
                text = await r.text()
            assert 'xpyd_planner_desired_replicas{role="prefill"} 2.0' in text
            assert 'xpyd_planner_desired_replicas{role="decode"} 3.0' in text
            assert 'xpyd_planner_decisions_total{direction="up",role="decode"} 1.0' in text
    finally:
        stop.set()
        await asyncio.wait_for(serving, 60)
        await runner.cleanup()
    assert [(m, ct) for m, _, ct, _ in fake.seen if m == "PATCH"] == [("PATCH", MERGE_PATCH)] * 2


async def test_with_deletion_costs_the_least_busy_running_pod_of_the_role_is_deleted_first(api):
    """Before the drain every running decode pod gets its worker's load as its deletion cost (the worker whose
    address is the pod's IP; one not scraped costs the most); pods of the other role, pods being deleted and
    pods without an IP are left alone; then the Deployment shrinks by one."""
    fake, client, _ = api
    decode = {"app": "x", "component": "decode"}
    for name, ip, phase, deleting in (("d-a", "10.0.0.1", "Running", False), ("d-b", "10.0.0.2", "Running", False),
                                      ("d-c", "10.0.0.3", "Running", False), ("d-old", "10.0.0.4", "Running", True),
                                      ("d-new", "", "Pending", False)):
        fake.pods[name] = {"labels": decode, "ip": ip, "phase": phase, "deleting": deleting, "annotations": {}}
    fake.pods["p-a"] = {"labels": {"app": "x", "component": "prefill"}, "ip": "10.0.1.1", "phase": "Running",
                        "deleting": False, "annotations": {}}
    fake.replicas[NAMES[Role.DECODE]] = 3
    urls = {Role.DECODE: ["http://10.0.0.1:8200", "http://10.0.0.2:8200", "http://10.0.0.4:8200"],
            Role.PREFILL: ["http://10.0.1.1:8100"]}
    loads = {"http://10.0.0.1:8200": 5.0, "http://10.0.0.2:8200": 1.0, "http://10.0.0.4:8200": 0.0}
    workers = Deployments(client, NAMES, asyncio.get_running_loop(), urls=lambda role: urls[role])
    await asyncio.to_thread(workers.fleet)
    said = await asyncio.to_thread(workers.drain, Role.DECODE, loads.get)
    assert said == "demo-xpyd-decode 3 -> 2 replicas (deleted first: d-b, 1 requests)"
    costs = {name: p["annotations"].get(DELETION_COST) for name, p in fake.pods.items()}
    assert costs == {"d-a": "5", "d-b": "1", "d-c": str(2**31 - 1), "d-old": None, "d-new": None, "p-a": None}
    assert fake.replicas[NAMES[Role.DECODE]] == 2
    assert ("GET", f"/api/v1/namespaces/{NS}/pods?labelSelector=app=x,component=decode", None, None) in fake.seen
    patches = [body for method, path, kind, body in fake.seen if method == "PATCH" and "/pods/" in path]
    assert patches[0] == {"metadata": {"annotations": {DELETION_COST: "5"}}}
    fake.forbid_pods = True  # (no RBAC for pods: the drain is not made, and the error says what is missing)
    with pytest.raises(WorkersError, match="HTTP 403.*planner.podDeletionCost"):
        await asyncio.to_thread(workers.drain, Role.DECODE, loads.get)
    assert fake.replicas[NAMES[Role.DECODE]] == 2
