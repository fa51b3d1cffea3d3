"""The two small Python programs the chart runs inside the xpyd image (the proxy's liveness
check and the wait-for-etcd init container), run here against real local sockets."""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from helmchart import Helm

FULLNAME = "demo-xpyd"
SCRIPT_TIMEOUT = 20


class _StatusHandler(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[http.server.HTTPServer]:
    server = http.server.HTTPServer(("127.0.0.1", 0), type("H", (_StatusHandler,), {}))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _deployment(docs: list[dict], name: str) -> dict:
    return next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name)


def _run(command: list[str]) -> subprocess.CompletedProcess:
    assert command[0] == "python"
    return subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True, timeout=SCRIPT_TIMEOUT)


@pytest.mark.parametrize(("status", "alive"), [(200, True), (503, True), (500, False), (404, False)])
def test_proxy_liveness_accepts_200_and_503(helm: Helm, health_server, status: int, alive: bool) -> None:
    port = health_server.server_address[1]
    health_server.RequestHandlerClass.status = status
    docs = helm.template(sets=(f"proxy.port={port}",))
    proxy = _deployment(docs, f"{FULLNAME}-proxy")["spec"]["template"]["spec"]["containers"][0]
    done = _run(proxy["livenessProbe"]["exec"]["command"])
    assert (done.returncode == 0) == alive, done.stderr


def test_proxy_liveness_fails_when_nothing_listens(helm: Helm) -> None:
    docs = helm.template(sets=(f"proxy.port={_free_port()}",))
    proxy = _deployment(docs, f"{FULLNAME}-proxy")["spec"]["template"]["spec"]["containers"][0]
    assert _run(proxy["livenessProbe"]["exec"]["command"]).returncode != 0


def _wait_command(helm: Helm, endpoint: str, timeout: int) -> list[str]:
    docs = helm.template(sets=(f"waitForEtcd.timeoutSeconds={timeout}",))
    (init,) = _deployment(docs, f"{FULLNAME}-decode")["spec"]["template"]["spec"]["initContainers"]
    # Kubernetes expands $(XPYD_ETCD) from the ConfigMap; do the same here.
    return [endpoint if arg == "$(XPYD_ETCD)" else arg for arg in init["command"]]


def test_wait_for_etcd_returns_once_the_port_accepts(helm: Helm) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        done = _run(_wait_command(helm, f"127.0.0.1:{listener.getsockname()[1]}", 10))
    assert done.returncode == 0, done.stderr
    assert "is reachable" in done.stdout


def test_wait_for_etcd_gives_up_after_its_timeout(helm: Helm) -> None:
    done = _run(_wait_command(helm, f"127.0.0.1:{_free_port()}", 1))
    assert done.returncode != 0
    assert "unreachable for 1s" in done.stderr
