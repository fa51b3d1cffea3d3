"""Host staging for device KV pools, exercised on CPU pools with staging forced on.

A staged pool registers a separate host copy; these tests prove the bytes of a request go pool ->
host copy -> wire -> host copy -> pool, land in the right blocks and nowhere else, and only once the
receive token is polled; and that aborts, failures and close leave the pool untouched.
"""

from __future__ import annotations

import pytest
import torch

from xpyd.model.kv_pool import KVLayout, KVPool
from xpyd.worker.kv_staging import (
    HostStaging,
    StagedTransfer,
    needs_staging,
    pool_memory,
    stage_pool,
    stage_transfer,
)
from xpyd.transfer.base import DeviceMemory, Region, TransferState
from xpyd.transfer.fake import FakeNetwork, FakeTransferBackend
from xpyd.transfer.auth import new_secret

SECRET = new_secret()  # the transfers here that are not about their secret share one

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="bfloat16", num_blocks=6, block_size=4)


def staged(network: FakeNetwork, auto_complete: bool = True) -> tuple[KVPool, StagedTransfer]:
    pool = KVPool(LAYOUT, device=torch.device("cpu"))
    transfer = StagedTransfer(FakeTransferBackend(network, auto_complete=auto_complete), stage_pool(pool, pin=False))
    return pool, transfer


def pool_bytes(pool: KVPool) -> torch.Tensor:
    return pool.tensor.view(-1).view(torch.uint8)


def staging_bytes(pool: KVPool) -> torch.Tensor:
    return torch.frombuffer(pool.buffer(), dtype=torch.uint8)


def test_bytes_round_trip_through_both_staging_copies_into_the_right_blocks():
    net = FakeNetwork()
    (src_pool, sender), (dst_pool, receiver) = staged(net), staged(net)
    peer = receiver.register(dst_pool.buffer())
    sender.register(src_pool.buffer())
    src_blocks, dst_blocks = [1, 2], [4, 5]
    src_pool.tensor[src_blocks] = torch.randn(2, *LAYOUT.shape[1:]).to(torch.bfloat16)
    (src,), (dst,) = [Region(*r) for r in src_pool.byte_ranges(src_blocks)], \
        [Region(*r) for r in dst_pool.byte_ranges(dst_blocks)]

    # the registered buffer is the host copy, not the pool: nothing there until a send stages it
    assert src_pool.buffer().nbytes == LAYOUT.total_bytes
    assert not staging_bytes(src_pool).any()

    recv = receiver.expect("t1", [dst], secret=SECRET)
    sent = sender.send("t1", [src], peer, [dst], secret=SECRET)
    assert sent.done()
    assert torch.equal(staging_bytes(src_pool)[src.offset : src.end], pool_bytes(src_pool)[src.offset : src.end])
    # arrived in the receiver's host copy; its pool is untouched until the token is polled
    assert torch.equal(staging_bytes(dst_pool)[dst.offset : dst.end], pool_bytes(src_pool)[src.offset : src.end])
    assert not dst_pool.tensor.any()
    assert receiver.outstanding() == {"t1"}

    assert recv.done() and recv.state() is TransferState.DONE and recv.error is None
    assert torch.equal(dst_pool.tensor[dst_blocks], src_pool.tensor[src_blocks])
    untouched = torch.ones(LAYOUT.num_blocks, dtype=torch.bool)
    untouched[dst_blocks] = False
    assert not dst_pool.tensor[untouched].any()  # no other block
    assert receiver.outstanding() == set()


def test_a_failed_transfer_fails_the_token_and_leaves_the_pool_alone():
    net = FakeNetwork()
    (dst_pool, receiver) = staged(net, auto_complete=False)
    receiver.register(dst_pool.buffer())
    token = receiver.expect("t1", [Region(*r) for r in dst_pool.byte_ranges([3])], secret=SECRET)
    assert token.state() is TransferState.PENDING
    receiver.inner.fail("t1", "peer died")
    assert token.failed() and token.error == "peer died"
    assert not dst_pool.tensor.any()


def test_abort_before_landing_means_no_copy_into_the_pool():
    net = FakeNetwork()
    (dst_pool, receiver) = staged(net, auto_complete=False)
    receiver.register(dst_pool.buffer())
    (region,) = [Region(*r) for r in dst_pool.byte_ranges([3])]
    token = receiver.expect("t1", [region], secret=SECRET)
    staging_bytes(dst_pool)[region.offset : region.end] = 7  # bytes arrived...
    receiver.inner.complete("t1")  # ...and the backend finished, but nobody polled yet
    receiver.abort("t1")
    assert token.failed() and token.error == "aborted"
    assert not dst_pool.tensor.any()
    assert receiver.outstanding() == set()


def test_close_fails_unlanded_receives():
    (dst_pool, receiver) = staged(FakeNetwork(), auto_complete=False)
    receiver.register(dst_pool.buffer())
    token = receiver.expect("t1", [Region(*r) for r in dst_pool.byte_ranges([0])], secret=SECRET)
    receiver.close()
    assert token.failed()
    assert receiver.inner.closed


def test_staging_checks_sizes_and_regions():
    pool = KVPool(LAYOUT)
    with pytest.raises(ValueError, match="staging buffer holds"):
        HostStaging(pool.tensor, memoryview(bytearray(LAYOUT.total_bytes - 1)))
    staging = stage_pool(pool, pin=False)
    with pytest.raises(ValueError, match="already has a staging copy"):
        stage_pool(pool)
    with pytest.raises(ValueError, match="outside"):
        staging.to_host([Region(LAYOUT.total_bytes - 1, 2)])
    transfer = StagedTransfer(FakeTransferBackend(), staging)
    with pytest.raises(ValueError, match="registered buffer holds"):
        transfer.register(memoryview(bytearray(8)))


def test_staging_in_backend_memory_for_the_sender():
    """stage_transfer(sender=True) puts the host copy where the backend wants to send from (shm: its segment)."""

    class SegmentBackend(FakeTransferBackend):
        def __init__(self) -> None:
            super().__init__()
            self.segment = bytearray(LAYOUT.total_bytes)
            self.allocated = False

        def allocate(self, size: int) -> memoryview:
            assert size == len(self.segment)
            self.allocated = True
            return memoryview(self.segment)

    pool = KVPool(LAYOUT)
    backend = SegmentBackend()
    transfer = stage_transfer(backend, pool, sender=True)
    pool.tensor[0, :1] = 1.0
    transfer.staging.to_host([Region(0, LAYOUT.token_bytes)])
    assert any(backend.segment[: LAYOUT.token_bytes]) and not any(backend.segment[LAYOUT.token_bytes :])
    # a receiver never uses backend memory: its host copy is its own
    pool2, backend2 = KVPool(LAYOUT), SegmentBackend()
    stage_transfer(backend2, pool2, sender=False)
    assert not backend2.allocated and pool2.buffer().nbytes == LAYOUT.total_bytes


def test_a_device_pool_has_no_host_buffer_until_staged():
    """'meta' stands in for a GPU: a pool that is not host memory."""
    pool = KVPool(LAYOUT, device="meta")
    assert pool.device.type == "meta" and pool.tensor.device.type == "meta"
    with pytest.raises(ValueError, match="not host memory"):
        pool.buffer()
    with pytest.raises(ValueError, match="cannot live in a host buffer"):
        KVPool(LAYOUT, buffer=memoryview(bytearray(LAYOUT.total_bytes)), device="meta")
    # a CPU pool passed its device explicitly is the ordinary pool
    cpu = KVPool(LAYOUT, device=torch.device("cpu"))
    assert cpu.staging is None and cpu.buffer().nbytes == LAYOUT.total_bytes


class _DeviceBackend:
    registers_device_memory = True  # like nixl


def test_only_backends_without_device_registration_stage_a_device_pool():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    fake = FakeTransferBackend(FakeNetwork())
    assert needs_staging(fake, cuda) and not needs_staging(fake, cpu)
    assert not needs_staging(_DeviceBackend(), cuda) and not needs_staging(_DeviceBackend(), cpu)


def test_pool_memory_hands_a_device_pool_to_a_device_registering_backend_as_is():
    pool = KVPool(LAYOUT, device=torch.device("cpu"))
    assert isinstance(pool_memory(pool, _DeviceBackend()), memoryview)  # host pool: host bytes
    pool.device = torch.device("cuda", 1)  # stands in for a pool on GPU 1 (no CUDA here)
    mem = pool_memory(pool, _DeviceBackend())
    assert mem == DeviceMemory("cuda", 1, pool.tensor.data_ptr(), LAYOUT.total_bytes)
    with pytest.raises(ValueError, match="not host memory"):  # tcp/shm need the staging copy first
        pool_memory(pool, FakeTransferBackend(FakeNetwork()))
    stage_pool(pool, pin=False)
    assert isinstance(pool_memory(pool, _DeviceBackend()), memoryview)  # staged: the host copy, always
