"""cuda_ipc on a real GPU: the test process is the sender (prefill), a child process on the same GPU the
receiver (decode), each with its own pool; KV moves through the real CUDA IPC handle, device to device.

Checks exact bytes (the receiver's whole pool hashed against the expected image: the dst regions hold the
src bytes, nothing else changed), through one copy_ per piece and through the copy kernel's one launch (many
pieces, aligned or at odd bytes), the kernel itself in one process, the stamps of each stage, that a
transfer sent right behind a kernel still writing its source waits for it (offered at once, the receiver
waits on the sender's event), and aborts while the receiver waits for that kernel (the sender's: nothing
copied; the receiver's: it returns while the kernel still runs) or before the offer (the receiver's).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (cuda_ipc copies on one GPU)")

SIZE = 64 << 20  # bytes of each pool
FILL = 0xAA
TIMEOUT = 60.0

RECEIVER = textwrap.dedent("""
    import hashlib, json, sys
    import torch
    from xpyd.transfer import make_backend
    from xpyd.transfer.base import Region
    from xpyd.transfer.cuda_ipc_stamps import Stamps
    size = int(sys.argv[1])
    pool = torch.full((size // 2,), 0, dtype=torch.bfloat16, device="cuda")
    pool.view(torch.uint8).fill_(0xAA)
    backend = make_backend("cuda_ipc", io_timeout=30.0)
    print(json.dumps(backend.register(pool).to_dict()), flush=True)
    backend.stamps = Stamps()
    tokens = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        tid = cmd["id"]
        if cmd["op"] == "expect":
            tokens[tid] = backend.expect(tid, [Region(*r) for r in cmd["dst"]], secret=bytes.fromhex(cmd["secret"]))
            out = {}
        elif cmd["op"] == "abort":
            backend.abort(tid)
            out = {}
        elif cmd["op"] == "stages":  # the stages reached so far (cuda_ipc_stamps), left in place
            with backend.stamps._lock:
                out = {"stages": list(backend.stamps.stages.get(tid, {}))}
        else:  # "state": wait for the token, then the whole pool's hash
            tok = tokens[tid]
            tok.wait(cmd["timeout"])
            host = pool.view(torch.uint8).cpu().numpy().tobytes()
            stages, device_s = backend.stamps.take(tid)
            out = {"state": tok.state().name, "error": tok.error, "sha": hashlib.sha256(host).hexdigest(),
                   "stages": list(stages), "device_s": device_s}
        print(json.dumps(out), flush=True)
    backend.close()
""")


class Receiver:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", RECEIVER, str(SIZE)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=pathlib.Path(__file__).parents[2])
        from xpyd.transfer.base import BackendDescriptor

        self.desc = BackendDescriptor.from_dict(json.loads(self._line()))
        self.image = np.full(SIZE, FILL, dtype=np.uint8)  # what its pool should hold

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        assert line, f"the receiver process exited ({self.proc.poll()})"
        return line

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(TIMEOUT) == 0


@pytest.fixture
def sides():
    from xpyd.transfer import make_backend

    pool = torch.empty(SIZE // 2, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(7)
    pool.view(torch.uint8).copy_(torch.randint(0, 256, (SIZE,), dtype=torch.uint8, device="cuda", generator=gen))
    sender = make_backend("cuda_ipc", io_timeout=30.0)
    sender.register(pool)
    receiver = Receiver()
    yield sender, pool, receiver
    sender.close()
    receiver.close()


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


def _transfer(sender, pool, receiver, tid, src, dst):
    from xpyd.transfer.auth import new_secret
    from xpyd.transfer.base import Region

    secret = new_secret()
    assert receiver.ask(op="expect", id=tid, dst=dst, secret=secret.hex()) == {}
    return sender.send(tid, [Region(*r) for r in src], receiver.desc, [Region(*r) for r in dst], secret=secret)


def _land(receiver, pool, src, dst) -> None:
    host = pool.view(torch.uint8).cpu().numpy()
    flat = np.concatenate([host[o: o + n] for o, n in src])
    at = 0
    for o, n in dst:
        receiver.image[o: o + n] = flat[at: at + n]
        at += n


def test_random_regions_arrive_exactly_and_nothing_else_changes(sides):
    sender, pool, receiver = sides
    assert receiver.desc.backend == "cuda_ipc"
    rng = np.random.default_rng(3)
    for i, unit in enumerate([4096, 64 << 10, 1 << 20, 4 << 20]):
        blocks = min(SIZE // unit // 2, 48)
        src, dst = _random_runs(rng, blocks, unit), _random_runs(rng, blocks, unit)
        tok = _transfer(sender, pool, receiver, f"t{i}", src, dst)
        assert tok.wait(TIMEOUT), tok.state()
        assert tok.state().name == "DONE", tok.error
        _land(receiver, pool, src, dst)
        answer = receiver.ask(op="state", id=f"t{i}", timeout=TIMEOUT)
        assert answer["state"] == "DONE", answer
        assert answer["sha"] == hashlib.sha256(receiver.image.tobytes()).hexdigest()


def test_the_copy_waits_for_the_kernel_that_writes_the_source(sides):
    sender, pool, receiver = sides
    region = [(0, 8 << 20)]
    torch.cuda._sleep(200_000_000)  # keeps the current stream busy (~0.1 s) ...
    pool.view(torch.uint8)[: 8 << 20].fill_(0x3C)  # ... before this write lands; send() is called right after
    tok = _transfer(sender, pool, receiver, "late", region, region)
    assert tok.wait(TIMEOUT) and tok.state().name == "DONE", tok.error
    receiver.image[: 8 << 20] = 0x3C
    answer = receiver.ask(op="state", id="late", timeout=TIMEOUT)
    assert answer["sha"] == hashlib.sha256(receiver.image.tobytes()).hexdigest()


def _reached(receiver, tid: str, stage: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while stage not in receiver.ask(op="stages", id=tid)["stages"]:
        assert time.monotonic() < deadline, f"the receiver never reached {stage!r} for {tid!r}"
        time.sleep(0.005)


def test_a_sender_abort_before_its_source_is_written_fails_it_and_nothing_lands(sides):
    sender, pool, receiver = sides
    torch.cuda._sleep(2_000_000_000)  # the "forward" still runs (~1 s): the receiver waits on its event
    tok = _transfer(sender, pool, receiver, "gone", [(0, 1 << 20)], [(0, 1 << 20)])
    _reached(receiver, "gone", "prepared")  # offered at once, prepared, waiting for the forward
    sender.abort("gone")  # (revokes its board entry)
    assert tok.state().name == "FAILED" and tok.error == "aborted"
    answer = receiver.ask(op="state", id="gone", timeout=TIMEOUT)  # woken when the forward ended: revoked
    assert answer["state"] == "FAILED" and "aborted by the sender" in answer["error"]
    assert "launching" not in answer["stages"]  # no copy at all
    assert answer["sha"] == hashlib.sha256(receiver.image.tobytes()).hexdigest()
    # the connection stays usable
    tok = _transfer(sender, pool, receiver, "next", [(1 << 20, 1 << 20)], [(0, 1 << 20)])
    assert tok.wait(TIMEOUT) and tok.state().name == "DONE", tok.error


def test_a_receiver_abort_while_the_forward_runs_is_prompt_and_nothing_lands(sides):
    sender, pool, receiver = sides
    torch.cuda._sleep(4_000_000_000)  # ~2 s of "forward"
    tok = _transfer(sender, pool, receiver, "quit", [(0, 1 << 20)], [(0, 1 << 20)])
    _reached(receiver, "quit", "prepared")
    assert receiver.ask(op="abort", id="quit") == {}
    assert torch.cuda.current_stream().query() is False  # (the forward still ran when the abort returned)
    # ("state" hashes the pool: its device-to-host copy waits behind the sender's forward, since opening the
    # sender's pool made the receiver's default stream wait for the event torch exported with it)
    answer = receiver.ask(op="state", id="quit", timeout=0)
    assert answer["state"] == "FAILED"
    assert tok.wait(TIMEOUT) and tok.state().name == "FAILED" and "aborted by the receiver" in tok.error
    torch.cuda.synchronize()
    answer = receiver.ask(op="state", id="quit", timeout=0)
    assert answer["sha"] == hashlib.sha256(receiver.image.tobytes()).hexdigest()
    tok = _transfer(sender, pool, receiver, "after", [(1 << 20, 1 << 20)], [(0, 1 << 20)])
    assert tok.wait(TIMEOUT) and tok.state().name == "DONE", tok.error


def test_a_receiver_abort_refuses_the_offer(sides):
    sender, pool, receiver = sides
    from xpyd.transfer.auth import new_secret
    from xpyd.transfer.base import Region

    secret = new_secret()
    receiver.ask(op="expect", id="r", dst=[(0, 4096)], secret=secret.hex())
    receiver.ask(op="abort", id="r")
    tok = sender.send("r", [Region(0, 4096)], receiver.desc, [Region(0, 4096)], secret=secret)
    assert tok.wait(TIMEOUT) and tok.state().name == "FAILED"
    assert "unexpected transfer id" in tok.error
    answer = receiver.ask(op="state", id="r", timeout=0)
    assert answer["state"] == "FAILED"
    assert answer["sha"] == hashlib.sha256(receiver.image.tobytes()).hexdigest()


def test_pieces_at_odd_bytes_arrive_exactly_through_one_launch(sides):
    sender, pool, receiver = sides
    from xpyd.transfer.cuda_ipc_device import FEW_PIECES

    rng = np.random.default_rng(5)
    starts = np.sort(rng.choice(SIZE // 8192, size=40, replace=False)) * 8192
    src = [(int(o) + 3, int(n)) for o, n in zip(starts, rng.integers(1, 8000, size=40))]  # 1-byte words
    dst = [(int(o) + 5, n) for o, (_, n) in zip(starts[::-1], src)]
    assert len(src) > FEW_PIECES
    tok = _transfer(sender, pool, receiver, "odd", src, dst)
    assert tok.wait(TIMEOUT) and tok.state().name == "DONE", tok.error
    _land(receiver, pool, src, dst)
    answer = receiver.ask(op="state", id="odd", timeout=TIMEOUT)
    assert answer["sha"] == hashlib.sha256(receiver.image.tobytes()).hexdigest()
    from xpyd.transfer.cuda_ipc_stamps import RECEIVER_STAGES

    stages = [stage for stage in answer["stages"] if not stage.startswith("copy:")]  # (finer steps of the copy)
    assert stages == list(RECEIVER_STAGES) and answer["device_s"] > 0


@pytest.mark.parametrize("way", ["tiles", "flat", "loop", "copy_runs_foreach"])
def test_the_copy_kernel_on_the_device_matches_a_copy_per_piece(way):
    from xpyd.transfer import cuda_ipc_kernel

    if way != "copy_runs_foreach" and cuda_ipc_kernel.why_unavailable(torch.device("cuda")):
        pytest.skip(cuda_ipc_kernel.why_unavailable(torch.device("cuda")))
    gen = torch.Generator(device="cuda").manual_seed(11)
    src = torch.randint(0, 256, (SIZE,), dtype=torch.uint8, device="cuda", generator=gen)
    dst = torch.full((SIZE,), FILL, dtype=torch.uint8, device="cuda")
    rng = np.random.default_rng(9)
    for unit, shift in [(2 << 20, 0), (4096, 0), (4096, 8), (4096, 1)]:  # 16-byte vectors, 8-byte, 1-byte words
        blocks = rng.choice(SIZE // unit - 1, size=min(64, SIZE // unit // 2), replace=False)
        pieces = [(int(b) * unit + shift, int(b2) * unit + shift, unit - shift)
                  for b, b2 in zip(blocks, rng.permutation(blocks))]
        want = dst.clone()
        for s, d, n in pieces:
            want[d: d + n] = src[s: s + n]
        if way == "copy_runs_foreach":
            cuda_ipc_kernel.copy_runs_foreach(dst, src, pieces)
        else:
            cuda_ipc_kernel.copy_runs(dst, src, pieces, way)
        torch.cuda.synchronize()
        assert torch.equal(dst, want), (unit, shift)
