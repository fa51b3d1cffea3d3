"""The prefill worker's bounded memory of ended / released-early request ids."""

from __future__ import annotations

import pytest

from xpyd.prefill_worker.recent import RecentIds


def test_bounded_by_count_and_age():
    r: RecentIds[str] = RecentIds(retention=10.0, max_entries=3)
    for i in range(5):
        r.add(f"id{i}", f"v{i}", now=float(i))
    assert len(r) == 3 and r.get("id0") is None and r.get("id1") is None and r.get("id4") == "v4"
    r.add("id2", "again", now=5.0)  # re-adding refreshes its age
    r.prune(now=13.5)  # id3 (added at 3) is 10.5 s old; id4 and id2 are younger
    assert r.get("id3") is None and r.get("id4") == "v4" and r.get("id2") == "again"
    assert r.pop("id4") == "v4" and r.pop("id4") is None
    r.prune(now=100.0)
    assert len(r) == 0


def test_rejects_nonsense_limits():
    with pytest.raises(ValueError):
        RecentIds(retention=0, max_entries=1)
    with pytest.raises(ValueError):
        RecentIds(retention=1, max_entries=0)
