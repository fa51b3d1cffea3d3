"""The engine's torch device: explicit CPU runs as before, weights, pool and every per-step tensor are on
the device, a pool on a device reaches the transfer backend through host copies, and a device this
machine does not have is refused at startup (CPU only here; GPUs are untested).

'meta' tensors stand in for a GPU where a test needs a device that is not the CPU: they carry no data.
`DeviceLedger` watches every aten op while a step runs on 'meta': it records each copy between the host
and the device, and any op that takes tensors of both (what a per-step tensor made on the host, e.g.
positions, block tables or a mask, would do); a copy off 'meta' gives a host tensor of a chosen byte.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM

from xpyd.model.kv_pool import KVLayout, KVPool
from xpyd.model.llama_fast import FastLlama
from xpyd.model.runner import ModelRunner
from xpyd.transfer.base import Region
from xpyd.transfer.fake import FakeNetwork, FakeTransferBackend
from xpyd.worker.config import WorkerConfig, add_worker_arguments, check_device, config_from_args
from xpyd.worker.kv_staging import StagedTransfer, needs_staging, stage_transfer
from xpyd.transfer.auth import new_secret

SECRET = new_secret()  # the transfers here that are not about their secret share one

torch.set_num_threads(1)

NO_CUDA = not torch.cuda.is_available()
aten = torch.ops.aten
_COPIES = (aten.copy_, aten._to_copy, aten.to)


@dataclass(frozen=True)
class Copy:
    src: str  # device type
    dst: str
    numel: int
    dtype: torch.dtype
    device_offset: int  # storage offset (elements) of the device-side tensor
    host_values: tuple[int, ...] | None = None  # distinct values of a host source (small uint8 copies)


class DeviceLedger(TorchDispatchMode):
    """Every aten op while active: copies between the host and ``device``, and ops mixing the two."""

    def __init__(self, device: str = "meta", fill: int = 0) -> None:
        super().__init__()
        self.device = device
        self.fill = fill  # what a copy off the device reads ('meta' has no data)
        self.copies: list[Copy] = []
        self.mixed: list[tuple[str, set[str]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        devices = {t.device.type for t in tensors}
        if func.overloadpacket in _COPIES:
            in_place = func.overloadpacket is aten.copy_
            src = args[1] if in_place else args[0]
            if in_place:
                dst = args[0].device.type
            else:
                target = kwargs.get("device") or next((a for a in args[1:] if isinstance(a, torch.device)), None)
                dst = torch.device(target).type if target is not None else src.device.type
            if src.device.type == self.device and dst == "cpu":  # off the device: a host tensor of `fill`
                self.copies.append(Copy(self.device, "cpu", src.numel(), src.dtype, src.storage_offset()))
                data = torch.full(src.shape, self.fill, dtype=kwargs.get("dtype") or src.dtype)
                return args[0].copy_(data) if in_place else data
            if src.device.type == "cpu" and dst == self.device:
                out = func(*args, **kwargs)
                values = tuple(torch.unique(src).tolist()) if src.dtype == torch.uint8 else None
                self.copies.append(Copy("cpu", self.device, src.numel(), src.dtype, out.storage_offset(), values))
                return out
        if len(devices) > 1:
            self.mixed.append((str(func), devices))
        return func(*args, **kwargs)

    def to_host(self) -> list[Copy]:
        return [c for c in self.copies if c.src == self.device]

    def to_device(self) -> list[Copy]:
        return [c for c in self.copies if c.dst == self.device]


def tensor_devices(obj, seen: set[int] | None = None) -> set[str]:
    """Device types of every tensor reachable from ``obj`` (attributes, slots, lists)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or obj is None or isinstance(obj, (int, float, str, bool, torch.dtype, torch.device)):
        return set()
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return {obj.device.type}
    if isinstance(obj, torch.nn.Module):
        return {t.device.type for t in (*obj.parameters(), *obj.buffers())}
    if isinstance(obj, (list, tuple)):
        return set().union(*(tensor_devices(o, seen) for o in obj))
    found: set[str] = set()
    fields = list(getattr(obj, "__dict__", {}).values())
    for klass in type(obj).__mro__:
        fields += [getattr(obj, n, None) for n in getattr(klass, "__slots__", ())]
    for value in fields:
        if isinstance(value, (torch.Tensor, torch.nn.Module, list, tuple)) or type(value).__module__.startswith("xpyd."):
            found |= tensor_devices(value, seen)
    return found


def test_explicit_cpu_device_gives_the_default_runner(tiny_model_dir):
    default = ModelRunner(tiny_model_dir, torch.float32, num_blocks=4, max_seq_len=64, block_size=4)
    explicit = ModelRunner(tiny_model_dir, torch.float32, num_blocks=4, max_seq_len=64, block_size=4,
                           device=torch.device("cpu"))
    assert explicit.device == torch.device("cpu") and explicit.pool.device == torch.device("cpu")
    assert explicit.fast_path.device == torch.device("cpu")
    assert tensor_devices(explicit.model) == {"cpu"} and explicit.pool.tensor.device.type == "cpu"
    assert tensor_devices(explicit.fast_path) == {"cpu"}
    prompt = [1, 5, 9, 2, 7]
    runners = (default, explicit)
    tables = [r.pool.blocks.allocate(2) for r in runners]
    first = [r.prefill(t, prompt) for r, t in zip(runners, tables)]
    assert torch.equal(first[0], first[1]) and first[1].device.type == "cpu"
    steps = [r.decode([t], [3], [len(prompt)]) for r, t in zip(runners, tables)]
    assert torch.equal(steps[0], steps[1])
    for r, t in zip(runners, tables):
        r.use_fast_path(False)
        r.pool.blocks.acquire(t[:1])
    # the general path, decoding and prefilling after a shared block
    steps = [r.decode([t], [4], [len(prompt) + 1]) for r, t in zip(runners, tables)]
    assert torch.equal(steps[0], steps[1])
    shared = [t[:1] + r.pool.blocks.allocate(1) for r, t in zip(runners, tables)]
    steps = [r.prefill(t, prompt[:4] + [8, 8], start=4) for r, t in zip(runners, shared)]
    assert torch.equal(steps[0], steps[1])
    for r, t, s in zip(runners, tables, shared):
        r.pool.blocks.release(t + s)
        assert r.pool.num_used == 0


@pytest.mark.parametrize("attention", ["matmul", "sdpa"])
@pytest.mark.parametrize("batch", [  # (tables, positions): one request, a padded batch, per request (ragged)
    ([[3]], [6]), ([[3], [0, 1], [6, 2]], [6, 20, 17]), ([[3, 5, 7], [0], [6]], [40, 2, 3])],
    ids=["one", "padded", "per-request"])
def test_lean_forward_runs_on_a_non_cpu_device(tiny_model_dir, attention, batch):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.bfloat16).eval().to("meta")
    fast = FastLlama(model, 64, torch.bfloat16, decode_attention=attention)
    assert fast.device.type == "meta" and fast.cos.device.type == "meta"
    assert all(lin.packed is None for lin in (fast.lm_head, fast.layers[0].qkv))  # oneDNN packing is CPU-only
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    pool = torch.zeros(8, cfg.num_key_value_heads, cfg.num_hidden_layers, 2, 16, head_dim, dtype=torch.bfloat16,
                       device="meta")
    assert tensor_devices(fast) == {"meta"}  # weights, fused weights, rotary tables
    tables, positions = batch
    with torch.inference_mode(), DeviceLedger() as ledger:
        logits = fast.prefill(pool, [3], torch.tensor([1, 2, 3, 4, 5, 6], device="meta"))
        assert logits.shape == (cfg.vocab_size,) and logits.device.type == "meta"
        logits = fast.prefill(pool, [3, 4], torch.tensor([5, 6], device="meta"), start=16)  # after a cached block
        assert logits.shape == (cfg.vocab_size,) and logits.device.type == "meta"
        logits = fast.decode(pool, tables, positions, torch.tensor([7] * len(tables), device="meta"))
    assert logits.shape == (len(tables), cfg.vocab_size) and logits.device.type == "meta"
    assert ledger.mixed == []  # no per-step tensor was made on the host
    assert ledger.copies == []  # and none was copied over: the lean forward makes them on its device
    with pytest.raises(ValueError, match="CPU-only"):
        FastLlama(model, 64, torch.bfloat16, pack=True)


@pytest.mark.parametrize("lean", [True, False], ids=["lean-forward", "general-forward"])
def test_runner_on_a_device_keeps_weights_pool_and_every_step_there(tiny_model_dir, lean):
    runner = ModelRunner(tiny_model_dir, torch.float32, num_blocks=8, max_seq_len=64, block_size=4, device="meta")
    runner.use_fast_path(lean)
    assert tensor_devices(runner.model) == {"meta"}
    assert runner.pool.tensor.device.type == "meta" and tensor_devices(runner.fast_path) == {"meta"}
    vocab = runner.vocab_size
    prompts = [[1, 5, 9, 2, 7], [4, 4, 8], [1, 5, 9, 2, 6, 6]]  # the third after the first one's first block
    tables = [runner.pool.blocks.allocate(2), runner.pool.blocks.allocate(1)]

    def prefill_after_shared_block():
        runner.pool.blocks.acquire(tables[0][:1])
        tables.append(tables[0][:1] + runner.pool.blocks.allocate(1))
        return runner.prefill(tables[2], prompts[2], start=4)

    steps = [(lambda t=t, p=p: runner.prefill(t, p), len(p), vocab) for t, p in zip(tables, prompts[:2])]
    steps.append((prefill_after_shared_block, 2, vocab))
    steps.append((lambda: runner.decode(tables, [3, 6, 9], [len(p) for p in prompts]), 3, 3 * vocab))
    for step, num_ids, num_logits in steps:
        with DeviceLedger(fill=0) as ledger:
            logits = step()
        assert logits.device.type == "meta" and logits.numel() == num_logits  # sampled on the device
        assert ledger.mixed == [], ledger.mixed  # every per-step tensor is on the device
        # per step, at most the token ids go in, and nothing comes back (the sampler copies the sampled ids)
        assert [(c.numel, c.dtype) for c in ledger.to_device()] in ([], [(num_ids, torch.long)]), ledger.copies
        assert ledger.to_host() == [], ledger.copies
    for table in tables:
        runner.pool.blocks.release(table)
    assert runner.pool.num_used == 0


def test_staged_transfer_copies_a_device_pool_through_host_memory():
    """A pool on a device under a host-memory backend: send copies exactly the request's bytes device ->
    host before the backend sends them; a receive copies host -> device exactly the bytes that arrived,
    and only when its token is polled."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="bfloat16", num_blocks=6, block_size=4)
    net = FakeNetwork()
    src_pool, dst_pool = KVPool(layout, device="meta"), KVPool(layout, device="meta")
    backend = FakeTransferBackend(net, auto_complete=True)
    assert needs_staging(backend, src_pool.device)
    sender = stage_transfer(backend, src_pool, sender=True)
    receiver = stage_transfer(FakeTransferBackend(net, auto_complete=True), dst_pool, sender=False)
    assert isinstance(sender, StagedTransfer) and isinstance(receiver, StagedTransfer)
    peer = receiver.register(dst_pool.buffer())
    sender.register(src_pool.buffer())
    src_blocks = src_pool.blocks.allocate(3)[1:]  # a request's two blocks: adjacent here, not there
    dst_blocks = dst_pool.blocks.allocate(5)[2::2]
    (src,), (dst, dst2) = [Region(*r) for r in src_pool.byte_ranges(src_blocks)], \
        [Region(*r) for r in dst_pool.byte_ranges(dst_blocks)]
    assert src.offset != dst.offset and src.length == dst.length + dst2.length
    host = {name: torch.frombuffer(pool.buffer(), dtype=torch.uint8) for name, pool in
            (("src", src_pool), ("dst", dst_pool))}

    with DeviceLedger(fill=0xA5) as ledger:
        token = receiver.expect("t1", [dst, dst2], secret=SECRET)
        assert ledger.copies == []
        assert sender.send("t1", [src], peer, [dst, dst2], secret=SECRET).done()
        assert ledger.copies == [Copy("meta", "cpu", src.length, torch.uint8, src.offset)]  # the request only
        # the pool's bytes (0xA5) went through the sender's host copy into the receiver's
        assert set(host["src"][src.offset : src.end].tolist()) == {0xA5}
        assert host["src"].count_nonzero() == src.length
        for r in (dst, dst2):
            assert set(host["dst"][r.offset : r.end].tolist()) == {0xA5}
        assert host["dst"].count_nonzero() == src.length
        assert len(ledger.copies) == 1  # not in the receiver's pool until its token is polled
        assert token.done()
    assert ledger.copies[1:] == [Copy("cpu", "meta", r.length, torch.uint8, r.offset, (0xA5,)) for r in (dst, dst2)]
    assert receiver.outstanding() == set() and ledger.mixed == []
    src_pool.blocks.release(src_blocks)
    dst_pool.blocks.release(dst_blocks)


def test_device_names_are_checked():
    assert WorkerConfig("decode").device == "cpu"
    for role in ("prefill", "decode", "colocated"):
        p = argparse.ArgumentParser()
        add_worker_arguments(p, role)
        assert config_from_args(p.parse_args([]), role).device == "cpu"
        assert config_from_args(p.parse_args(["--device", "cpu"]), role).device == "cpu"
    for bad in ("gpu", "cuda:", "cuda:-1", "cuda:x", "CPU", "cuda:0,1", "mps"):
        with pytest.raises(ValueError, match="--device must be cpu, cuda or cuda:N"):
            WorkerConfig("decode", device=bad)


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:1"])
def test_cuda_is_refused_without_cuda(device):
    with pytest.raises(ValueError, match=rf"--device {device}: CUDA is not available on this machine"):
        WorkerConfig("prefill", device=device)


def test_cuda_index_checks_when_cuda_is_there(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert check_device("cuda:1") == "cuda:1"
    with pytest.raises(ValueError, match="has 2 CUDA device"):
        check_device("cuda:2")
    # nixl registers a GPU pool itself (VRAM; untested here), so the config takes it
    assert WorkerConfig("decode", device="cuda", kv_backend="nixl").kv_backend == "nixl"
    assert WorkerConfig("decode", device="cuda", kv_backend="auto").device == "cuda"


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_worker_with_cuda_fails_at_startup_with_a_clear_message():
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    argv = ["decode", "--device", "cuda", "--port", "1"]
    out = subprocess.run([sys.executable, "-c", f"import sys; from xpyd.cli import main; sys.exit(main({argv!r}))"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0
    assert "--device cuda: CUDA is not available on this machine" in out.stderr
    assert "Traceback" not in out.stderr
