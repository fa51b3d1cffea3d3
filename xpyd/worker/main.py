"""Start one worker process: load the model, start its engine, serve the HTTP API.

With ``--etcd`` the worker registers itself once it accepts connections, and
watches the other role's workers so it can drop connections to peers that
left. On SIGTERM it deregisters first (the proxy stops routing to it within
milliseconds), keeps serving for a short grace period, then finishes what is
in flight (HTTP streams, KV not yet pulled) before exiting. If its engine fails (a step raised: its
state can no longer be trusted; every request it held has been sent an error) it deregisters, gives the
HTTP streams ``FAILED_FLUSH`` seconds to deliver those errors and exits with ``ENGINE_FAILED_EXIT``, to be
restarted (Kubernetes, ``xpyd up``).

``--engine torch`` loads the model with torch (`xpyd.model.runner.ModelRunner`, transformers' tokenizer);
``--engine sim`` runs the simulated forward pass (`xpyd.model.sim.SimRunner`) with the torch-free tokenizer
(`xpyd.tokenization`): such a process never imports torch or transformers, so every torch import here is on
the torch engine's path only.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hypercorn.asyncio import serve
from hypercorn.config import Config as HyperConfig

from xpyd.discovery.etcd import EtcdRegistration, EtcdRegistry
from xpyd.discovery.types import Role
from xpyd.model.kv_layout import ROW_SCALE_BYTES, ROW_SCALED
from xpyd.model.loader import ResolvedModel, ensure_converted, generation_defaults
from xpyd.model.sim.profile import SimProfile, default_profile
from xpyd.model.sim.runner import ModelFacts, SimRunner
from xpyd.model.tokenizer import load_tokenizer
from xpyd.tokenization.chat import read_chat_template
from xpyd.netaddr import WORKER_KEEP_ALIVE, fd_bind, host_port, reserve_listen
from xpyd.tokenization.tokenizer import LightTokenizer
from xpyd.transfer.auto import AutoTransferBackend
from xpyd.transfer.selection import kv_copy_threads, make_worker_backend
from xpyd.worker.config import WorkerConfig
from xpyd.worker.cpu_share import CpuShare
from xpyd.worker.engine import WorkerEngine
from xpyd.worker.http_api import create_worker_app
from xpyd.worker.kv_staging import adopt_pool, needs_staging, shared_pool_memory, stage_transfer
from xpyd.worker.request_gate import PrefillPeers
from xpyd.worker.malloc_tuning import tune_malloc

log = logging.getLogger("xpyd.worker")

DEREGISTER_GRACE = 0.5  # keep serving this long after deregistering (requests already routed here)
LISTEN_TIMEOUT = 30.0
FAILED_FLUSH = 1.0  # seconds the HTTP streams get to deliver their error events once the engine failed
ENGINE_FAILED_EXIT = 70  # EX_SOFTWARE: the engine failed; restart the worker


@dataclass(frozen=True, slots=True)
class EngineParts:
    """What the runtime built for a role's engine: the model runner (with its KV pool; a `ModelRunner` or a
    `SimRunner`), the tokenizer, the config, the KV transfer backend (None for the colocated role) and the
    served model name."""

    runner: Any
    tokenizer: object
    config: WorkerConfig
    transfer: object | None
    served: str


# A role's engine factory: builds and starts its engine; returns it and what to close after it stopped.
StartEngine = Callable[[EngineParts], tuple[WorkerEngine, Callable[[], None] | None]]


def run_worker(config: WorkerConfig, start_engine: StartEngine, http_socket: socket.socket | None = None) -> None:
    """The worker process for ``config.role``: model, KV pool and transfer backend, the engine that
    ``start_engine`` builds on them (each role package passes its own), and the HTTP API until SIGTERM.
    ``http_socket``: the HTTP port, already bound (`xpyd.cli` binds it before importing the runtime)."""
    if http_socket is None:
        http_socket = reserve_listen(config.host, config.port)  # before the model loads: a taken port fails now
    if config.engine == "torch" and not tune_malloc():  # (the simulated engine has no activations: a
        # tuned heap would only keep what start-up freed)
        log.info("glibc mallopt not available: activation buffers are page-faulted in per prefill")
    if config.nice:
        os.nice(config.nice)  # let other roles on the same cores win the CPU when both are busy
    if config.engine == "torch":
        import torch

        torch.set_num_threads(config.threads)
    transfer = None
    if config.role in ("prefill", "decode"):
        copy_threads = kv_copy_threads(config.kv_copy_threads, config.threads, config.device)
        transfer = make_worker_backend(config.kv_backend, config.host, config.kv_port, config.advertise_host,
                                       copy_threads, config.cluster_token, config.transfer_stall_timeout,
                                       device=config.device if config.engine == "torch" else None,
                                       lanes=config.kv_lanes, accepted_tokens=config.accepted_tokens)
        if config.role == "decode" and config.kv_backend in ("shm", "auto"):
            log.info("decode: shm transfers of 8 MiB or more are copied with %d thread(s)%s", copy_threads,
                     "" if config.kv_copy_threads else " (auto: --kv-copy-threads)")
    if config.engine == "sim":
        runner, resolved = build_sim_runner(config, transfer)
        tokenizer = LightTokenizer.from_folder(resolved.path)
    else:
        runner, resolved, transfer = build_torch_runner(config, transfer)
        tokenizer = load_tokenizer(resolved.path)
    if config.chat_template is not None:  # (checked at start-up: `check_chat_template`)
        template = read_chat_template(config.chat_template)
        if isinstance(tokenizer, LightTokenizer):
            tokenizer.set_chat_template(template)
        else:
            tokenizer.chat_template = template
    served = config.served_model_name or resolved.served_name
    defaults = generation_defaults(resolved.path, config.generation_config)
    if defaults.source is not None and defaults.named():
        log.info("%s: sampling defaults from %s: %s", config.role, defaults.source, defaults.named())
    engine, on_stop = start_engine(EngineParts(runner, tokenizer, config, transfer, served))

    # The prefill workers a decode worker without a cluster token may be sent to (etcd: fed by _join's watch).
    peers = PrefillPeers(config.prefill_peers, registry=config.etcd is not None, own_host=config.public_host)
    app = create_worker_app(engine, config,
                            None if transfer is None else lambda: kv_backend_stats(config, transfer), peers, defaults)
    hc = HyperConfig()
    hc.bind = [fd_bind(http_socket)]
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")  # our log format, printed once
    hc.graceful_timeout = config.drain_timeout
    hc.keep_alive_timeout = WORKER_KEEP_ALIVE  # longer than the proxy's (netaddr)

    # What start-up made (torch, transformers, the model: hundreds of thousands of objects) lives as long as
    # the process. Frozen (as vLLM does after its start-up), no full collection walks it while serving, nor
    # do the interpreter's collections at exit: an idle worker's SIGTERM-to-exit went from 1.6 s to 0.35 s.
    gc.collect()
    gc.freeze()
    if config.engine == "sim":
        _release_freed_heap()  # what start-up freed (parsing tokenizer.json: ~15 MB) goes back to the system
    try:
        asyncio.run(_serve(config, engine, app, hc, serve, peers))
    finally:
        engine.stop()
        if on_stop is not None:
            on_stop()
        log.info("%s worker stopped", config.role)
    if engine.failure() is not None:
        log.error("%s worker: exiting with code %d (its engine failed: %s)", config.role, ENGINE_FAILED_EXIT,
                  engine.failure())
        raise SystemExit(ENGINE_FAILED_EXIT)


def build_torch_runner(config: WorkerConfig, transfer) -> tuple[Any, ResolvedModel, Any]:
    """The model loaded with torch (`ModelRunner`), its pool moved where ``transfer`` wants it (prefill, shm:
    a shared segment; a device pool under tcp/shm: staged through host memory, ``transfer`` wrapped)."""
    import torch

    from xpyd.model.runner import ModelRunner, kv_token_bytes

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.dtype]
    device = torch.device(config.device)
    resolved = None

    def build_runner() -> ModelRunner:
        nonlocal resolved
        resolved = ensure_converted(config.model)  # (the first start converts a GGUF: torch work too)
        if config.gpu_memory_utilization is not None:
            from xpyd.model.gpu.memory import share_blocks

            num_blocks = share_blocks(config.gpu_memory_utilization, config.batch_size, config.prefill_chunk,
                                      config.max_model_len, config.role)
            size = f"KV cache from {config.gpu_memory_utilization:g} of the device"
        else:
            num_blocks = config.kv_blocks(kv_token_bytes(resolved.path, dtype, config.kv_cache_dtype))
            size = f"KV cache of {num_blocks} blocks"
        log.info("%s: loading %s (%s%s on %s; %s x %d tokens%s)", config.role, resolved.path,
                 config.dtype if config.kv_cache_dtype == "auto" else f"{config.dtype}, {config.kv_cache_dtype} KV",
                 ", random weights" if config.load_format == "dummy" else "", device, size, config.block_size,
                 ", prefix caching" if config.prefix_cache else "")
        runner = ModelRunner(resolved.path, dtype, num_blocks=num_blocks, max_seq_len=config.max_model_len,
                             block_size=config.block_size, device=device, caching=config.prefix_cache,
                             load_format=config.load_format, max_batch=config.batch_size,
                             cuda_graphs=not config.enforce_eager, kv_cache_dtype=config.kv_cache_dtype)
        log.info("%s: %s", config.role, describe_forward(runner))
        if config.cpu_share:
            runner.cpu_share = CpuShare(config.cpu_share, max_threads=config.threads)
        runner.warmup()
        if config.role == "prefill" and device.type == "cpu":
            adopt_pool(transfer, runner)  # shm/auto: the prefill KV pool moves into a shared-memory segment
        # (the decode pool stays in process memory: shm receivers copy into it from the prefill's segment)
        return runner

    runner = in_passing_thread(build_runner)
    if transfer is not None and needs_staging(transfer, device):  # a device pool under tcp/shm: transfers
        transfer = stage_transfer(transfer, runner.pool, sender=config.role == "prefill")  # stage via host memory
    return runner, resolved, transfer


def build_sim_runner(config: WorkerConfig, transfer) -> tuple[SimRunner, ResolvedModel]:
    """The simulated engine over the model folder's config (`SimRunner`): a host KV pool sized as the real
    engine's (``config.kv_blocks``) at its KV bytes per token; a prefill worker's pool in the memory its
    backend provides (shm: a shared segment), as `adopt_pool` moves a torch pool there."""
    resolved = ensure_converted(config.model)  # (a GGUF converted before is found in the cache, without torch)
    facts = ModelFacts.read(resolved.path)
    token_bytes = config.sim_kv_token_bytes or facts.kv_token_bytes
    if config.sim_kv_token_bytes is None and config.kv_cache_dtype != "auto":
        # (the model's size is in 16-bit floats; codes take one byte, and an int8 row ends in its scale)
        token_bytes = token_bytes // 2 + (facts.kv_rows * ROW_SCALE_BYTES if config.kv_cache_dtype in ROW_SCALED else 0)
    num_blocks = config.kv_blocks(token_bytes)
    buffer = None
    if config.role == "prefill":  # (the decode pool stays in process memory, as the real engine's)
        buffer = shared_pool_memory(transfer, num_blocks * config.block_size * token_bytes)
    profile = SimProfile.load(config.sim_profile) if config.sim_profile else default_profile()
    runner = SimRunner(resolved.path, num_blocks=num_blocks, max_seq_len=config.max_model_len,
                       block_size=config.block_size, caching=config.prefix_cache, kv_token_bytes=token_bytes,
                       profile=profile, speedup=config.sim_speedup, buffer=buffer,
                       zeroed=buffer is not None)  # (a new segment: zero-filled already)
    log.info("%s: simulated engine for %s (KV cache of %d blocks x %d tokens x %d bytes%s%s; %s, speed-up %s)",
             config.role, resolved.path, num_blocks, config.block_size, token_bytes,
             ", prefix caching" if config.prefix_cache else "", ", in shared memory" if buffer is not None else "",
             config.sim_profile or "built-in profile", config.sim_speedup)
    runner.warmup()
    return runner, resolved


def kv_backend_stats(config: WorkerConfig, transfer) -> dict:
    """``kv_backend`` in ``/xpyd/stats``: the configured backend, for ``auto`` which of its parts carried
    the transfers so far (``{"name": "auto", "sent": {"tcp": 3}, "received": {}}``), and how many frames
    that tried to open a transfer its listeners refused (``refused``: no or a wrong MAC, an id not
    expected; backends that count them), and how many connections they closed before any opened a transfer
    (``unproven``: past the 1 s deadline, or evicted by the per-source caps)."""
    out: dict = {"name": config.kv_backend}
    if isinstance(transfer, AutoTransferBackend):
        out.update(transfer.used())
    for key in ("refused", "unproven"):
        count = getattr(transfer, key, None)
        if isinstance(count, int):
            out[key] = count
    return out


def describe_forward(runner) -> str:
    """Which forward pass (and decode attention) this worker runs, and why not the faster one."""
    import torch

    from xpyd.model import native

    if runner.fast_path is None:
        return f"general forward (the lean one does not cover this model: {runner.fast_path_reason})"
    fast = runner.fast_path
    text = f"lean forward, {fast.prefill_attention} prefill and {fast.decode_attention} decode attention, " \
           f"{'native' if fast.native_pointwise else 'torch'} RMSNorm/rotary"
    if getattr(runner, "kv_codec", None) is not None:
        layout = runner.pool.layout
        text += f"; {layout.dtype} KV cache" + (f" (scales {layout.scales})" if layout.scales else " (a scale per row)")
    if runner.device.type == "cuda":
        if runner.decoder is not None:
            graphs = ",".join(map(str, runner.decoder.graph_sizes))
            text += f"; CUDA decode: paged kernels, {f'graphs for batch {graphs}' if graphs else 'eager'}"
        else:
            text += f"; CUDA decode without the paged kernels ({runner.decoder_reason})"
    if runner.dtype == torch.bfloat16 and runner.device.type == "cpu":
        reasons = {native.unavailable_reason(src) for src in ("decode_attention.c", "pointwise.c")} - {None}
        if reasons:
            text += f" (native kernels unavailable: {'; '.join(sorted(reasons))})"
    return text


def _release_freed_heap() -> None:
    """glibc's malloc_trim(0): free pages in the heap go back to the system (a simulated worker's start-up
    frees more than it keeps; measured: a decode worker's PSS 90 -> 75 MB). Nothing where it is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


def in_passing_thread(fn):
    """Run ``fn()`` in a thread of its own that has ended when this returns; its result (or exception).

    For everything that computes with torch before the engine thread starts (load, prepack, warm-up,
    zeroing the pool): libgomp keeps one OpenMP team per thread that ran a parallel region, and when a
    process holds more OpenMP threads than cores it throttles spin-waiting to almost nothing, so every
    parallel region of the engine then pays futex wake-ups. A team dies with its thread; so the
    engine's team is the only one left (measured: decode step B=1 on 2 threads 57 -> 28 ms).
    """
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # re-raised in the caller
            box["error"] = e

    thread = threading.Thread(target=run, name="xpyd-load")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


async def _serve(config: WorkerConfig, engine, app, hc, serve, peers: PrefillPeers | None = None) -> None:
    stop = asyncio.Event()
    failed = asyncio.Event()
    shutdown = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    engine.on_failure(lambda: loop.call_soon_threadsafe(failed.set))
    serving = asyncio.create_task(serve(app, hc, shutdown_trigger=shutdown.wait))
    await _wait_listening(config.host, config.port, serving)
    log.info("%s worker ready on http://%s:%d (signal %s)", config.role, config.host, config.port,
             engine.info.signal_addr)

    registration = watcher = None
    if config.etcd and not failed.is_set():
        registration, watcher = await _join(config, engine, peers)
    stopped, failing = asyncio.create_task(stop.wait()), asyncio.create_task(failed.wait())
    await asyncio.wait({serving, stopped, failing}, return_when=asyncio.FIRST_COMPLETED)
    if failed.is_set():
        await _leave_failed(config, registration, watcher, serving, shutdown)
        stopped.cancel()
        return
    failing.cancel()
    t0 = time.monotonic()
    if registration is not None:
        await registration.close()  # the key disappears now; the proxy stops routing here
        log.info("%s worker deregistered; draining", config.role)
        await asyncio.sleep(DEREGISTER_GRACE)
    engine.kv_events.close()  # KV event streams end (hypercorn would wait for them up to drain_timeout)
    shutdown.set()
    await serving  # hypercorn finishes in-flight HTTP requests (up to drain_timeout)
    remaining = max(0.0, config.drain_timeout - (time.monotonic() - t0))
    if not await loop.run_in_executor(None, engine.drain, remaining):
        log.warning("%s worker: in-flight work not finished within --drain-timeout", config.role)
    if watcher is not None:
        await watcher.close()
    stopped.cancel()


async def _leave_failed(config: WorkerConfig, registration, watcher, serving: asyncio.Task,
                        shutdown: asyncio.Event) -> None:
    """The engine failed and sent every request it held an error: deregister, let the HTTP handlers deliver
    those errors (at most FAILED_FLUSH seconds), stop."""
    log.error("%s worker: its engine failed; deregistering and exiting", config.role)
    if registration is not None:
        await registration.close()
    shutdown.set()  # hypercorn stops accepting, then waits for the handlers (each has its error by now)
    await asyncio.wait({serving}, timeout=FAILED_FLUSH)
    if not serving.done():
        serving.cancel()
        await asyncio.wait({serving})
    if watcher is not None:
        await watcher.close()


async def _join(config: WorkerConfig, engine, peers: PrefillPeers | None = None):
    """Watch the other role's workers, then register in etcd (we accept connections now): a decode worker
    knows the prefill workers registered before the proxy can send it a request naming one (``peers``)."""
    watcher = EtcdRegistry(config.etcd, model_id=engine.info.model_id, ops=engine.metrics.etcd)
    await watcher.start()
    peer_role = Role.DECODE if config.role == "prefill" else Role.PREFILL
    seen = {w.signal_addr for w in watcher.workers(peer_role)}
    if peers is not None and peer_role is Role.PREFILL:
        peers.update(seen)

    def on_change() -> None:
        nonlocal seen
        now = {w.signal_addr for w in watcher.workers(peer_role)}
        if peers is not None and peer_role is Role.PREFILL:
            peers.update(now)
        left, joined = seen - now, now - seen  # (joined: new, or back, e.g. after an etcd outage of its own)
        seen = now
        if left:
            log.info("%s workers left the cluster: %s", peer_role.value, ", ".join(sorted(left)))
        if left or joined:
            engine.peers_left(left, joined)

    # Before anything awaits: a worker that registers while ours does is heard of (a callback set after the
    # registration missed such a one for good: a decode worker of 2P6D refused one prefill worker's requests).
    watcher.on_change(on_change)
    try:
        registration = EtcdRegistration(config.etcd, engine.info, ttl=config.lease_ttl, ops=engine.metrics.etcd)
        await registration.start()
    except BaseException:
        await watcher.close()
        raise
    log.info("%s worker registered in etcd %s", config.role, config.etcd)
    return registration, watcher


async def _wait_listening(host: str, port: int, serving: asyncio.Task) -> None:
    deadline = time.monotonic() + LISTEN_TIMEOUT
    while True:
        if serving.done():
            serving.result()  # raises the bind error
            raise RuntimeError("HTTP server stopped during start-up")
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 1.0)
            writer.close()
            return
        except (OSError, asyncio.TimeoutError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"HTTP server did not start listening on {host_port(host, port)}") from None
            await asyncio.sleep(0.05)
