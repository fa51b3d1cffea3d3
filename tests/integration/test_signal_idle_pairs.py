"""What an idle prefill/decode pair costs on the signal plane: nothing. A decode worker heartbeats only the
prefill workers that hold requests of its own, and closes a session that held none and carried nothing for a
while (the prefill worker hears the session end; the next request opens a new one). Real sockets, a real
signal server and client in this process."""

from __future__ import annotations

import time

from tests.integration.test_signal_plane import Handler, _client, _pump, _ready
from tests.waiting import wait_until
from xpyd.signal.client import PeerState
from xpyd.signal.server import SignalServer


def _two_servers():
    servers = [SignalServer("127.0.0.1", 0, h) for h in (Handler(), Handler())]
    for s in servers:
        s.start()
    return servers, [f"127.0.0.1:{s.port}" for s in servers]


def test_heartbeats_go_only_to_prefill_workers_holding_requests():
    servers, (busy, idle) = _two_servers()
    c = _client()
    try:
        _ready(c, busy)
        _ready(c, idle)
        sent = c.counts.snapshot().get(("sent", "heartbeat"), 0)
        c.heartbeat(0.0, {busy})
        _pump(c, lambda r, f: not c.get(busy).pending)
        assert c.counts.snapshot().get(("sent", "heartbeat"), 0) == sent + 1
        assert servers[0].counts.snapshot().get(("received", "heartbeat"), 0) == 1
        assert servers[1].counts.snapshot().get(("received", "heartbeat"), 0) == 0
        c.heartbeat(0.0, set())  # nobody holds requests: nothing is sent
        assert c.counts.snapshot().get(("sent", "heartbeat"), 0) == sent + 1
    finally:
        c.close()
        for s in servers:
            s.close()


def test_an_idle_session_is_closed_and_reopened_on_demand():
    servers, (busy, idle) = _two_servers()
    c = _client()
    try:
        _ready(c, busy)
        _ready(c, idle)
        assert c.close_idle(60.0, set()) == []  # both just spoke
        time.sleep(0.05)  # (both were sent nothing since: idle for at least this long)
        assert c.close_idle(0.05, {busy}) == [idle]
        assert c.get(idle) is None and c.get(busy).state is PeerState.READY
        wait_until(lambda: [a for a, _ in servers[1]._handler.closed] != [], "the prefill side to see it end")
        assert servers[0]._handler.closed == []
        _ready(c, idle)  # the next request for it opens a new session
        assert c.get(idle).state is PeerState.READY
    finally:
        c.close()
        for s in servers:
            s.close()
