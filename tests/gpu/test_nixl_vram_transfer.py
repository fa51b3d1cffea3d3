"""nixl on a real GPU: two processes on one GPU, each with a nixl backend built as the workers build it
(``make_worker_backend("nixl", ...)``) and its pool registered as the workers register it (``pool_memory``:
a CUDA pool goes to NIXL as ``VRAM``, no host staging). The test process sends (prefill), a child
process receives (decode) and READs the bytes straight out of the sender's GPU pool through UCX.

Checks exact bytes (the receiver's whole pool hashed against the expected image: the dst regions hold
the src bytes, nothing else changed), that the handshake names both pools' memory (the sender's Hello as the
receiver parsed it, and the memory types every READ named on both sides), one host pool -> GPU pool, and
that a send right behind a kernel still writing its source waits for it. If UCX cannot move CUDA memory
here, the transfer fails within its timeouts and the test says so.

On a CPU (NIXL installed, host pools): the stream ordering's protocol, with the CUDA events replaced by
gates: the sender offers only once the mark ``send()`` took completed, the receiver READs only once the mark
``expect()`` took completed, and no mark outlives its transfer.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import queue
import subprocess
import sys
import tempfile
import textwrap
import threading
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")


def _nixl_missing() -> str | None:
    from xpyd.transfer.nixl_agent import load

    try:
        load()
    except ImportError as e:
        return str(e)
    return None


pytestmark = pytest.mark.skipif(_nixl_missing() is not None, reason=f"needs NIXL: {_nixl_missing()}")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (nixl READs GPU pool to GPU pool)")

SIZE = 64 << 20  # bytes of each pool
FILL = 0xAA
TIMEOUT = 60.0  # every wait on the receiver or a token (the backends' own io_timeout is 30 s)
NO_VRAM = "NIXL/UCX could not move CUDA memory between two processes on this GPU"

RECEIVER = textwrap.dedent("""
    import hashlib, json, sys
    from types import SimpleNamespace
    import torch
    from xpyd.transfer import nixl_agent, nixl_backend
    from xpyd.transfer.base import Region
    from xpyd.transfer.selection import make_worker_backend
    from xpyd.worker.kv_staging import pool_memory
    size = int(sys.argv[1])
    torch.cuda.set_device(0)
    t = torch.full((size,), 0xAA, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    seen = {"hello": [], "reads": set()}  # the handshake as this side saw it
    parse = nixl_backend.Hello.parse
    def hello(d):
        h = parse(d)
        seen["hello"].append(list(h.memory))
        return h
    nixl_backend.Hello.parse = hello
    read = nixl_agent.Agent.read
    def reading(self, peer, pieces, src_base, dst_base, src_memory=nixl_agent.HOST, dst_memory=nixl_agent.HOST):
        seen["reads"].add((tuple(src_memory), tuple(dst_memory)))
        return read(self, peer, pieces, src_base, dst_base, src_memory, dst_memory)
    nixl_agent.Agent.read = reading
    backend = make_worker_backend("nixl", "127.0.0.1", 0, None)
    pool = SimpleNamespace(device=t.device, tensor=t, staging=None)
    memory = pool_memory(pool, backend)
    print(json.dumps({"desc": backend.register(memory).to_dict(), "registered": type(memory).__name__,
                      "memory": list(backend._memory)}), flush=True)
    tokens = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        tid = cmd["id"]
        if cmd["op"] == "expect":
            tokens[tid] = backend.expect(tid, [Region(*r) for r in cmd["dst"]], secret=bytes.fromhex(cmd["secret"]))
            out = {}
        else:  # "state": wait for the token, then the whole pool's hash and what the handshake said
            tok = tokens[tid]
            tok.wait(cmd["timeout"])
            torch.cuda.synchronize()
            host = t.cpu().numpy().tobytes()
            out = {"state": tok.state().name, "error": tok.error, "sha": hashlib.sha256(host).hexdigest(),
                   "hello": seen["hello"], "reads": sorted([list(map(list, r)) for r in seen["reads"]])}
        print(json.dumps(out), flush=True)
    backend.close()
""")


class Receiver:
    """The decode side in a child process; every answer is awaited at most ``TIMEOUT`` seconds."""

    def __init__(self) -> None:
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-c", RECEIVER, str(SIZE)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     cwd=pathlib.Path(__file__).parents[2])
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        from xpyd.transfer.base import BackendDescriptor

        first = json.loads(self._line())
        self.desc = BackendDescriptor.from_dict(first["desc"])
        self.registered, self.memory = first["registered"], first["memory"]
        self.image = np.full(SIZE, FILL, dtype=np.uint8)  # what its pool should hold

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put("")

    def stderr(self) -> str:
        self.err.seek(0)
        return self.err.read()[-4000:]

    def _line(self) -> str:
        try:
            line = self._lines.get(timeout=TIMEOUT)
        except queue.Empty:
            raise AssertionError(f"{NO_VRAM}? the receiver answered nothing within {TIMEOUT:g}s; its stderr:\n"
                                 f"{self.stderr()}") from None
        assert line, f"the receiver process exited ({self.proc.poll()}); its stderr:\n{self.stderr()}"
        return line

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            assert self.proc.wait(TIMEOUT) == 0, self.stderr()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.err.close()


def _sender(device: str):
    """A prefill side in this process: random bytes in a pool on ``device``, registered as a worker does."""
    from xpyd.transfer.selection import make_worker_backend
    from xpyd.worker.kv_staging import pool_memory

    gen = torch.Generator(device="cpu").manual_seed(7)
    t = torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=gen).to(device)
    torch.cuda.synchronize()
    pool = SimpleNamespace(device=t.device, tensor=t, staging=None,
                           buffer=lambda: memoryview(t.numpy()).cast("B"))
    backend = make_worker_backend("nixl", "127.0.0.1", 0, None)
    memory = pool_memory(pool, backend)
    backend.register(memory)
    return backend, t, memory


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def _random_runs(rng: np.random.Generator, blocks: int, unit: int) -> list[tuple[int, int]]:
    """``blocks`` distinct blocks of ``unit`` bytes at random, adjacent ones coalesced into runs (as the
    workers' ``byte_ranges`` do), the runs in random order."""
    picked = np.sort(rng.choice(SIZE // unit, size=blocks, replace=False))
    runs: list[list[int]] = []
    for b in picked.tolist():
        if runs and runs[-1][0] + runs[-1][1] == b * unit:
            runs[-1][1] += unit
        else:
            runs.append([b * unit, unit])
    rng.shuffle(runs)
    return [(o, n) for o, n in runs]


def _move(sender, t, receiver, tid, src, dst) -> dict:
    """Send ``src`` -> ``dst``; the receiver's answer once its token ended (state, hash, handshake)."""
    from xpyd.transfer.auth import new_secret
    from xpyd.transfer.base import Region

    secret = new_secret()
    assert receiver.ask(op="expect", id=tid, dst=dst, secret=secret.hex()) == {}
    tok = sender.send(tid, [Region(*r) for r in src], receiver.desc, [Region(*r) for r in dst], secret=secret)
    ended = tok.wait(TIMEOUT)
    answer = receiver.ask(op="state", id=tid, timeout=TIMEOUT)
    assert ended and tok.state().name == "DONE", (
        f"{NO_VRAM}: the sender's transfer is {tok.state().name} ({tok.error}); the receiver's is "
        f"{answer['state']} ({answer['error']}); receiver stderr:\n{receiver.stderr()}")
    assert answer["state"] == "DONE", answer
    host = t.cpu().numpy()
    flat = np.concatenate([host[o: o + n] for o, n in src])
    at = 0
    for o, n in dst:
        receiver.image[o: o + n] = flat[at: at + n]
        at += n
    assert answer["sha"] == hashlib.sha256(receiver.image.tobytes()).hexdigest(), "the receiver's pool differs"
    return answer


@gpu
def test_gpu_pool_to_gpu_pool_random_regions_arrive_exactly_and_the_handshake_says_vram(receiver):
    from xpyd.transfer.base import DeviceMemory

    assert receiver.registered == "DeviceMemory" and receiver.memory == ["VRAM", 0]
    sender, t, memory = _sender("cuda")
    try:
        assert isinstance(memory, DeviceMemory) and sender._memory == ("VRAM", 0)
        rng = np.random.default_rng(3)
        for i, unit in enumerate([4096, 64 << 10, 2 << 20]):
            blocks = min(SIZE // unit // 2, 48)
            src, dst = _random_runs(rng, blocks, unit), _random_runs(rng, blocks, unit)
            answer = _move(sender, t, receiver, f"t{i}", src, dst)
        # the sender's Hello said VRAM; every READ named VRAM on both sides (device 0)
        assert answer["hello"] == [["VRAM", 0]]
        assert answer["reads"] == [[["VRAM", 0], ["VRAM", 0]]]
        # one READ request is capped at READ_CHUNK (16 MiB): a whole-pool move takes several
        answer = _move(sender, t, receiver, "all", [(0, SIZE)], [(0, SIZE)])
        assert answer["hello"] == [["VRAM", 0]]
    finally:
        sender.close()


@gpu
def test_host_pool_to_gpu_pool_arrives_exactly_and_the_handshake_says_dram_to_vram(receiver):
    sender, t, memory = _sender("cpu")
    try:
        assert isinstance(memory, memoryview) and sender._memory == ("DRAM", 0)
        rng = np.random.default_rng(5)
        src, dst = _random_runs(rng, 40, 64 << 10), _random_runs(rng, 40, 64 << 10)
        answer = _move(sender, t, receiver, "h", src, dst)
        assert answer["hello"] == [["DRAM", 0]]
        assert answer["reads"] == [[["DRAM", 0], ["VRAM", 0]]]
    finally:
        sender.close()


@gpu
def test_a_send_right_behind_a_kernel_still_writing_its_source_waits_for_it(receiver):
    sender, t, _ = _sender("cuda")
    try:
        torch.cuda._sleep(200_000_000)  # keeps the current stream busy (~0.1 s) ...
        t[: 8 << 20].fill_(0x3C)  # ... before this write lands; send() is called right after
        answer = _move(sender, t, receiver, "late", [(0, 8 << 20)], [(0, 8 << 20)])
        assert answer["state"] == "DONE"
    finally:
        sender.close()


class Gate:
    """Stands in for a GPU pool's CUDA events: ``mark()`` is ``open`` (complete once set); ``waiting`` is set
    once a backend thread waits on it."""

    def __init__(self) -> None:
        self.open, self.waiting = threading.Event(), threading.Event()

    def mark(self) -> threading.Event:
        return self.open

    def wait(self, mark: threading.Event) -> None:
        self.waiting.set()
        assert mark.wait(TIMEOUT)


@pytest.mark.parametrize("side", ["send", "expect"])
def test_a_transfer_waits_for_the_engine_stream_mark_of_each_side(side):
    from xpyd.transfer.auth import new_secret
    from xpyd.transfer.base import Region
    from xpyd.transfer.selection import make_worker_backend

    src_pool, dst_pool = bytearray(range(256)) * 256, bytearray(64 << 10)
    sender = make_worker_backend("nixl", "127.0.0.1", 0, None)
    receiver = make_worker_backend("nixl", "127.0.0.1", 0, None)
    try:
        sender.register(memoryview(src_pool))
        desc = receiver.register(memoryview(dst_pool))
        gate = Gate()
        (sender if side == "send" else receiver)._marker = gate  # as register() sets it for a GPU pool
        secret = new_secret()
        got = receiver.expect("k", [Region(4096, 8192)], secret=secret)
        sent = sender.send("k", [Region(100, 8192)], desc, [Region(4096, 8192)], secret=secret)
        assert gate.waiting.wait(TIMEOUT), f"the {side} side never waited for its mark"
        assert got.state().name == "PENDING" and not sent.finished()
        assert dst_pool == bytearray(64 << 10)  # no byte moved before the mark completed
        gate.open.set()
        assert got.wait(TIMEOUT) and sent.wait(TIMEOUT)
        assert got.state().name == "DONE" and sent.state().name == "DONE", (got.error, sent.error)
        assert dst_pool[4096: 4096 + 8192] == src_pool[100: 100 + 8192]
        assert sender._marks == {} and receiver._marks == {}  # no mark outlives its transfer
    finally:
        sender.close()
        receiver.close()
