"""Host and port written together, the same way for IPv4, IPv6 and DNS names.

An IPv6 literal is bracketed wherever a port follows it (``[::1]:8100``): in request ids,
worker URLs, ZMQ endpoints and hypercorn binds. IPv4 addresses and names are left as they are.
Also the HTTP keep-alive the proxy and the workers agree on, and listening sockets bound before serving.
"""

from __future__ import annotations

import socket

# HTTP keep-alive between the proxy and its workers: the proxy lets an idle pooled connection go well before
# the worker would close it, so it does not send a request on a connection the worker is closing (aiohttp does
# not retry a POST: it failed as "Server disconnected" when aiohttp's 15 s outlived hypercorn's 5 s). The margin
# is wide because both clocks are event-loop timers: with 64 workers on 2 cores a loop ran seconds late and a
# 3 s / 5 s pair still raced (the proxy then tries once more on a new connection: ``proxy.client``). 30 s of
# idle hold is no new exposure: a stranger who can reach a worker can open connections faster than 5 s lets go.
WORKER_KEEP_ALIVE = 30.0  # seconds a worker keeps an idle HTTP connection open
PROXY_KEEP_ALIVE = 3.0  # seconds the proxy keeps an idle pooled connection to a worker


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


def reserve_tcp(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to ``host:port`` but not yet listening, for a server that starts later
    (hypercorn takes it as ``fd://N`` and listens on it).

    Binding first, before a worker spends seconds loading its model, makes a taken port an error at once
    and keeps the port ours meanwhile: a port that is only chosen (a number in a flag) can be taken as the
    local end of any outgoing connection, or of a readiness probe connecting to itself (a TCP
    self-connect, possible for ports in the ephemeral range), and the server's own bind then fails. Until
    the server listens, connections are refused as before. Raises ``OSError`` (``EADDRINUSE``).
    ``reuse_port``: SO_REUSEPORT, for processes that all listen on the port (``xpyd proxy --workers``).
    """
    sock = socket.socket(socket.AF_INET6 if is_ipv6(host) else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted sockets inherit it
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def reserve_listen(host: str, port: int) -> socket.socket:
    """``reserve_tcp`` for a server's own port: a taken one is a ValueError saying so (one line for the user)."""
    try:
        return reserve_tcp(host, port)
    except OSError as e:
        raise ValueError(f"cannot listen on {host_port(host, port)}: {e.strerror or e}") from None


def fd_bind(sock: socket.socket) -> str:
    """The hypercorn ``bind`` entry that hands it ``sock`` (hypercorn owns and closes the descriptor)."""
    return f"fd://{sock.detach()}"
