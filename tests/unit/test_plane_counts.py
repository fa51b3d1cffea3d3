"""The control plane's plain counters and their Prometheus export: signal-plane messages by kind, etcd
operations by kind, HTTP requests by route, the proxy's routing time."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from xpyd.discovery.counts import OPS, EtcdOps
from xpyd.proxy.metrics import ROUTING_BUCKETS, ProxyMetrics
from xpyd.signal import messages as m
from xpyd.signal.counts import MessageCounts
from xpyd.worker.metrics import WorkerMetrics


def samples(text: bytes) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text.decode()) for s in f.samples}


@pytest.mark.parametrize("msg", [m.Heartbeat("10.0.0.1:7001"), m.HeartbeatReply(), m.Release("a:1", ("r",)),
                                 m.ErrorReply("no"), m.Notify(())])
def test_kind_of_reads_the_tag_of_an_encoded_frame(msg):
    assert m.kind_of(m.encode(7, msg)) == msg.TYPE


@pytest.mark.parametrize("frame", [b"", b"\xc1garbage", m.encode(1, m.Heartbeat("a:1"))[:-3],
                                   b"\x81\xa3msg\x81\xa4type\xa4evil"])  # (a tag no message has)
def test_kind_of_a_frame_without_a_known_tag_is_invalid(frame):
    assert m.kind_of(frame) == "invalid"


def test_message_counts_by_direction_and_kind():
    c = MessageCounts()
    for kind in ("heartbeat", "heartbeat", "lookup_all"):
        c.sent(kind)
    c.received("heartbeat_reply")
    assert c.snapshot() == {("sent", "heartbeat"): 2, ("sent", "lookup_all"): 1,
                            ("received", "heartbeat_reply"): 1}
    assert (c.total("sent"), c.total("received")) == (3, 1)


def test_etcd_ops_refuse_an_unknown_op():
    ops = EtcdOps()
    ops.count("watch_event", 3)
    assert ops.snapshot() == {**dict.fromkeys(OPS, 0), "watch_event": 3}
    with pytest.raises(ValueError, match="unknown etcd op"):
        ops.count("compact")


def test_worker_metrics_export_signal_etcd_and_http_counts():
    w = WorkerMetrics("decode")
    w.signal.sent("heartbeat")
    w.signal.sent("heartbeat")
    w.signal.received("heartbeat_reply")
    w.etcd.count("lease_refresh")
    w.http_request("/xpyd/stats")
    w.http_request("/xpyd/stats")
    got = samples(w.render()[0])
    role = ("role", "decode")
    assert got[("xpyd_signal_messages_total", (("direction", "sent"), ("kind", "heartbeat"), role))] == 2
    assert got[("xpyd_signal_messages_total", (("direction", "received"), ("kind", "heartbeat_reply"), role))] == 1
    assert {k[1]: v for k, v in got.items() if k[0] == "xpyd_etcd_operations_total"} == {
        (("op", op), role): (1.0 if op == "lease_refresh" else 0.0) for op in OPS}
    assert got[("xpyd_http_requests_total", (role, ("route", "/xpyd/stats")))] == 2


def test_proxy_metrics_routing_histogram_and_etcd_ops():
    ops = EtcdOps()
    ops.count("watch_event", 5)
    p = ProxyMetrics(etcd=ops)
    for seconds in (3e-6, 4e-5, 4e-5, 0.0015):
        p.routed(seconds)
    got = samples(p.render()[0])
    bucket = {dict(k[1])["le"]: v for k, v in got.items() if k[0] == "xpyd_proxy_routing_seconds_bucket"}
    assert len(bucket) == len(ROUTING_BUCKETS) + 1
    assert (bucket["5e-06"], bucket["5e-05"], bucket["0.001"], bucket["0.002"], bucket["+Inf"]) == (1, 3, 3, 4, 4)
    assert got[("xpyd_etcd_operations_total", (("op", "watch_event"), ("role", "proxy")))] == 5
    assert not any(k[0] == "xpyd_etcd_operations_total" for k in samples(ProxyMetrics().render()[0]))
