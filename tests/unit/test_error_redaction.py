"""What a client reads of an error names nothing inside the cluster (xpyd.proxy.http_errors.Redactor)."""

from __future__ import annotations

import pytest

from xpyd.api.openai import APIError
from xpyd.discovery.types import Role, WorkerInfo
from xpyd.proxy.http_errors import INTERNAL_ADDRESS as A
from xpyd.proxy.http_errors import INTERNAL_ID, Redactor
from xpyd.proxy.upstream import UpstreamError

P = WorkerInfo(Role.PREFILL, "http://prefill-0:8100", "prefill-0:9100", "m", 1, 8)  # names without a dot
D = WorkerInfo(Role.DECODE, "http://[fd00::2]:8200", "[fd00::2]:9200", "m", 1, 8)
RID = "xpyd-" + "ab" * 16 + "~p~prefill-0:9100~d~[fd00::2]:9200"
SIGNED = RID + "~m~" + "0f" * 32


@pytest.fixture
def redactor() -> Redactor:
    return Redactor(lambda: [P, D])


@pytest.mark.parametrize("text, public", [
    (f"prefill worker {P.http_url} failed with HTTP 500: boom", "prefill worker failed with HTTP 500: boom"),
    (f"decode worker {D.http_url} unreachable: ClientConnectorError: Cannot connect to host fd00::2:8200 "
     "ssl:default [Connect call failed ('fd00::2', 8200, 0, 0)]",
     f"decode worker unreachable: ClientConnectorError: Cannot connect to host {A} ssl:default "
     f"[Connect call failed {A}]"),
    (f"decode worker {D.http_url} unreachable: ConnectFailed: cannot connect to [fd00::2]:8200: Connection refused",
     f"decode worker unreachable: ConnectFailed: cannot connect to {A}: Connection refused"),
    ("prefill worker http://10.0.0.5:8100 unreachable: ConnectFailed: cannot connect to 10.0.0.5:8100: Connection "
     "refused", f"prefill worker unreachable: ConnectFailed: cannot connect to {A}: Connection refused"),
    ("cannot reach prefill-0:9100 (dotless, but a known worker's)", f"cannot reach {A} (dotless, but a known worker's)"),
    (f"X-Request-Id: malformed, got {RID!r}", "X-Request-Id: malformed, got 'cmpl-pub'"),
    (f"{SIGNED} and its parts xpyd-{'ab' * 16}.0, xpyd-{'ab' * 16}.1", "cmpl-pub and its parts cmpl-pub, cmpl-pub"),
    (f"another request: xpyd-{'cd' * 16}~p~h:1~d~h:2.", f"another request: {INTERNAL_ID}."),
    ("10.0.0.5 and 10.0.0.5:7000, [::1]:80, ::1, fe80::1:2, 2001:db8::7, http://x.y/z?q=1 and https://h:1",
     f"{A} and {A}, {A}, {A}, {A}, {A}, {A} and {A}"),
    ("etcd.kube-system.svc.cluster.local:2379 or localhost:8000.", f"{A} or {A}."),
])
def test_addresses_and_ids_are_taken_out(redactor, text, public):
    assert redactor.text(text, RID, "cmpl-pub") == public
    assert redactor.text(public, RID, "cmpl-pub") == public  # nothing left to take: the same again


@pytest.mark.parametrize("text", [
    "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens.",
    "The model `Qwen/Qwen2.5-0.5B-Instruct` does not exist.", "The model `llama3:8b` does not exist.",
    "version 1.2.3.4.5, at 12:30:45, std::vector, temperature must be in [0, 2]", "worker is starting",
    "kv_transfer_params.response.id must be a string of 1 to 256 visible ASCII characters",
])
def test_everything_else_is_left_as_it_was(redactor, text):
    assert redactor.text(text, RID, "cmpl-pub") == text


def test_without_the_call_every_id_is_an_internal_one(redactor):
    assert redactor.text(f"after: {RID} failed") == f"after: {INTERNAL_ID} failed"


def test_a_worker_that_left_is_still_caught_by_its_shape():
    gone = Redactor(lambda: [])
    assert gone.text(f"prefill worker {P.http_url} failed") == "prefill worker failed"
    assert gone.text("decode worker http://10.1.0.7:8200 failed: see 10.1.0.8:7001") == f"decode worker failed: see {A}"


def test_an_error_and_a_workers_body_are_redacted_in_place(redactor):
    body = {"error": {"message": f"bad id {RID}", "type": "BadRequestError", "param": "X-Request-Id",
                      "code": 400, "detail": [{"loc": P.signal_addr, "n": 3}]}}
    e = UpstreamError(400, f"bad id {RID}", body, P)
    assert redactor.error(e, RID, "cmpl-pub") is e
    assert e.message == str(e) == "bad id cmpl-pub"
    assert e.to_dict() == {"error": {"message": "bad id cmpl-pub", "type": "BadRequestError", "param": "X-Request-Id",
                                     "code": 400, "detail": [{"loc": A, "n": 3}]}}
    mine = redactor.error(APIError(503, f"no decode worker available (after: decode worker {D.http_url} timed out)"))
    assert mine.message == "no decode worker available (after: decode worker timed out)" and mine.status == 503


def test_the_calls_own_workers_count_as_known():
    bare = Redactor(lambda: [])
    assert bare.text("cannot reach prefill-0:9100", workers=[P]) == f"cannot reach {A}"
