"""The neuron backend without hardware: region planning, communicators, completion tracking (fake runtime)."""

from __future__ import annotations

import importlib.util

import pytest

from xpyd.transfer.base import BackendDescriptor, Region, TransferError, TransferState
from xpyd.transfer.neuron_backend import NeuronTransferBackend
from xpyd.transfer.neuron_plan import CommState, CommTable, DeviceTensor, TensorMap, plan
from xpyd.transfer.auth import new_secret

SECRET = new_secret()  # the transfers here that are not about their secret share one

KB = 1024


def test_split_walks_tensor_boundaries():
    m = TensorMap([DeviceTensor(0, 100), DeviceTensor(1, 50), DeviceTensor(0, 30)])
    assert m.nbytes == 180
    assert m.split(Region(90, 70)) == [(0, 90, 10), (1, 0, 50), (2, 0, 10)]
    assert m.split(Region(100, 50)) == [(1, 0, 50)]
    assert m.split(Region(179, 1)) == [(2, 29, 1)]
    with pytest.raises(ValueError, match="outside"):
        m.split(Region(170, 11))


def test_plan_pairs_pieces_and_cores():
    local = TensorMap([DeviceTensor(0, 100), DeviceTensor(1, 100)])
    peer = TensorMap([DeviceTensor(4, 100), DeviceTensor(5, 100)])
    p = plan(local, [Region(50, 100)], peer, [Region(50, 60), Region(110, 40)])
    assert (p.tensors, p.offsets, p.lengths) == ((0, 1, 1), (50, 0, 10), (50, 10, 40))
    assert (p.local_cores, p.peer_cores) == ((0, 1, 1), (4, 5, 5))
    assert p.total == 100 and len(p) == 3


def test_plan_refuses_layout_mismatch_and_byte_count_mismatch():
    local = TensorMap([DeviceTensor(0, 100), DeviceTensor(1, 100)])
    with pytest.raises(ValueError, match="share one layout"):
        plan(local, [Region(0, 10)], local, [Region(10, 10)])
    with pytest.raises(ValueError, match="different byte counts"):
        plan(local, [Region(0, 10)], local, [Region(0, 11)])


def test_comm_table_ready_timeout_and_recreate():
    now = [0.0]
    created, ready = [], set()
    table = CommTable(lambda k: created.append(k) or len(created), lambda cid: cid in ready, timeout=5,
                      clock=lambda: now[0])
    a = table.get("send", "10.0.0.2", 1, 0)
    assert table.get("send", "10.0.0.2", 1, 0) is a and a.comm_id == 1
    b = table.get("recv", "10.0.0.3", 0, 0)
    ready.add(1)
    table.poll()
    assert (a.state, b.state) == (CommState.READY, CommState.CONNECTING)
    now[0] = 6
    table.poll()
    assert b.state is CommState.FAILED and "not ready within 5s" in b.error
    with pytest.raises(ValueError, match="illegal"):
        b.move(CommState.READY)
    assert table.get("recv", "10.0.0.3", 0, 0).comm_id == 3  # a failed one is recreated
    assert len(table.forget("10.0.0.2")) == 1 and ("send", "10.0.0.2", 1, 0) not in table.comms
    with pytest.raises(ValueError):
        table.get("sideways", "x", 0, 0)


class FakeToken:
    def __init__(self) -> None:
        self.flag = False

    def is_done(self) -> bool:
        return self.flag


class FakeRuntime:
    def __init__(self) -> None:
        self.inited, self.comms, self.ready, self.queued, self.fail_queue = [], [], set(), [], None

    def init_core(self, core):
        self.inited.append(core)

    def create_comm(self, direction, ip, peer_core, local_core):
        self.comms.append((direction, ip, peer_core, local_core))
        return 100 + len(self.comms)

    def test_comm(self, cid):
        return cid in self.ready

    def new_token(self):
        return FakeToken()

    def queue(self, tensors, offsets, lengths, peer_devices, local_devices, comm_ids, count, token, timeout):
        if self.fail_queue:
            raise RuntimeError(self.fail_queue)
        self.queued.append((tensors, offsets, lengths, peer_devices, local_devices, comm_ids, count, token))


def _backend(rt, host="10.0.0.1"):
    tensors = [bytearray(64 * KB), bytearray(64 * KB)]  # stand-ins for device tensors
    b = NeuronTransferBackend([memoryview(t) for t in tensors], [0, 1], host, 9000, runtime=rt)
    b.register(memoryview(bytearray(128 * KB)))
    return b


def test_send_waits_for_communicators_then_queues_and_completes_on_poll():
    rt = FakeRuntime()
    a, b = _backend(rt), _backend(FakeRuntime(), "10.0.0.2")
    assert rt.inited == [0, 1]
    tok = a.send("r1", [Region(60 * KB, 8 * KB)], b.descriptor, [Region(60 * KB, 8 * KB)], secret=SECRET)
    assert rt.comms == [("send", "10.0.0.2", 0, 0), ("send", "10.0.0.2", 1, 1)]
    assert tok.state() is TransferState.PENDING and rt.queued == []  # communicators not ready yet
    rt.ready |= {101, 102}
    assert tok.state() is TransferState.TRANSFERRING
    tensors, offsets, lengths, peer_devs, local_devs, comm_ids, count, native = rt.queued[0]
    assert (offsets, lengths, peer_devs, local_devs, comm_ids, count) == (
        [60 * KB, 0], [4 * KB, 4 * KB], [0, 1], [0, 1], [101, 102], 2)
    assert a.outstanding() == {"r1"}
    native.flag = True
    assert tok.done() and a.outstanding() == set()


def test_errors_abort_close_and_queue_failure():
    rt = FakeRuntime()
    a, peer = _backend(rt), _backend(FakeRuntime(), "10.0.0.2").descriptor
    with pytest.raises(TransferError, match="expect_from"):
        a.expect("x", [Region(0, 10)], secret=SECRET)
    with pytest.raises(ValueError, match="neuron BackendDescriptor"):
        a.send("x", [Region(0, 10)], BackendDescriptor("tcp", "h:1", 10), [Region(0, 10)], secret=SECRET)
    other = BackendDescriptor("neuron", "10.0.0.3:1", peer.buffer_size, offers=(("neuron-cores", "0,1"),
                                                                               ("neuron-layout", "beef")))
    with pytest.raises(ValueError, match="layout hash"):
        a.send("x", [Region(0, 10)], other, [Region(0, 10)], secret=SECRET)
    with pytest.raises(ValueError):
        a.send("x", [Region(128 * KB, 1)], peer, [Region(0, 1)], secret=SECRET)
    t1 = a.expect_from("r", [Region(0, 10)], peer, [Region(0, 10)], secret=SECRET)
    assert rt.comms[-1][0] == "recv"
    a.abort("r")
    assert t1.state() is TransferState.FAILED and t1.error == "aborted"
    rt.ready |= set(range(100, 110))
    rt.fail_queue = "device busy"
    t2 = a.send("q", [Region(0, 10)], peer, [Region(0, 10)], secret=SECRET)
    assert t2.failed() and "device busy" in t2.error
    rt.fail_queue = None
    t3 = a.send("c", [Region(0, 10)], peer, [Region(0, 10)], secret=SECRET)
    a.close()
    assert t3.failed() and t3.error == "backend closed" and a.outstanding() == set()
    with pytest.raises(TransferError):
        a.send("d", [Region(0, 10)], peer, [Region(0, 10)], secret=SECRET)


def test_real_module_refuses_to_import_without_torch_neuronx():
    if importlib.util.find_spec("torch_neuronx") is not None:
        pytest.skip("torch-neuronx is installed")
    with pytest.raises(ImportError, match="torch-neuronx"):
        import xpyd.transfer.neuron  # noqa: F401
    from xpyd.transfer import make_backend

    with pytest.raises(ImportError, match="torch-neuronx"):
        make_backend("neuron", tensors=[], cores=[], host="h", port=1)
