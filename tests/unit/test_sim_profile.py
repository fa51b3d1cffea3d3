"""The simulated engine's timing profile: exact on the grid, bilinear between, linear past the edges, never
below 0; the JSON file round-trips and anything else is refused saying why; the built-in profile loads."""

from __future__ import annotations

import copy
import json

import pytest

from xpyd.model.sim.profile import SimProfile, default_profile

DATA = {
    "format": "xpyd-sim-profile/1", "model": "m", "machine": "here", "dtype": "float32", "threads": 2,
    "created": "2026-01-01T00:00:00Z",
    "prefill": {"new_tokens": [16, 32, 64], "cached_tokens": [0, 100],
                "seconds": [[0.1, 0.2], [0.3, 0.5], [0.7, 1.3]]},
    "decode": {"batch": [1, 4], "context_tokens": [10, 1000], "seconds": [[0.01, 0.02], [0.04, 0.09]]},
}


def _profile(**changes) -> SimProfile:
    data = copy.deepcopy(DATA)
    data.update(changes)
    return SimProfile.from_dict(data)


def test_exact_on_grid_points():
    p = _profile()
    for i, new in enumerate(DATA["prefill"]["new_tokens"]):
        for j, cached in enumerate(DATA["prefill"]["cached_tokens"]):
            assert p.prefill_seconds(new, cached) == DATA["prefill"]["seconds"][i][j]
    assert p.decode_seconds(4, 1000) == 0.09 and p.decode_seconds(1, 10) == 0.01


def test_linear_between_grid_points():
    p = _profile()
    assert p.prefill_seconds(24, 0) == pytest.approx(0.2)  # halfway along an edge
    assert p.prefill_seconds(16, 25) == pytest.approx(0.125)
    assert p.prefill_seconds(48, 50) == pytest.approx((0.3 + 0.5 + 0.7 + 1.3) / 4)  # a cell's centre
    assert p.prefill_seconds(40, 20) == pytest.approx(0.75 * 0.8 * 0.3 + 0.25 * 0.8 * 0.7 + 0.75 * 0.2 * 0.5
                                                      + 0.25 * 0.2 * 1.3)
    assert p.decode_seconds(2, 505) == pytest.approx((0.01 * 2 / 3 + 0.04 / 3 + 0.02 * 2 / 3 + 0.09 / 3) / 2)


def test_linear_past_the_edges_and_never_below_zero():
    p = _profile()
    assert p.prefill_seconds(128, 0) == pytest.approx(0.7 + 2 * 0.4)  # the last cell's slope, continued
    assert p.prefill_seconds(64, 200) == pytest.approx(1.3 + 0.6)
    assert p.decode_seconds(7, 10) == pytest.approx(0.04 + 0.03)
    assert p.prefill_seconds(8, 0) == pytest.approx(0.0)  # 0.1 - 0.5 * 0.2: stops at 0
    assert p.prefill_seconds(0, 0) == 0.0  # below 0 on the line: 0
    single = _profile(decode={"batch": [1], "context_tokens": [10], "seconds": [[0.5]]})
    assert single.decode_seconds(64, 100_000) == 0.5  # one point: the same time everywhere


def test_save_and_load_round_trip(tmp_path):
    path = tmp_path / "p.json"
    p = _profile(notes="by hand")
    p.save(path)
    assert SimProfile.load(path) == p
    assert json.loads(path.read_text()) == {**DATA, "notes": "by hand"}


@pytest.mark.parametrize("change, message", [
    ({"format": "other/1"}, "format must be"),
    ({"speed": 1}, "unknown profile keys"),
    ({"threads": 0}, "threads must be"),
    ({"threads": None, "machine": 3}, "machine must be a string"),
    ({"prefill": {"new_tokens": [16, 16], "cached_tokens": [0], "seconds": [[1], [1]]}}, "strictly increasing"),
    ({"prefill": {"new_tokens": [32, 16], "cached_tokens": [0], "seconds": [[1], [1]]}}, "strictly increasing"),
    ({"prefill": {"new_tokens": [-1, 16], "cached_tokens": [0], "seconds": [[1], [1]]}}, "numbers >= 0"),
    ({"prefill": {"new_tokens": [], "cached_tokens": [0], "seconds": []}}, "non-empty"),
    ({"prefill": {"new_tokens": [16], "cached_tokens": [0, 1], "seconds": [[1]]}}, "1 rows of 2 values"),
    ({"prefill": {"new_tokens": [16], "cached_tokens": [0], "seconds": [[-0.1]]}}, "finite numbers >= 0"),
    ({"decode": {"batch": [1], "context_tokens": [1], "seconds": [[float("nan")]]}}, "finite numbers >= 0"),
    ({"decode": {"batch": [1], "context": [1], "seconds": [[1]]}}, "exactly batch, context_tokens and seconds"),
    ({"decode": {"batch": [1], "context_tokens": [1], "seconds": 1}}, "profile decode"),
])
def test_an_invalid_profile_is_refused_saying_why(change, message):
    with pytest.raises(ValueError, match=message):
        _profile(**change)


def test_a_missing_key_or_file_is_refused_naming_it(tmp_path):
    data = copy.deepcopy(DATA)
    del data["created"]
    with pytest.raises(ValueError, match="lacks \\['created'\\]"):
        SimProfile.from_dict(data)
    with pytest.raises(ValueError, match="a JSON object"):
        SimProfile.from_dict([])
    with pytest.raises(ValueError, match="simulation profile .*nope.json"):
        SimProfile.load(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="simulation profile .*bad.json"):
        SimProfile.load(tmp_path / "bad.json")


def test_the_built_in_profile_loads_and_grows_with_the_work():
    p = default_profile()
    assert p.model and p.machine and p.dtype == "float32" and p.created
    assert 0 < p.prefill_seconds(16, 0) < p.prefill_seconds(512, 0) < p.prefill_seconds(512, 2048)
    assert 0 < p.decode_seconds(1, 64) < p.decode_seconds(16, 16 * 512)


def test_a_faster_profile_takes_its_share_of_every_time():
    from xpyd.model.sim.profile import default_profile

    p = default_profile()
    q = p.faster(4)
    for new, cached in ((16, 0), (700, 300), (5000, 0)):
        assert q.prefill_seconds(new, cached) == pytest.approx(p.prefill_seconds(new, cached) / 4)
    assert q.decode_seconds(8, 2000) == pytest.approx(p.decode_seconds(8, 2000) / 4)
    with pytest.raises(ValueError):
        p.faster(float("inf"))
