"""CompletionToken.on_finish: what lets an engine sleep until a transfer ends instead of ticking."""

from __future__ import annotations

import threading

from xpyd.transfer.base import CompletionToken, Region, TransferState
from xpyd.transfer.fake import FakeNetwork, FakeTransferBackend
from xpyd.transfer.auth import new_secret

SECRET = new_secret()  # the transfers here that are not about their secret share one


def test_on_finish_runs_once_when_the_token_finishes_on_the_finishing_thread():
    token = CompletionToken("t")
    calls: list[str] = []
    token.on_finish(lambda: calls.append(threading.current_thread().name))
    token._advance(TransferState.TRANSFERRING)
    assert calls == []
    worker = threading.Thread(target=token._advance, args=(TransferState.DONE,), name="io")
    worker.start()
    worker.join()
    assert calls == ["io"]
    token._fail("late")  # already finished: no second call
    assert calls == ["io"] and token.done()


def test_on_finish_on_a_finished_token_runs_at_once_and_a_failing_callback_breaks_nothing():
    token = CompletionToken("t")
    token._fail("refused")
    calls = []
    token.on_finish(lambda: calls.append(1))
    assert calls == [1]
    other = CompletionToken("u")
    other.on_finish(lambda: 1 / 0)  # logged, not raised into the backend
    other.on_finish(lambda: calls.append(2))
    assert other._advance(TransferState.DONE) and calls == [1, 2]


def test_a_receive_on_the_fake_backend_wakes_its_waiter():
    net = FakeNetwork()
    receiver = FakeTransferBackend(net)
    receiver.register(memoryview(bytearray(64)))
    woken = threading.Event()
    token = receiver.expect("x", [Region(0, 8)], secret=SECRET)
    token.on_finish(woken.set)
    assert not woken.is_set()
    receiver.complete("x")
    assert woken.is_set() and token.done()
