"""Signal-plane messages (xpyd.signal.messages): round trips, the wire shape, and refusals of bad frames."""

from __future__ import annotations

import random
import typing

import msgpack
import pytest

from xpyd import PROTOCOL_VERSION
from xpyd.signal import messages as m

RID = "xpyd-0123456789abcdef0123456789abcdef~p~10.0.0.1:7100~d~10.0.0.2:7200"
COMPAT = {"layout": "block-head-major/1", "num_layers": 2, "num_kv_heads": 2, "head_dim": 4, "dtype": "float32",
          "block_size": 16}
TRANSFER = {"backend": "tcp", "address": "127.0.0.1:9", "buffer_size": 4096, "offers": [["tcp", "x"]]}
SECRET = bytes(range(m.TRANSFER_SECRET_BYTES))
NONCE = bytes(range(32, 32 + m.NONCE_BYTES))
PROOF = bytes(range(64, 64 + m.PROOF_BYTES))

EVERY_MESSAGE = [
    m.Hello("10.0.0.2:7200", "0123456789abcdef", NONCE, True),
    m.Challenge(NONCE, PROOF),
    m.Challenge(NONCE, None),
    m.Proof(PROOF),
    m.Proof(None),
    m.AuthReply(True),
    m.AuthReply(False, "cluster token mismatch"),
    m.Handshake("10.0.0.2:7200", "m", COMPAT),
    m.HandshakeReply(True, None, "m"),
    m.HandshakeReply(False, "model mismatch"),
    m.KVMapInit("10.0.0.2:7200", TRANSFER, 1024, 4),
    m.KVMapReply(True),
    m.KVMapReply(False, "KV map does not fit the registered buffer"),
    m.LookupAll("10.0.0.2:7200", (m.LookupEntry(RID), m.LookupEntry(RID, (0,), 0, SECRET),
                                  m.LookupEntry(RID, (1 << 40, 3, 4), 2, SECRET))),
    m.LookupAll("10.0.0.2:7200", ()),
    m.LookupReply(tuple(m.LookupResult(RID, s, 7 if s in (m.LookupStatus.READY, m.LookupStatus.SENDING) else None,
                                       3, "why" if s is m.LookupStatus.FAILED else None) for s in m.LookupStatus)),
    m.Release("10.0.0.2:7200", (RID, "xpyd-short")),
    m.ReleaseReply(2),
    m.Heartbeat("10.0.0.2:7200"),
    m.HeartbeatReply(),
    m.Notify((m.LookupResult(RID, m.LookupStatus.READY, 7, 35, block_hashes=m.pack_hashes([1, 2**64 - 1]), tail=(5, 6, 7),
                             cached_tokens=16), m.LookupResult(RID, m.LookupStatus.EXPIRED,
                                                                            error="KV expired"))),
    m.ErrorReply("handshake first"),
]


def test_every_message_type_is_covered():
    assert {type(x) for x in EVERY_MESSAGE} == set(typing.get_args(m.Message))


@pytest.mark.parametrize("msg", EVERY_MESSAGE, ids=lambda x: x.TYPE)
def test_round_trip(msg):
    env = m.decode(m.encode(12, msg))
    assert env.seq == 12 and env.version == PROTOCOL_VERSION and env.msg == msg and type(env.msg) is type(msg)


def test_wire_shape_is_a_versioned_map_with_tagged_message_and_enum_values():
    result = m.LookupResult(RID, m.LookupStatus.READY, 9, 19, block_hashes=m.pack_hashes([258]), tail=(4, 5, 6),
                            cached_tokens=16)
    frame = m.encode(5, m.LookupReply((result,)))
    assert msgpack.unpackb(frame) == {"version": PROTOCOL_VERSION, "seq": 5, "msg": {
        "type": "lookup_reply", "results": [[RID, "ready", 9, 19, None, b"\x02\x01" + b"\0" * 6, [4, 5, 6], 16, 0, 0]]}}
    frame = m.encode(6, m.LookupAll("a:1", (m.LookupEntry(RID, (64, 65), 1, SECRET, 32), m.LookupEntry(RID))))
    assert msgpack.unpackb(frame)["msg"] == {"type": "lookup_all", "sender": "a:1",
                                              "entries": [[RID, [64, 65], 1, SECRET, 32], [RID, None, 0, None, 0]]}
    assert m.unpack_hashes(m.pack_hashes([0, 7, 2**64 - 1])) == [0, 7, 2**64 - 1]
    with pytest.raises(m.MessageError, match="multiple of 8"):
        m.unpack_hashes(b"\0" * 9)


def test_limits_are_inclusive():
    full = m.LookupAll("a:1", (m.LookupEntry("x" * m.MAX_REQUEST_ID_LEN, (0,), 0, SECRET),) * m.MAX_ENTRIES)
    assert m.decode(m.encode(1, full)).msg == full
    blocks = m.LookupAll("a:1", (m.LookupEntry("r", tuple(range(m.MAX_BLOCKS)), 0, SECRET),))
    assert m.decode(m.encode(1, blocks)).msg == blocks
    assert m.decode(m.encode(2, m.Release("a:1", ("r",) * m.MAX_ENTRIES))).msg.request_ids == ("r",) * m.MAX_ENTRIES


def _frame(msg: dict | None = None, **envelope) -> bytes:
    return msgpack.packb({"version": PROTOCOL_VERSION, "seq": 3, "msg": msg, **envelope})


LOOKUP = {"type": "lookup_all", "sender": "a:1"}
RELEASE = {"type": "release", "sender": "a:1"}
HANDSHAKE = {"type": "handshake", "sender": "a:1", "model_id": "m", "kv_compat": COMPAT}
HELLO = {"type": "hello", "sender": "a:1", "instance": "i", "nonce": NONCE, "token": True}
RESULT = [RID, "ready", 9, 3, None]


@pytest.mark.parametrize("frame, needle", [
    pytest.param(b"\xc1garbage", "undecodable", id="garbage"),
    pytest.param(_frame(HANDSHAKE)[:-4], "undecodable", id="truncated"),
    pytest.param(_frame(HANDSHAKE) + b"\x00", "undecodable", id="trailing-bytes"),
    pytest.param(b"\x81\xa1x" + b"\x91" * 200_000 + b"\xc0", "undecodable", id="nested-too-deep"),
    pytest.param(_frame({**HANDSHAKE, "model_id": "@@@"}).replace(b"@@@", b"\xff\xfe\xfd"),
                 "undecodable", id="not-utf8"),
    pytest.param(b"", "undecodable", id="empty"),
    pytest.param(msgpack.packb([1, 2, 3]), "invalid message", id="not-a-map"),
    pytest.param(_frame(HANDSHAKE, version=PROTOCOL_VERSION + 1), "protocol version mismatch", id="newer-version"),
    pytest.param(_frame({"type": "handshake"}, version=PROTOCOL_VERSION + 1), "peer speaks",
                 id="newer-version-bad-body"),
    pytest.param(msgpack.packb({"v": 3, "t": "handshake", "seq": 1, "b": {}}), "peer speaks 3", id="protocol-3-frame"),
    pytest.param(_frame(HANDSHAKE, version="4"), "protocol version mismatch", id="version-not-an-int"),
    pytest.param(_frame(HANDSHAKE, seq=-1), "$.seq", id="negative-seq"),
    pytest.param(_frame(HANDSHAKE, seq=True), "$.seq", id="bool-seq"),
    pytest.param(_frame(None), "$.msg", id="no-message"),
    pytest.param(_frame({"type": "evil"}), "$.msg.type", id="unknown-tag"),
    pytest.param(_frame({"type": ["handshake"]}), "$.msg.type", id="tag-not-a-string"),
    pytest.param(_frame({**HANDSHAKE, "sender": 3}), "$.msg.sender", id="wrong-type"),
    pytest.param(_frame({**HANDSHAKE, "sender": b"a:1"}), "$.msg.sender", id="bytes-for-str"),
    pytest.param(_frame({k: v for k, v in HANDSHAKE.items() if k != "model_id"}), "model_id", id="missing-field"),
    pytest.param(_frame({**HANDSHAKE, "kv_compat": {1: 2}}), "$.msg.kv_compat", id="non-str-key"),
    pytest.param(_frame({"type": "handshake_reply", "ok": 1}), "$.msg.ok", id="int-for-bool"),
    pytest.param(_frame({**LOOKUP, "entries": [["x" * 601, None]]}), "$.msg.entries[0][0]", id="request-id-too-long"),
    pytest.param(_frame({**LOOKUP, "entries": [["", None]]}), "$.msg.entries[0][0]", id="empty-request-id"),
    pytest.param(_frame({**LOOKUP, "entries": [["r", [-5]]]}), "$.msg.entries[0][1][0]", id="negative-block"),
    pytest.param(_frame({**LOOKUP, "entries": [["r", [True]]]}), "$.msg.entries[0][1][0]", id="bool-block"),
    pytest.param(_frame({**LOOKUP, "entries": [["r", [1.0]]]}), "$.msg.entries[0][1][0]", id="float-block"),
    pytest.param(_frame({**LOOKUP, "entries": [["r", 5]]}), "$.msg.entries[0][1]", id="offset-not-blocks"),
    pytest.param(_frame({**LOOKUP, "entries": [["r", []]]}), "$.msg.entries[0][1]", id="no-blocks"),
    pytest.param(_frame({**LOOKUP, "entries": [["r", list(range(m.MAX_BLOCKS + 1))]]}), "$.msg.entries[0][1]",
                 id="too-many-blocks"),
    pytest.param(_frame({**LOOKUP, "entries": [["r", [0], -1]]}), "$.msg.entries[0][2]", id="negative-first-block"),
    pytest.param(_frame({**LOOKUP, "entries": [["r", [0], 1, SECRET, 2, 9]]}), "$.msg.entries[0]", id="entry-too-long"),
    pytest.param(_frame({**LOOKUP, "entries": [["r", [0], 1, SECRET, m.MAX_BLOCKS + 1]]}), "$.msg.entries[0][4]",
                 id="part-too-large"),
    pytest.param(_frame({**LOOKUP, "entries": [["r", [0], 1]]}), "carries a transfer secret", id="pull-without-secret"),
    pytest.param(_frame({**LOOKUP, "entries": [["r", [0], 1, None]]}), "carries a transfer secret",
                 id="pull-with-null-secret"),
    pytest.param(_frame({**LOOKUP, "entries": [["r", None, 0, SECRET]]}), "a claim none", id="claim-with-secret"),
    pytest.param(_frame({**LOOKUP, "entries": [["r", [0], 1, SECRET[:-1]]]}), "$.msg.entries[0][3]",
                 id="secret-too-short"),
    pytest.param(_frame({**LOOKUP, "entries": [["r", [0], 1, SECRET + b"x"]]}), "$.msg.entries[0][3]",
                 id="secret-too-long"),
    pytest.param(_frame({**LOOKUP, "entries": [["r", [0], 1, SECRET.hex()[:32]]]}), "$.msg.entries[0][3]",
                 id="secret-not-bytes"),
    pytest.param(_frame({**LOOKUP, "entries": [["r"]] * (m.MAX_ENTRIES + 1)}), "$.msg.entries", id="too-many-entries"),
    pytest.param(_frame({**LOOKUP, "entries": {"r": 0}}), "$.msg.entries", id="entries-not-a-list"),
    pytest.param(_frame({**RELEASE, "request_ids": ["x" * 601]}), "$.msg.request_ids[0]", id="release-id-too-long"),
    pytest.param(_frame({**RELEASE, "request_ids": ["r"] * (m.MAX_ENTRIES + 1)}), "$.msg.request_ids",
                 id="release-too-many"),
    pytest.param(_frame({"type": "lookup_reply", "results": [RESULT] * (m.MAX_ENTRIES + 1)}), "$.msg.results",
                 id="too-many-results"),
    pytest.param(_frame({"type": "lookup_reply", "results": [[RID, "done", 9, 3, None]]}), "$.msg.results[0][1]",
                 id="unknown-status"),
    pytest.param(_frame({"type": "lookup_reply", "results": [[RID, "ready", 9, -3, None]]}), "$.msg.results[0][3]",
                 id="negative-num-tokens"),
    pytest.param(_frame({"type": "kv_map_init", "sender": "a:1", "transfer": TRANSFER, "block_bytes": 0,
                         "num_blocks": 4}), "$.msg.block_bytes", id="zero-block-bytes"),
    pytest.param(_frame({"type": "lookup_reply", "results": [[RID, "ready", 9, 3, None, b"", list(range(1025))]]}),
                 "$.msg.results[0][6]", id="tail-too-long"),
    pytest.param(_frame({"type": "release_reply", "released": -1}), "$.msg.released", id="negative-released"),
    pytest.param(_frame({**HELLO, "nonce": NONCE[:-1]}), "$.msg.nonce", id="short-nonce"),
    pytest.param(_frame({**HELLO, "sender": "x" * (m.MAX_ADDRESS + 1)}), "$.msg.sender", id="hello-sender-too-long"),
    pytest.param(_frame({**HELLO, "instance": ""}), "$.msg.instance", id="empty-instance"),
    pytest.param(_frame({**HELLO, "token": "yes"}), "$.msg.token", id="token-flag-not-bool"),
    pytest.param(_frame({"type": "proof", "proof": PROOF + b"x"}), "$.msg.proof", id="proof-too-long"),
    pytest.param(_frame({"type": "challenge", "nonce": NONCE, "proof": "s3cret"}), "$.msg.proof",
                 id="proof-not-bytes"),
])
def test_bad_frames_raise_message_error(frame, needle):
    with pytest.raises(m.MessageError) as info:
        m.decode(frame)
    assert needle in str(info.value)


def test_a_frame_over_the_limit_is_refused_before_decoding():
    with pytest.raises(m.MessageError, match="exceeds"):
        m.decode(b"x" * (m.MAX_FRAME_BYTES + 1))
    with pytest.raises(m.MessageError, match="exceeds"):
        m.encode(1, m.ErrorReply("x" * m.MAX_FRAME_BYTES))


@pytest.mark.parametrize("frame, seq", [
    (_frame({"type": "evil"}, seq=41), 41),
    (msgpack.packb({"v": 3, "t": "handshake", "seq": 8, "b": {}}), 8),
    (_frame({"type": "evil"}, seq=-4), 0),
    (_frame({"type": "evil"}, seq=True), 0),
    (b"\xc1", 0),
    (msgpack.packb([1, 2]), 0),
])
def test_seq_of_a_refused_frame(frame, seq):
    assert m.seq_of(frame) == seq


def test_mutated_frames_decode_or_raise_message_error_only():
    rng = random.Random(3)
    frames = [m.encode(i, msg) for i, msg in enumerate(EVERY_MESSAGE)]
    refused = 0
    for _ in range(3000):
        frame = bytearray(rng.choice(frames))
        for _ in range(rng.randint(1, 4)):
            frame[rng.randrange(len(frame))] = rng.randrange(256)
        try:
            m.decode(bytes(frame))
        except m.MessageError:
            refused += 1
    assert refused > 1000


# The largest legal answer to one lookup: MAX_ENTRIES results, each naming MAX_BLOCKS block hashes (512 KiB) and
# a full tail, against a frame cap of MAX_FRAME_BYTES (4 MiB).
BIG_HASHES = bytes(range(256)) * (8 * m.MAX_BLOCKS // 256)


def _big_result(i: int) -> m.LookupResult:
    return m.LookupResult(f"{RID}-{i}", m.LookupStatus.READY, 7, m.MAX_BLOCKS * 16 + m.MAX_TAIL,
                          block_hashes=BIG_HASHES, tail=tuple(range(m.MAX_TAIL)), cached_tokens=16)


def test_the_largest_lookup_answer_splits_into_frames_under_the_cap_and_arrives_whole():
    results = tuple(_big_result(i) for i in range(m.MAX_ENTRIES))
    with pytest.raises(m.MessageError, match="exceeds"):  # one frame cannot hold it
        m.encode(3, m.LookupReply(results))
    groups = m.split_results(results)
    frames = [m.encode(0, m.Notify(g)) for g in groups[:-1]] + [m.encode(3, m.LookupReply(groups[-1]))]
    assert all(len(f) <= m.MAX_FRAME_BYTES for f in frames) and len(frames) > 1
    got = [r for f in frames for r in m.decode(f).msg.results]
    assert [r.request_id for r in got] == [r.request_id for r in results]  # every one, in order
    assert all(r == _big_result(int(r.request_id.rsplit("-", 1)[1])) for r in got)


def test_small_answers_stay_one_frame_and_an_oversized_result_is_failed_not_dropped():
    small = tuple(m.LookupResult(f"{RID}-{i}", m.LookupStatus.NOT_READY) for i in range(m.MAX_ENTRIES))
    assert m.split_results(small) == [small] and m.split_results(()) == [()]
    huge = m.LookupResult(RID, m.LookupStatus.FAILED, error="x" * m.MAX_FRAME_BYTES)
    ((only,),) = m.split_results((huge,))
    assert only.request_id == RID and only.status is m.LookupStatus.FAILED and "exceeds a signal frame" in only.error
