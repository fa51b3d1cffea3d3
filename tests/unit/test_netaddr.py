"""host:port strings: IPv6 literals are bracketed, IPv4 addresses and names are left as they are."""

from __future__ import annotations

import pytest

from xpyd.netaddr import bracketed, host_port, http_url, is_ipv6
from xpyd.signal.request_id import RequestId
from xpyd.transfer.tcp_wire import format_address, parse_address


@pytest.mark.parametrize("host,port,expected", [
    ("127.0.0.1", 8100, "127.0.0.1:8100"),
    ("0.0.0.0", 1, "0.0.0.0:1"),
    ("localhost", 8200, "localhost:8200"),
    ("prefill-0.xpyd.svc.cluster.local", 8101, "prefill-0.xpyd.svc.cluster.local:8101"),
    ("::1", 8100, "[::1]:8100"),
    ("::", 65535, "[::]:65535"),
    ("fd00::12:34", 8201, "[fd00::12:34]:8201"),
    ("::ffff:127.0.0.1", 9, "[::ffff:127.0.0.1]:9"),
])
def test_host_port_brackets_only_ipv6(host, port, expected):
    assert host_port(host, port) == expected
    assert http_url(host, port) == f"http://{expected}"
    assert format_address(host, port) == expected  # the transfer backends' name for it
    assert parse_address(expected) == (host, port)  # and back


@pytest.mark.parametrize("host,v6", [("127.0.0.1", False), ("example.com", False), ("", False),
                                     ("::1", True), ("fe80::1%eth0", True)])
def test_is_ipv6_and_bracketed(host, v6):
    assert is_ipv6(host) is v6
    assert bracketed(host) == (f"[{host}]" if v6 else host)


def test_ipv6_addresses_fit_request_ids():
    rid = RequestId.new(host_port("::1", 8101), host_port("fd00::2", 8201))
    assert (rid.prefill_addr, rid.decode_addr) == ("[::1]:8101", "[fd00::2]:8201")
