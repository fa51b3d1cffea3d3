"""Splitting a request with several choices into one-choice requests and joining their answers (vLLM's
indices, seeds and usage)."""

from __future__ import annotations

import asyncio
import json

from xpyd.api.choices import join_json, join_streams, several, split
from xpyd.api.openai import RequestKind, parse_request
from xpyd.api.responses import SSE_DONE, sse, stream_chunk, usage_chunk

C, CHAT = RequestKind.COMPLETION, RequestKind.CHAT


def _req(kind=C, **body):
    if kind is C:
        body.setdefault("prompt", "hi")
    else:
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return parse_request(json.dumps(body).encode(), kind)


def test_split_gives_vllm_indices_and_seeds():
    req = _req(prompt=["a", "b"], n=3, seed=2**64 - 2, stream=True)
    assert several(req)
    kids = split(req)
    assert [(k.index, k.prompt_index, k.first_of_prompt) for k in kids] == [
        (0, 0, True), (1, 0, False), (2, 0, False), (3, 1, True), (4, 1, False), (5, 1, False)]
    assert [k.req.seed for k in kids] == [2**64 - 2, 2**64 - 1, 0] * 2  # (seed + j, within the seed's range)
    assert [k.req.prompt for k in kids] == ["a"] * 3 + ["b"] * 3
    for k in kids:
        assert k.req.n == 1 and k.req.prompts is None and not several(k.req)
        assert k.req.raw["prompt"] == k.req.prompt and k.req.raw["n"] == 1 and k.req.raw["seed"] == k.req.seed
        assert k.req.include_usage and k.req.raw["stream_options"] == {"include_usage": True}
    unseeded = split(_req(n=2))
    assert [k.req.seed for k in unseeded] == [None, None] and "seed" not in unseeded[1].req.raw
    assert not several(_req()) and not several(_req(prompt=["only"]))
    assert [k.req.messages for k in split(_req(CHAT, n=2))] == [[{"role": "user", "content": "hi"}]] * 2


def _answer(index_text: str, prompt: int, completion: int, cached: int = 0) -> dict:
    return {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": index_text, "logprobs": None, "finish_reason": "length",
                         "stop_reason": None}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": cached}}}


def test_join_json_counts_each_prompt_once():
    req = _req(prompt=["a", "b"], n=2)
    kids = split(req)
    answers = [(kids[3], _answer("b1", 7, 4)), (kids[0], _answer("a0", 5, 3, 2)), (kids[1], _answer("a1", 5, 2, 5)),
               (kids[2], _answer("b0", 7, 1))]
    out = join_json(req, answers)
    assert [(c["index"], c["text"]) for c in out["choices"]] == [(0, "a0"), (1, "a1"), (2, "b0"), (3, "b1")]
    assert out["usage"] == {"prompt_tokens": 12, "completion_tokens": 10, "total_tokens": 22,
                            "prompt_tokens_details": {"cached_tokens": 2}}
    assert out["id"] == "cmpl-x" and out["object"] == "text_completion"


async def _stream(events: list[bytes], delay: float = 0.0):
    for e in events:
        await asyncio.sleep(delay)
        yield e


def test_join_streams_reindexes_and_sums_usage():
    req = _req(prompt=["a", "b"], stream=True, stream_options={"include_usage": True})
    kids = split(req)

    def child(text: str, prompt: int) -> list[bytes]:
        return [sse(stream_chunk("cmpl-x", 1, "m", C, text, None)), sse(stream_chunk("cmpl-x", 1, "m", C, "", "length")),
                sse(usage_chunk("cmpl-x", 1, "m", C, prompt, 1)), SSE_DONE]

    async def run() -> list[dict]:
        out = []
        async for block in join_streams(req, [(kids[0], _stream(child("A", 3))), (kids[1], _stream(child("B", 4), 0.001))],
                                        ("cmpl-x", 1, "m")):
            out.append(block)
        assert out[-1] == SSE_DONE
        return [json.loads(b[6:]) for b in out[:-1]]

    events = asyncio.run(run())
    texts = {}
    for e in events[:-1]:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {0: "A", 1: "B"}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["prompt_tokens"] == 7
    assert events[-1]["usage"]["completion_tokens"] == 2


def test_an_error_in_one_choice_ends_the_stream_and_closes_the_others():
    req = _req(n=2, stream=True)
    kids = split(req)
    closed = []

    async def endless():
        try:
            while True:
                await asyncio.sleep(0.001)
                yield sse(stream_chunk("cmpl-x", 1, "m", C, "x", None))
        finally:
            closed.append(True)

    async def failing():
        yield sse({"error": {"message": "boom", "type": "server_error", "param": None, "code": 500}})
        yield SSE_DONE

    async def run() -> list[bytes]:
        return [b async for b in join_streams(req, [(kids[0], endless()), (kids[1], failing())], ("cmpl-x", 1, "m"))]

    out = asyncio.run(run())
    assert out[-1] == SSE_DONE and b'"boom"' in out[-2]
    assert closed == [True]
