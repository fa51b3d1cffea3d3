"""Checks of one request field's value, shared by the request parsers (``xpyd.api.openai``, ``chat_request``):
each returns the value or raises a 400 that names the field."""

from __future__ import annotations

import math
from typing import Any

from xpyd.api.errors import bad_request as _bad


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def optional_bool(d: dict, key: str, default: bool = False) -> bool:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"'{key}' must be a boolean", key)
    return v


def optional_number(d: dict, key: str, default: float) -> float:
    v = d.get(key)
    if v is None:
        return default
    if not is_number(v):
        raise _bad(f"'{key}' must be a number", key)
    return float(v)
