"""The proxy's drain time (--drain-timeout): parsed, checked, and handed to the HTTP server's graceful shutdown
(in-process, no workers)."""

from __future__ import annotations

import argparse
import asyncio
import socket

import pytest

from xpyd.proxy import main as proxy_main
from xpyd.proxy.config import ProxyConfig


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    proxy_main.add_arguments(p)
    return p.parse_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", *argv])


def test_the_drain_timeout_comes_from_the_flag_with_a_5s_default():
    assert proxy_main.config_from_args(_args()).drain_timeout == 5.0
    assert proxy_main.config_from_args(_args("--drain-timeout", "600")).drain_timeout == 600.0
    assert proxy_main.config_from_args(_args("--drain-timeout=0")).drain_timeout == 0.0


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "3601"])
def test_a_drain_timeout_out_of_range_is_refused(value: str):
    with pytest.raises(ValueError, match="drain_timeout"):
        proxy_main.config_from_args(_args(f"--drain-timeout={value}"))


def test_serve_proxy_gives_the_server_the_configured_drain_time(monkeypatch: pytest.MonkeyPatch):
    from xpyd.proxy import colocated

    seen = []

    async def fake_serve(app, stop, sock, graceful_timeout):
        seen.append(graceful_timeout)
        sock.close()

    monkeypatch.setattr(proxy_main, "serve", fake_serve)
    monkeypatch.setattr(colocated, "create_colocated_app", lambda config, url: object())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = ProxyConfig(host="127.0.0.1", port=port, colocated_url="http://127.0.0.1:1", drain_timeout=42.0)
    asyncio.run(proxy_main.serve_proxy(config, asyncio.Event()))
    assert seen == [42.0]
