"""Request ids carrying both signal-plane addresses (xpyd.signal.request_id)."""

import pytest

from xpyd.signal.request_id import MAX_LEN, RequestId, RequestIdError, parse_request_id

UID = "0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize(
    "p, d",
    [
        ("10.0.0.1:5555", "10.0.0.2:6000"),
        ("prefill-0.svc.cluster.local:7000", "decode-3:7001"),
        ("[::1]:5555", "[fe80::1]:1"),
        ("localhost:65535", "127.0.0.1:80"),
    ],
)
def test_round_trip(p, d):
    rid = RequestId.new(p, d)
    assert len(rid.uid) == 32
    text = str(rid)
    assert text == f"xpyd-{rid.uid}~p~{p}~d~{d}"
    assert parse_request_id(text) == rid
    assert rid.short == f"xpyd-{rid.uid}"


def test_new_ids_are_unique():
    assert RequestId.new("a:1", "b:2").uid != RequestId.new("a:1", "b:2").uid


@pytest.mark.parametrize(
    "text",
    [
        "",
        "xpyd-",
        f"cmpl-{UID}~p~a:1~d~b:2",  # wrong prefix
        f"xpyd-{UID[:-1]}~p~a:1~d~b:2",  # short uid
        f"xpyd-{UID.upper()}~p~a:1~d~b:2",  # uppercase hex
        f"xpyd-{UID}~p~a:1",  # no decode address
        f"xpyd-{UID}~d~b:2~p~a:1",  # swapped order
        f"xpyd-{UID}~p~a~d~b:2",  # no port
        f"xpyd-{UID}~p~a:0~d~b:2",  # port out of range
        f"xpyd-{UID}~p~a:1~d~b:65536",
        f"xpyd-{UID}~p~a:1~d~b:123456",
        f"xpyd-{UID}~p~a:1~d~b:2-suffix",  # a server appended its own suffix
        f"xpyd-{UID}~p~a:1~d~b:2 ",
        f" xpyd-{UID}~p~a:1~d~b:2",
        f"xpyd-{UID}~p~a b:1~d~b:2",
        f"xpyd-{UID}~p~::1:5~d~b:2",  # IPv6 must be bracketed
        f"xpyd-{UID}~p~-a:1~d~b:2",
        f"xpyd-{UID}~p~a:1~d~b:2\n",  # a trailing newline is not part of an id
        f"xpyd-{UID}~p~{'a' * MAX_LEN}:1~d~b:2",  # too long
    ],
)
def test_malformed_ids_are_rejected(text):
    with pytest.raises(RequestIdError):
        parse_request_id(text)


def test_non_string_is_rejected():
    with pytest.raises(RequestIdError, match="missing"):
        parse_request_id(None)  # type: ignore[arg-type]


def test_error_message_is_clear():
    with pytest.raises(RequestIdError, match=r"expected 'xpyd-<32 hex>~p~<host:port>~d~<host:port>'"):
        parse_request_id("bogus")


def test_new_rejects_bad_addresses():
    with pytest.raises(RequestIdError):
        RequestId.new("no-port", "b:2")
    with pytest.raises(RequestIdError):
        RequestId.new("a:1", "b:99999")


def test_request_id_is_a_subclass_of_value_error():
    assert issubclass(RequestIdError, ValueError)
