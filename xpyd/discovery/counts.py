"""etcd operations counted by kind, for the cost of discovery as the cluster grows.

=================  ================================================================
op                 what
=================  ================================================================
lease_grant        a worker's registration: a new lease
put                a worker's key written (at registration, or again when not ours)
lease_refresh      a worker's keep-alive (every ttl/3)
lease_revoke       a worker leaving
get                a single key read (the keep-alive checks its own key)
get_prefix         a listing of every worker (a watcher's start and each resync)
watch_start        a watch opened
watch_event        an event received on a watch (a worker put, refreshed or gone)
=================  ================================================================

One ``EtcdOps`` per registration or registry (both may share one: a worker has one of each); counted on the
event loop that makes the calls, read from any thread. Exported by the worker's and the proxy's metrics
(``xpyd_etcd_operations_total``).
"""

from __future__ import annotations

OPS = ("lease_grant", "put", "lease_refresh", "lease_revoke", "get", "get_prefix", "watch_start", "watch_event")


class EtcdOps:
    __slots__ = ("_n",)

    def __init__(self) -> None:
        self._n: dict[str, int] = dict.fromkeys(OPS, 0)

    def count(self, op: str, n: int = 1) -> None:
        if op not in self._n:
            raise ValueError(f"unknown etcd op {op!r}; expected one of {OPS}")
        self._n[op] += n

    def snapshot(self) -> dict[str, int]:
        """op -> operations so far (a copy)."""
        return dict(self._n)
