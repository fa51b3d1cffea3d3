"""Arrival processes: when each request is sent.

- closed loop: C workers, each sends its next request as soon as its previous one ended;
- open loop: Poisson arrivals at a given send time each, regardless of what is in flight;
- prefill-stall: a closed loop of short streams plus an open-ended Poisson process of long prompts
  that stops issuing once the short class has finished;
- conversations: C workers, each drives one multi-turn conversation at a time (its turns one after
  another, a think time between them, each turn built from the previous answer), then the next.

Every process stops *issuing* at the deadline (``--duration``) and always waits for what is in
flight. ``send`` never raises for a failed request: it returns a ``RequestResult`` with an error.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable, Iterator

from xpyd.bench.client import RequestResult
from xpyd.bench.conversation import Dialogue
from xpyd.bench.workload import RequestSpec, iter_poisson_gaps

Send = Callable[[RequestSpec], Awaitable[RequestResult]]
OnDone = Callable[[RequestResult], None]


def _noop(_: RequestResult) -> None:
    pass


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.perf_counter() >= deadline


async def closed_loop(send: Send, specs: Iterable[RequestSpec], concurrency: int,
                      deadline: float | None = None, on_done: OnDone = _noop) -> list[RequestResult]:
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    it = iter(specs)  # shared by the workers: one event loop, no locking needed
    results: list[RequestResult] = []

    async def worker() -> None:
        while not _past(deadline):
            spec = next(it, None)
            if spec is None:
                return
            r = await send(spec)
            results.append(r)
            on_done(r)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def open_loop(send: Send, specs: Iterable[RequestSpec], offsets: Iterable[float],
                    deadline: float | None = None, on_done: OnDone = _noop) -> list[RequestResult]:
    """Sends ``specs[i]`` at ``start + offsets[i]`` (start = now)."""
    start = time.perf_counter()
    results: list[RequestResult] = []

    async def one(spec: RequestSpec) -> None:
        r = await send(spec)
        results.append(r)
        on_done(r)

    tasks = []
    for spec, offset in zip(specs, offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if _past(deadline):
            break
        tasks.append(asyncio.create_task(one(spec)))
    await asyncio.gather(*tasks)
    return results


async def prefill_stall(send: Send, short_specs: Iterable[RequestSpec], short_concurrency: int,
                        long_specs: Iterator[RequestSpec], long_rate: float, seed: int,
                        deadline: float | None = None, on_done: OnDone = _noop) -> list[RequestResult]:
    """Short streams in a closed loop; long prompts at Poisson times (the first after one gap) until
    the short class is done or the deadline passes."""
    shorts = asyncio.create_task(closed_loop(send, short_specs, short_concurrency, deadline, on_done))
    results: list[RequestResult] = []

    async def one(spec: RequestSpec) -> None:
        r = await send(spec)
        results.append(r)
        on_done(r)

    longs = []
    try:
        for gap in iter_poisson_gaps(long_rate, seed):
            finished, _ = await asyncio.wait({shorts}, timeout=gap)
            if finished or _past(deadline):
                break
            longs.append(asyncio.create_task(one(next(long_specs))))
        results.extend(await shorts)
        await asyncio.gather(*longs)
    finally:
        for t in [shorts, *longs]:
            t.cancel()  # only does something when we are being cancelled
    return results


async def conversations(send: Send, dialogues: Iterable[Dialogue], concurrency: int,
                        deadline: float | None = None, on_done: OnDone = _noop) -> list[RequestResult]:
    """At most ``concurrency`` conversations in flight, each sequential: sleep the turn's think time,
    send it, feed the answer's text back to the dialogue for the next turn. A failed turn ends its
    conversation (there is no answer to build on); past the deadline no turn is sent."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    it = iter(dialogues)
    results: list[RequestResult] = []

    async def drive(dialogue: Dialogue) -> None:
        try:
            turn = next(dialogue)
            while True:
                pause = turn.think_s if deadline is None else min(turn.think_s, deadline - time.perf_counter())
                if pause > 0:
                    await asyncio.sleep(pause)
                if _past(deadline):
                    return
                r = await send(turn.spec)
                results.append(r)
                on_done(r)
                if not r.ok:
                    return
                turn = dialogue.send(r.text)
        except StopIteration:
            return
        finally:
            dialogue.close()

    async def worker() -> None:
        while not _past(deadline):
            dialogue = next(it, None)
            if dialogue is None:
                return
            await drive(dialogue)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


@dataclass(frozen=True, slots=True)
class Timed:
    """The results of a measured phase and its wall duration (first send to last end)."""

    results: list[RequestResult]
    duration_s: float
    start: float  # perf_counter at the start (report times are relative to it)


async def timed(phase: Awaitable[list[RequestResult]]) -> Timed:
    start = time.perf_counter()
    results = await phase
    end = max((r.end_time for r in results), default=time.perf_counter())
    return Timed(results, max(end - start, 1e-9), start)
