"""``xpyd proxy --workers N``'s pieces that need no process: the children's command line, their log label, the
shared worker-names key, and the flag's bounds."""

from __future__ import annotations

import argparse

import pytest

from xpyd.proxy import main as proxy_main
from xpyd.proxy.processes import NAMES_KEY_ENV, child_argv, process_label
from xpyd.proxy.worker_names import WorkerNames


def test_children_get_the_same_flags_without_workers():
    assert child_argv(["--port", "8000", "--workers", "4", "--etcd", "h:1"]) == ["--port", "8000", "--etcd", "h:1"]
    assert child_argv(["--workers=4", "--log-requests"]) == ["--log-requests"]


def test_a_child_is_labelled_by_its_index():
    assert process_label({"XPYD_PROXY_PROCESS": "2/4"}) == "proxy.2"
    assert process_label({}) is None


def test_one_key_names_workers_alike_in_every_process():
    key = bytes(range(32))
    assert WorkerNames(key=key).name("prefill", "http://a:1") == WorkerNames(key=key).name("prefill", "http://a:1")
    assert WorkerNames().name("prefill", "http://a:1") != WorkerNames().name("prefill", "http://a:1")  # random
    with pytest.raises(ValueError):
        WorkerNames(key=b"short")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    proxy_main.add_arguments(parser)
    return parser.parse_args(["--prefill", "http://a:1", "--decode", "http://b:2", *argv])


def test_the_names_key_comes_from_the_parent_and_workers_is_bounded(monkeypatch):
    monkeypatch.setenv(NAMES_KEY_ENV, "ab" * 32)
    assert proxy_main.config_from_args(_args()).names_key == b"\xab" * 32
    monkeypatch.setenv(NAMES_KEY_ENV, "not hex")
    with pytest.raises(ValueError, match="not hex"):
        proxy_main.config_from_args(_args())
    monkeypatch.delenv(NAMES_KEY_ENV)
    assert proxy_main.config_from_args(_args()).names_key is None
    with pytest.raises(ValueError, match="--workers"):
        proxy_main.config_from_args(_args("--workers", "0"))


def test_up_passes_proxy_workers_on():
    from xpyd.launcher import up as launcher

    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    assert launcher._proxy_options(parser.parse_args(["--proxy-workers", "3"]))[-2:] == ["--workers", "3"]
    assert "--workers" not in launcher._proxy_options(parser.parse_args([]))
