"""Request migration's parts: the token ids chunks name (``xpyd.api.resume``), the proxy's ``MigratingCall`` over
fake calls (what it resumes after, what the client gets, when it gives up), a worker's replay of a resumed output
(``WorkItem``), and the bodies the proxy sends for a resumed request."""

from __future__ import annotations

import asyncio
import json

import pytest

from xpyd.api.identity import ResponseIdentity
from xpyd.api.openai import RequestKind, parse_request
from xpyd.api.responses import dumps
from xpyd.api.resume import CHUNK_IDS_KEY, MAX_CHUNK_IDS, TokenIdsError, split_ids
from xpyd.discovery.types import Role, WorkerInfo
from xpyd.model.output import StopParams
from xpyd.model.sampling import TorchSampler, make_generator
from xpyd.model.sampling_params import SamplingParams
from xpyd.proxy.migration import MigratingCall
from xpyd.proxy.upstream import Fault, UpstreamError
from xpyd.proxy.worker_api import Delta, FirstToken, Usage, decode_body, prefill_body
from xpyd.signal.request_id import RequestId
from xpyd.worker.work_item import WorkItem

NAME = ResponseIdentity("cmpl-abc", 1700000000, "m")


# --- the ids a chunk names -----------------------------------------------------------------------------------
def test_split_ids_takes_the_last_key_off_a_chunk():
    chunk = {"id": "x", "choices": [{"index": 0, "text": "a \"]}\" b", "finish_reason": None}], CHUNK_IDS_KEY: [5, 17]}
    data, ids = split_ids(dumps(chunk))
    assert ids == [5, 17]
    assert json.loads(data) == {k: v for k, v in chunk.items() if k != CHUNK_IDS_KEY}
    assert split_ids(dumps({**chunk, CHUNK_IDS_KEY: []}))[1] == []
    plain = dumps({"id": "x", "choices": []})
    assert split_ids(plain) == (plain, None)


@pytest.mark.parametrize("tail", [b',"xpyd_token_ids":[1,x]}', b',"xpyd_token_ids":[1,-2]}',
                                  b',"xpyd_token_ids":[1],"more":1}',
                                  b',"xpyd_token_ids":[' + b",".join([b"1"] * (MAX_CHUNK_IDS + 1)) + b"]}"])
def test_split_ids_refuses_what_is_not_a_short_list_of_ids(tail):
    with pytest.raises(TokenIdsError):
        split_ids(b'{"id":"x"' + tail)


# --- MigratingCall over fake calls ---------------------------------------------------------------------------
class FakeCall:
    """A call whose decode part yields ``blocks`` (each naming one token) and then fails with ``error``."""

    def __init__(self, first_ids, blocks, error=None, named=True):
        self.identity, self.request_id, self.workers, self.pair = NAME, "rid", (), (None, None)
        self._named = named  # False: a worker that named no tokens
        self._first_ids, self._blocks, self._error = list(first_ids), blocks, error
        self._sent: list[int] = []
        self.closed = False
        self.completed = False
        self.usage = Usage(3, len(first_ids) + len(blocks))

    @property
    def client_tokens(self):
        return self._first_ids + self._sent if self._named else None

    async def relay(self):
        for token, block in self._blocks:
            self._sent.append(token)
            yield block
        if self._error is not None:
            raise self._error
        self.completed = True

    async def rest(self):
        async for block in self.relay():
            yield Delta(block.decode(), None)

    def abort(self):
        self.closed = True

    async def aclose(self):
        self.closed = True


def _req(**extra):
    return parse_request(json.dumps({"prompt": "hi", "max_tokens": 10, **extra}).encode(), RequestKind.COMPLETION)


def _migrating(calls, limit=3, req=None):
    """A MigratingCall over ``calls[0]`` whose restarts hand out the rest in turn; (it, restarts' resumes, failures)."""
    resumes, failures = [], []
    rest = iter(calls[1:])

    async def restart(resume, error):
        resumes.append(resume)
        call, first = next(rest)
        return call, first

    first = FirstToken("a", None, Usage(3, 1), token_ids=(1,))
    m = MigratingCall(calls[0], first, req or _req(stream=True), restart, limit, failures.append)
    return m, resumes, failures


def _collect(agen):
    async def run():
        return [x async for x in agen]
    return asyncio.run(run())


LOST = UpstreamError(502, "decode worker unreachable", fault=Fault.UNREACHABLE)


def test_a_call_that_fails_mid_stream_resumes_after_every_token_the_client_got():
    first = FakeCall([1], [(2, b"B"), (3, b"C")], LOST)
    second = FakeCall([4], [(5, b"E")])
    resumed_first = FirstToken("d", None, Usage(3, 4), token_ids=(4,))
    m, resumes, failures = _migrating([first, (second, resumed_first)])
    blocks = _collect(m.relay())
    assert resumes == [(1, 2, 3)]  # prefill's token, then decode's as they went on
    assert failures == [LOST] and first.closed and m.migrations == 1
    assert blocks[:2] == [b"B", b"C"] and blocks[-1] == b"E"
    (resumed,) = [json.loads(b[6:]) for b in blocks[2:-1]]  # the resumed call's first token: a chunk of this response
    assert resumed["id"] == NAME.id and resumed["choices"][0]["text"] == "d"
    assert m.usage == second.usage and m.completed


def test_a_resumed_call_that_ends_on_prefill_ends_the_stream_with_its_usage():
    first = FakeCall([1], [(2, b"B")], LOST)
    done = FirstToken("z", "length", Usage(3, 3), token_ids=(3,))
    m, resumes, _ = _migrating([first, (FakeCall([3], []), done)],
                               req=_req(stream=True, stream_options={"include_usage": True}))
    blocks = [json.loads(b[6:]) for b in _collect(m.relay())[1:]]
    assert [c["finish_reason"] for c in blocks[0]["choices"]] == ["length"]
    assert blocks[1]["usage"]["completion_tokens"] == 3 and blocks[1]["choices"] == []


def test_a_json_answer_resumes_with_a_delta():
    first = FakeCall([1], [(2, b"B")], LOST)
    m, _, _ = _migrating([first, (FakeCall([3], [(4, b"D")]), FirstToken("c", None, Usage(3, 3), token_ids=(3,)))],
                         req=_req())
    assert [d.text for d in _collect(m.rest())] == ["B", "c", "D"]


def test_migration_stops_at_the_limit_and_at_errors_that_are_the_requests_own():
    calls = [FakeCall([1], [(2, b"B")], LOST)] + [
        (FakeCall([3 + i], [(10 + i, b"x")], LOST), FirstToken("y", None, Usage(3, 3), token_ids=(3 + i,)))
        for i in range(2)]
    m, resumes, _ = _migrating(calls, limit=2)
    with pytest.raises(UpstreamError):
        _collect(m.relay())
    assert m.migrations == 2 and len(resumes) == 2
    assert resumes[1] == (1, 2, 3, 10)  # the earlier calls' tokens, then this one's
    refused = UpstreamError(400, "bad", fault=Fault.NONE)
    m, resumes, _ = _migrating([FakeCall([1], [(2, b"B")], refused)])
    with pytest.raises(UpstreamError) as e:
        _collect(m.relay())
    assert e.value is refused and resumes == []


def test_a_call_whose_tokens_are_unknown_is_not_moved():
    m, resumes, _ = _migrating([FakeCall([1], [(2, b"B")], LOST, named=False)])
    with pytest.raises(UpstreamError):
        _collect(m.relay())
    assert resumes == []


# --- the worker's replay ------------------------------------------------------------------------------------
class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def _item(resumed=(), temperature=0.0, seed=None, max_tokens=8):
    return WorkItem(request_id=RequestId.new("127.0.0.1:1", "127.0.0.1:2"), prompt_ids=[9, 9, *resumed],
                    sampling=SamplingParams(temperature=temperature, seed=seed, frequency_penalty=0.5),
                    stop=StopParams(max_tokens=max_tokens), sink=None, resumed=tuple(resumed))


def test_a_resumed_output_replays_its_tokens_and_draws_then_names_only_new_ones():
    sampler = TorchSampler()
    item = _item(resumed=(0, 1, 2), temperature=0.7, seed=4)
    item.start_output(_Tok(), sampler)
    assert item.output.token_ids == [0, 1, 2] and item.output.text == "abc"
    assert item.prompt_tokens(len(item.prompt_ids)) == 2
    assert item.token_history.sync() is not None  # the penalty reads the replayed output
    g = make_generator(4)
    for _ in range(3):
        sampler.skip_draw(g)
    assert item.generator.get_state().equal(g.get_state())  # one draw per replayed token
    assert item.new_ids() == ()
    item.output.append(3)
    assert item.new_ids() == (3,) and item.new_ids() == ()


def test_a_resumed_output_that_would_already_have_ended_is_refused():
    item = _item(resumed=(0, 1, 2), max_tokens=3)
    with pytest.raises(ValueError):
        item.start_output(_Tok(), TorchSampler())


# --- what the proxy sends --------------------------------------------------------------------------------------
def test_a_resumed_requests_bodies_carry_its_tokens_and_leave_the_prompts_part_out():
    req = _req(echo=True, logprobs=1, prompt_logprobs=1)
    p = WorkerInfo(Role.PREFILL, "http://p", "127.0.0.1:1", "m", 1, 8)
    d = WorkerInfo(Role.DECODE, "http://d", "127.0.0.1:2", "m", 1, 8)
    fresh, resumed = prefill_body(req, p), prefill_body(req, p, (4, 5))
    assert fresh["kv_transfer_params"]["token_ids"] is True and "resume_token_ids" not in fresh["kv_transfer_params"]
    assert fresh["echo"] and "echo" not in resumed and "prompt_logprobs" not in resumed
    assert resumed["kv_transfer_params"]["resume_token_ids"] == [4, 5] and resumed["logprobs"] == 1
    dec = decode_body(req, d, NAME, (4, 5))
    assert dec["kv_transfer_params"]["resume_token_ids"] == [4, 5] and "echo" not in dec
    assert decode_body(req, d, NAME)["echo"]
