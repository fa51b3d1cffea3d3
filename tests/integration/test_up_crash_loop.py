"""`xpyd up` gives up on a worker that keeps crashing right after it starts: after five fast crashes in a
row it stops the whole cluster (every child, its ports free again) and exits 1, saying why.

The crash loop is real: the decode worker is SIGKILLed once, and its HTTP port is then taken by this test,
so each restart exits at once with "cannot listen" (workers bind their port before anything else).
"""

from __future__ import annotations

import os
import re
import signal
import socket
from pathlib import Path

from tests.cluster import UpProcess, up_child_pid, wait_until

BACKOFF = 0.25  # --restart-backoff: xpyd up waits 0.25, 0.5, 1, 2 s before restarts 1..4 (it doubles)
BACKOFFS = BACKOFF * (1 + 2 + 4 + 8)


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
        except (OSError, ValueError):
            continue
    return out


def test_five_fast_crashes_in_a_row_stop_the_cluster(tiny_model_dir: Path, tmp_path: Path):
    up = UpProcess(tiny_model_dir, tmp_path / "up.log", "--max-model-len", "256", "--restart-backoff", str(BACKOFF))
    squatter = socket.socket()
    try:
        up.wait_ready()
        children = _children(up.proc.pid)
        assert len(children) == 3, children  # prefill, decode, proxy
        victim = up_child_pid(up.proc.pid, "decode", up.dp)
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: victim not in _children(up.proc.pid), 10, "the killed decode worker reaped")
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", up.dp))  # every restart now fails to listen: a crash loop
        squatter.listen()
        assert up.proc.wait(BACKOFFS + 120) == 1
        text = up.text()
        assert text.count("cannot listen on 127.0.0.1:%d" % up.dp) == 4, text[-3000:]  # restarts 1..4 crashed
        assert "decode 0 exited 5 times in a row within 60s of starting" in text, text[-3000:]
        delays = [float(d) for d in re.findall(r"decode 0 exited unexpectedly .* restarting it in ([0-9.]+)s", text)]
        assert delays == [BACKOFF * 2**k for k in range(4)], delays  # the back-off asked for, doubling
        assert "stopping the cluster" in text
        assert not any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in children)  # every child gone
        with socket.socket() as s:  # and their ports free (the proxy's, prefill's)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", up.port))
    finally:
        squatter.close()
        up.stop()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
