"""What the proxy tells a worker to call its response (xpyd.api.identity): checked strictly on the worker."""

from __future__ import annotations

import pytest

from xpyd.api.identity import MAX_CREATED, MAX_ID_CHARS, MAX_MODEL_CHARS, ResponseIdentity, response_identity
from xpyd.api.openai import APIError, RequestKind
from xpyd.api.responses import chunk_head, dumps, stream_chunk, usage_chunk

GOOD = {"id": "chatcmpl-0123abcd", "created": 1_700_000_000, "model": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def test_absent_means_the_workers_own_values():
    assert response_identity(None) is None
    assert response_identity({}) is None
    assert response_identity({"role": "decode"}) is None
    assert response_identity({"role": "decode", "response": None}) is None


def test_a_good_one_round_trips():
    named = response_identity({"role": "decode", "response": GOOD})
    assert named == ResponseIdentity(**GOOD)
    assert named.to_wire() == GOOD
    edge = {"id": "x" * MAX_ID_CHARS, "created": MAX_CREATED, "model": "é 模型 " + "m" * (MAX_MODEL_CHARS - 5)}
    assert response_identity({"response": edge}).to_wire() == edge
    assert response_identity({"response": {"id": "a~b:[::1]!#$%", "created": 0, "model": "m"}}).created == 0


@pytest.mark.parametrize("response, param", [
    ("chatcmpl-1", "kv_transfer_params.response"),
    ([GOOD["id"], GOOD["created"], GOOD["model"]], "kv_transfer_params.response"),
    ({**GOOD, "object": "chat.completion"}, "kv_transfer_params.response"),  # unknown field
    ({"created": 1, "model": "m"}, "kv_transfer_params.response.id"),
    ({**GOOD, "id": ""}, "kv_transfer_params.response.id"),
    ({**GOOD, "id": "x" * (MAX_ID_CHARS + 1)}, "kv_transfer_params.response.id"),
    ({**GOOD, "id": 5}, "kv_transfer_params.response.id"),
    ({**GOOD, "id": None}, "kv_transfer_params.response.id"),
    ({**GOOD, "id": "a b"}, "kv_transfer_params.response.id"),
    ({**GOOD, "id": 'a"b'}, "kv_transfer_params.response.id"),
    ({**GOOD, "id": "a\\b"}, "kv_transfer_params.response.id"),
    ({**GOOD, "id": "a\nb"}, "kv_transfer_params.response.id"),
    ({**GOOD, "id": "ид"}, "kv_transfer_params.response.id"),
    ({"id": "x", "model": "m"}, "kv_transfer_params.response.created"),
    ({**GOOD, "created": -1}, "kv_transfer_params.response.created"),
    ({**GOOD, "created": MAX_CREATED + 1}, "kv_transfer_params.response.created"),
    ({**GOOD, "created": 1.5}, "kv_transfer_params.response.created"),
    ({**GOOD, "created": 1e9}, "kv_transfer_params.response.created"),
    ({**GOOD, "created": True}, "kv_transfer_params.response.created"),
    ({**GOOD, "created": "1700000000"}, "kv_transfer_params.response.created"),
    ({"id": "x", "created": 1}, "kv_transfer_params.response.model"),
    ({**GOOD, "model": ""}, "kv_transfer_params.response.model"),
    ({**GOOD, "model": "m" * (MAX_MODEL_CHARS + 1)}, "kv_transfer_params.response.model"),
    ({**GOOD, "model": "a\nb"}, "kv_transfer_params.response.model"),
    ({**GOOD, "model": "a\x00b"}, "kv_transfer_params.response.model"),
    ({**GOOD, "model": ["m"]}, "kv_transfer_params.response.model"),
])
def test_bad_ones_are_a_400_naming_the_field(response, param):
    with pytest.raises(APIError) as e:
        response_identity({"role": "decode", "response": response})
    assert e.value.status == 400 and e.value.param == param
    assert e.value.to_dict()["error"]["type"] == "invalid_request_error"
    assert e.value.message.startswith(param)


def test_the_proxy_cannot_build_a_bad_one():
    with pytest.raises(ValueError, match="response model"):
        ResponseIdentity("cmpl-1", 1, "a\nb")
    with pytest.raises(ValueError, match="response created"):
        ResponseIdentity("cmpl-1", -1, "m")


@pytest.mark.parametrize("kind", list(RequestKind))
def test_chunk_head_is_how_every_chunk_of_the_stream_starts(kind):
    args = ("chatcmpl-1", 1_700_000_000, "modèle/名前", kind)
    head = chunk_head(*args)
    for chunk in (stream_chunk(*args, "hi", None), stream_chunk(*args, None, "stop"),
                  stream_chunk(*args, None, None, role=True), usage_chunk(*args, 3, 4)):
        assert dumps(chunk).startswith(head)
    assert not dumps(stream_chunk("chatcmpl-2", *args[1:], "hi", None)).startswith(head)


# ------------------------------------------------------------------ a client's own X-Request-Id


def test_a_clients_request_id_names_the_response_as_vllm_does():
    from xpyd.api.identity import MAX_CLIENT_ID_CHARS, client_request_id
    from xpyd.api.responses import new_response_id

    assert client_request_id(None) is None and client_request_id("") is None  # none: the proxy's own
    for good in ("abc", "0f" * 16, "trace=1;span/2:3~x", "x" * MAX_CLIENT_ID_CHARS):
        assert client_request_id(good) == good
        for kind in RequestKind:
            ResponseIdentity(new_response_id(kind, good), 1, "m")  # (any it takes fits a response id)
    assert new_response_id(RequestKind.CHAT, "abc") == "chatcmpl-abc"
    assert new_response_id(RequestKind.COMPLETION, "abc") == "cmpl-abc"
    for bad in ("x" * (MAX_CLIENT_ID_CHARS + 1), "a b", 'a"b', "a\\b", "a\tb", "caf\u00e9", "\x00"):
        with pytest.raises(APIError) as e:
            client_request_id(bad)
        assert e.value.status == 400 and e.value.param == "X-Request-Id"
