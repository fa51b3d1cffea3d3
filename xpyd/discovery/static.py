"""Static discovery: worker URLs given on the command line.

``start()`` asks every worker for ``GET {url}/xpyd/info`` (retrying until it
answers or the timeout passes), then checks that each worker has the role it
was listed under and that all of them serve the same model with the same
protocol version. The set never changes afterwards; a worker that dies later
shows up as failed requests, not as a registry change.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import aiohttp

from xpyd.discovery.base import RegistryError
from xpyd.discovery.types import Role, WorkerInfo

RETRY_INTERVAL = 0.25  # seconds between attempts while a worker is starting
ATTEMPT_TIMEOUT = 5.0  # one GET /xpyd/info


class StaticRegistry:
    def __init__(
        self, prefill_urls: list[str], decode_urls: list[str], timeout: float = 60.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        """``headers``: sent with every ``/xpyd/info`` (the proxy's credential, where workers require one)."""
        if not prefill_urls or not decode_urls:
            raise ValueError("static discovery needs at least one prefill and one decode URL")
        urls = [u.rstrip("/") for u in [*prefill_urls, *decode_urls]]
        if len(set(urls)) != len(urls):
            raise ValueError(f"duplicate worker URL in {urls}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        self._urls = {
            Role.PREFILL: [u.rstrip("/") for u in prefill_urls],
            Role.DECODE: [u.rstrip("/") for u in decode_urls],
        }
        self._timeout = timeout
        self._headers = dict(headers or {})
        self._workers: dict[Role, list[WorkerInfo]] = {Role.PREFILL: [], Role.DECODE: []}

    async def start(self) -> None:
        deadline = time.monotonic() + self._timeout
        timeout = aiohttp.ClientTimeout(total=ATTEMPT_TIMEOUT)
        async with aiohttp.ClientSession(timeout=timeout, headers=self._headers) as session:
            tasks = {
                (role, url): asyncio.create_task(self._fetch(session, url, role, deadline))
                for role, urls in self._urls.items()
                for url in urls
            }
            try:
                await asyncio.gather(*tasks.values())
            finally:
                for task in tasks.values():
                    task.cancel()
        fetched = {role: [tasks[role, url].result() for url in urls]
                   for role, urls in self._urls.items()}
        _check_consistent([*fetched[Role.PREFILL], *fetched[Role.DECODE]])
        self._workers = fetched

    def workers(self, role: Role) -> list[WorkerInfo]:
        return list(self._workers[role])

    async def close(self) -> None:
        self._workers = {Role.PREFILL: [], Role.DECODE: []}

    async def _fetch(
        self, session: aiohttp.ClientSession, url: str, role: Role, deadline: float
    ) -> WorkerInfo:
        last_error = "no attempt made"
        while True:
            try:
                async with session.get(f"{url}/xpyd/info") as resp:
                    if resp.status == 200:
                        info = WorkerInfo.from_dict(await resp.json(content_type=None))
                        break
                    if resp.status == 401:  # retrying will not help
                        raise RegistryError(
                            f"{role.value} worker {url} refused the proxy (HTTP 401): give the proxy the "
                            "workers' --cluster-token ($XPYD_CLUSTER_TOKEN)")
                    last_error = f"HTTP {resp.status}"
            except aiohttp.InvalidURL as e:
                raise RegistryError(f"{role.value} worker: invalid URL {url!r}") from e
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                last_error = f"{type(e).__name__}: {e}"
            except ValueError as e:  # bad JSON or bad WorkerInfo: retrying will not help
                raise RegistryError(f"{role.value} worker {url}: {e}") from e
            if time.monotonic() + RETRY_INTERVAL > deadline:
                raise RegistryError(
                    f"{role.value} worker {url} not ready after {self._timeout:g}s "
                    f"(GET {url}/xpyd/info: {last_error})"
                )
            await asyncio.sleep(RETRY_INTERVAL)
        if info.role is not role:
            raise RegistryError(
                f"worker {url} was given as {role.value} but reports role {info.role.value}"
            )
        # The URL we were given is how we reach it; the worker may report a bind address.
        return dataclasses.replace(info, http_url=url)


def _check_consistent(infos: list[WorkerInfo]) -> None:
    models = {i.model_id for i in infos}
    if len(models) > 1:
        detail = ", ".join(f"{i.http_url}={i.model_id}" for i in infos)
        raise RegistryError(f"workers serve different models: {detail}")
    versions = {i.protocol_version for i in infos}
    if len(versions) > 1:
        detail = ", ".join(f"{i.http_url}=v{i.protocol_version}" for i in infos)
        raise RegistryError(f"workers speak different protocol versions: {detail}")
