"""The test bed itself (scripts/netbed.py): hosts reach each other over real links, and each fault does
what it says (a cut drops one pair only, loss drops, isolate unplugs, shape limits the rate both ways),
``xpyd bench transfer`` runs its two sides on two hosts, and ``down`` leaves nothing behind."""

from __future__ import annotations

import secrets
import subprocess
import sys
import time

import pytest
from testbed import netbed

# Connect from a host to ADDR:PORT (nothing listens there): "refused" means the SYN got there and the RST
# came back, "blocked" that nothing came back.
PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 9), timeout=float(sys.argv[2])).close()
    print("open")
except ConnectionRefusedError:
    print("refused")
except OSError:
    print("blocked")
"""


def reach(bed, src, dst, timeout: float = 0.4) -> str:
    out = bed.run(src, [sys.executable, "-c", PROBE, bed.host(dst).ip, str(timeout)], check=True)
    return out.stdout.strip()


@pytest.fixture(scope="module")
def hosts(bed):
    return [bed.add_host(n) for n in ("a", "b", "c")]


def test_hosts_have_their_own_address_and_loopback(bed, hosts):
    a, b, c = hosts
    assert len({h.ip for h in hosts}) == 3 and all(h.ip.startswith(bed.subnet.rsplit(".", 1)[0] + ".") for h in hosts)
    out = bed.run(a, ["ip", "-4", "-o", "addr", "show"], check=True).stdout
    assert f"inet {a.ip}/24" in out and "inet 127.0.0.1/8" in out and b.ip not in out
    assert reach(bed, a, b) == reach(bed, b, c) == reach(bed, c, a) == "refused"
    # the root namespace sees the bed only through its access link
    root = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True).stdout
    assert f"inet {bed.access_ip}/24" in root and a.ip not in root


def test_cut_drops_one_pair_both_ways_and_heals(bed, hosts, needs_nft):
    a, b, c = hosts
    bed.cut(a, b)
    try:
        assert reach(bed, a, b) == reach(bed, b, a) == "blocked"
        assert reach(bed, a, c) == reach(bed, c, b) == "refused"  # both still reach the others
    finally:
        bed.heal(b, a)
    assert reach(bed, a, b) == reach(bed, b, a) == "refused"


def test_loss_drops_a_random_share_and_stops(bed, hosts, needs_nft):
    a, b, _ = hosts
    bed.loss(a, 100)
    try:
        assert reach(bed, b, a) == "blocked"
        assert reach(bed, a, a) == "refused"  # (its loopback is spared)
        bed.loss(a, 5)
        rules = bed.run(a, ["nft", "list", "table", "inet", "xnb"], check=True).stdout
        assert rules.count("numgen random mod 100 < 5 drop") == 2  # in and out
    finally:
        bed.no_loss(a)
    assert reach(bed, b, a) == "refused"
    assert "numgen" not in bed.run(a, ["nft", "list", "table", "inet", "xnb"], check=True).stdout


def test_isolate_unplugs_and_rejoin_plugs_back(bed, hosts):
    a, _, c = hosts
    bed.isolate(c)
    try:
        assert reach(bed, a, c) == "blocked"
    finally:
        bed.rejoin(c)
    assert reach(bed, a, c, timeout=2) == "refused"


def test_bench_transfer_runs_between_two_hosts_over_a_shaped_link(bed, hosts):
    from xpyd.bench.transfer_bench import measure, parse_place

    a, b, _ = hosts
    for h in (a, b):
        bed.shape(h, "200mbit")
    try:
        for h in (a, b):  # both ends of each link
            assert "tbf" in bed.run(h, ["tc", "qdisc", "show", "dev", "eth0"], check=True).stdout
        out = subprocess.run(["tc", "-n", bed.switch_ns, "qdisc", "show", "dev", a.switch_dev], capture_output=True,
                             text=True, check=True).stdout
        assert "rate 200Mbit" in out
        report = measure("tcp", [1 << 20], repeats=2, sender=parse_place(f"{a.ip}@{a.ns}"),
                         receiver=parse_place(f"{b.ip}@{b.ns}"))
    finally:
        for h in (a, b):
            bed.unshape(h)
    (r,) = report["results"]
    assert report["sides"]["receiver"] == {"host": b.ip, "netns": b.ns}
    # 200 Mbit/s is 0.025 GB/s: both the backend and the raw socket are held to the link's rate
    assert 0.005 < r["gbps"] < 0.03 and 0.005 < r["socket_gbps"] < 0.03, r


def test_down_removes_everything_with_the_prefix(netbed_ready):
    name = "t" + secrets.token_hex(3)
    bed = netbed.NetBed(name, access=True)
    h = bed.add_host("x")
    sleeper = bed.popen(h, ["sleep", "60"])
    assert netbed.NetBed.attach(name).host("x") == h  # the state is shared through its file
    # (in the namespace before `down` looks for what runs there: `ip netns exec` enters it after its start)
    deadline = time.monotonic() + 10
    while str(sleeper.pid) not in subprocess.run(["ip", "netns", "pids", h.ns], capture_output=True,
                                                 text=True).stdout.split():
        assert time.monotonic() < deadline, "the sleeper never entered its namespace"
        time.sleep(0.01)
    netbed.down(name)
    assert sleeper.wait(10) is not None  # processes left in the bed's hosts are stopped
    assert not [ns for ns in netbed._netns_list() if ns.startswith(f"xnb-{name}-")]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    assert f"xnb{name}" not in links
    assert not (netbed.STATE_DIR / f"{name}.json").exists()


def test_cli_up_status_cut_down(netbed_ready, needs_nft):
    name = "t" + secrets.token_hex(3)
    cli = [sys.executable, str(netbed.__file__), "--name", name]
    try:
        up = subprocess.run([*cli, "up", "--hosts", "p,d", "--rate", "1gbit"], capture_output=True, text=True)
        assert up.returncode == 0, up.stderr
        assert subprocess.run([*cli, "cut", "p", "d"], capture_output=True, text=True).returncode == 0
        status = subprocess.run([*cli, "status"], capture_output=True, text=True).stdout
        assert f"bed {name}:" in status and "rate 1gbit, cut from d" in status
        bed = netbed.NetBed.attach(name)
        assert reach(bed, "p", "d") == "blocked"
        out = subprocess.run([*cli, "exec", "d", "--", "ip", "-4", "-o", "addr", "show", "eth0"],
                             capture_output=True, text=True).stdout
        assert bed.host("d").ip in out
    finally:
        down = subprocess.run([*cli, "down"], capture_output=True, text=True)
    assert down.returncode == 0 and f"xnb-{name}-p" in down.stdout
