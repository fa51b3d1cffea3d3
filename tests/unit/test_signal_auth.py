"""Signal-plane authentication (xpyd.signal.auth) and the prefill worker's session table (xpyd.signal.sessions)."""

from __future__ import annotations

from xpyd.signal import auth
from xpyd.signal import messages as m
from xpyd.signal.sessions import Sessions

TOKEN = "s3cret-cluster-token"
D0 = "10.0.0.2:7200"


def _hello(sender: str = D0, token: bool = True, instance: str = "inst-1") -> tuple[m.Hello, bytes]:
    hello = m.Hello(sender, instance, auth.new_nonce(), token)
    return hello, m.encode(1, hello)


def _open(sessions: Sessions, rid: bytes, fd: int | None, sender: str = D0, token: str | None = TOKEN,
          instance: str = "inst-1"):
    """A decode worker's whole exchange, as its client does it: (challenge, auth reply, replaced session)."""
    hello, frame = _hello(sender, token is not None, instance)
    challenge = sessions.hello(rid, fd, hello, frame, token)
    assert isinstance(challenge, m.Challenge)
    proof = None if token is None else auth.decode_proof(token, challenge.nonce, hello.nonce, frame)
    reply, replaced = sessions.prove(rid, fd, m.Proof(proof))
    return challenge, reply, replaced


def test_proofs_bind_the_token_both_nonces_the_hello_and_the_side():
    nd, np_, frame = b"d" * 32, b"p" * 32, b"hello-frame"
    p = auth.prefill_proof(TOKEN, nd, np_, frame)
    assert p == auth.prefill_proof(TOKEN, nd, np_, frame) and len(p) == auth.PROOF_BYTES
    others = {auth.prefill_proof(TOKEN + "x", nd, np_, frame), auth.prefill_proof(TOKEN, b"e" * 32, np_, frame),
              auth.prefill_proof(TOKEN, nd, b"q" * 32, frame), auth.prefill_proof(TOKEN, nd, np_, b"hello-framf"),
              auth.decode_proof(TOKEN, nd, np_, frame), auth.decode_proof(TOKEN, np_, nd, frame)}
    assert p not in others and len(others) == 6  # (no reflection: a prefill proof never passes as a decode one)
    assert TOKEN.encode() not in p


def test_refusals_say_which_side_lacks_the_token():
    good = auth.decode_proof(TOKEN, b"p" * 32, b"d" * 32, b"f")
    assert auth.check_proof(None, None, "decode") == (None, None)
    assert "same --cluster-token" in auth.check_proof(None, good, "prefill")[1]
    assert "required" in auth.check_proof((good,), None, "decode")[1]
    assert auth.check_proof((good,), bytes(32), "decode") == (None, "cluster token mismatch")
    assert auth.check_proof((good,), good, "decode") == (0, None)
    assert auth.presence_refusal(None, False, "decode") is None and auth.presence_refusal(TOKEN, True, "decode") is None
    assert "required" in auth.presence_refusal(TOKEN, False, "decode")
    assert "same --cluster-token" in auth.presence_refusal(None, True, "decode")
    assert len(auth.prefill_proof("\udcff-lone-surrogate", b"d" * 32, b"p" * 32, b"f")) == 32  # (no crash)


def test_a_session_opens_only_on_the_right_proof_and_then_routes_pushes():
    s = Sessions()
    hello, frame = _hello()
    challenge = s.hello(b"\0r1", 5, hello, frame, TOKEN)
    assert challenge.proof == auth.prefill_proof(TOKEN, hello.nonce, challenge.nonce, frame)  # prefill proves first
    assert s.get(b"\0r1", 5) == (None, None) and s.route(D0) is None  # nothing served before the proof
    wrong = auth.decode_proof("another-token-123", challenge.nonce, hello.nonce, frame)
    assert s.prove(b"\0r1", 5, m.Proof(wrong)) == (m.AuthReply(False, "cluster token mismatch"), None)
    assert s.route(D0) is None and s.num_pending == 0  # (refused: hello again)
    _, reply, replaced = _open(s, b"\0r1", 5)
    assert reply == m.AuthReply(True) and replaced is None
    session, _ = s.get(b"\0r1", 5)
    assert session.sender == D0 and session.instance == "inst-1" and s.route(D0) is session


def test_a_recorded_proof_does_not_open_a_session_again():
    s = Sessions()
    hello, frame = _hello()
    first = s.hello(b"\0r1", 5, hello, frame, TOKEN)
    recorded = m.Proof(auth.decode_proof(TOKEN, first.nonce, hello.nonce, frame))
    assert s.prove(b"\0r1", 5, recorded)[0].ok
    again = s.hello(b"\0r2", 6, hello, frame, TOKEN)  # the recorded hello, replayed on a new connection
    assert again.nonce != first.nonce
    assert s.prove(b"\0r2", 6, recorded) == (m.AuthReply(False, "cluster token mismatch"), None)
    assert s.get(b"\0r2", 6) == (None, None) and s.route(D0).routing_id == b"\0r1"


def test_without_a_token_the_exchange_only_opens_a_per_connection_session():
    s = Sessions()
    challenge, reply, _ = _open(s, b"\0r1", 5, token=None)
    assert challenge.proof is None and reply.ok and s.route(D0).routing_id == b"\0r1"
    hello, frame = _hello(token=True)
    assert "same --cluster-token" in s.hello(b"\0r2", 6, hello, frame, None).error  # a token on one side only
    hello, frame = _hello(token=False)
    assert "required" in s.hello(b"\0r2", 6, hello, frame, TOKEN).error
    assert s.prove(b"\0r3", 7, m.Proof(None)) == (m.AuthReply(False, "hello first"), None)


def test_without_a_token_an_open_session_is_not_replaced_until_its_connection_closes():
    s = Sessions()
    _open(s, b"\0r1", 5, token=None)
    _, reply, replaced = _open(s, b"\0r2", 6, token=None, instance="someone")  # anyone may say they are D0
    assert not reply.ok and "has an open session" in reply.error and replaced is None
    assert s.route(D0).routing_id == b"\0r1" and s.get(b"\0r2", 6) == (None, None)
    s.closed_fd(5)  # the old connection closed
    assert _open(s, b"\0r2", 6, token=None)[1].ok and s.route(D0).routing_id == b"\0r2"


def test_a_new_session_of_the_same_address_replaces_the_old_one():
    s = Sessions()
    _open(s, b"\0r1", 5)
    old, _ = s.get(b"\0r1", 5)
    _, reply, replaced = _open(s, b"\0r2", 6, instance="inst-2")  # restarted (or reconnected)
    assert reply.ok and replaced is old and s.route(D0).instance == "inst-2"
    assert s.get(b"\0r1", 5) == (None, None)  # the old connection is served nothing any more
    assert s.closed_fd(5) == [] and s.route(D0) is not None  # its close later changes nothing


def test_a_session_ends_with_its_connection_or_when_its_routing_id_shows_up_on_another():
    s = Sessions()
    _open(s, b"\0r1", 5)
    _open(s, b"\0r2", 6, sender="10.0.0.3:7200")
    (closed,) = s.closed_fd(5)
    assert closed.sender == D0 and s.route(D0) is None and s.get(b"\0r1", 5) == (None, None)
    session, stolen = s.get(b"\0r2", 9)  # same routing id, another connection: a stranger took it
    assert session is None and stolen.sender == "10.0.0.3:7200" and s.route("10.0.0.3:7200") is None
    _open(s, b"\0r3", 7)
    assert s.close(b"\0r3").sender == D0 and s.close(b"\0r3") is None and s.num_open == 0


def test_unproven_hellos_are_bounded_in_number_and_time():
    s = Sessions(max_pending=2, auth_timeout=10.0)
    for i in range(3):
        hello, frame = _hello()
        s.hello(bytes([0, i]), i, hello, frame, TOKEN, now=float(i))
    assert s.num_pending == 2 and s.prove(b"\0\0", 0, m.Proof(bytes(32)))[0].error == "hello first"  # oldest gone
    s.expire(11.9)
    assert s.num_pending == 1
    s.expire(12.0)
    assert s.num_pending == 0


def test_open_sessions_are_bounded():
    s = Sessions(max_open=1)
    assert _open(s, b"\0r1", 5)[1].ok
    assert _open(s, b"\0r2", 6, sender="10.0.0.3:7200")[1] == m.AuthReply(False, "too many decode workers (1)")
    assert _open(s, b"\0r3", 7)[1].ok  # (a known address may always replace its session)


def test_a_hello_on_an_open_session_is_refused_and_changes_nothing():
    s = Sessions()
    _open(s, b"\0r1", 5)
    hello, frame = _hello(sender="10.0.0.3:7200")
    assert s.hello(b"\0r1", 5, hello, frame, TOKEN) == m.HandshakeReply(False, "this connection's session is open already")
    assert s.route(D0).routing_id == b"\0r1" and s.route("10.0.0.3:7200") is None and s.num_pending == 0


def test_a_proof_is_checked_against_every_token_held_and_names_the_one_it_proved():
    """A rotation window: this side holds its primary and an accepted token; the peer proves one of them."""
    nd, np_, frame = b"d" * 32, b"p" * 32, b"f"
    held = (TOKEN, "the-next-cluster-token")
    expected = tuple(auth.decode_proof(t, np_, nd, frame) for t in held)
    assert auth.check_proof(expected, auth.decode_proof(TOKEN, np_, nd, frame), "decode") == (0, None)
    assert auth.check_proof(expected, auth.decode_proof(held[1], np_, nd, frame), "decode") == (1, None)
    assert auth.check_proof(expected, auth.decode_proof("a-third-token", np_, nd, frame), "decode") == (
        None, "cluster token mismatch")
    assert auth.check_proof(expected, auth.prefill_proof(held[1], nd, np_, frame), "decode")[0] is None  # (labels)
