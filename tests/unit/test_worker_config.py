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
