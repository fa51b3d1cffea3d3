"""An accepted token (a rotation window's second one) is a non-empty str wherever a proof is checked: the
signal plane's client refuses None or empty ones at construction, as the transfer backends do."""

from __future__ import annotations

import pytest

from xpyd.cluster_tokens import check_accepted_tokens
from xpyd.signal import messages as m
from xpyd.signal.client import SignalClient


def test_accepted_tokens_are_non_empty_strings():
    assert check_accepted_tokens(()) == ()
    assert check_accepted_tokens(["the-old-token"]) == ("the-old-token",)
    for bad in [(None,), ("",), "the-old-token", (b"x",), None, ("ok-token", None)]:
        with pytest.raises(ValueError, match="accepted tokens"):
            check_accepted_tokens(bad)


@pytest.mark.parametrize("accepted", [(None,), ("",)])
def test_the_signal_client_refuses_an_accepted_none_or_empty_token(accepted):
    with pytest.raises(ValueError, match="accepted tokens"):
        SignalClient("127.0.0.1:7001", m.Handshake("127.0.0.1:7001", "m", {}),
                     m.KVMapInit("127.0.0.1:7001", {}, 1, 1), cluster_token="the-cluster-token",
                     accepted_tokens=accepted)
