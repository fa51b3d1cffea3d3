"""`xpyd status`: the workers registered in etcd, as a table (one list of the prefix, no watch)."""

from __future__ import annotations

import asyncio
import sys

from xpyd.discovery.etcd_common import EXPECTED_ERRORS, PREFIX, close_client, connect, describe_error, parse_worker
from xpyd.discovery.types import WorkerInfo

COLUMNS = ("ROLE", "HTTP URL", "SIGNAL ADDR", "MODEL", "CAPACITY")


class EtcdUnreachable(RuntimeError):
    """etcd did not answer the listing."""


async def fetch_workers(endpoint: str, timeout: float = 5.0) -> list[WorkerInfo]:
    """Every valid worker entry under ``/workers/``, sorted by role then URL.

    Entries that are not valid ``WorkerInfo`` (or speak another protocol version) are skipped
    with a note on stderr. Raises EtcdUnreachable if etcd does not answer within ``timeout``.
    """
    client = connect(endpoint)
    try:
        listing = await asyncio.wait_for(client.get_prefix(PREFIX.encode()), timeout)
    except EXPECTED_ERRORS as e:
        if isinstance(e, asyncio.TimeoutError):
            e = TimeoutError(f"no answer within {timeout:g}s")
        raise EtcdUnreachable(f"cannot reach etcd at {endpoint}: {describe_error(e)}") from e
    finally:
        await close_client(client)
    workers = []
    for kv in listing:
        key = kv.key.decode(errors="replace")
        try:
            workers.append(parse_worker(key, kv.value))
        except ValueError as e:
            print(f"skipping {key}: {e}", file=sys.stderr)
    return sorted(workers, key=lambda w: (w.role.value, w.http_url))


def format_workers(workers: list[WorkerInfo]) -> str:
    """An aligned table with a header row: role, http url, signal addr, model, capacity."""
    rows = [COLUMNS] + [
        (w.role.value, w.http_url, w.signal_addr, w.model_id, str(w.capacity)) for w in workers
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def main(endpoint: str) -> int:
    """Print the registered workers; exit code 2 (with the reason on stderr) if etcd is unreachable."""
    try:
        workers = asyncio.run(fetch_workers(endpoint))
    except (ValueError, EtcdUnreachable) as e:  # a malformed endpoint, or no answer
        print(f"xpyd status: {e}", file=sys.stderr)
        return 2
    if not workers:
        print(f"no workers registered in etcd at {endpoint}")
        return 0
    print(format_workers(workers))
    return 0
