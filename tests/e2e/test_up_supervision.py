"""`xpyd up` keeps serving when a worker dies, as Kubernetes would: the worker is restarted, the others serve.

Real processes started by `xpyd up` (tiny random Llama): a SIGKILLed decode worker under eight streams in
a dynamic 2P2D cluster (etcd). (The only decode worker of a static 1P1D cluster, killed: the proxy answers
503 with Retry-After while the role has no live worker, then serves again, is in
tests/integration/test_launcher.py, on the `xpyd up` its other tests use.)
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

from tests.cluster import STARTUP, http_ok, UpProcess as Up, free_port_run as _free_run, up_child_pid as _worker_pid
from tests.cluster import wait_until as _wait
from tests.e2e.test_dead_workers import CLIENTS, Load, _on, stream_once
from tests.request_log import dispatches

FAULT_BOUND = 2.0  # seconds from the kill to the end of every affected stream

def _json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def test_a_killed_decode_worker_is_restarted_while_the_others_keep_serving(tiny_model_dir: Path, tmp_path: Path):
    etcd_port = _free_run(2)
    up = Up(tiny_model_dir, tmp_path / "up.log", "--max-model-len", "256", "--prefill", "2", "--decode", "2",
            "--etcd-port", str(etcd_port),
            # round robin: the clients' prompts share a prefix, so cache-aware routing may put every stream on
            # one decode worker, and then none is on the survivor to show it keeps serving
            "--batch-size", "4", "--log-requests", "--policy", "round_robin")
    try:
        up.wait_ready()
        victim_url = f"http://127.0.0.1:{up.dp}"
        victim_addr = _json(victim_url + "/xpyd/info")["signal_addr"]
        victim_pid = _worker_pid(up.proc.pid, "decode", up.dp)

        load = Load(up.url)
        try:
            _wait(lambda: sum(1 for r in load.results if r.outcome == "ok") >= CLIENTS, 60, "streams flowing")
            # (killed while it runs streams: on a loaded machine its streams could all have ended at the kill)
            _wait(lambda: _json(victim_url + "/xpyd/stats")["running"] > 0, 60, "streams on the victim")
            os.kill(victim_pid, signal.SIGKILL)
            t_kill = time.monotonic()
            time.sleep(FAULT_BOUND + 0.5)  # the window the affected requests must end in
        finally:
            results = load.stop()
        ids = dispatches(up.text())

        bad = [r for r in results if r.outcome not in ("ok", "error")]
        assert not bad, bad[:5]
        in_flight = [r for r in results if r.start < t_kill < r.end]
        errors = [r for r in in_flight if r.outcome == "error"]
        late = [(round(r.end - t_kill, 3), r.detail) for r in errors if r.end - t_kill > FAULT_BOUND]
        assert not late, late
        assert any(_on(r, victim_addr, ids) or r.outcome == "error" for r in in_flight), in_flight  # it hit some
        assert all(r.rid is None or _on(r, victim_addr, ids) for r in errors), errors
        others = [r for r in in_flight if r.rid is not None and not _on(r, victim_addr, ids)]
        assert others and all(r.outcome == "ok" for r in others), [r for r in others if r.outcome != "ok"]
        assert up.proc.poll() is None, "xpyd up stopped the cluster:\n" + up.text()[-3000:]

        next16 = [stream_once(up.url, i) for i in range(16)]
        assert all(r.outcome == "ok" for r in next16), [r for r in next16 if r.outcome != "ok"]

        # The killed worker is back: a new process on the same port, registered in etcd, routed to.
        _wait(lambda: http_ok(victim_url + "/health"), STARTUP, "restarted decode worker healthy")
        assert _worker_pid(up.proc.pid, "decode", up.dp) != victim_pid

        def routed() -> bool:
            workers = _json(up.url + "/cluster")["workers"]
            return any(w["http_url"] == victim_url and w["health"] == "up" for w in workers)
        _wait(routed, STARTUP, "restarted decode worker registered and up at the proxy")
        text = up.text()
        assert "decode 0 exited unexpectedly (killed by SIGKILL)" in text, text[-3000:]
        assert "decode 0 restarted (restart 1" in text
        assert "stopping the cluster" not in text
    finally:
        up.stop()
    assert up.proc.returncode == 0
