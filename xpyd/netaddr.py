"""Host and port written together, the same way for IPv4, IPv6 and DNS names.

An IPv6 literal is bracketed wherever a port follows it (``[::1]:8100``): in request ids,
worker URLs, ZMQ endpoints and hypercorn binds. IPv4 addresses and names are left as they are.
"""

from __future__ import annotations

import socket


def is_ipv6(host: str) -> bool:
    """True for an IPv6 literal (``::1``, ``fe80::1%eth0``); names and IPv4 addresses hold no colon."""
    return ":" in host


def bracketed(host: str) -> str:
    """``host``, in brackets if it is an IPv6 literal (how it goes before ``:port``)."""
    return f"[{host}]" if is_ipv6(host) else host


def host_port(host: str, port: int) -> str:
    """``host:port``, or ``[host]:port`` for an IPv6 literal."""
    return f"{bracketed(host)}:{port}"


def http_url(host: str, port: int) -> str:
    return f"http://{host_port(host, port)}"


def listen_tcp(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A listening TCP socket: IPv6 for an IPv6 literal, IPv4 otherwise (names resolve to IPv4, as before)."""
    family = socket.AF_INET6 if is_ipv6(host) else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=backlog)
