"""What a worker checks of an HTTP request before it does anything with it.

    /v1/*, /xpyd/*  -> with a cluster token: Authorization: Bearer <ClusterKeys.http_bearer>, else 401
                       (before the body is read; /health and /metrics stay open for probes and scrapers)
    X-Request-Id    -> parsed strictly (400)
                    -> with a cluster token: the proxy's MAC over the id (403 when missing or wrong)
                    -> decode without a token: the prefill worker it names must be known (403 otherwise), or
                       be this decode worker itself (a request it prefills locally: ``xpyd.api.local_prefill``)

A decode worker connects to the prefill worker a request id names. With a cluster token only the proxy
can name one (it signs the id). Without one, the decode worker takes the prefill workers it knows
(``PrefillPeers``): those registered in etcd (``--etcd``) and those listed with ``--prefill-peers``; with
neither, addresses of its own host (loopback and its advertised host), as on one machine (``xpyd up``). An id
naming any other address is refused before anything connects or queues.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Callable, Iterable

from xpyd.api.openai import APIError
from xpyd.signal.request_id import ClusterKeys, RequestId, RequestIdError, SignatureError, split_signature

REQUEST_ID_HEADER = "X-Request-Id"
PEER_WAIT = 2.0  # etcd: seconds a request naming a prefill worker not yet seen here waits for the watch
_GUARDED = ("/v1/", "/xpyd/")


def _host_of(addr: str) -> str:
    host = addr.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") else host


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class PrefillPeers:
    """The prefill workers' signal-plane addresses a decode worker without a cluster token connects to."""

    def __init__(self, listed: Iterable[str] = (), registry: bool = False, own_host: str | None = None) -> None:
        self._listed = frozenset(listed)
        self._registry_mode = registry  # etcd: ``update`` feeds the registered prefill workers
        self._registered: frozenset[str] = frozenset()
        self._local = not self._listed and not registry  # neither: this host's addresses only
        self._own_host = own_host.strip("[]") if own_host else None  # (as _host_of gives it: unbracketed)
        self._changed = asyncio.Event()

    def describe(self) -> str:
        if self._local:
            return "this host's addresses (no --etcd, no --prefill-peers)"
        parts = [f"--prefill-peers {', '.join(sorted(self._listed))}"] if self._listed else []
        if self._registry_mode:
            parts.append(f"{len(self._registered)} registered in etcd")
        return "; ".join(parts)

    def update(self, registered: Iterable[str]) -> None:
        """The prefill workers registered in etcd now (called by the worker's etcd watch)."""
        self._registered = frozenset(registered)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def knows(self, addr: str) -> bool:
        if addr in self._listed or addr in self._registered:
            return True
        if self._local:
            host = _host_of(addr)
            return _is_loopback(host) or (self._own_host is not None and host == self._own_host)
        return False

    async def admits(self, addr: str, wait: float = PEER_WAIT) -> bool:
        """Whether ``addr`` is known; with etcd, one not seen yet is waited for up to ``wait`` seconds (it may
        have registered a moment ago: the proxy's watch can be ahead of ours)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while not self.knows(addr):
            remaining = deadline - loop.time()
            if not self._registry_mode or remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return self.knows(addr)
        return True


class RequestGate:
    """A worker's checks of a request's credentials and id (see the module docstring)."""

    def __init__(self, role: str, cluster_token: str | None, peers: PrefillPeers | None = None,
                 own_addr: Callable[[], str | None] | None = None, accepted_tokens: tuple[str, ...] = ()) -> None:
        """``own_addr()``: a decode worker's own signal address (None until it is known): an id naming it as
        both workers is a request it prefills itself, which connects to nobody. ``accepted_tokens``: bearers
        and signatures of these pass too (a rotation window)."""
        self.role = role
        self._keys = ClusterKeys(cluster_token, accepted_tokens) if cluster_token else None
        self._peers = peers if role == "decode" and self._keys is None else None
        self._own_addr = own_addr

    def guards(self, path: str) -> bool:
        """Whether ``path`` needs the cluster's bearer."""
        return self._keys is not None and (path.startswith(_GUARDED) or path in ("/v1", "/xpyd"))

    def authorized(self, authorization: str | None) -> bool:
        return self._keys is None or self._keys.http_authorized(authorization)

    def parse(self, text: str | None) -> RequestId:
        """The request id of an ``X-Request-Id`` value: APIError 400 if malformed, 403 if its signature fails."""
        try:
            if self._keys is not None:
                return self._keys.verify(text or "")
            return split_signature(text or "")[0]  # (a MAC without a token here: nothing to check it with)
        except SignatureError as e:
            raise APIError(403, f"{REQUEST_ID_HEADER}: {e}", "permission_error", param=REQUEST_ID_HEADER) from None
        except RequestIdError as e:
            raise APIError(400, f"{REQUEST_ID_HEADER}: {e}", param=REQUEST_ID_HEADER) from None

    async def admit(self, text: str | None) -> RequestId:
        """``parse``, and for a decode worker without a token: the prefill worker named must be known (403)."""
        rid = self.parse(text)
        if self._peers is not None and not self._names_itself(rid) and not await self._peers.admits(rid.prefill_addr):
            raise APIError(403, f"{REQUEST_ID_HEADER}: prefill worker {rid.prefill_addr} is not one this decode "
                           f"worker knows ({self._peers.describe()}); list it with --prefill-peers, register it "
                           "in etcd, or give the proxy and every worker a --cluster-token",
                           "permission_error", param=REQUEST_ID_HEADER)
        return rid

    def _names_itself(self, rid: RequestId) -> bool:
        own = self._own_addr() if self._own_addr is not None else None
        return own is not None and rid.prefill_addr == own == rid.decode_addr
