"""Where a request goes, and its call started there (the proxy's event loop alone).

    keys(req, tokenizer)  the prompt's token ids and block hashes, for the cache-aware router and the local
                          prefill decision; None when neither has a use for them or they cannot be had (no
                          tokenizer yet, a prompt the workers will refuse): routed by load then
    start(...)            a request that needs no decode step (``prefill_alone``) goes to a prefill worker alone;
                          any other to a decode worker (the router's pick, avoiding decode workers each of whose
                          pairs failed lately while there are others), its prompt computed there or on a prefill
                          worker (``prefill_path``; the router's pick, avoiding those whose path to that decode
                          worker failed lately while there are others); 503 if a role needed has no UP worker.
                          The call starts (``inflight``) under a new ``RequestId`` that names both workers.
    failed(e)             what a failed call says of its workers: one marked down, or their pair avoided a while
    retry_or_raise(...)   a call that failed before the client got anything: started over on a fresh pair when
                          a worker was unreachable or the path between the two failed (``retries`` times at
                          most), else the error raised as the client may read it

The router (``routing``), the prefix index it and the local prefill decision read (cache_aware, or local
prefills), and the calls in flight are the dispatcher's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from xpyd.api.identity import ResponseIdentity
from xpyd.api.openai import APIError, CompletionRequest
from xpyd.discovery.base import Registry
from xpyd.discovery.types import Role, WorkerInfo
from xpyd.proxy.client import WorkerClient
from xpyd.proxy.config import ProxyConfig
from xpyd.proxy.inflight import InFlight, TrackedCall
from xpyd.proxy.metrics import ProxyMetrics
from xpyd.proxy.pairs import PairHealth
from xpyd.proxy.prefill_path import PrefillDecider, PrefillPath
from xpyd.proxy.prefix_index import PrefixIndex, PromptKeys
from xpyd.proxy.prompt_tokens import PromptTokenizer
from xpyd.proxy.routing import NoWorkerError, Policy, Router, make_router
from xpyd.proxy.upstream import Fault, UpstreamError
from xpyd.proxy.workers import Health, WorkerTable
from xpyd.signal.request_id import RequestId

log = logging.getLogger(__name__)

INLINE_PROMPT_CHARS = 1024  # a completion prompt this short is tokenized on the event loop (tens of us)


def prefill_alone(req: CompletionRequest) -> bool:
    """The request needs no decode step: at most one token (max_tokens 1, or 0 with echo: an evaluation
    harness's loglikelihood requests), which prefill samples."""
    return req.max_tokens is not None and req.max_tokens <= 1


class Dispatcher:
    """The proxy's routing over ``registry``'s workers as ``table`` sees them; ``pairs`` says which pairs to
    avoid; ``on_end`` runs when a call ends (a decode worker may have room again)."""

    def __init__(self, config: ProxyConfig, registry: Registry, table: WorkerTable, pairs: PairHealth,
                 metrics: ProxyMetrics, on_end: Callable[[], None]) -> None:
        self.registry = registry
        self.table = table
        self.pairs = pairs
        self.metrics = metrics
        self.log_requests = config.log_requests
        self.decider = PrefillDecider(config.local_prefill_max_tokens)
        # cache_aware, or local prefills: which blocks each worker caches, fed by the poller through the CacheFeed
        # (the proxy's open()); the prompt's tokens come from its tokenizer
        self.index = PrefixIndex() if config.policy is Policy.CACHE_AWARE or self.decider.enabled else None
        self.router: Router = make_router(config.policy, table, self.index)
        self.inflight = InFlight(self.router, pairs, on_end=on_end)

    async def keys(self, req: CompletionRequest, tokenizer: PromptTokenizer | None) -> PromptKeys | None:
        """The prompt's block hashes for the cache-aware router; None when it has no use for them or they
        cannot be had (no tokenizer yet, a prompt the workers will refuse): routed by load then."""
        if tokenizer is None or not (self._have_choice() or self.decider.eligible(req)):
            return None
        try:
            if isinstance(req.prompt, str) and len(req.prompt) <= INLINE_PROMPT_CHARS:
                return tokenizer.keys(req)  # (a thread hop would cost more than the tokenizing)
            return await asyncio.to_thread(tokenizer.keys, req)
        except ValueError as e:
            log.debug("routing a request by load alone: %s", e)
        except Exception:  # routing never fails a request
            log.exception("tokenizing a prompt for routing failed; routing it by load alone")
        return None

    def start(self, client: WorkerClient, req: CompletionRequest, identity: ResponseIdentity,
              failed: UpstreamError | None, keys: PromptKeys | None, prefer: tuple | None = None,
              resume: tuple[int, ...] = ()) -> TrackedCall:
        """``prefer``: a (prefill, decode) pair to call while both are up (another choice's, whose prompt blocks
        they cache); ``resume``: a migrated request's output so far; ``failed``: why the last try failed."""
        began = time.perf_counter()
        if prefill_alone(req):
            return self._start_alone(client, req, identity, failed, keys, began)
        try:
            decode = self._decode_for(keys, prefer)
            path = self.decider.decide(req, keys, self._cached_blocks(decode, keys), resume)
            prefill = self._prefill_for(decode, keys, prefer) if path is PrefillPath.REMOTE else None
        except NoWorkerError as e:
            raise _unavailable(e, failed) from None
        request_id = str(RequestId.new((prefill or decode).signal_addr, decode.signal_addr))
        if self.log_requests:
            log.info("%s -> %s (prefill %s, decode %s)", identity.id, request_id,
                     prefill.http_url if prefill is not None else "on decode", decode.http_url)
        call = self.inflight.start(client, req, prefill, decode, request_id, identity, keys, resume)
        self.metrics.prefill_path(path)
        self.table.prefill_path(decode, path.value)
        self.metrics.routed(time.perf_counter() - began)
        return call

    def _start_alone(self, client: WorkerClient, req: CompletionRequest, identity: ResponseIdentity,
                     failed: UpstreamError | None, keys: PromptKeys | None, began: float) -> TrackedCall:
        """A request that needs no decode step goes to a prefill worker alone: no decode worker claims it, no
        KV moves. Its id names that prefill worker in both places (``RequestId``)."""
        try:
            prefill = self.router.pick(Role.PREFILL, self.registry.workers(Role.PREFILL), keys)
        except NoWorkerError as e:
            raise _unavailable(e, failed) from None
        request_id = str(RequestId.new(prefill.signal_addr, prefill.signal_addr))
        if self.log_requests:
            log.info("%s -> %s (prefill %s alone)", identity.id, request_id, prefill.http_url)
        call = self.inflight.start(client, req, prefill, None, request_id, identity, keys)
        self.metrics.routed(time.perf_counter() - began)
        return call

    def retry_or_raise(self, call: TrackedCall, e: UpstreamError, retries: int,
                       public: Callable[[APIError], APIError]) -> int:
        """``call`` failed before the client got anything: the retries left after this one (it may start over
        on a fresh pair), or the error as the client may read it (``public``), raised."""
        self.failed(e)
        if e.fault in (Fault.UNREACHABLE, Fault.PATH) and retries > 0:
            log.warning("%s (%s): %s; retrying on another pair", call.identity.id, call.request_id, e.message)
            return retries - 1
        level = logging.INFO if e.status < 500 else logging.WARNING
        log.log(level, "%s (%s): %s (HTTP %d)", call.identity.id, call.request_id, e.message, e.status)
        raise public(e) from None

    def failed(self, e: APIError) -> None:
        """Mark the worker behind ``e`` down if the failure says it is unhealthy (or avoid its pair a while)."""
        if not isinstance(e, UpstreamError) or e.fault is Fault.NONE:
            return
        if e.fault is Fault.PATH:
            if e.pair is not None:
                prefill, decode = e.pair
                cooldown = self.pairs.failed(prefill, decode, e.message)
                self.metrics.pair_failed()
                log.warning("avoiding the pair of prefill worker %s and decode worker %s for %gs: %s",
                            prefill.http_url, decode.http_url, cooldown, e.message)
        elif e.worker is not None:
            self.table.mark_down(e.worker, e.message, unreachable=e.fault is Fault.UNREACHABLE)

    def _have_choice(self) -> bool:
        """More than one UP worker for some role (else the blocks would change nothing)."""
        return any(sum(s.health is Health.UP for s in self.table.sync(role, self.registry.workers(role))) > 1
                   for role in Role)

    def _decode_for(self, keys: PromptKeys | None, prefer: tuple | None) -> WorkerInfo:
        """``prefer``'s decode worker while it is up; else the router's pick, avoiding decode workers each of
        whose pairs failed lately (while there are others)."""
        if prefer is not None and prefer[1] is not None and self._up(prefer[1]):
            return prefer[1]
        prefills = self.registry.workers(Role.PREFILL)
        up = [s.info for s in self.table.sync(Role.PREFILL, prefills) if s.health is Health.UP]
        return self.router.pick(Role.DECODE, self.registry.workers(Role.DECODE), keys,
                                avoid=lambda d: self.pairs.stranded_decode(d, up))

    def _prefill_for(self, decode: WorkerInfo, keys: PromptKeys | None, prefer: tuple | None) -> WorkerInfo:
        """``prefer``'s prefill worker while it is up (and ``decode`` is its pair's); else the router's pick,
        avoiding those whose path to ``decode`` failed lately (while there are others)."""
        if prefer is not None and prefer[0] is not None and prefer[1] == decode and self._up(prefer[0]):
            return prefer[0]
        return self.router.pick(Role.PREFILL, self.registry.workers(Role.PREFILL), keys,
                                avoid=lambda p: not self.pairs.usable(p, decode))

    def _cached_blocks(self, decode: WorkerInfo, keys: PromptKeys | None) -> int:
        """The prompt's leading full blocks ``decode`` holds, as far as the prefix index knows."""
        if keys is None or self.index is None or not self.decider.enabled:
            return 0
        return self.index.match(decode, keys.hashes)

    def _up(self, worker: WorkerInfo) -> bool:
        return any(s.info == worker and s.health is Health.UP
                   for s in self.table.sync(worker.role, self.registry.workers(worker.role)))


def _unavailable(e: NoWorkerError, failed: UpstreamError | None) -> APIError:
    why = f" (after: {failed.message})" if failed is not None else ""
    return APIError(503, f"{e}{why}", type="server_error")
