"""`xpyd up --cluster-token`: every child gets the token (in its environment, not on its command line), the
workers' APIs refuse anyone without it, and the proxy, which has it, serves requests end to end."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import UpProcess, up_child_pid
from xpyd.signal.request_id import ClusterKeys

TOKEN = "token-of-xpyd-up-tests"


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def _status(url: str, headers: dict | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture(scope="module")
def up(tmp_path_factory, tiny_model_dir: Path):
    env_token = os.environ.pop("XPYD_CLUSTER_TOKEN", None)  # (the flag is what this test gives)
    u = UpProcess(tiny_model_dir, tmp_path_factory.mktemp("up-token") / "up.log", "--cluster-token", TOKEN,
                  "--max-model-len", "256")
    try:
        u.wait_ready()
        yield u
    finally:
        u.stop()
        if env_token is not None:
            os.environ["XPYD_CLUSTER_TOKEN"] = env_token


def test_up_serves_a_request_end_to_end_with_the_token(up):
    body = json.dumps({"prompt": "the cluster token", "max_tokens": 5, "temperature": 0}).encode()
    req = urllib.request.Request(up.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        data = json.loads(r.read())
    assert data["usage"]["completion_tokens"] == 5 and data["choices"][0]["text"]


def test_every_child_has_the_token_in_its_environment_only(up):
    children = _children(up.proc.pid)
    assert len(children) == 3  # prefill, decode, proxy
    for pid in children:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert not any(TOKEN.encode() in word for word in argv), argv
        assert f"XPYD_CLUSTER_TOKEN={TOKEN}".encode() in environ, argv


def test_each_workers_api_refuses_a_caller_without_the_token(up):
    bearer = {"Authorization": f"Bearer {ClusterKeys(TOKEN).http_bearer}"}
    for role, port in (("prefill", up.pp), ("decode", up.dp)):
        up_child_pid(up.proc.pid, role, port)  # (it is xpyd up's child)
        url = f"http://127.0.0.1:{port}"
        for path in ("/xpyd/info", "/xpyd/stats", "/v1/models"):
            assert _status(url + path) == 401, (role, path)
            assert _status(url + path, bearer) == 200, (role, path)
        assert _status(url + "/health") == 200  # (what xpyd up and probes wait on)


def _up_args(*argv: str):
    import argparse

    from xpyd.launcher import up as launcher

    p = argparse.ArgumentParser()
    launcher.add_arguments(p)
    return launcher, p.parse_args(list(argv))


def test_the_environment_variable_reaches_every_child_and_the_flag_wins(monkeypatch):
    monkeypatch.setenv("XPYD_CLUSTER_TOKEN", "from-the-environment")
    launcher, args = _up_args()
    for proxy in (False, True):
        assert launcher.child_env(args, proxy=proxy)["XPYD_CLUSTER_TOKEN"] == "from-the-environment"
    launcher, args = _up_args("--cluster-token", TOKEN, "--api-key", "sk-0123456789")
    assert launcher.child_env(args)["XPYD_CLUSTER_TOKEN"] == TOKEN
    assert "XPYD_API_KEY" not in launcher.child_env(args)  # (the API key is the proxy's alone)
    assert launcher.child_env(args, proxy=True)["XPYD_API_KEY"] == "sk-0123456789"
    monkeypatch.delenv("XPYD_CLUSTER_TOKEN")
    assert launcher.child_env(_up_args()[1]) is None  # nothing to add: the children inherit this environment


def test_a_token_the_workers_would_refuse_stops_xpyd_up_before_anything_starts(monkeypatch):
    monkeypatch.delenv("XPYD_CLUSTER_TOKEN", raising=False)
    launcher, args = _up_args("--cluster-token", "short")
    with pytest.raises(ValueError, match="8-256"):
        launcher._plan(args)
    assert launcher.run(args) == 2
