"""Requests with several choices (``n`` > 1, or a list of prompts) split into one-choice requests and their
answers joined back, with vLLM's semantics:

- choice ``prompt_index * n + j`` is the j-th completion of prompt ``prompt_index``;
- with a ``seed``, choice j samples from ``seed + j`` (vLLM v1's parallel sampling), so each choice is the
  answer a one-choice request with that seed gets (greedy choices are all alike);
- ``usage``: each prompt's tokens once (as vLLM counts a prompt whose choices share its KV), every choice's
  completion tokens;
- a stream interleaves the choices' chunks as they come, each with its index (a chat stream opens every choice
  with its role chunk), then one usage chunk if asked, then ``[DONE]``; an error in one choice ends the stream
  with its error event.

Whoever serves the one-choice requests (the P/D proxy: a call per choice; a colocated worker: an engine request
per choice) starts a prompt's first choice before its others, so they find its prompt's blocks in the prefix
cache: the choices share the prompt's KV instead of each computing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace

from xpyd.api.openai import CompletionRequest, RequestKind
from xpyd.api.responses import DONE_DATA, SSE_DONE, SSE_KEEPALIVE, has_text, sse, usage_chunk
from xpyd.api.sse import sse_data

_SEED_LIMIT = 2**64


@dataclass(frozen=True, slots=True)
class Child:
    index: int  # the choice's index in the response
    prompt_index: int
    first_of_prompt: bool  # its prompt's first choice (counts the prompt's tokens; its siblings wait for it)
    req: CompletionRequest


def several(req: CompletionRequest) -> bool:
    return req.n > 1 or (req.prompts is not None and len(req.prompts) > 1)


def split(req: CompletionRequest) -> list[Child]:
    """One one-choice request per (prompt, j), in choice order; ``raw`` (what a worker is sent) follows."""
    prompts = req.prompts if req.prompts is not None else (req.prompt,)
    out = []
    for p, prompt in enumerate(prompts):
        for j in range(req.n):
            seed = None if req.seed is None else (req.seed + j) % _SEED_LIMIT
            raw = {**req.raw, "n": 1}
            if req.kind is RequestKind.COMPLETION:
                raw["prompt"] = prompt
            if seed is not None:
                raw["seed"] = seed
            if req.stream:  # (its usage is needed for the joined usage chunk)
                raw["stream_options"] = {**(raw.get("stream_options") or {}), "include_usage": True}
            child = replace(req, n=1, prompt=prompt, prompts=None, seed=seed, raw=raw,
                            include_usage=req.stream)
            out.append(Child(p * req.n + j, p, j == 0, child))
    return out


def _usage(children: Sequence[Child], usages: dict[int, dict]) -> dict:
    prompt = completion = cached = 0
    for c in children:
        u = usages.get(c.index)
        if u is None:
            continue
        completion += u.get("completion_tokens", 0)
        if c.first_of_prompt:
            prompt += u.get("prompt_tokens", 0)
            cached += (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def join_json(req: CompletionRequest, answers: Sequence[tuple[Child, dict]]) -> dict:
    """The response of ``req`` from its children's (one-choice) responses, which share its id and model."""
    first = answers[0][1]
    choices = []
    for child, answer in sorted(answers, key=lambda a: a[0].index):
        for choice in answer["choices"]:
            choices.append({**choice, "index": child.index})
    out = {k: v for k, v in first.items() if k not in ("choices", "usage")}
    out["choices"] = choices
    out["usage"] = _usage([c for c, _ in answers], {c.index: a.get("usage") or {} for c, a in answers})
    return out


async def join_streams(req: CompletionRequest, streams: Sequence[tuple[Child, AsyncIterator[bytes]]],
                       name: tuple[str, int, str], first_text: Callable[[], None] | None = None,
                       trailer: Callable[[], bytes] | None = None,
                       keepalive: float | None = None) -> AsyncIterator[bytes]:
    """The SSE stream of ``req`` from its children's streams (each a whole one-choice stream with its usage
    chunk); ``name``: the response's (id, created, model). Closing it closes every child stream.
    ``first_text``: called as the first chunk with text is handed to the connection (just before its yield);
    ``trailer``: what goes just before ``[DONE]`` when every child ended (a timing comment); ``keepalive``:
    write ``SSE_KEEPALIVE`` after each that many seconds in which no child said anything."""
    queue: asyncio.Queue[tuple[Child, bytes | None]] = asyncio.Queue()
    usages: dict[int, dict] = {}

    async def pump(child: Child, stream: AsyncIterator[bytes]) -> None:
        try:
            async with contextlib.aclosing(sse_data(stream)) as events:
                async for data in events:
                    await queue.put((child, data))
        finally:
            await queue.put((child, None))

    tasks = [asyncio.create_task(pump(c, s)) for c, s in streams]
    open_streams = len(tasks)
    try:
        while open_streams:
            if keepalive is not None and queue.empty():
                try:
                    async with asyncio.timeout(keepalive):
                        child, data = await queue.get()
                except TimeoutError:
                    yield SSE_KEEPALIVE  # (the children's keep-alives are comments: their parsers skip them)
                    continue
            else:
                child, data = await queue.get()
            if data is None:
                open_streams -= 1
                continue
            if data == DONE_DATA:
                continue
            event = json.loads(data)
            if "error" in event:
                yield sse(event)
                break
            if not event.get("choices") and "usage" in event:
                usages[child.index] = event["usage"]
                continue
            for choice in event.get("choices", ()):
                choice["index"] = child.index
            if first_text is not None and has_text(event):
                first_text()
                first_text = None
            yield sse(event)
        else:
            if req.include_usage:
                u = _usage([c for c, _ in streams], usages)
                yield sse({**usage_chunk(*name, req.kind, 0, 0), "usage": u})
            if trailer is not None:
                yield trailer()
        yield SSE_DONE
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, s in streams:  # (a stream its task never started is closed here)
            aclose = getattr(s, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
