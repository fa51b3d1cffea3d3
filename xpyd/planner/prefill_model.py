"""One prefill worker in the fleet model, stepped as `xpyd.prefill_worker.scheduler` plans its steps.

A job moves waiting -> running (it has computed some of its prompt; at most ``max_running`` at once) -> done.
Chunked (``chunk`` > 0), a step computes at most ``chunk`` prompt tokens, taken shortest-remaining first
(a waiting job counts its whole prompt) after any job that got no tokens for ``age_steps`` steps in a row;
several short prompts share a step, a long one goes on from its own KV. Unchunked (``chunk`` 0), a step is one
whole prompt, oldest first. A step takes the profile's time for its new tokens and the cached tokens of its
parts (the prefix reused from the worker's `PrefixLRU` and the chunks already computed).

The worker keeps no clock: the fleet asks for a step (`start_step`, its duration) and reports it done
(`finish_step`, the jobs whose prompt it completed).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from xpyd.model.sim.profile import SimProfile
from xpyd.planner.prefix_lru import PrefixLRU

__all__ = ["PrefillJob", "PrefillWorker"]

AGE_STEPS = 8  # as the prefill scheduler's


@dataclass(eq=False, slots=True)
class PrefillJob:
    index: int  # the request's index in the workload
    prompt_tokens: int
    remaining: int  # prompt tokens still to compute
    computed: int  # tokens whose KV it holds: the reused prefix, then computed chunks
    order: int  # arrival order on this worker
    arrived_step: int  # the worker's step count when it arrived
    started: bool = False  # running: admitted, holds KV
    starved: int = 0  # running: steps in a row it got no token

    def key(self, aged: bool) -> tuple[bool, int, int]:
        """The scheduler's order: aged first, then the least remaining (a waiting job: its whole prompt)."""
        return (not aged, self.remaining if self.started else self.prompt_tokens, self.order)


class PrefillWorker:
    """Waiting jobs are kept in two queues: fresh (arrived fewer than ``age_steps`` steps ago, in arrival order)
    and aged (a heap by prompt length), so a step looks at the running jobs and at most as many waiting ones as
    there are free places, however long the queue."""

    def __init__(self, profile: SimProfile, chunk: int, max_running: int, kv_blocks: int,
                 age_steps: int = AGE_STEPS) -> None:
        if chunk < 0 or max_running < 1 or age_steps < 1:
            raise ValueError("chunk must be >= 0, max_running and age_steps >= 1")
        self.profile = profile
        self.chunk = chunk
        self.max_running = max_running
        self.age_steps = age_steps
        self.cache = PrefixLRU(kv_blocks)
        self.running: list[PrefillJob] = []
        self._fresh: deque[PrefillJob] = deque()
        self._aged: list[tuple[int, int, PrefillJob]] = []  # (prompt tokens, order, job)
        self.queued_tokens = 0  # prompt tokens still to compute, over all jobs
        self.busy = False
        self._step: list[tuple[PrefillJob, int]] = []
        self._orders = 0
        self._steps = 0

    @property
    def jobs(self) -> int:
        """Waiting and running."""
        return len(self.running) + len(self._fresh) + len(self._aged)

    def add(self, index: int, new_tokens: int, cached_tokens: int) -> None:
        job = PrefillJob(index, new_tokens + cached_tokens, new_tokens, cached_tokens, self._orders, self._steps)
        self._orders += 1
        self.queued_tokens += new_tokens
        if self.chunk == 0:
            heapq.heappush(self._aged, (job.order, job.order, job))  # unchunked: oldest first
        else:
            self._fresh.append(job)

    def start_step(self) -> float | None:
        """Plan the next step; its duration in seconds, None when there is nothing to run."""
        if self.busy:
            raise ValueError("the previous step has not finished")
        if self.chunk == 0:
            if not self._aged:
                return None
            job = heapq.heappop(self._aged)[2]
            job.started = True
            self.running.append(job)
            self._step = [(job, job.remaining)]
            self.busy = True
            return self.profile.prefill_seconds(job.remaining, job.computed)
        aged = self.age_steps
        while self._fresh and self._steps - self._fresh[0].arrived_step >= aged:
            job = self._fresh.popleft()
            heapq.heappush(self._aged, (job.prompt_tokens, job.order, job))
        free = self.max_running - len(self.running)
        waiting = [heapq.heappop(self._aged)[2] for _ in range(min(free, len(self._aged)))]
        waiting_keys = [(j.key(True), j) for j in waiting]
        waiting_keys += sorted(((j.key(False), j) for j in self._fresh), key=lambda kj: kj[0])[:free]
        candidates = [(j.key(j.starved >= aged), j) for j in self.running] + waiting_keys
        candidates.sort(key=lambda kj: kj[0])
        if not candidates:
            return None
        budget, new, cached = self.chunk, 0, 0
        step: list[tuple[PrefillJob, int]] = []
        for _, job in candidates:
            if budget == 0 or (not job.started and len(self.running) >= self.max_running):
                job.starved += job.started
                continue
            if not job.started:
                job.started = True
                self.running.append(job)
                if job in waiting:
                    waiting.remove(job)
                else:
                    self._fresh.remove(job)
            n = min(budget, job.remaining)
            step.append((job, n))
            budget -= n
            new += n
            cached += job.computed
            job.starved = 0
        for job in waiting:  # not admitted this step: back to the queue
            heapq.heappush(self._aged, (job.prompt_tokens, job.order, job))
        self._step = step
        self._steps += 1
        self.busy = True
        return self.profile.prefill_seconds(new, cached)

    def finish_step(self) -> list[int]:
        """The step is done: the indices of the jobs whose prompt it completed."""
        if not self.busy:
            raise ValueError("no step is running")
        done = []
        for job, n in self._step:
            job.remaining -= n
            job.computed += n
            self.queued_tokens -= n
            if job.remaining == 0:
                done.append(job.index)
        if done:
            self.running = [j for j in self.running if j.remaining > 0]
        self._step = []
        self.busy = False
        return done
