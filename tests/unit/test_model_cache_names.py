"""Converted GGUFs are named by content, not path (a new virtual environment's copy of the same wheel reuses the
conversion), and conversions unused for PRUNE_AFTER_DAYS are removed when a new one is made."""

from __future__ import annotations

import json
import os
import time

import pytest

from xpyd.model import loader


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XPYD_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def _gguf(path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_the_same_file_anywhere_has_one_conversion_and_other_content_another(cache, tmp_path):
    a = _gguf(tmp_path / "venv1" / "m.gguf", b"GGUF" + b"x" * 5000)
    b = _gguf(tmp_path / "venv2" / "m.gguf", b"GGUF" + b"x" * 5000)
    c = _gguf(tmp_path / "venv3" / "m.gguf", b"GGUF" + b"x" * 4999 + b"y")  # (same size, one byte differs)
    assert loader.converted_dir(a) == loader.converted_dir(b) != loader.converted_dir(c)
    assert loader.converted_dir(a).parent == cache and loader.converted_dir(a).name.startswith("m-")


def test_a_digest_is_remembered_until_the_file_changes(cache, tmp_path):
    a = _gguf(tmp_path / "m.gguf", b"one")
    first = loader.converted_dir(a)
    index = json.loads((cache / loader.DIGESTS).read_text())
    assert list(index.values()) == [loader._content_digest(a)] and len(index) == 1
    a.write_bytes(b"two")
    os.utime(a, ns=(time.time_ns(), time.time_ns() + 10**9))  # (a new mtime, as any rewrite gives)
    assert loader.converted_dir(a) != first
    gone = _gguf(tmp_path / "gone" / "m.gguf", b"one")
    loader.converted_dir(gone)
    gone.unlink()
    loader.converted_dir(_gguf(tmp_path / "third.gguf", b"three"))  # (a new entry forgets paths that are gone)
    assert not any("/gone/" in k for k in json.loads((cache / loader.DIGESTS).read_text()))


def test_a_corrupt_index_is_rebuilt(cache, tmp_path):
    a = _gguf(tmp_path / "m.gguf", b"data")
    cache.mkdir(parents=True)
    (cache / loader.DIGESTS).write_text("[not a dict")
    assert loader.converted_dir(a) == loader.converted_dir(a)
    assert isinstance(json.loads((cache / loader.DIGESTS).read_text()), dict)


def test_conversions_unused_for_the_prune_age_go_the_rest_stay(cache):
    now = time.time()
    old_age = (loader.PRUNE_AFTER_DAYS + 1) * 86400
    folders = {}
    for name, age, marked in [("old-used", old_age, True), ("old-unmarked", old_age, False),
                              ("recent", 3600, True), ("keep", old_age, True)]:
        folder = cache / f"m-{name}"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        target = folder / loader.USED if marked else folder
        if marked:
            target.touch()
        os.utime(target, (now - age, now - age))
        folders[name] = folder
    removed = loader._prune(cache, folders["keep"], now)
    assert sorted(p.name for p in removed) == ["m-old-unmarked", "m-old-used"]
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == ["m-keep", "m-recent"]
