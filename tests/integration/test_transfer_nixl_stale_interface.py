"""A nixl sender whose agent started while a network interface existed that is gone since (real NIXL, UCX and
interfaces, in a private network namespace).

A NIXL agent's metadata lists its UCX worker's addresses as they were when the agent started, one per
network interface. UCX prefers the fastest: a veth (10 Gbit/s) over a NIC whose speed it cannot read
(assumed 100 Mbit/s). Once that veth is gone, a receiver whose UCX routes the address through its
default gateway (UCX reads the routing table once per process, here before the veth came) cannot connect
(this machine's gateway answers "network unreachable"; here an unreachable route stands in for it), so
the metadata load fails with NIXL_ERR_BACKEND, at every attempt. The test bed of tests/multihost does just that to the machine's
network namespace (its access link, ``xnb<bed>`` with 10.77.N.254, comes and goes while other test files
run in a parallel pytest worker): it is why the nixl cases of test_transfer_listener_flood.py pin UCX to
loopback.

- Left to UCX's defaults, the transfer fails and the receiver says why (``nixl_agent.PeerUnreachable``).
- With ``UCX_NET_DEVICES=lo`` (what the listener-flood tests set) the same sequence moves the bytes.

Each case runs this file as a program inside ``unshare --net --mount`` (root, iproute2 and veth links
needed; it skips, saying why, without them), so the machine's own interfaces are never touched.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SIZE = 1 << 20
CHUNK = 8192
# The namespace: lo, a NIC (veth eth9, 10.99.0.2/24, default route through 10.99.0.1) and later a veth
# like the test bed's access link (xnbq0, 10.213.7.254/24)
NIC = ("ip link set lo up && ip link add eth9 type veth peer name eth9p && ip addr add 10.99.0.2/24 dev eth9 "
       "&& ip link set eth9 up && ip link set eth9p up && ip route add default via 10.99.0.1")
ACCESS_UP = ("ip link add xnbq0 type veth peer name xnbq1 && ip addr add 10.213.7.254/24 dev xnbq0 "
             "&& ip link set xnbq0 up && ip link set xnbq1 up")
# gone; its subnet is unreachable from now on (as through this machine's gateway)
ACCESS_GONE = "ip link del xnbq0 && ip route add unreachable 10.213.7.0/24"
PRIVATE = 'mount --make-rprivate / && mount -t sysfs sysfs /sys && exec "$@"'  # (/sys: this namespace's links)


@functools.cache
def _why_no_namespace() -> str | None:
    if importlib.util.find_spec("nixl") is None:
        return "NIXL is not installed (pip install --no-deps nixl nixl-cu13)"
    if os.geteuid() != 0:
        return "needs root (a private network namespace with veth links)"
    if not shutil.which("unshare") or not shutil.which("ip"):
        return "needs unshare (util-linux) and ip (iproute2)"
    probe = subprocess.run(["unshare", "--net", "--mount", "sh", "-c",
                            PRIVATE + " && ip link add p0 type veth peer name p1", "sh", "true"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"cannot make a network namespace with a veth link here: {probe.stderr.strip()[:200]}"
    return None


def _run_case(pin_to_loopback: bool) -> dict:
    reason = _why_no_namespace()
    if reason:
        pytest.skip(reason)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("UCX_NET_DEVICES", None)
    if pin_to_loopback:
        env["UCX_NET_DEVICES"] = "lo"
    proc = subprocess.run(["unshare", "--net", "--mount", "sh", "-c", PRIVATE, "sh", sys.executable, __file__],
                          capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    results = [line[len("RESULT "):] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(results) == 1, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    return json.loads(results[0])


def test_a_sender_whose_interface_went_since_its_agent_started_is_refused_with_the_reason():
    out = _run_case(pin_to_loopback=False)
    assert out["seeded"] == "DONE"
    assert out["receiver"] == "FAILED" and not out["landed"]
    assert out["error"].startswith("cannot load the sender's NIXL metadata: NIXL_ERR_BACKEND: UCX could not "
                                   "connect to the agent"), out["error"]
    assert "UCX_NET_DEVICES" in out["error"]


def test_with_ucx_pinned_to_loopback_the_interface_coming_and_going_changes_nothing():
    out = _run_case(pin_to_loopback=True)
    assert out == {"seeded": "DONE", "receiver": "DONE", "error": None, "landed": True}


# -- the program each case runs in its network namespace --------------------------------------------------


def _pair():
    from xpyd.transfer import make_backend

    rx, tx = make_backend("nixl"), make_backend("nixl")
    src = memoryview(bytearray(random.Random(5).randbytes(SIZE)))
    tx.register(src)
    dst = bytearray(SIZE)
    return rx, tx, src, dst, rx.register(memoryview(dst))


def _transfer(pair, tid: str) -> tuple[str, str | None, bool]:
    from xpyd.transfer.auth import new_secret
    from xpyd.transfer.base import Region

    rx, tx, src, dst, desc = pair
    secret = new_secret()
    regions = [Region(0, CHUNK)]
    rtok = rx.expect(tid, regions, secret=secret)
    tx.send(tid, regions, desc, regions, secret=secret).wait(60)
    rtok.wait(60)
    return rtok.state().name, rtok.error, dst[:CHUNK] == src[:CHUNK]


def _sh(command: str) -> None:
    subprocess.run(["sh", "-c", command], check=True, timeout=30)


def _main() -> None:
    _sh(NIC)
    first = _pair()  # a transfer before the veth exists: UCX reads the routing table now (once per process)
    seeded = _transfer(first, "seed")[0]
    _sh(ACCESS_UP)
    pair = _pair()  # both agents list an address on the veth
    _sh(ACCESS_GONE)
    state, error, landed = _transfer(pair, "t0")
    for rx, tx, *_ in (first, pair):
        tx.close()
        rx.close()
    print("RESULT " + json.dumps({"seeded": seeded, "receiver": state, "error": error, "landed": landed}), flush=True)


if __name__ == "__main__":
    _main()
