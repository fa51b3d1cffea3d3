"""A latent KV layout (multi-head latent attention: one vector per token and layer, not a K and a V per KV head):
its shape, bytes and byte ranges, what it names in the handshake, and a prefill worker refusing a decode worker
whose KV is laid out otherwise (per head, or latents of another size), saying both."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from xpyd.model.kv_pool import ByteRange, KVLayout, KVPool
from xpyd.model.sampling import TorchSampler
from xpyd.prefill_worker.engine import PrefillEngine
from xpyd.signal import messages as m
from xpyd.transfer.fake import FakeNetwork, FakeTransferBackend
from xpyd.worker.config import WorkerConfig

LATENT = KVLayout(num_layers=3, num_kv_heads=1, head_dim=40, dtype="float32", num_blocks=8, block_size=4, kind="latent")
PER_HEAD = KVLayout(num_layers=3, num_kv_heads=1, head_dim=40, dtype="float32", num_blocks=8, block_size=4)
DECODE = "127.0.0.1:7001"


def test_a_latent_layout_is_one_vector_per_token_and_layer():
    assert LATENT.shape == (8, 1, 3, 1, 4, 40) and PER_HEAD.shape == (8, 1, 3, 2, 4, 40)
    assert LATENT.token_bytes == 3 * 40 * 4 == PER_HEAD.token_bytes // 2
    assert LATENT.block_bytes == 4 * LATENT.token_bytes and LATENT.total_bytes == 8 * LATENT.block_bytes
    assert KVLayout(3, 1, 40, "bfloat16", 8, 4, kind="latent").token_bytes == 3 * 40 * 2
    pool = KVPool(LATENT)
    assert pool.tensor.shape == LATENT.shape and pool.tensor.numel() * 4 == LATENT.total_bytes
    pool.tensor[5] = torch.arange(pool.tensor[5].numel(), dtype=torch.float32).view(pool.tensor[5].shape)
    assert pool.byte_ranges([5, 6]) == [ByteRange(5 * LATENT.block_bytes, 2 * LATENT.block_bytes)]
    (r,) = pool.byte_ranges([5])
    assert bytes(pool.buffer()[r.offset : r.end]) == pool.tensor[5].numpy().tobytes()


def test_a_latent_layout_names_itself_and_the_latent_size_in_the_handshake():
    assert LATENT.compat() == {"layout": "block-latent/1", "num_layers": 3, "latent_dim": 40, "dtype": "float32",
                               "block_size": 4}
    assert PER_HEAD.compat()["layout"] == "block-head-major/1" and "kind" not in PER_HEAD.compat()
    assert LATENT.compat() != PER_HEAD.compat()
    assert LATENT.compat() == KVLayout(3, 1, 40, "float32", 99, 4, kind="latent").compat()  # (blocks: local)
    assert LATENT.compat() != KVLayout(3, 1, 48, "float32", 8, 4, kind="latent").compat()


@pytest.mark.parametrize("kwargs", [dict(kind="mla"), dict(kind="latent", num_kv_heads=2), dict(kind=None)])
def test_a_latent_layout_is_checked(kwargs):
    args = dict(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", num_blocks=1, block_size=1) | kwargs
    with pytest.raises(ValueError, match="kind|latent"):
        KVLayout(**args)


@pytest.fixture
def engine():
    transfer = FakeTransferBackend(FakeNetwork())
    runner = SimpleNamespace(pool=KVPool(LATENT), max_model_len=32, eos_token_ids=frozenset(), sampler=TorchSampler())
    engine = PrefillEngine(runner, None, WorkerConfig(role="prefill", port=8100), transfer, "m")
    yield engine
    transfer.close()


def test_a_latent_prefill_worker_shakes_hands_only_with_the_same_latents(engine):
    assert engine.on_handshake(DECODE, m.Handshake(DECODE, "m", engine.peer_compat())).ok
    for other in (PER_HEAD, KVLayout(3, 1, 48, "float32", 8, 4, kind="latent"),
                  KVLayout(3, 4, 24, "float32", 8, 4)):
        reply = engine.on_handshake(DECODE, m.Handshake(DECODE, "m", {**other.compat(), "weights": engine.weights}))
        assert not reply.ok and "KV layout mismatch" in reply.error, reply
        assert "block-latent/1" in reply.error and "'latent_dim': 40" in reply.error, reply.error
