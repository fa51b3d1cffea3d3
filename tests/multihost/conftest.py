"""Fixtures for tests across a multi-host test bed on this machine (scripts/netbed.py): network
namespaces as hosts, joined through a bridge. Everything here skips, saying why, where namespaces cannot
be made (not root, no iproute2, a sandbox that refuses them); what needs nftables skips without ``nft``."""

from __future__ import annotations

import secrets

import pytest
from testbed import netbed


@pytest.fixture(scope="session")
def netbed_ready():
    reason = netbed.available()
    if reason:
        pytest.skip(f"no multi-host test bed on this machine: {reason}")
    netbed.sweep_stale()  # beds a crashed run left behind (their owner process is gone)
    return netbed


@pytest.fixture(scope="module")
def bed(netbed_ready):
    """A bed with an access link, so this test process reaches every host; removed after the module,
    whatever happened (processes still running in its hosts are stopped)."""
    b = netbed.NetBed("t" + secrets.token_hex(3), access=True)
    try:
        yield b
    finally:
        b.close()


@pytest.fixture
def needs_nft():
    reason = netbed.nft_missing()
    if reason:
        pytest.skip(reason)
