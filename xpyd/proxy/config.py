"""The proxy's configuration: one frozen dataclass, built once from the CLI (``xpyd.proxy.main``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from xpyd.api.identity import MAX_MODEL_CHARS
from xpyd.proxy.pairs import MAX_COOLDOWN as MAX_PAIR_COOLDOWN
from xpyd.proxy.prefill_path import DEFAULT_MAX_TOKENS as DEFAULT_LOCAL_PREFILL, PrefillDecider
from xpyd.proxy.routing import Policy

MAX_DRAIN_SECONDS = 3600.0  # the longest --drain-timeout (a stream may take this long to finish)


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None  # None: the model the workers report
    prefill_urls: tuple[str, ...] = ()  # static discovery
    decode_urls: tuple[str, ...] = ()
    etcd: str | None = None  # dynamic discovery: etcd's HOST:PORT
    colocated_url: str | None = None  # baseline mode: one worker doing prefill and decode (no P/D split)
    policy: Policy = Policy.CACHE_AWARE  # the CLI's default for static 1P1D is least_loaded: see default_policy
    poll_interval: float = 0.2  # every worker's stats (UP) or health (DOWN) this often
    poll_timeout: float = 1.0  # one poll
    retries: int = 1  # a request whose worker was unreachable starts over this often
    migration_limit: int = 3  # a request whose workers failed mid-answer moves on to another pair this often
    # a prompt with at most this many tokens its decode worker does not cache is prefilled there (0: never)
    local_prefill_max_tokens: int = DEFAULT_LOCAL_PREFILL
    connect_timeout: float = 10.0  # TCP connect to a worker
    read_timeout: float = 300.0  # each read from a worker: prefill's answer, each stream chunk
    discovery_timeout: float = 120.0  # static discovery: wait this long for workers to be ready
    max_body_bytes: int = 4 * 1024 * 1024  # larger client bodies get 413
    max_connections: int = 1024  # pooled connections to workers
    api_key: str | None = field(default=None, repr=False)  # None: no authentication
    cluster_token: str | None = field(default=None, repr=False)  # the workers' token: the proxy signs each
    # request id with it and presents the bearer derived from it (xpyd.signal.request_id.ClusterKeys)
    max_concurrent_requests: int = 1024  # generation requests in the proxy at once (queued included); 429 beyond
    max_queue: int = 256  # requests waiting for room on a decode worker; 503 beyond
    queue_timeout: float = 30.0  # longest wait in that queue; 503 after it
    drain_timeout: float = 5.0  # on SIGTERM: in-flight requests (streams) finish for up to this long
    pair_cooldown: float = 5.0  # a prefill/decode pair whose path failed is avoided this long (doubling, max 60 s)
    log_requests: bool = False  # log each dispatch: response id -> the workers' request id and both workers
    expose_worker_names: bool = False  # x-xpyd-workers on every answer: opaque names of the workers that served it
    names_key: bytes | None = field(default=None, repr=False)  # names' key without a token (--workers: shared)
    expose_worker_timing: bool = False  # answers carry the workers' own timing and phases (xpyd.api.timing)
    trust_request_chat_template: bool = False  # run a request's own chat_template (vLLM's flag of that name)
    tool_call_parser: str | None = None  # how tool_choice auto reads calls out of an answer (xpyd.api.tool_parsers)

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must not be empty")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.model_name is not None and not self.model_name.strip():
            raise ValueError("model_name must not be blank")
        if self.model_name is not None and not (len(self.model_name) <= MAX_MODEL_CHARS
                                                and self.model_name.isprintable()):
            raise ValueError(f"model_name must be at most {MAX_MODEL_CHARS} printable characters (workers are "
                             "told to write it into every chunk)")
        for name in ("connect_timeout", "read_timeout", "discovery_timeout", "poll_interval",
                     "poll_timeout", "queue_timeout", "pair_cooldown"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if not (math.isfinite(self.drain_timeout) and 0 <= self.drain_timeout <= MAX_DRAIN_SECONDS):
            raise ValueError(f"drain_timeout must be 0..{MAX_DRAIN_SECONDS:g} seconds, got {self.drain_timeout}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.api_key is not None and not 8 <= len(self.api_key) <= 512:
            raise ValueError("the API key must be 8-512 characters")
        if self.api_key is not None and not (self.api_key.isprintable() and self.api_key.isascii()
                                             and " " not in self.api_key):
            raise ValueError("the API key must be printable ASCII without spaces")
        if self.cluster_token is not None and not 8 <= len(self.cluster_token) <= 256:
            raise ValueError("the cluster token must be 8-256 characters")
        if self.max_concurrent_requests < 1:
            raise ValueError(f"max_concurrent_requests must be >= 1, got {self.max_concurrent_requests}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        for url in (*self.prefill_urls, *self.decode_urls):
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"worker URL must look like http://host:port, got {url!r}")
        if self.etcd is not None:
            if self.prefill_urls or self.decode_urls:
                raise ValueError("use either etcd (dynamic discovery) or worker URLs (static), not both")
            host, _, port = self.etcd.rpartition(":")
            if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
                raise ValueError(f"etcd must look like HOST:PORT, got {self.etcd!r}")
        if self.colocated_url is not None and (self.etcd or self.prefill_urls or self.decode_urls):
            raise ValueError("colocated mode takes one worker URL and no other discovery")
        if not isinstance(self.policy, Policy):
            raise ValueError(f"policy must be a Policy, got {self.policy!r}")
        if self.pair_cooldown > MAX_PAIR_COOLDOWN:
            raise ValueError(f"pair_cooldown must be at most {MAX_PAIR_COOLDOWN:g} seconds, got {self.pair_cooldown}")
        for name in ("log_requests", "expose_worker_names", "expose_worker_timing"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not 0 <= self.retries <= 3:
            raise ValueError(f"retries must be in 0..3, got {self.retries}")
        if isinstance(self.migration_limit, bool) or not isinstance(self.migration_limit, int) \
                or not 0 <= self.migration_limit <= 16:
            raise ValueError(f"migration_limit must be in 0..16, got {self.migration_limit!r}")
        PrefillDecider(self.local_prefill_max_tokens)  # (raises naming the field)


def default_policy(etcd: str | None, prefill_urls: tuple[str, ...], decode_urls: tuple[str, ...]) -> Policy:
    """cache_aware wherever there is a choice to make; least_loaded for a static 1P1D cluster (`xpyd up`'s
    default), where the proxy would tokenize every prompt and poll KV events for nothing."""
    if etcd is None and len(prefill_urls) <= 1 and len(decode_urls) <= 1:
        return Policy.LEAST_LOADED
    return Policy.CACHE_AWARE
