"""Integration fixtures: a real etcd server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from xpyd.discovery.local_etcd import LocalEtcd


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[LocalEtcd]:
    """A fresh single-member etcd on free ports (~0.2 s to start), stopped at teardown.

    Its data dir is ``tmp_path / "etcd"``, so a test may ``kill()``/``stop()`` and ``start()``
    it again and get the same endpoint with its data kept.
    """
    server = LocalEtcd(data_dir=tmp_path / "etcd")
    server.start()
    try:
        yield server
    finally:
        server.stop()
