"""How long the simulated engine's forward passes take: a profile measured on the real engine.

Two tables on grids, from `xpyd bench calibrate` (`xpyd.model.sim_calibrate`) or written by hand (e.g. a
larger model on a GPU, from published figures):
- prefill: seconds of one forward pass vs (new tokens, cached tokens), summed over the pass's parts (a part's
  cached tokens: the prefix already in its blocks, earlier chunks included);
- decode: seconds of one step vs (batch, context tokens: the sum over the batch of each request's tokens).
Between grid points the time is interpolated bilinearly, past the grid's edges extrapolated linearly from the
outermost cells, and never below 0.

The file (JSON)::

    {"format": "xpyd-sim-profile/1", "model": "...", "machine": "...", "dtype": "float32", "threads": 2,
     "created": "2026-01-01T00:00:00Z", "notes": "optional",
     "prefill": {"new_tokens": [16, 256], "cached_tokens": [0, 1024], "seconds": [[a, b], [c, d]]},
     "decode": {"batch": [1, 8], "context_tokens": [64, 4096], "seconds": [[e, f], [g, h]]}}

``seconds[i][j]`` is the time at (first axis[i], second axis[j]). Axes strictly increasing, >= 0; times finite,
>= 0. A built-in profile (`default_profile`) ships with the package, measured for the default model.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_PROFILE", "FORMAT", "SimProfile", "Table", "default_profile", "shipped_profile", "shipped_profiles"]

FORMAT = "xpyd-sim-profile/1"
DEFAULT_PROFILE = "smollm2-135m-instruct-float32.json"  # in xpyd/model/sim/profiles/
_TABLES = {"prefill": ("new_tokens", "cached_tokens"), "decode": ("batch", "context_tokens")}
_META = ("model", "machine", "dtype", "threads", "created")


@dataclass(frozen=True, slots=True)
class Table:
    """Seconds on a grid: ``seconds[i][j]`` at (x[i], y[j])."""

    x: tuple[float, ...]
    y: tuple[float, ...]
    seconds: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        for name in ("x", "y"):
            axis = getattr(self, name)
            if not axis or not all(_number(v) and v >= 0 for v in axis):
                raise ValueError(f"an axis must be a non-empty list of numbers >= 0, got {list(axis)!r}")
            if any(b <= a for a, b in zip(axis, axis[1:])):
                raise ValueError(f"an axis must be strictly increasing, got {list(axis)!r}")
        if len(self.seconds) != len(self.x) or any(len(row) != len(self.y) for row in self.seconds):
            raise ValueError(f"seconds must be {len(self.x)} rows of {len(self.y)} values")
        if not all(_number(v) and v >= 0 for row in self.seconds for v in row):
            raise ValueError("seconds must be finite numbers >= 0")

    def at(self, x: float, y: float) -> float:
        """Bilinear inside the grid, linear past its edges, never below 0."""
        i, i1, tx = _cell(self.x, x)
        j, j1, ty = _cell(self.y, y)
        s = self.seconds
        value = ((1 - tx) * (1 - ty) * s[i][j] + tx * (1 - ty) * s[i1][j]
                 + (1 - tx) * ty * s[i][j1] + tx * ty * s[i1][j1])
        return max(0.0, value)


def _cell(axis: tuple[float, ...], v: float) -> tuple[int, int, float]:
    """The grid cell whose edges interpolate (or extrapolate to) ``v``: (low index, high index, weight of high)."""
    if len(axis) == 1:
        return 0, 0, 0.0
    i = min(max(bisect.bisect_right(axis, v) - 1, 0), len(axis) - 2)
    return i, i + 1, (v - axis[i]) / (axis[i + 1] - axis[i])


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True, slots=True)
class SimProfile:
    prefill: Table  # (new tokens, cached tokens) of one forward pass
    decode: Table  # (batch, context tokens of the batch) of one step
    model: str
    machine: str
    dtype: str
    threads: int | None  # None: not a CPU thread count (e.g. a GPU)
    created: str
    notes: str = ""

    def __post_init__(self) -> None:
        for name in ("model", "machine", "dtype", "created", "notes"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"profile {name} must be a string, got {getattr(self, name)!r}")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise ValueError(f"profile threads must be an int >= 1 or null, got {self.threads!r}")

    def faster(self, speedup: float) -> SimProfile:
        """The same profile ``speedup`` times faster (what a sim worker run with ``--sim-speedup`` takes)."""
        if not (math.isfinite(speedup) and speedup > 0):
            raise ValueError(f"a profile can be made faster by a finite factor > 0, got {speedup!r}")

        def scaled(t: Table) -> Table:
            return Table(t.x, t.y, tuple(tuple(v / speedup for v in row) for row in t.seconds))

        return dataclasses.replace(self, prefill=scaled(self.prefill), decode=scaled(self.decode),
                                   notes=f"{self.notes} (x{speedup:g} faster)".strip())

    def prefill_seconds(self, new_tokens: int, cached_tokens: int) -> float:
        return self.prefill.at(new_tokens, cached_tokens)

    def decode_seconds(self, batch: int, context_tokens: int) -> float:
        return self.decode.at(batch, context_tokens)

    @classmethod
    def from_dict(cls, data: Any) -> SimProfile:
        """ValueError saying what is wrong for anything but a valid profile."""
        if not isinstance(data, dict):
            raise ValueError("a profile is a JSON object")
        if data.get("format") != FORMAT:
            raise ValueError(f"profile format must be {FORMAT!r}, got {data.get('format')!r}")
        unknown = set(data) - {"format", "notes", *_META, *_TABLES}
        if unknown:
            raise ValueError(f"unknown profile keys: {sorted(unknown)}")
        missing = [k for k in (*_META, *_TABLES) if k not in data]
        if missing:
            raise ValueError(f"profile lacks {missing}")
        tables = {}
        for name, (x, y) in _TABLES.items():
            t = data[name]
            if not isinstance(t, dict) or set(t) != {x, y, "seconds"}:
                raise ValueError(f"profile {name} must be an object with exactly {x}, {y} and seconds")
            try:
                tables[name] = Table(tuple(t[x]), tuple(t[y]), tuple(tuple(row) for row in t["seconds"]))
            except (TypeError, ValueError) as e:
                raise ValueError(f"profile {name}: {e}") from None
        return cls(tables["prefill"], tables["decode"], *(data[k] for k in _META), notes=data.get("notes", ""))

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"format": FORMAT, **{k: getattr(self, k) for k in _META}}
        if self.notes:
            out["notes"] = self.notes
        for name, (x, y) in _TABLES.items():
            t: Table = getattr(self, name)
            out[name] = {x: list(t.x), y: list(t.y), "seconds": [list(row) for row in t.seconds]}
        return out

    @classmethod
    def load(cls, path: str | Path) -> SimProfile:
        """The profile in the JSON file ``path``; ValueError naming the file when it cannot be read or is not
        a valid profile."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"simulation profile {path}: {e}") from None
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"simulation profile {path}: {e}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


@functools.cache
def default_profile() -> SimProfile:
    """The built-in profile (measured with `xpyd bench calibrate` for the default model; its metadata says
    on which machine)."""
    return shipped_profile(DEFAULT_PROFILE.removesuffix(".json"))


def shipped_profiles() -> list[str]:
    """The names of the profiles that ship in xpyd/model/sim/profiles/ (their file names less ``.json``)."""
    folder = resources.files("xpyd.model.sim").joinpath("profiles")
    return sorted(f.name.removesuffix(".json") for f in folder.iterdir() if f.name.endswith(".json"))


def shipped_profile(name: str) -> SimProfile:
    """The shipped profile ``name`` (see `shipped_profiles`); ValueError listing them for another name."""
    if name not in shipped_profiles():
        raise ValueError(f"no shipped profile {name!r} (shipped: {', '.join(shipped_profiles())})")
    text = resources.files("xpyd.model.sim").joinpath("profiles", f"{name}.json").read_text()
    return SimProfile.from_dict(json.loads(text))
