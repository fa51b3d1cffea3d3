"""The kept block tables: rows handed out and returned (and reused), growth in rows and width, ids checked when
written, the KV cache keeping a decoding request's row up to date, and the O(batch) checks of a decode step
over rows (`batch_checks.decode_rows`), each refusal leaving the tables and the pool as they were."""

from __future__ import annotations

import pytest

from tests.unit.kv_fixtures import kv_cache
from xpyd.model import batch_checks
from xpyd.model.block_tables import BlockTables
from xpyd.model.kv_blocks import BlockAllocator
from xpyd.model.kv_layout import KVLayout


def matrix(tables: BlockTables) -> list[list[int]]:
    """The whole array, row by row."""
    w = tables.width
    return [tables.data[r * w : (r + 1) * w].tolist() for r in range(tables.capacity)]


def test_rows_are_handed_out_lowest_first_and_a_returned_row_is_reused_zeroed():
    tables = BlockTables(100, rows=4, width=4)
    assert tables.data.itemsize == 4 and tables.num_open == 0
    a = tables.open([7, 3])
    b = tables.open([9])
    assert (a, b) == (0, 1) and tables.num_open == 2
    assert matrix(tables) == [[7, 3, 0, 0], [9, 0, 0, 0], [0] * 4, [0] * 4]
    assert tables.blocks(a) == [7, 3] and tables.length(b) == 1 and tables.block(a, 1) == 3
    tables.close(a)
    assert tables.num_open == 1 and matrix(tables)[0] == [0] * 4
    with pytest.raises(ValueError, match="row 0 is not an open row"):
        tables.length(0)
    c = tables.open([1, 2, 4])
    assert c == 0 and tables.blocks(c) == [1, 2, 4]  # the returned row, before the untouched ones
    tables.close(b)
    tables.close(c)
    assert tables.num_open == 0 and matrix(tables) == [[0] * 4] * 4  # freeing leaves nothing


def test_rows_grow_by_blocks_and_the_array_doubles_in_width_and_rows_keeping_every_row():
    tables = BlockTables(1000, rows=2, width=2)
    a = tables.open([5])
    tables.extend(a, [6])
    tables.extend(a, [])
    assert tables.width == 2 and tables.blocks(a) == [5, 6]
    old = tables.data
    tables.extend(a, [7, 8, 9])  # 5 blocks: width 2 -> 8 (a new array; the old one is left as it was)
    assert tables.width == 8 and tables.data is not old and old.tolist() == [5, 6, 0, 0]
    b = tables.open([10])
    c = tables.open([11, 12])  # a third row: 2 -> 4 rows
    assert (b, c) == (1, 2) and tables.capacity == 4
    assert [tables.blocks(r) for r in (a, b, c)] == [[5, 6, 7, 8, 9], [10], [11, 12]]
    assert matrix(tables) == [[5, 6, 7, 8, 9, 0, 0, 0], [10] + [0] * 7, [11, 12] + [0] * 6, [0] * 8]
    assert tables.open([13]) == 3
    assert tables.open([14]) == 4 and tables.capacity == 8  # then 8 rows, the next ones in order
    for row in range(5):
        tables.close(row)
    assert tables.num_open == 0 and set(tables.data) == {0}
    assert [tables.open([i]) for i in range(8)] == [4, 3, 2, 1, 0, 5, 6, 7]  # returned rows first, newest first


@pytest.mark.parametrize("blocks, message", [
    ([3, 100], "KV block 100 does not exist"), ([-1], "KV block -1 does not exist"), ([True], "KV block True"),
    ([2.0], "KV block 2.0"), ([4, 5, 4], "appears twice")])
def test_ids_are_checked_when_written_and_a_refusal_changes_nothing(blocks, message):
    tables = BlockTables(100, rows=1, width=2)
    with pytest.raises(ValueError, match=message):
        tables.open(blocks)
    assert tables.num_open == 0 and set(tables.data) == {0}
    row = tables.open([4])
    with pytest.raises(ValueError, match="does not exist|appears twice"):
        tables.extend(row, blocks)
    assert tables.blocks(row) == [4] and tables.width == 2 and tables.data.tolist() == [4, 0]
    with pytest.raises(ValueError, match="appears twice in row 0"):
        tables.extend(row, [5, 4])  # already in the row
    assert tables.blocks(row) == [4]


@pytest.mark.parametrize("row", [1, -1, True, 0.0, None])
def test_only_open_rows_are_read_written_or_returned(row):
    tables = BlockTables(10, rows=2)
    tables.open([1])
    for call in (tables.length, tables.blocks, tables.close, lambda r: tables.extend(r, [2])):
        with pytest.raises(ValueError, match="is not an open row"):
            call(row)
    with pytest.raises(ValueError, match="holds 1 blocks, not block 1"):
        tables.block(0, 1)
    assert tables.num_open == 1 and tables.blocks(0) == [1]
    with pytest.raises(ValueError, match="num_blocks must be a positive int"):
        BlockTables(0)


def test_the_kv_cache_opens_a_row_at_the_first_step_grows_it_and_frees_it():
    cache = kv_cache(12)  # 4-token blocks
    kv = cache.admit([], num_tokens=5, reuse_tokens=0)
    other = cache.admit([], num_tokens=3, reuse_tokens=0)
    cache.grow(kv, 6)  # before its first step: no row yet
    assert kv.row is None and cache.tables.num_open == 0
    row = cache.table_row(kv)
    assert row == 0 and cache.table_row(kv) == 0 and cache.tables.blocks(row) == kv.blocks
    assert cache.table_row(other) == 1
    cache.grow(kv, 9)  # a third block, into the row too
    cache.grow(kv, 16)
    assert len(kv.blocks) == 4 and cache.tables.blocks(row) == kv.blocks
    cache.free(kv)
    assert kv.row is None and cache.tables.num_open == 1
    again = cache.admit([], num_tokens=2, reuse_tokens=0)
    assert cache.table_row(again) == 0 and cache.tables.blocks(0) == again.blocks  # the row reused
    cache.free(again)
    cache.free(other)
    cache.free(other)  # (a second free of the same request changes nothing)
    assert cache.tables.num_open == 0 and set(cache.tables.data) == {0}
    assert cache.allocator.num_referenced == 0


LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16", num_blocks=16, block_size=4)


def decode_setup():
    allocator = BlockAllocator(LAYOUT.num_blocks)
    tables = BlockTables(LAYOUT.num_blocks, rows=2)
    a, b = allocator.allocate(2), allocator.allocate(3)  # 8 and 12 tokens' room
    return allocator, tables, tables.open(a), tables.open(b), a, b


def test_a_decode_step_over_rows_returns_the_blocks_it_writes():
    allocator, tables, ra, rb, a, b = decode_setup()
    written = batch_checks.decode_rows(LAYOUT, allocator, 64, tables, [rb, ra], [1, 2], [9, 4])
    assert written == [b[2], a[1]]
    assert batch_checks.decode_rows(LAYOUT, allocator, 64, tables, [ra], [1], [7]) == [a[1]]


@pytest.mark.parametrize("rows, ids, positions, message", [
    ([], [], [], "non-empty"), ([0], [1, 2], [3], "equally long"),
    ([0, 0], [1, 1], [3, 4], "row appears twice"), ([5], [1], [3], "row 5 is not an open row"),
    ([0], [1], [8], "row 0's 2 KV blocks cannot hold position 8"), ([0], [1], [64], "position 64 outside"),
    ([0], [1], [-1], "position -1 outside"), ([0], [1], [True], "position True outside"),
    ([0, 1], [1, 1], [4, 3], "is shared by 2 requests"),  # a shared (prefix) block is not written
])
def test_a_bad_decode_step_over_rows_is_refused(rows, ids, positions, message):
    allocator, tables, ra, rb, a, b = decode_setup()
    allocator.acquire(a[1:2])  # a's second block shared: held twice
    before = (tables.data.tolist(), allocator.num_referenced)
    with pytest.raises(ValueError, match=message):
        batch_checks.decode_rows(LAYOUT, allocator, 64, tables, rows, ids, positions)
    assert (tables.data.tolist(), allocator.num_referenced) == before


def test_two_rows_writing_one_block_row_and_tables_of_another_pool_are_refused():
    allocator, tables, ra, rb, a, b = decode_setup()
    bad = BlockTables(LAYOUT.num_blocks)
    x, y = bad.open([a[0]]), bad.open([a[0], b[0]])  # (only a bug would put one block in two requests' rows)
    with pytest.raises(ValueError, match="write the same KV row"):
        batch_checks.decode_rows(LAYOUT, allocator, 64, bad, [x, y], [1, 1], [2, 2])
    with pytest.raises(ValueError, match="block tables of a 17-block pool"):
        batch_checks.decode_rows(LAYOUT, allocator, 64, BlockTables(17), [0], [1], [0])
    unheld = BlockTables(LAYOUT.num_blocks)
    row = unheld.open(allocator.allocate(1))
    allocator.release([unheld.block(row, 0)])
    with pytest.raises(ValueError, match="not held by any request"):
        batch_checks.decode_rows(LAYOUT, allocator, 64, unheld, [row], [1], [0])
