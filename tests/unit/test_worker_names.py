"""The opaque worker names of ``x-xpyd-workers`` (``xpyd.proxy.worker_names``): no part of the worker's address
in them, stable, distinct per worker, keyed by the cluster token when there is one; and the proxy's flag."""

from __future__ import annotations

import argparse
import re
from urllib.parse import urlsplit

import pytest

from xpyd import PROTOCOL_VERSION
from xpyd.discovery.types import Role, WorkerInfo
from xpyd.proxy import worker_names
from xpyd.proxy.config import ProxyConfig
from xpyd.proxy.main import add_arguments, config_from_args
from xpyd.proxy.worker_names import WorkerNames

TOKEN = "a-cluster-token-0123"
NAME = re.compile(r"^[pdc][0-9a-f]{8}$")


def info(role: Role, url: str) -> WorkerInfo:
    return WorkerInfo(role, url, "127.0.0.1:5555", "m", PROTOCOL_VERSION, 8)


def address_parts(url: str) -> list[str]:
    """Every piece of ``url`` that could identify the worker: host, each of its labels/octets of 3+ characters,
    the port."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    pieces = [host, str(parts.port), *(p for p in re.split(r"[.:\[\]]", host) if len(p) >= 3)]
    return [p for p in pieces if p]


URLS = [f"http://10.0.{i // 250}.{i % 250 + 1}:{8100 + i}" for i in range(64)] + [
    "http://127.0.0.1:18000", "http://[::1]:8200", "https://decode-7.cluster.internal:9443"]


@pytest.mark.parametrize("token", [None, TOKEN])
def test_a_name_is_a_role_letter_and_8_hex_digits_with_no_part_of_the_address(token):
    names = WorkerNames(token)
    for role in Role:
        for url in URLS:
            name = names.of(info(role, url))
            assert NAME.match(name) and name[0] == role.value[0], name
            if token is not None:  # (a fixed key: a port's digits cannot turn up in the hex by chance one run in 30)
                for piece in address_parts(url):
                    assert piece not in name, (url, piece, name)
    assert names.colocated("http://127.0.0.1:18000") == f"colocated={names.name('colocated', 'http://127.0.0.1:18000')}"
    assert names.name("colocated", "http://127.0.0.1:18000").startswith("c")


def test_names_are_stable_and_distinct_per_worker():
    names = WorkerNames(None)
    first = {(role, url): names.of(info(role, url)) for role in Role for url in URLS}
    again = {(role, url): names.of(info(role, url)) for role in Role for url in URLS}
    assert first == again
    assert len(set(first.values())) == len(first) == 2 * len(URLS)
    # The same worker is the same name whatever else its registration says (protocol, capacity, model).
    other = WorkerInfo(Role.DECODE, URLS[0], "10.9.9.9:1", "other", PROTOCOL_VERSION, 64)
    assert names.of(other) == first[(Role.DECODE, URLS[0])]


def test_the_key_comes_from_the_cluster_token_else_it_is_this_proxys_own():
    url = URLS[3]
    assert WorkerNames(TOKEN).of(info(Role.PREFILL, url)) == WorkerNames(TOKEN).of(info(Role.PREFILL, url))
    assert WorkerNames(TOKEN).of(info(Role.PREFILL, url)) != WorkerNames(TOKEN + "x").of(info(Role.PREFILL, url))
    # Without a token nobody can recompute a name from a guessed address: each proxy has a random key.
    assert WorkerNames(None).of(info(Role.PREFILL, url)) != WorkerNames(None).of(info(Role.PREFILL, url))


def test_a_collision_of_8_digits_gives_the_later_worker_16(monkeypatch):
    monkeypatch.setattr(worker_names, "_DIGITS", 1)  # one hex digit: 17 workers must collide
    names = WorkerNames(TOKEN)
    got = [names.of(info(Role.DECODE, url)) for url in URLS[:17]]
    assert len(set(got)) == 17
    assert {len(n) for n in got} == {2, 3}  # role letter + 1, or + 2 after a collision
    assert got == [names.of(info(Role.DECODE, url)) for url in URLS[:17]]  # never renamed


def test_pair_header_value():
    names = WorkerNames(TOKEN)
    p, d = info(Role.PREFILL, URLS[0]), info(Role.DECODE, URLS[1])
    assert names.pair(p, d) == f"prefill={names.of(p)}, decode={names.of(d)}"
    with pytest.raises(ValueError, match="role"):
        names.name("router", URLS[0])


def test_the_flag_is_off_by_default_and_validated():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    assert config_from_args(parser.parse_args(base)).expose_worker_names is False
    assert config_from_args(parser.parse_args([*base, "--expose-worker-names"])).expose_worker_names is True
    with pytest.raises(ValueError, match="expose_worker_names"):
        ProxyConfig(expose_worker_names="yes")


def test_xpyd_up_passes_the_flag_to_the_proxy():
    from xpyd.launcher import up as launcher

    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    assert "--expose-worker-names" not in launcher._proxy_options(parser.parse_args([]))
    assert launcher._proxy_options(parser.parse_args(["--expose-worker-names"]))[-1] == "--expose-worker-names"
