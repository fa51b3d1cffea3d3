"""The cuda_ipc receiver's state per connection: the sender's pool and board (``PeerPool``) and its copying
thread, one per connection, so that the copy is launched by the thread that
woke when the sender's forward ended, and the transfer is confirmed and DONE right after the copy's fence.

A receiver's reader thread claims an offer and prepares its copy while the sender's forward still runs; it
hands the rest (wait for the sender's event, copy, confirm, DONE: ``work``) to its connection's ``Copier``
and waits, checking every ``poll`` seconds whether to give up (``give_up``: the receiver aborted, the
sender hung up, a deadline passed). Giving up does not stop the copier, which may sleep in the driver for
good (a wait on the event of a process that died never ends): ``run`` says so and the caller drops that
copier (the next transfer gets a new one). The copier thread is long-lived because a thread's first CUDA
calls cost ~0.1 ms (measured on an H200) that would otherwise sit between the forward's end and the copy.
"""

from __future__ import annotations

import threading
from queue import SimpleQueue
from typing import Callable

from xpyd.transfer import shm_board, shm_segment
from xpyd.transfer.cuda_ipc_device import DeviceOps
from xpyd.transfer.cuda_ipc_wire import Hello
from xpyd.transfer.shm_board import BoardView


class Copier:
    """A daemon thread that runs the jobs it is given, in order."""

    def __init__(self, name: str) -> None:
        self._jobs: SimpleQueue = SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def run(self, work: Callable[[], "str | None"], give_up: Callable[[], "str | None"],
            poll: float) -> tuple[bool, "str | None"]:
        """Run ``work`` on this thread and wait for it: (True, its outcome), or (False, why) as soon as
        ``give_up`` (asked every ``poll`` seconds) says why; then ``work`` may still run, or never end."""
        finished = threading.Event()
        outcome: list = []

        def job() -> None:
            try:
                outcome.append(work())
            except Exception as e:  # (a driver error)
                outcome.append(f"device error: {e}")
            finally:
                finished.set()

        self._jobs.put(job)
        while not finished.wait(poll):
            why = give_up()
            if why is not None:
                if finished.is_set():  # (it ended meanwhile: its own outcome stands)
                    break
                return False, why
        return True, outcome[0]

    def close(self, join_timeout: float = 0.0) -> None:
        """Let the thread end after the jobs it has (at once if it is idle); wait up to ``join_timeout`` for
        it (one asleep in the driver for good is left behind)."""
        self._jobs.put(None)
        if join_timeout > 0:
            self._thread.join(join_timeout)


class PeerPool:
    """The sender's pool and abort board as its Hello names them (opened when the first offer that checks out
    needs them), and the connection's copier (``cuda_ipc_copier``; made when a transfer first waits)."""

    __slots__ = ("hello", "pool", "board", "copier")

    def __init__(self, hello: Hello) -> None:
        self.hello = hello
        self.pool = None
        self.board: BoardView | None = None
        self.copier: Copier | None = None

    def open(self, ops: DeviceOps):
        if self.pool is None:
            board = BoardView(shm_segment.map_peer(self.hello.board, shm_board.BYTES), 0)
            self.pool, self.board = ops.open(self.hello.export), board
        return self.pool
