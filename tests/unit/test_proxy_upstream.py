"""How the proxy reports a worker's failure status (xpyd.proxy.upstream), without a network."""

from __future__ import annotations

import pytest

from xpyd.discovery.types import Role, WorkerInfo
from xpyd.proxy.upstream import Fault, in_stream_error, server_error_status

DECODE = WorkerInfo(Role.DECODE, "http://10.0.0.2:8200", "10.0.0.2:9200", "m", 1, 8)


@pytest.mark.parametrize("worker, client", [(500, 502), (502, 502), (503, 503), (504, 504), (599, 502)])
def test_server_error_status_keeps_503_and_504(worker: int, client: int):
    assert server_error_status(worker) == client


@pytest.mark.parametrize(
    "error, status, message",
    [
        ({"message": "KV did not arrive within 30s", "code": 504}, 504, "KV did not arrive within 30s"),
        ({"message": "draining", "code": 503}, 503, "draining"),
        ({"message": "decode failed", "code": 500}, 502, "decode failed"),
        ({"message": "no code", "code": None}, 502, "no code"),
        ({"message": "a 4xx after the 200 is still the worker's failure", "code": 409}, 502,
         "a 4xx after the 200 is still the worker's failure"),
        ({"message": "a bool is not a status", "code": True}, 502, "a bool is not a status"),
        ({"message": "a string is not a status", "code": "504"}, 502, "a string is not a status"),
        ("boom", 502, "boom"),
    ],
)
def test_in_stream_error(error: object, status: int, message: str):
    e = in_stream_error(error, DECODE)
    assert e.status == status
    assert e.message == f"decode worker {DECODE.http_url} failed: {message}"
    assert e.to_dict()["error"]["type"] == "server_error"
    assert e.worker is DECODE and e.fault is Fault.NONE  # it answered: not marked down


@pytest.mark.parametrize("flag, fault", [(True, Fault.PATH), (False, Fault.NONE), ("true", Fault.NONE),
                                         (1, Fault.NONE)])
def test_an_in_stream_error_on_the_kv_path_blames_the_pair_not_the_worker(flag: object, fault: Fault):
    e = in_stream_error({"message": "prefill worker unreachable", "code": 502, "kv_path": flag}, DECODE)
    assert (e.status, e.fault, e.worker) == (502, fault, DECODE)
    assert e.pair is None  # (the call names the pair: only it knows the prefill worker)


def test_a_decode_worker_marks_its_path_failures_in_the_error_event():
    from xpyd.worker.answers import error_body
    from xpyd.worker.work_item import ErrorEvent

    body = error_body(ErrorEvent(504, "KV from prefill worker p did not arrive within 30s", kv_path=True))
    assert body["error"]["kv_path"] is True and body["error"]["code"] == 504
    assert in_stream_error(body["error"], DECODE).fault is Fault.PATH
    assert "kv_path" not in error_body(ErrorEvent(500, "decode failed"))["error"]


class _Content:
    def __init__(self, raw: bytes) -> None:
        self._raw = raw

    async def read(self, n: int) -> bytes:
        return self._raw[:n]


class _Resp:
    def __init__(self, status: int, raw: bytes) -> None:
        self.status, self.content = status, _Content(raw)


async def test_a_long_plain_text_error_is_cut_between_words_so_no_half_address_is_left():
    from xpyd.proxy.http_errors import Redactor
    from xpyd.proxy.upstream import UpstreamError, raise_for_status

    text = ("x " * 94 + "upstream 10.11.12.13:8100 refused").encode()  # the address straddles 200 characters
    with pytest.raises(UpstreamError) as e:
        await raise_for_status(_Resp(500, text), DECODE)
    assert "upstream 10." not in Redactor(lambda: []).text(e.value.message)


@pytest.mark.parametrize("status,fault,client_status", [(409, Fault.PATH, 502), (400, Fault.NONE, 400),
                                                        (404, Fault.NONE, 404)])
async def test_a_workers_409_is_not_the_clients_conflict(status: int, fault: Fault, client_status: int):
    """A worker's 409 (the request released by its other worker, e.g. decode gave up waiting for its KV) is the
    pair's failure, not the client's: 502, and the request may start over on another pair; a 400 or 404 (about
    the request itself) reaches the client as it is."""
    from xpyd.proxy.upstream import UpstreamError, raise_for_status

    raw = b'{"error": {"message": "request x was released before its prefill ran to completion"}}'
    with pytest.raises(UpstreamError) as e:
        await raise_for_status(_Resp(status, raw), DECODE)
    assert e.value.status == client_status and e.value.fault is fault
