"""Processes that talk to etcd and start children keep gRPC's fork handlers off (grpc/grpc#43055: with them
on, a child closing its descriptors before exec can abort on gRPC's restarted poller; seen as a worker that
died with SIGABRT at start, "epoll_wait error: Bad file descriptor", 3 in 60 starts while an etcd client ran)."""

from __future__ import annotations

import os
import subprocess
import sys

_PROBE = "import os, xpyd.discovery.etcd, grpc; print(os.environ.get('GRPC_ENABLE_FORK_SUPPORT'))"


def _probe(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=60,
                         check=True)
    return out.stdout.strip()


def test_importing_the_etcd_registry_turns_grpc_fork_handlers_off():
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    assert _probe(env) == "false"


def test_an_operator_setting_wins():
    env = {**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "true"}
    assert _probe(env) == "true"
