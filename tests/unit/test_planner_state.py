"""The planner's state as etcd holds it for /cluster (``xpyd.discovery.planner_state``): what a planner writes
reads back the same, and what a reader refuses (untrusted etcd data) it refuses whole, with the reason."""

from __future__ import annotations

import json

import pytest

from xpyd.discovery.planner_state import (MAX_DECISIONS, MAX_STATE_BYTES, MAX_TEXT, DecisionRecord, PlannerMode,
                                          PlannerState, Target, decode_state, encode_state)
from xpyd.discovery.types import Role


def _state(**changes) -> PlannerState:
    record = DecisionRecord(1_700_000_000.5, Role.DECODE, 1, 3, "at 4 req/s 2 decode predicted to meet ...",
                            ("decode 2",))
    fields = dict(mode=PlannerMode.SCALE, slo="ttft=2s,itl=200ms,attainment=0.95", max_workers=8, interval_s=15.0,
                  updated_at=1_700_000_001.0, target=Target(2, 3), decisions=(record,))
    return PlannerState(**{**fields, **changes})


def _json(**changes) -> bytes:
    return json.dumps({**json.loads(encode_state(_state())), **changes}).encode()


def test_a_state_reads_back_as_written_and_shows_as_plain_json():
    state = _state()
    assert decode_state(encode_state(state)) == state
    view = json.loads(json.dumps(state.to_dict()))  # (what /cluster answers)
    assert view["mode"] == "scale" and view["target"] == {"prefill": 2, "decode": 3} and view["version"] == 1
    assert view["decisions"] == [{"at": 1_700_000_000.5, "role": "decode", "delta": 1, "target": 3,
                                  "reason": "at 4 req/s 2 decode predicted to meet ...", "workers": ["decode 2"],
                                  "error": None}]


def test_a_planner_before_its_first_interval_has_no_target():
    state = _state(target=None, decisions=())
    assert decode_state(encode_state(state)).target is None


def test_a_record_is_cut_to_the_bounds_a_reader_checks():
    record = DecisionRecord.of(1.0, Role.PREFILL, -1, 1, "r" * 5000, ["w" * 500] * 40 + [""], "e" * 5000)
    assert len(record.reason) == len(record.error) == MAX_TEXT and len(record.workers) == 16
    state = _state(decisions=(record,) * MAX_DECISIONS)
    assert decode_state(encode_state(state)) == state


def test_fields_a_newer_planner_adds_are_ignored():
    assert decode_state(_json(cooldown_s=5)) == _state()


@pytest.mark.parametrize(("value", "why"), [
    (b"not json", "not a planner state"),
    (b"[]", "not a planner state"),
    (b" " * (MAX_STATE_BYTES + 1), "over"),
    (_json(version=2), "version 2"),
    (_json(mode="autoscale"), "mode"),
    (_json(max_workers=-1), "max_workers"),
    (_json(interval_s=0), "interval_s"),
    (_json(updated_at="yesterday"), "updated_at"),
    (_json(target={"prefill": 1}), "decode"),
    (_json(target={"prefill": 10**9, "decode": 1}), "prefill"),
    (_json(slo="x" * (MAX_TEXT + 1)), "slo"),
    (_json(decisions=[json.loads(encode_state(_state()))["decisions"][0]] * (MAX_DECISIONS + 1)), "decisions"),
    (_json(decisions=[{"at": 1.0, "role": "decode", "delta": 0, "target": 1, "reason": ""}]), "delta"),
    (_json(decisions=[{"at": 1.0, "role": "router", "delta": 1, "target": 1, "reason": ""}]), "role"),
    (_json(decisions=[{"at": 1.0, "role": "decode", "delta": 1, "target": 1, "reason": "", "workers": [""]}]),
     "workers"),
    (_json(decisions=[{"at": 1.0, "role": "decode", "delta": 1, "target": 1, "reason": "r" * (MAX_TEXT + 1)}]),
     "reason"),
])
def test_a_value_out_of_bounds_is_refused_whole(value: bytes, why: str):
    with pytest.raises(ValueError, match=why):
        decode_state(value)


def test_a_state_too_big_to_be_read_is_not_written():
    with pytest.raises(ValueError, match="over"):
        encode_state(_state(slo="s" * (MAX_STATE_BYTES + 1)))
