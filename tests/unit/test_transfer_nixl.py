"""The nixl backend's parts that need no NIXL: READ planning, the hello frame, the import guard.

The backend itself runs the transfer contract suite (tests/integration/test_transfer_contract.py)
when NIXL is installed.
"""

from __future__ import annotations

import importlib
import sys

import msgpack
import pytest

from xpyd.transfer import make_backend
from xpyd.transfer.base import Region
from xpyd.transfer.nixl_agent import plan
from xpyd.transfer.nixl_wire import MAX_METADATA, Hello
from xpyd.transfer.tcp_wire import ProtocolError


def _bytes(requests):
    return [sum(n for _, _, n in r) for r in requests]


def test_plan_walks_both_region_lists_in_step_and_caps_each_request():
    src = [Region(0, 10), Region(100, 30)]
    dst = [Region(1000, 25), Region(2000, 15)]
    assert plan(src, dst, 1 << 20) == [[(0, 1000, 10), (100, 1010, 15), (115, 2000, 15)]]
    requests = plan(src, dst, 12)
    assert _bytes(requests) == [12, 12, 12, 4]
    flat = [p for r in requests for p in r]
    assert flat[0] == (0, 1000, 10) and flat[1] == (100, 1010, 2)
    # every byte once, in order, on both sides
    assert [s + i for s, _, n in flat for i in range(n)] == list(range(10)) + list(range(100, 130))
    assert [d + i for _, d, n in flat for i in range(n)] == list(range(1000, 1025)) + list(range(2000, 2015))


def test_plan_refuses_mismatched_totals_and_bad_chunks():
    with pytest.raises(ValueError, match="different byte counts"):
        plan([Region(0, 10)], [Region(0, 11)], 8)
    with pytest.raises(ValueError, match="chunk"):
        plan([Region(0, 10)], [Region(0, 10)], 0)


def test_hello_round_trips_and_rejects_bad_fields():
    h = Hello(1, "xpyd-1-ab", b"\x00md", 4096, 1 << 20)
    frame = h.pack()
    assert Hello.parse(msgpack.unpackb(frame[4:], raw=False)) == h
    good = {"t": "hello", "v": 1, "agent": "a", "md": b"x", "addr": 4096, "size": 10}
    for key, bad in [("md", "text"), ("md", b""), ("md", b"x" * (MAX_METADATA + 1)), ("agent", ""),
                     ("addr", 0), ("addr", -5), ("size", 0), ("size", 1 << 64), ("v", "1"), ("t", "offer")]:
        with pytest.raises(ProtocolError):
            Hello.parse({**good, key: bad})


def test_imports_without_nixl_and_construction_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl", None)  # as if not installed
    for mod in ("xpyd.transfer.nixl_backend", "xpyd.transfer.nixl_agent", "xpyd.transfer.nixl_wire"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
        importlib.import_module(mod)
    with pytest.raises(ImportError, match=r"pip install 'xpyd\[nixl\]'.*pip install --no-deps nixl nixl-cu13"):
        make_backend("nixl")
