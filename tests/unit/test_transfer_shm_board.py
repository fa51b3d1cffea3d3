"""The shm abort board's bookkeeping, on ordinary memory (the backend puts it at the end of its segment)."""

from __future__ import annotations

from xpyd.transfer.shm_board import BYTES, SLOTS, Board, BoardView, board_offset, segment_size


def _pair():
    """A sender's board and a receiver's view of the same bytes (as its read-only mapping of the segment)."""
    memory = bytearray(64 + BYTES)
    return Board(memory, 64), BoardView(memory, 64)


def test_an_offer_is_valid_until_revoked_or_retired():
    board, view = _pair()
    slot, ticket = board.publish("a")
    assert view.valid(slot, ticket) and not view.valid(slot, ticket + 1)
    board.revoke("a")  # the sender aborted: a receiver that checks now fails the transfer
    assert not view.valid(slot, ticket)
    board.retire("a")
    assert board.in_use() == 0
    board.revoke("a")  # unknown by now: a no-op
    board.revoke("never-offered")


def test_tickets_are_never_reused_so_a_reused_entry_never_validates_an_old_offer():
    board, view = _pair()
    seen = set()
    for i in range(3 * SLOTS):
        slot, ticket = board.publish(f"t{i}")
        assert ticket not in seen
        seen.add(ticket)
        board.retire(f"t{i}")
        assert not view.valid(slot, ticket)  # retired: zeroed


def test_revoking_one_offer_leaves_the_others_valid():
    board, view = _pair()
    entries = {tid: board.publish(tid) for tid in ("a", "b", "c")}
    board.revoke("b")
    assert [view.valid(*entries[t]) for t in ("a", "b", "c")] == [True, False, True]
    for tid in entries:
        board.retire(tid)
    assert board.in_use() == 0


def test_a_full_board_refuses_more_offers_until_one_is_retired():
    board, _ = _pair()
    for i in range(SLOTS):
        assert board.publish(f"t{i}") is not None
    assert board.publish("one-too-many") is None
    board.retire("t7")
    assert board.publish("now-fits") is not None


def test_the_board_follows_the_pool_64_byte_aligned():
    assert board_offset(1) == 64 and board_offset(64) == 64 and board_offset(65) == 128
    assert segment_size(1000) == 1024 + BYTES
