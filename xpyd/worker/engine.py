"""What every role's engine holds and how requests reach it."""

from __future__ import annotations

import json
import logging
import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from xpyd.discovery.types import WorkerInfo
from xpyd.model.fingerprint import weights_fingerprint
from xpyd.prefix_hash import hash_key, hash_seed
from xpyd.worker.kv_cache import KVCache
from xpyd.worker.kv_events import KVEventLog
from xpyd.worker.config import WorkerConfig
from xpyd.worker.faults import FaultInjection, FaultSite, RequestScope
from xpyd.worker.loop import EngineThread
from xpyd.worker.metrics import WorkerMetrics
from xpyd.worker.work_item import ErrorEvent, WorkItem

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Abort:
    """Posted to the engine thread: drop this request wherever it is."""

    request_id: str


@dataclass(frozen=True, slots=True)
class PeersLeft:
    """Posted to the engine thread: these workers of the other role left the cluster (discovery), and those
    in ``joined`` are listed since the last change (new ones, or ones back after they had left)."""

    addrs: frozenset[str]
    joined: frozenset[str] = frozenset()


def _kv_cache(pool, weights: str, key: bytes) -> KVCache:
    """The schedulers' view of ``pool``; block hashes are seeded with the model's weights and the KV layout,
    so workers agree on them exactly when their KV bytes mean the same, and keyed with the deployment's key."""
    layout = pool.layout
    return KVCache(pool.blocks, layout.block_size, hash_seed(weights, json.dumps(layout.compat(), sort_keys=True)),
                   key)


def model_identity(runner, served_name: str) -> str:
    """What names the runner's weights: its own ``identity`` when it has one (the simulated engine's: "sim:"
    and the folder's fingerprint, so simulated and real KV never mix), else the fingerprint of the folder it
    loaded (``config.name_or_path``), not the name they are served under; a runner without weights (a test's
    fake) is named by ``served_name``."""
    identity = getattr(runner, "identity", None)
    if isinstance(identity, str) and identity:
        return identity
    config = getattr(runner, "config", None)
    return served_name if config is None else "weights:" + weights_fingerprint(Path(config.name_or_path))


class WorkerEngine(EngineThread):
    """The model runner, its KV pool, the tokenizer, config and metrics; ``submit``/``abort`` from HTTP.

    A role's step runs each piece of one request's work in ``isolate`` (adding a request: ``admit``);
    the role says how one of its requests fails (``fail_held``).
    """

    def __init__(self, runner, tokenizer, config: WorkerConfig, served_name: str) -> None:
        super().__init__()
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.pool = runner.pool
        self.weights = model_identity(runner, served_name)  # what the KV depends on: the weights, not the name
        self.kv_cache = (_kv_cache(self.pool, self.weights, hash_key(config.cluster_token))
                         if self.pool is not None else None)
        self.kv_events = KVEventLog()  # the block hashes this worker caches, for routers
        self.max_model_len: int = runner.max_model_len
        self.eos_token_ids: frozenset[int] = runner.eos_token_ids
        self.model_id = served_name
        self.metrics = WorkerMetrics(config.role, model_name=served_name, max_model_len=runner.max_model_len)
        self.info: WorkerInfo | None = None
        self._items: weakref.WeakSet[WorkItem] = weakref.WeakSet()  # submitted, still referenced by the engine
        self._fault: FaultInjection | None = None
        self._grammars = None  # (xpyd.model.grammar.Grammars: made by the first request with a constraint)
        self._grammars_lock = threading.Lock()

    def grammars(self):
        """The worker's grammar engine (``xpyd.model.grammar``), made on first use: the tokenizer's view for it
        takes ~0.5 s to build, which workers that never see structured output do not pay (nor its memory)."""
        with self._grammars_lock:
            if self._grammars is None:
                from xpyd.model.grammar import Grammars

                vocab = getattr(self.runner, "vocab_size", None) or len(self.tokenizer)
                self._grammars = Grammars(self.tokenizer, vocab, self.eos_token_ids)
            return self._grammars

    def peer_compat(self) -> dict:
        """What a prefill and a decode worker must share to move KV between them, compared whole at their
        handshake: the KV layout and the weights (two models served under one name must not mix KV)."""
        return {**self.pool.layout.compat(), "weights": self.weights}

    def start_thread(self) -> None:
        self._fault = FaultInjection.from_env(os.environ)  # test-only fault injection: see worker/faults.py
        super().start_thread()

    # --- HTTP side ---------------------------------------------------------
    def submit(self, item: WorkItem) -> None:
        self._items.add(item)
        if not self.post_unless_failed(item):
            item.sink.put(ErrorEvent(503, f"the {self.config.role} worker's engine failed ({self.failure()}); "
                                          "it is restarting"))

    def abort(self, request_id: str) -> None:
        self.post(Abort(request_id))

    def peers_left(self, addrs: set[str], joined: set[str] = frozenset()) -> None:
        """Workers of the other role left the cluster, or joined it (signal addresses): the role's step
        handles it."""
        self.post(PeersLeft(frozenset(addrs), frozenset(joined)))

    # --- engine thread -----------------------------------------------------
    def publish_kv_events(self) -> None:
        """Move the allocator's stored/removed block hashes into the log routers read (engine thread, with
        whatever lock guards the allocator held)."""
        if self.pool is not None:
            self.kv_events.record(*self.pool.blocks.take_events())

    def isolate(self, request_id: str, item: WorkItem | None = None) -> RequestScope:
        """``with engine.isolate(rid, item):`` an exception inside fails just this request (500) and the
        step goes on. ``item``: the request's work item when it may not be held yet (being added)."""
        return RequestScope(self._request_failed, request_id, item)

    def admit(self, item: WorkItem, add: Callable[[WorkItem], None]) -> None:
        """Add a request from the inbox with the role's ``add``, isolated."""
        fault = self._fault.site_for(item) if self._fault is not None else None
        with self.isolate(str(item.request_id), item):
            add(item)
            if fault is FaultSite.ADD:
                raise self._fault.error()
        if fault is FaultSite.STEP:
            raise self._fault.error()

    def fail_held(self, request_id: str, item: WorkItem | None, error: str) -> bool:
        """Fail this request (``item``'s, if given) if the engine holds it: the scheduler's fail path (KV
        and blocks released), an ``ErrorEvent(500, error)`` on its sink, metrics. False if not held. Override."""
        return False

    def _request_failed(self, request_id: str, item: WorkItem | None, exc: Exception) -> None:
        log.error("request %s failed in the %s engine", request_id, self.config.role, exc_info=exc)
        error = f"internal error in the {self.config.role} worker: {type(exc).__name__}: {exc}"
        if not self.fail_held(request_id, item, error) and item is not None and not item.sink.ended:
            self.metrics.request_done("failed")  # (raised before the scheduler took it)
            item.sink.put(ErrorEvent(500, error))

    def fail_all(self, error: str) -> None:
        message = f"the {self.config.role} worker's engine failed ({error}); it is restarting"
        posted = [i for i in self.drain_inbox() if isinstance(i, WorkItem)]
        for item in {*self._items, *posted}:
            if not item.sink.ended:
                self.metrics.request_done("failed")
                item.sink.put(ErrorEvent(500, message))
