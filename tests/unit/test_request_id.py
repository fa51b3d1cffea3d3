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


# --- signed ids (ClusterKeys) ----------------------------------------------------------------------

from xpyd.signal.request_id import (  # noqa: E402
    MAX_SIGNED_LEN,
    ClusterKeys,
    SignatureError,
    check_signal_addr,
    split_signature,
    transfer_id_of,
)

TOKEN = "cluster-token-for-tests"


def test_a_signed_id_verifies_and_keeps_its_unsigned_id_and_transfer_id():
    keys = ClusterKeys(TOKEN)
    rid = RequestId.new("10.0.0.1:5555", "[::1]:6000")
    signed = keys.sign(str(rid))
    assert signed.startswith(str(rid) + "~m~") and len(signed) == len(str(rid)) + 3 + 64
    assert keys.verify(signed) == rid and str(keys.verify(signed)) == str(rid)  # keyed by the unsigned id
    assert transfer_id_of(signed) == transfer_id_of(str(rid)) == rid.short  # transfer ids unchanged
    assert split_signature(signed) == (rid, signed[-64:])
    assert split_signature(str(rid)) == (rid, None)
    assert ClusterKeys(TOKEN).sign(str(rid)) == signed  # deterministic: any proxy with the token signs alike


def _forgeries():
    keys = ClusterKeys(TOKEN)
    real = str(RequestId.new("10.0.0.1:5555", "10.0.0.2:6000"))
    other = str(RequestId.new("10.6.6.6:5555", "10.0.0.2:6000"))
    signed = keys.sign(real)
    flip = "0" if signed[-1] != "0" else "1"
    return {
        "unsigned": real,
        "wrong MAC": signed[:-1] + flip,
        "another token's MAC": ClusterKeys("some-other-token").sign(other),
        "a valid MAC over another address": other + signed[len(real):],
    }


@pytest.mark.parametrize("name", sorted(_forgeries()))
def test_forged_ids_are_refused(name):
    with pytest.raises(SignatureError):
        ClusterKeys(TOKEN).verify(_forgeries()[name])


@pytest.mark.parametrize("text", [
    f"xpyd-{UID}~p~a:1~d~b:2~m~" + "0" * 63,  # short MAC
    f"xpyd-{UID}~p~a:1~d~b:2~m~" + "A" * 64,  # uppercase hex
    f"xpyd-{UID}~p~a:1~d~b:2~m~" + "0" * 65,
    f"xpyd-{UID}~p~a:1~d~b:2~m~" + "0" * 64 + "\n",
    f"xpyd-{UID}~p~a:1~d~b:2~m~" + "0" * 64 + "~m~" + "0" * 64,  # two MACs
    f"xpyd-{UID}~p~{'a' * MAX_SIGNED_LEN}:1~d~b:2~m~" + "0" * 64,  # too long
])
def test_malformed_signed_ids_are_rejected(text):
    with pytest.raises(RequestIdError):
        split_signature(text)
    with pytest.raises(RequestIdError):
        ClusterKeys(TOKEN).verify(text)


def test_the_http_bearer_is_derived_not_the_token():
    keys = ClusterKeys(TOKEN)
    assert TOKEN not in keys.http_bearer and len(keys.http_bearer) == 64
    assert keys.http_authorized(f"Bearer {keys.http_bearer}")
    assert keys.http_authorized(f"bearer {keys.http_bearer}")
    for header in (None, "", f"Bearer {TOKEN}", "Bearer", f"Basic {keys.http_bearer}",
                   f"Bearer {ClusterKeys('some-other-token').http_bearer}"):
        assert not keys.http_authorized(header), header
    assert TOKEN not in repr(keys)


def test_check_signal_addr():
    assert check_signal_addr("[::1]:5") == "[::1]:5"
    for bad in ("::1:5", "a", "a:0", "a:65536", "a:1,b:2", ""):
        with pytest.raises(RequestIdError):
            check_signal_addr(bad)


def test_in_a_rotation_window_ids_and_bearers_of_either_token_pass_and_only_the_primary_signs():
    old, new = TOKEN, "the-next-cluster-token"
    switched = ClusterKeys(new, (old,))  # the second step: signs with the new token, accepts the old
    rid = str(RequestId.new("10.0.0.1:5555", "10.0.0.2:6000"))
    assert switched.sign(rid) == ClusterKeys(new).sign(rid) != ClusterKeys(old).sign(rid)
    assert switched.http_bearer == ClusterKeys(new).http_bearer
    for signer in (old, new):
        assert str(switched.verify(ClusterKeys(signer).sign(rid))) == rid
        assert switched.http_authorized(f"Bearer {ClusterKeys(signer).http_bearer}")
    with pytest.raises(SignatureError):
        switched.verify(ClusterKeys("a-third-token").sign(rid))
    assert not switched.http_authorized(f"Bearer {ClusterKeys('a-third-token').http_bearer}")
    assert not ClusterKeys(old).http_authorized(f"Bearer {ClusterKeys(new).http_bearer}")  # (no window: refused)
    with pytest.raises(SignatureError):
        ClusterKeys(old).verify(ClusterKeys(new).sign(rid))
