#!/usr/bin/env python3
"""A multi-host test bed on one Linux machine: network namespaces as hosts, joined through a bridge.

Each host is a network namespace with its loopback up and one veth link (``eth0``, an address in a
private /24, 10.77.N.0/24) plugged into a Linux bridge. The bridge lives in a namespace of its own (the
"switch"), so the root namespace sees nothing of the bed unless asked for an access link (``access=True``
/ ``up --access``): a veth from the root namespace into the switch, with the address .254, through
which the machine's own processes (a test, curl) reach every host.

What a bed can do to a host's traffic:

- ``shape``: bandwidth, with ``tc ... tbf`` on both directions of the host's link (host-side egress and
  switch-side egress);
- ``cut`` / ``heal``: drop everything between two hosts, both ways (nftables in the first one's namespace),
  while both still reach everyone else;
- ``isolate`` / ``rejoin``: the host's switch port down / up (a pulled cable: the host's link loses
  carrier, packets are dropped, nothing is refused);
- ``loss``: drop a random share of the host's packets, both directions (nftables ``numgen random``).

Latency, jitter and reordering cannot be emulated: they need ``netem``, which this kernel lacks.

Every name starts with ``xnb-<bed>-`` (namespaces) or ``xnb<bed>`` (the root-side access link), so beds
run side by side and ``down`` finds a bed's leftovers after a crash. A bed's state is a JSON file in
/run/xpyd-netbed/, so the CLI can act on a bed a program made, and the other way round.

Library::

    with NetBed("demo", access=True) as bed:
        a, b = bed.add_host("a"), bed.add_host("b")
        bed.shape(a, "1gbit")
        server = bed.popen(b, ["iperf3", "-s", "-1"])
        bed.run(a, ["iperf3", "-c", b.ip, "-t", "2"])
        bed.cut(a, b); bed.heal(a, b)

CLI (root)::

    netbed.py up --hosts a,b,c [--rate 1gbit] [--access] [--name bed]
    netbed.py exec a -- python3 -m http.server --bind 10.77.N.1
    netbed.py cut a b / heal a b / loss a 5 (0: none) / shape a 100mbit / isolate a / rejoin a
    netbed.py status
    netbed.py down [--name bed | --all]

Standard library only (Python 3.11); needs ``ip`` and ``tc`` (iproute2), and ``nft`` (nftables) for
``cut`` and ``loss``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Sequence

PREFIX = "xnb"  # every namespace is xnb-<bed>-<host>; the root-side access link is xnb<bed>
STATE_DIR = Path(os.environ.get("XPYD_NETBED_DIR", "/run/xpyd-netbed"))
SUBNET_BASE = "10.77"  # beds take 10.77.N.0/24, N in 1..254, one each
ACCESS_HOST = 254  # the root namespace's address in a bed with an access link
SWITCH = "switch"  # the bridge's namespace: xnb-<bed>-switch (so no host may be called that)
BRIDGE = "br0"
HOST_LINK = "eth0"  # a host's side of its link
UPLINK = "uplink"  # the switch's side of the access link
NFT_TABLE = "xnb"
COMMAND_TIMEOUT = 30.0
BED_NAME = re.compile(r"[a-z0-9]{1,10}")  # xnb<bed> must fit an interface name (15 characters)
HOST_NAME = re.compile(r"[a-z][a-z0-9]{0,11}")  # v-<host> likewise
RATE = re.compile(r"\d+(\.\d+)?([kmg]?bit|[kmg]?bps)")


class NetBedError(RuntimeError):
    """A command the bed ran failed (the message quotes it and its stderr)."""


class Unsupported(NetBedError):
    """This machine cannot do it (not root, a tool or kernel feature missing): tests skip on this."""


@dataclass(frozen=True)
class Host:
    name: str
    ns: str  # network namespace (``ip netns exec <ns> ...``)
    ip: str  # its address on the bed's /24
    switch_dev: str  # its link's name on the switch (``v-<name>``)


# -- running commands -------------------------------------------------------------------------------


def _run(argv: Sequence[str], input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    except FileNotFoundError:
        raise Unsupported(f"{argv[0]} is not installed ({_PACKAGES.get(argv[0], argv[0])})") from None
    if check and done.returncode != 0:
        raise NetBedError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    return done


_PACKAGES = {"ip": "apt-get install iproute2", "tc": "apt-get install iproute2", "nft": "apt-get install nftables"}


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *(["-n", ns] if ns else []), *args], check=check)


def _netns_list() -> list[str]:
    out = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def available() -> str | None:
    """None if beds can be built here, else why not (not root, no iproute2, namespaces refused)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"{PREFIX}-probe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except NetBedError as e:
        return f"cannot create a network namespace: {e}"
    try:
        for what, step in (("a veth pair", ["ip", "-n", probe, "link", "add", "probe0", "type", "veth", "peer",
                                            "name", "probe1"]),
                           ("a bridge", ["ip", "-n", probe, "link", "add", "probe2", "type", "bridge"]),
                           ("a process in a namespace", ["ip", "netns", "exec", probe, "true"])):
            try:
                _run(step)
            except NetBedError as e:
                return f"cannot create {what}: {e}"
    finally:
        _ip("netns", "delete", probe, check=False)
    return None


def nft_missing() -> str | None:
    """None if nftables rules can be set in a bed (cut, loss), else why not."""
    return None if shutil.which("nft") else "nft (nftables) is not installed: apt-get install -y nftables"


# -- state ------------------------------------------------------------------------------------------


def _state_path(name: str) -> Path:
    return STATE_DIR / f"{name}.json"


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """Serialises bed creation and removal between processes (subnets are handed out under it)."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _load(name: str) -> dict:
    try:
        return json.loads(_state_path(name).read_text())
    except FileNotFoundError:
        raise NetBedError(f"no bed named {name!r} (netbed.py status lists them)") from None


def _beds() -> dict[str, dict]:
    out = {}
    for p in sorted(STATE_DIR.glob("*.json")) if STATE_DIR.is_dir() else []:
        try:
            out[p.stem] = json.loads(p.read_text())
        except (OSError, ValueError):
            out[p.stem] = {}
    return out


def _alive(pid: int | None) -> bool:
    if not pid:
        return True  # made by the CLI: lives until `down`
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _free_subnet() -> int:
    used = {state.get("subnet") for state in _beds().values()}
    addrs = _run(["ip", "-4", "-o", "addr", "show"]).stdout  # (the root namespace: where access links land)
    used |= {int(m) for m in re.findall(rf"inet {re.escape(SUBNET_BASE)}\.(\d+)\.", addrs)}
    for n in range(1, 255):
        if n not in used:
            return n
    raise NetBedError(f"every {SUBNET_BASE}.N.0/24 is taken")


# -- the bed ----------------------------------------------------------------------------------------


class NetBed:
    """A bed of namespace hosts on a bridge. ``NetBed(name)`` builds the switch; ``close()`` removes it all.

    ``access=True`` adds a link from the root namespace into the switch (address .254), so this machine's
    own processes reach the hosts. ``owner_pid`` marks who owns the bed (default: this process), so a later
    ``sweep_stale()`` removes it if that process died without cleaning up; 0 = nobody (the CLI's beds).
    """

    def __init__(self, name: str, access: bool = False, owner_pid: int | None = None, *, _state: dict | None = None):
        if not BED_NAME.fullmatch(name):
            raise ValueError(f"bed name must match {BED_NAME.pattern}, got {name!r}")
        self.name = name
        if _state is not None:  # attach to an existing bed
            self._state = _state
            return
        reason = available()
        if reason:
            raise Unsupported(reason)
        with _locked():
            if _state_path(name).exists() or any(ns.startswith(self._ns_prefix) for ns in _netns_list()):
                raise NetBedError(f"a bed named {name!r} exists already (netbed.py down --name {name})")
            self._state = {"name": name, "subnet": _free_subnet(),
                           "owner_pid": os.getpid() if owner_pid is None else owner_pid,
                           "access": None, "hosts": {}, "shaped": {}, "cuts": [], "loss": {}, "isolated": []}
            self._save()  # first: a crash from here on leaves a state file naming the leftovers
        try:
            sw = self.switch_ns
            _ip("netns", "add", sw)
            _ip("link", "add", BRIDGE, "type", "bridge", ns=sw)
            _ip("link", "set", BRIDGE, "up", ns=sw)
            if access:
                dev = f"{PREFIX}{name}"
                self._state["access"] = dev
                self._save()
                _ip("link", "add", dev, "type", "veth", "peer", "name", UPLINK, "netns", sw)
                _ip("link", "set", UPLINK, "master", BRIDGE, ns=sw)
                _ip("link", "set", UPLINK, "up", ns=sw)
                _ip("addr", "add", f"{self._addr(ACCESS_HOST)}/24", "dev", dev)
                _ip("link", "set", dev, "up")
        except BaseException:
            down(name)
            raise

    @classmethod
    def attach(cls, name: str) -> "NetBed":
        """The bed ``name`` as its state file describes it (made by another process, or the CLI)."""
        return cls(name, _state=_load(name))

    # -- names ------------------------------------------------------------------------------------

    @property
    def _ns_prefix(self) -> str:
        return f"{PREFIX}-{self.name}-"

    @property
    def switch_ns(self) -> str:
        return self._ns_prefix + SWITCH

    @property
    def subnet(self) -> str:
        return f"{SUBNET_BASE}.{self._state['subnet']}.0/24"

    @property
    def access_ip(self) -> str | None:
        """The root namespace's address on the bed (None without an access link)."""
        return self._addr(ACCESS_HOST) if self._state["access"] else None

    def _addr(self, index: int) -> str:
        return f"{SUBNET_BASE}.{self._state['subnet']}.{index}"

    def _save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = _state_path(self.name).with_suffix(".tmp")
        tmp.write_text(json.dumps(self._state, indent=1))
        tmp.replace(_state_path(self.name))

    @property
    def hosts(self) -> dict[str, Host]:
        return {n: Host(**h) for n, h in self._state["hosts"].items()}

    def host(self, host: Host | str) -> Host:
        name = host.name if isinstance(host, Host) else host
        try:
            return Host(**self._state["hosts"][name])
        except KeyError:
            raise NetBedError(f"bed {self.name!r} has no host {name!r}") from None

    # -- hosts ------------------------------------------------------------------------------------

    def add_host(self, name: str) -> Host:
        """A new namespace host: loopback up, ``eth0`` with the next free address, plugged into the switch."""
        if not HOST_NAME.fullmatch(name) or name == SWITCH:
            raise ValueError(f"host name must match {HOST_NAME.pattern} and not be {SWITCH!r}, got {name!r}")
        if name in self._state["hosts"]:
            raise NetBedError(f"bed {self.name!r} has a host {name!r} already")
        taken = {int(h["ip"].rsplit(".", 1)[1]) for h in self._state["hosts"].values()}
        index = next(i for i in range(1, ACCESS_HOST + 1) if i not in taken)
        if index == ACCESS_HOST:
            raise NetBedError("a bed holds at most 253 hosts")
        host = Host(name, self._ns_prefix + name, self._addr(index), f"v-{name}")
        self._state["hosts"][name] = asdict(host)
        self._save()
        sw = self.switch_ns
        _ip("netns", "add", host.ns)
        _ip("link", "set", "lo", "up", ns=host.ns)
        _ip("link", "add", host.switch_dev, "type", "veth", "peer", "name", HOST_LINK, "netns", host.ns, ns=sw)
        _ip("link", "set", host.switch_dev, "master", BRIDGE, ns=sw)
        _ip("link", "set", host.switch_dev, "up", ns=sw)
        _ip("addr", "add", f"{host.ip}/24", "dev", HOST_LINK, ns=host.ns)
        _ip("link", "set", HOST_LINK, "up", ns=host.ns)
        return host

    def popen(self, host: Host | str, argv: Sequence[str], **kw) -> subprocess.Popen:
        """``argv`` as a process on ``host`` (``ip netns exec``); keywords go to ``subprocess.Popen``."""
        return subprocess.Popen(["ip", "netns", "exec", self.host(host).ns, *argv], **kw)

    def run(self, host: Host | str, argv: Sequence[str], timeout: float = COMMAND_TIMEOUT,
            **kw) -> subprocess.CompletedProcess:
        """``argv`` on ``host`` to its end (``subprocess.run``; output captured as text unless told)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(["ip", "netns", "exec", self.host(host).ns, *argv], timeout=timeout, **kw)

    # -- link shaping and faults ----------------------------------------------------------------

    def shape(self, host: Host | str, rate: str = "1gbit", burst: str = "256kb", latency: str = "100ms") -> None:
        """Limit both directions of ``host``'s link to ``rate`` (tc tbf on each end's egress)."""
        h = self.host(host)
        if not RATE.fullmatch(rate):
            raise ValueError(f"rate must be like 1gbit, 100mbit or 50mbps, got {rate!r}")
        tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", latency]
        for ns, dev in ((h.ns, HOST_LINK), (self.switch_ns, h.switch_dev)):
            try:
                _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, *tbf])
            except NetBedError as e:
                raise Unsupported(f"tc tbf does not work here: {e}") from None
        self._state["shaped"][h.name] = rate
        self._save()

    def unshape(self, host: Host | str) -> None:
        h = self.host(host)
        for ns, dev in ((h.ns, HOST_LINK), (self.switch_ns, h.switch_dev)):
            _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
        self._state["shaped"].pop(h.name, None)
        self._save()

    def cut(self, a: Host | str, b: Host | str) -> None:
        """Drop every packet between ``a`` and ``b``, both directions; each still reaches the others."""
        a, b = self.host(a), self.host(b)
        self._nft(a, f"add element inet {NFT_TABLE} cut {{ {b.ip} }}")
        pair = sorted([a.name, b.name])
        if pair not in self._state["cuts"]:
            self._state["cuts"].append(pair)
            self._save()

    def heal(self, a: Host | str, b: Host | str) -> None:
        """Undo ``cut(a, b)`` (either order)."""
        a, b = self.host(a), self.host(b)
        for x, y in ((a, b), (b, a)):
            if self._has_table(x):
                _run(["ip", "netns", "exec", x.ns, "nft", "delete", "element", "inet", NFT_TABLE, "cut",
                      f"{{ {y.ip} }}"], check=False)
        pair = sorted([a.name, b.name])
        self._state["cuts"] = [c for c in self._state["cuts"] if c != pair]
        self._save()

    def loss(self, host: Host | str, percent: float) -> None:
        """Drop a random ``percent`` (integer 1..100) of ``host``'s packets each way; 0 removes the loss."""
        h = self.host(host)
        if percent != int(percent) or not 0 <= percent <= 100:
            raise ValueError(f"loss percent must be an integer in 0..100, got {percent!r}")
        percent = int(percent)
        commands = [f"flush chain inet {NFT_TABLE} loss_in", f"flush chain inet {NFT_TABLE} loss_out"]
        if percent:
            match = "" if percent == 100 else f"numgen random mod 100 < {percent} "
            commands += [f"add rule inet {NFT_TABLE} loss_{d} {match}drop" for d in ("in", "out")]
        self._nft(h, "\n".join(commands))
        if percent:
            self._state["loss"][h.name] = percent
        else:
            self._state["loss"].pop(h.name, None)
        self._save()

    def no_loss(self, host: Host | str) -> None:
        self.loss(host, 0)

    def isolate(self, host: Host | str) -> None:
        """Take ``host``'s switch port down: its link loses carrier, every packet to or from it is lost."""
        h = self.host(host)
        _ip("link", "set", h.switch_dev, "down", ns=self.switch_ns)
        if h.name not in self._state["isolated"]:
            self._state["isolated"].append(h.name)
            self._save()

    def rejoin(self, host: Host | str) -> None:
        h = self.host(host)
        _ip("link", "set", h.switch_dev, "up", ns=self.switch_ns)
        self._state["isolated"] = [n for n in self._state["isolated"] if n != h.name]
        self._save()

    def link_bytes(self, host: Host | str) -> tuple[int, int]:
        """(bytes sent, bytes received) on ``host``'s link so far."""
        h = self.host(host)
        out = self.run(h, ["cat", f"/sys/class/net/{HOST_LINK}/statistics/tx_bytes",
                           f"/sys/class/net/{HOST_LINK}/statistics/rx_bytes"], check=True).stdout.split()
        return int(out[0]), int(out[1])

    def _has_table(self, h: Host) -> bool:
        return _run(["ip", "netns", "exec", h.ns, "nft", "list", "table", "inet", NFT_TABLE], check=False).returncode == 0

    def _nft(self, h: Host, commands: str) -> None:
        reason = nft_missing()
        if reason:
            raise Unsupported(reason)
        if not self._has_table(h):  # the host's filter: cut peers and loss, never its loopback
            table = f"""
table inet {NFT_TABLE} {{
  set cut {{ type ipv4_addr; }}
  chain loss_in {{ }}
  chain loss_out {{ }}
  chain in {{ type filter hook input priority 0; policy accept; iifname "lo" accept; ip saddr @cut drop; jump loss_in; }}
  chain out {{ type filter hook output priority 0; policy accept; oifname "lo" accept; ip daddr @cut drop; jump loss_out; }}
}}"""
            try:
                _run(["ip", "netns", "exec", h.ns, "nft", "-f", "-"], input=table)
            except NetBedError as e:
                raise Unsupported(f"nftables does not work here: {e}") from None
        _run(["ip", "netns", "exec", h.ns, "nft", "-f", "-"], input=commands + "\n")

    # -- the end ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Remove the bed (its namespaces, links, state; processes left in its hosts are stopped)."""
        down(self.name)

    def __enter__(self) -> "NetBed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> str:
        s = self._state
        lines = [f"bed {self.name}: {self.subnet}, switch {self.switch_ns}"
                 + (f", access {s['access']} {self.access_ip}" if s["access"] else "")
                 + (f", owner pid {s['owner_pid']}" if s["owner_pid"] else "")]
        present = set(_netns_list())
        for h in self.hosts.values():
            notes = [f"rate {s['shaped'][h.name]}"] if h.name in s["shaped"] else []
            notes += [f"loss {s['loss'][h.name]}%"] if h.name in s["loss"] else []
            notes += ["isolated"] if h.name in s["isolated"] else []
            notes += [f"cut from {'/'.join(n for n in c if n != h.name)}" for c in s["cuts"] if h.name in c]
            notes += [] if h.ns in present else ["NAMESPACE MISSING"]
            lines.append(f"  {h.name:<12} {h.ip:<15} {h.ns}" + (f"  ({', '.join(notes)})" if notes else ""))
        return "\n".join(lines)


# -- removal --------------------------------------------------------------------------------------


def _stop_processes(namespaces: list[str], grace: float = 3.0) -> None:
    """SIGTERM the processes still in ``namespaces`` (the bed started them), SIGKILL after ``grace``."""
    pids = set()
    for ns in namespaces:
        out = _run(["ip", "netns", "pids", ns], check=False).stdout
        pids |= {int(p) for p in out.split() if p.isdigit()}
    pids.discard(os.getpid())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in list(pids):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pids.discard(pid)
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = {pid for pid in pids if _running(pid)}
        if not pids:
            return


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (ended, waiting for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def down(name: str | None = None) -> list[str]:
    """Remove bed ``name`` (None: every bed and leftover with the prefix); returns what was removed."""
    if name is not None and not BED_NAME.fullmatch(name):
        raise ValueError(f"bed name must match {BED_NAME.pattern}, got {name!r}")
    removed = []
    with _locked():
        prefix = f"{PREFIX}-{name}-" if name is not None else f"{PREFIX}-"
        namespaces = [ns for ns in _netns_list() if ns.startswith(prefix)]
        _stop_processes(namespaces)
        for ns in namespaces:  # (the switch goes too: every veth dies with one of its ends)
            _ip("netns", "delete", ns, check=False)
            removed.append(ns)
        links = _run(["ip", "-o", "link", "show"]).stdout
        for dev in re.findall(rf"^\d+: ({PREFIX}[a-z0-9]+)[@:]", links, re.M):
            if name is None or dev == f"{PREFIX}{name}":
                _ip("link", "delete", dev, check=False)
                removed.append(dev)
        for p in [_state_path(name)] if name is not None else list(STATE_DIR.glob("*.json")):
            if p.exists():
                p.unlink()
                removed.append(str(p))
    return removed


def sweep_stale() -> list[str]:
    """Remove the beds whose owner process is gone (a crashed test run), and namespaces with the prefix
    that no bed's state names; returns what was removed. Beds of live owners and of the CLI stay."""
    removed = []
    beds = _beds()
    for name, state in beds.items():
        if not _alive(state.get("owner_pid")) and BED_NAME.fullmatch(name):
            removed += down(name)
    with _locked():
        known = {f"{PREFIX}-{name}-" for name in _beds()}
        orphans = [ns for ns in _netns_list()
                   if ns.startswith(f"{PREFIX}-") and not any(ns.startswith(k) for k in known)]
    for ns in orphans:
        m = re.fullmatch(rf"{PREFIX}-([a-z0-9]+)-.*", ns)
        if m and not _state_path(m.group(1)).exists():
            removed += down(m.group(1))
    return removed


# -- CLI --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="netbed.py", description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="bed", help="the bed to act on (default: %(default)s)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build a bed: the switch and one namespace host per name")
    up.add_argument("--hosts", required=True, help="comma-separated host names, e.g. etcd,proxy,p0,d0")
    up.add_argument("--rate", help="shape every host's link, e.g. 1gbit (tc tbf)")
    up.add_argument("--access", action="store_true", help="a link from the root namespace into the switch (.254)")
    dn = sub.add_parser("down", help="remove the bed (or --all: every bed and leftover)")
    dn.add_argument("--all", action="store_true")
    ex = sub.add_parser("exec", help="run a command on a host: exec HOST -- cmd ...")
    ex.add_argument("host")
    ex.add_argument("command", nargs=argparse.REMAINDER)
    for cmd, text in (("cut", "drop all traffic between A and B"), ("heal", "undo cut A B")):
        p = sub.add_parser(cmd, help=text)
        p.add_argument("a")
        p.add_argument("b")
    ls = sub.add_parser("loss", help="drop PCT%% of HOST's packets each way (0: stop)")
    ls.add_argument("host")
    ls.add_argument("percent", type=int)
    sh = sub.add_parser("shape", help="limit HOST's link to RATE both ways (none: remove)")
    sh.add_argument("host")
    sh.add_argument("rate")
    for cmd, text in (("isolate", "take HOST's switch port down"), ("rejoin", "bring it back up")):
        sub.add_parser(cmd, help=text).add_argument("host")
    sub.add_parser("status", help="the beds and their hosts")
    args = parser.parse_args(argv)
    try:
        return _command(args)
    except (NetBedError, ValueError) as e:
        print(f"netbed: {e}", file=sys.stderr)
        return 1


def _command(args: argparse.Namespace) -> int:
    if args.cmd == "up":
        names = [n.strip() for n in args.hosts.split(",") if n.strip()]
        bed = NetBed(args.name, access=args.access, owner_pid=0)
        try:
            for n in names:
                bed.add_host(n)
                if args.rate:
                    bed.shape(n, args.rate)
        except BaseException:
            bed.close()
            raise
        print(bed.describe())
        return 0
    if args.cmd == "down":
        removed = down(None if args.all else args.name)
        print("\n".join(removed) if removed else "nothing to remove")
        return 0
    if args.cmd == "status":
        beds = _beds()
        for name in beds:
            print(NetBed.attach(name).describe())
        leftovers = [ns for ns in _netns_list() if ns.startswith(f"{PREFIX}-")
                     and not any(ns.startswith(f"{PREFIX}-{b}-") for b in beds)]
        if leftovers:
            print("leftover namespaces (netbed.py down --all): " + " ".join(leftovers))
        if not beds and not leftovers:
            print("no beds")
        return 0
    bed = NetBed.attach(args.name)
    if args.cmd == "exec":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            raise ValueError("exec HOST -- command ...: no command given")
        os.execvp("ip", ["ip", "netns", "exec", bed.host(args.host).ns, *command])
    elif args.cmd == "cut":
        bed.cut(args.a, args.b)
    elif args.cmd == "heal":
        bed.heal(args.a, args.b)
    elif args.cmd == "loss":
        bed.loss(args.host, args.percent)
    elif args.cmd == "shape":
        if args.rate == "none":
            bed.unshape(args.host)
        else:
            bed.shape(args.host, args.rate)
    elif args.cmd == "isolate":
        bed.isolate(args.host)
    elif args.cmd == "rejoin":
        bed.rejoin(args.host)
    print(bed.describe())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
