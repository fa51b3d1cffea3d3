"""A prefill worker's handshake with a decode worker: the served name, the KV layout and the weights must
match (two models served under one name must not mix KV); each refusal says what differs."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from xpyd.model.sampling import TorchSampler
from xpyd.model.kv_pool import KVLayout, KVPool
from xpyd.prefill_worker.engine import PrefillEngine
from xpyd.signal import messages as m
from xpyd.transfer.fake import FakeNetwork, FakeTransferBackend
from xpyd.worker.config import WorkerConfig

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", num_blocks=8, block_size=4)
DECODE = "127.0.0.1:7001"


@pytest.fixture
def engine():
    transfer = FakeTransferBackend(FakeNetwork())
    runner = SimpleNamespace(pool=KVPool(LAYOUT), max_model_len=32, eos_token_ids=frozenset(), sampler=TorchSampler())
    engine = PrefillEngine(runner, None, WorkerConfig(role="prefill", port=8100), transfer, "m")
    yield engine
    transfer.close()


def test_the_same_name_layout_and_weights_shake_hands(engine):
    compat = engine.peer_compat()
    assert compat == {**LAYOUT.compat(), "weights": engine.weights}
    assert engine.on_handshake(DECODE, m.Handshake(DECODE, "m", compat)).ok


def test_other_weights_under_the_same_name_are_refused(engine):
    reply = engine.on_handshake(DECODE, m.Handshake(DECODE, "m", {**LAYOUT.compat(), "weights": "weights:other"}))
    assert not reply.ok and "different weights" in reply.error and "cannot mix" in reply.error, reply
    reply = engine.on_handshake(DECODE, m.Handshake(DECODE, "m", LAYOUT.compat()))  # (a decode worker naming none)
    assert not reply.ok and "different weights" in reply.error, reply


def test_another_layout_or_name_is_refused(engine):
    other = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", num_blocks=8, block_size=8)
    reply = engine.on_handshake(DECODE, m.Handshake(DECODE, "m", {**other.compat(), "weights": engine.weights}))
    assert not reply.ok and "KV layout mismatch" in reply.error, reply
    reply = engine.on_handshake(DECODE, m.Handshake(DECODE, "n", engine.peer_compat()))
    assert not reply.ok and "model mismatch" in reply.error, reply


def test_another_kv_cache_dtype_or_other_fp8_scales_are_refused():
    """fp8 KV (`--kv-cache-dtype`) means numbers only with its scales: a decode worker of another KV dtype, or of
    fp8 with other scales, is refused at the handshake, the refusal naming both sides' dtypes."""
    fp8 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="fp8_e4m3", num_blocks=8, block_size=4,
                   scales="pow2:0123456789abcdef")
    transfer = FakeTransferBackend(FakeNetwork())
    runner = SimpleNamespace(pool=KVPool(fp8), max_model_len=32, eos_token_ids=frozenset(), sampler=TorchSampler())
    engine = PrefillEngine(runner, None, WorkerConfig(role="prefill", port=8100), transfer, "m")
    try:
        weights = engine.weights
        assert engine.on_handshake(DECODE, m.Handshake(DECODE, "m", engine.peer_compat())).ok
        bf16 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="bfloat16", num_blocks=8, block_size=4)
        for other, named in ((bf16, "decode bfloat16"), (dataclasses.replace(fp8, scales="pow2:fedcba9876543210"),
                                                          "decode fp8_e4m3 with scales pow2:fedcba9876543210"),
                             (dataclasses.replace(fp8, dtype="fp8_e5m2"), "decode fp8_e5m2")):
            reply = engine.on_handshake(DECODE, m.Handshake(DECODE, "m", {**other.compat(), "weights": weights}))
            assert not reply.ok and "KV cache dtype mismatch" in reply.error and named in reply.error, reply
            assert "prefill fp8_e4m3 with scales pow2:0123456789abcdef" in reply.error, reply
    finally:
        transfer.close()
