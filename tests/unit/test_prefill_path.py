"""Where a P/D request's prompt is computed (``xpyd.proxy.prefill_path``): on its decode worker when the tokens
that worker does not cache are at most the threshold, on a prefill worker otherwise, and always there when the
request has a part only prefill answers (echo, prompt logprobs), resumes an output, or its tokens are unknown."""

from __future__ import annotations

import json

import pytest

from xpyd.api.openai import RequestKind, parse_request
from xpyd.proxy.config import ProxyConfig
from xpyd.proxy.prefill_path import PrefillDecider, PrefillPath, uncached_tokens
from xpyd.proxy.prefix_index import PromptKeys

L, R = PrefillPath.LOCAL, PrefillPath.REMOTE


def req(**fields):
    return parse_request(json.dumps({"prompt": "hi", "max_tokens": 8, **fields}).encode(), RequestKind.COMPLETION)


def keys(tokens: int, block: int = 16) -> PromptKeys:
    return PromptKeys(tokens, block, tuple(range(tokens // block)))


@pytest.mark.parametrize("tokens, cached_blocks, path", [
    (64, 0, L), (65, 0, R), (1, 0, L),
    (1024, 60, L),  # 1,024 - 960 = 64 uncached
    (1024, 59, R),  # 80 uncached
    (1024, 64, L),  # all cached: its last token is computed
])
def test_local_when_the_uncached_tokens_are_at_most_the_threshold(tokens, cached_blocks, path):
    assert PrefillDecider(64).decide(req(), keys(tokens), cached_blocks) is path


def test_uncached_tokens_count_whole_cached_blocks_and_at_least_one():
    assert uncached_tokens(keys(40), 0) == 40
    assert uncached_tokens(keys(40), 2) == 8
    assert uncached_tokens(keys(32), 2) == 1
    assert uncached_tokens(keys(40), 9) == 8  # (no more than the prompt's full blocks)
    assert uncached_tokens(keys(40), -1) == 40


@pytest.mark.parametrize("fields", [{"echo": True}, {"prompt_logprobs": 1}])
def test_requests_with_a_part_only_prefill_answers_go_remote(fields):
    decider = PrefillDecider(64)
    assert not decider.eligible(req(**fields))
    assert decider.decide(req(**fields), keys(8), 0) is R


def test_no_tokens_a_resumed_output_or_zero_go_remote():
    assert PrefillDecider(64).decide(req(), None, 0) is R
    assert PrefillDecider(64).decide(req(), keys(8), 0, resume=(5, 6)) is R
    off = PrefillDecider(0)
    assert not off.enabled and not off.eligible(req()) and off.decide(req(), keys(1), 0) is R


@pytest.mark.parametrize("bad", [-1, True, 1.5, 1 << 21])
def test_the_threshold_is_checked_at_startup(bad):
    with pytest.raises(ValueError, match="local_prefill_max_tokens"):
        ProxyConfig(local_prefill_max_tokens=bad)
