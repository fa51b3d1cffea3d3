"""`xpyd up` as a user runs it: ready message, serving, a worker that dies restarted (static 1P1D: 503 while
it is down), and a clean stop on Ctrl-C / SIGTERM, or every child gone with it when it is SIGKILLed.

The first three tests share one static 1P1D `xpyd up`, in this order: it serves; its decode worker is killed
and restarted, and it serves again; Ctrl-C stops it (with the restarted worker). Each runs alone too.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import STARTUP, UpProcess, bindable, free_port, free_port_run, has_ipv6_loopback, up_child_pid, wait_until
from tests.e2e.test_dead_workers import stream_once
from xpyd.child import die_with_parent


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _start_up(model: Path, log: Path, port: int, pp: int, dp: int, *extra: str) -> subprocess.Popen:
    """`xpyd up` on the tiny model with the given ports, output to `log`."""
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "xpyd", "up", "--model", str(model), *extra, "--port", str(port),
         "--prefill-port", str(pp), "--decode-port", str(dp), "--dtype", "float32", "--threads", "1",
         "--max-model-len", "256"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent)


def _wait_ready(proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while "Press Ctrl-C to stop" not in log.read_text(errors="replace"):
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)


def _stop_and_check(proc: subprocess.Popen, stop_signal: int, children: list[int], ports: list[int],
                    host: str = "127.0.0.1") -> None:
    """Send ``stop_signal`` to `xpyd up`: it exits (0, or killed by SIGKILL), no child outlives it and every
    port is free again."""
    proc.send_signal(stop_signal)
    # SIGKILL cannot be handled: the children still go (parent-death signal)
    assert proc.wait(30) == (-signal.SIGKILL if stop_signal == signal.SIGKILL else 0)
    deadline = time.monotonic() + 10
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(c) for c in children), "orphaned child processes"
    for p in ports:
        assert bindable(p, host), f"port {p} still in use"


def _complete(url: str, max_tokens: int) -> dict:
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps({"prompt": "hello there", "max_tokens": max_tokens, "temperature": 0}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def static_up(tiny_model_dir: Path, tmp_path_factory):
    """A static 1P1D `xpyd up`, serving (see the module docstring for the order of the tests that share it)."""
    up = UpProcess(tiny_model_dir, tmp_path_factory.mktemp("up") / "up.log", "--max-model-len", "256")
    try:
        up.wait_ready()
        yield up
    finally:
        children = _children(up.proc.pid)
        up.stop()  # (SIGTERM, if the Ctrl-C test has not stopped it)
        for c in children:
            if _alive(c):
                os.kill(c, signal.SIGKILL)
    assert up.proc.returncode == 0, up.text()[-3000:]


def test_up_prints_its_url_and_serves(static_up: UpProcess):
    text = static_up.text()
    assert f"http://127.0.0.1:{static_up.port}/v1" in text and "curl " in text
    assert len(_children(static_up.proc.pid)) == 3  # proxy, prefill, decode
    assert _complete(static_up.url, 5)["usage"]["completion_tokens"] == 5


def test_static_1p1d_answers_503_while_its_decode_worker_is_down_then_serves_again(static_up: UpProcess):
    up = static_up
    assert stream_once(up.url, 0).outcome == "ok"
    victim_pid = up_child_pid(up.proc.pid, "decode", up.dp)
    os.kill(victim_pid, signal.SIGKILL)
    wait_until(lambda: "decode 0 exited unexpectedly" in up.text(), 10, "the launcher noticed the exit")

    body = json.dumps({"prompt": "hi", "max_tokens": 4}).encode()
    req = urllib.request.Request(up.url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 503
    assert int(err.value.headers["Retry-After"]) >= 1
    assert "no decode worker available" in json.loads(err.value.read())["error"]["message"]

    def serving() -> bool:
        return stream_once(up.url, 1).outcome == "ok"
    wait_until(serving, STARTUP, "served again after the restart")
    assert up_child_pid(up.proc.pid, "decode", up.dp) != victim_pid
    assert up.proc.poll() is None and len(_children(up.proc.pid)) == 3


# Ctrl-C and a handled stop signal: SIGINT here; SIGTERM takes the same path in `xpyd up` (one handler for
# both, xpyd/launcher/up.py) and is sent, with the same checks, by the IPv6 tests below.
def test_ctrl_c_stops_every_child(static_up: UpProcess):
    up = static_up
    children = _children(up.proc.pid)
    assert len(children) == 3  # proxy, prefill, decode (restarted, after the test above)
    _stop_and_check(up.proc, signal.SIGINT, children, [up.port, up.pp, up.pp + 1, up.dp, up.dp + 1])


def test_sigkilled_up_takes_every_child_with_it(tiny_model_dir: Path, tmp_path: Path):
    port, pp, dp = free_port_run(1), free_port_run(2), free_port_run(2)
    log = tmp_path / "up.log"
    proc = _start_up(tiny_model_dir, log, port, pp, dp)
    try:
        _wait_ready(proc, log)
        children = _children(proc.pid)
        assert len(children) == 3  # proxy, prefill, decode
        assert _complete(f"http://127.0.0.1:{port}", 5)["usage"]["completion_tokens"] == 5
        _stop_and_check(proc, signal.SIGKILL, children, [port, pp, pp + 1, dp, dp + 1])
    finally:
        if proc.poll() is None:
            proc.kill()
        for c in _children(proc.pid):
            os.kill(c, signal.SIGKILL)


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback (::1) on this machine")
@pytest.mark.parametrize("mode", ["static", "etcd"])
def test_up_serves_on_the_ipv6_loopback(tiny_model_dir: Path, tmp_path: Path, mode: str):
    """Static 1P1D, and dynamic 1P1D through etcd: the workers register their IPv6 addresses
    (``/workers/{role}/::1/{port}``) and the proxy routes to what it watches."""
    port, pp, dp = free_port_run(1, "::1"), free_port_run(2, "::1"), free_port_run(2, "::1")
    etcd_port = free_port_run(2)
    extra = ["--prefill", "1", "--decode", "1", "--etcd-port", str(etcd_port)] if mode == "etcd" else []
    log = tmp_path / "up.log"
    proc = _start_up(tiny_model_dir, log, port, pp, dp, "--host", "::1", *extra)
    try:
        _wait_ready(proc, log)
        assert f"http://[::1]:{port}/v1" in log.read_text()
        if mode == "etcd":
            text = log.read_text()
            assert f"registered /workers/prefill/::1/{pp} in etcd" in text, text[-3000:]
            assert f"registered /workers/decode/::1/{dp} in etcd" in text, text[-3000:]
        req = urllib.request.Request(
            f"http://[::1]:{port}/v1/completions",
            data=json.dumps({"prompt": "hello there", "max_tokens": 5, "temperature": 0,
                             "ignore_eos": True}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 5
        children = _children(proc.pid)
        assert len(children) == (4 if mode == "etcd" else 3)  # (etcd,) proxy, prefill, decode
        _stop_and_check(proc, signal.SIGTERM, children, [port, pp, pp + 1, dp, dp + 1], "::1")
        if mode == "etcd":
            assert all(bindable(p) for p in (etcd_port, etcd_port + 1)), "etcd's ports still in use"
    finally:
        if proc.poll() is None:
            proc.kill()
        for c in _children(proc.pid):
            os.kill(c, signal.SIGKILL)


def test_up_refuses_busy_port(tiny_model_dir: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "xpyd", "up", "--model", str(tiny_model_dir), "--port", str(busy)],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert f"proxy port {busy}" in r.stderr


def test_up_refuses_a_restart_backoff_above_its_maximum_before_starting_anything(tiny_model_dir: Path):
    r = subprocess.run([sys.executable, "-m", "xpyd", "up", "--model", str(tiny_model_dir), "--port", str(free_port()),
                        "--restart-backoff", "5", "--max-restart-backoff", "2"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2, r.stderr
    assert "--restart-backoff (5) <= --max-restart-backoff (2)" in r.stderr and "Traceback" not in r.stderr


def test_worker_on_a_taken_port_says_so_before_loading_the_model(tiny_model_dir: Path):
    """The HTTP port is bound first: a taken one is a one-line error, not a traceback after the model load
    (and while the model loads, no other socket can take the port from under the worker)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "xpyd", "decode", "--model", str(tiny_model_dir), "--port", str(busy)],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert f"cannot listen on 127.0.0.1:{busy}: Address already in use" in r.stderr
    assert "loading" not in r.stderr and "Traceback" not in r.stderr


def test_up_refuses_a_device_this_machine_lacks_before_starting_anything(tiny_model_dir: Path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = subprocess.run([sys.executable, "-m", "xpyd", "up", "--model", str(tiny_model_dir), "--device", "cuda"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "CUDA is not available" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("cmd", ["up", "proxy", "prefill", "decode", "planner"])
def test_help(cmd):
    r = subprocess.run([sys.executable, "-m", "xpyd", cmd, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    assert "--port" in r.stdout


def test_port_runs_handed_out_to_tests_never_overlap():
    """Two runs taken one after the other, before anything listens on them (an `xpyd up`'s prefill and
    decode ranges), never share a port: the allocator remembers what it handed out, and skips a port
    something listens on."""
    from tests.cluster import PortAllocator

    runs = [range(p, p + 4) for p in (free_port_run(4) for _ in range(300))]  # what the tests use
    taken = [q for r in runs for q in r]
    assert len(taken) == len(set(taken)) == 1200
    assert all(20000 <= q < 32000 for q in taken)  # below the ephemeral range
    slices = [PortAllocator(seed=1, worker=f"gw{i}", workers="3") for i in range(3)]  # pytest-xdist's processes
    given = [set(range(p, p + 4)) for a in slices for p in (a.take(4) for _ in range(50))]
    assert len(set().union(*given)) == 600  # no two test processes hand out one port
    ports = PortAllocator(seed=1)
    with socket.create_server(("127.0.0.1", ports._next)) as busy:  # the port it would hand out next
        assert ports.take(1) != busy.getsockname()[1]
