"""mallopt tuning: applied on glibc, harmless to repeat, a no-op elsewhere."""

from __future__ import annotations

import platform

import pytest

from xpyd.worker import malloc_tuning
from xpyd.worker.malloc_tuning import tune_malloc


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt tuning is glibc-only")
def test_tuning_applies_and_repeats():
    assert tune_malloc() is True
    assert tune_malloc() is True  # idempotent


def test_no_libc_means_no_change(monkeypatch):
    monkeypatch.setattr(malloc_tuning, "_mallopt", lambda: None)
    assert tune_malloc() is False
