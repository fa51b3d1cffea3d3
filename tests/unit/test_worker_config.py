"""Worker flags that tune fault handling: parsed per role, refused out of range with the flag's name."""

from __future__ import annotations

import argparse

import pytest

from xpyd.worker.config import WorkerConfig, add_worker_arguments, config_from_args


def parse(role: str, *argv: str) -> WorkerConfig:
    p = argparse.ArgumentParser()
    add_worker_arguments(p, role)
    return config_from_args(p.parse_args(list(argv)), role)


def test_the_signal_timeout_is_a_decode_flag():
    assert parse("decode").signal_timeout == 5.0
    assert parse("decode", "--signal-timeout", "2.5").signal_timeout == 2.5
    with pytest.raises(SystemExit):  # prefill answers; it has no such deadline
        parse("prefill", "--signal-timeout", "2")


@pytest.mark.parametrize("value", [0.5, 0.0, -1.0, 3601.0])
def test_a_signal_timeout_shorter_than_a_heartbeat_or_absurdly_long_is_refused(value):
    with pytest.raises(ValueError, match=r"--signal-timeout must be in \[1, 3600\]"):
        WorkerConfig("decode", signal_timeout=value)


def test_prefill_peers_are_a_decode_flag_given_repeated_or_comma_separated():
    assert parse("decode").prefill_peers == ()
    cfg = parse("decode", "--prefill-peers", "10.0.0.1:8101, [::1]:8101", "--prefill-peers", "p-0.svc:8101")
    assert cfg.prefill_peers == ("10.0.0.1:8101", "[::1]:8101", "p-0.svc:8101")
    with pytest.raises(SystemExit):
        parse("prefill", "--prefill-peers", "10.0.0.1:8101")
    for bad in ("10.0.0.1", "::1:8101", "a:0", "http://a:1"):
        with pytest.raises(ValueError, match="--prefill-peers"):
            parse("decode", "--prefill-peers", bad)


def test_the_cluster_token_comes_from_the_flag_or_the_environment_and_stays_out_of_repr(monkeypatch):
    monkeypatch.delenv("XPYD_CLUSTER_TOKEN", raising=False)
    assert parse("decode").cluster_token is None
    monkeypatch.setenv("XPYD_CLUSTER_TOKEN", "from-the-environment")
    assert parse("prefill").cluster_token == "from-the-environment"  # (read when the config is built)
    assert parse("decode", "--cluster-token", "from-the-flag").cluster_token == "from-the-flag"
    assert parse("colocated").cluster_token is None  # (no signal plane, no token)
    monkeypatch.setenv("XPYD_CLUSTER_TOKEN", "")
    assert parse("decode").cluster_token is None
    assert "secret-token" not in repr(WorkerConfig("decode", cluster_token="secret-token"))


def test_an_accepted_token_comes_from_the_flag_or_the_environment_and_needs_a_different_cluster_token(monkeypatch):
    monkeypatch.delenv("XPYD_CLUSTER_TOKEN", raising=False)
    monkeypatch.delenv("XPYD_CLUSTER_TOKEN_ACCEPT", raising=False)
    assert parse("decode").accepted_tokens == ()
    cfg = parse("decode", "--cluster-token", "the-new-token", "--cluster-token-accept", "the-old-token")
    assert cfg.accepted_tokens == ("the-old-token",) and "the-old-token" not in repr(cfg)
    monkeypatch.setenv("XPYD_CLUSTER_TOKEN_ACCEPT", "from-the-environment")
    assert parse("prefill", "--cluster-token", "the-new-token").accepted_tokens == ("from-the-environment",)
    with pytest.raises(ValueError, match="needs --cluster-token"):
        parse("prefill")
    monkeypatch.setenv("XPYD_CLUSTER_TOKEN_ACCEPT", "")
    assert parse("prefill", "--cluster-token", "the-new-token").accepted_tokens == ()
    with pytest.raises(ValueError, match="same as --cluster-token"):
        parse("decode", "--cluster-token", "the-new-token", "--cluster-token-accept", "the-new-token")
    with pytest.raises(ValueError, match="8-256"):
        parse("decode", "--cluster-token", "the-new-token", "--cluster-token-accept", "short")
    with pytest.raises(SystemExit):
        parse("colocated", "--cluster-token-accept", "the-old-token")
