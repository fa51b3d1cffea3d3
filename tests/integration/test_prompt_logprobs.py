"""ModelRunner.prefill_scored (prompt logprobs) on the tiny models vs transformers' full forward.

Every position's logprob is ``log_softmax(logits)[pos, next token]`` of transformers' forward in float64,
within the float32 bound measured from transformers' own float32 forward (tests/numerics.py); ranks and top
alternatives are compared where the exact values decide them by more than twice that bound. Both the lean
forward and the general path; one call, chunked calls, several parts in one pass, and a prompt longer than
one scoring slice.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.numerics import Reference, assert_paths_close
from xpyd.model.logprobs import MAX_LOGPROBS, TokenLogprob
from xpyd.model.logprobs_torch import PROMPT_SLICE
from xpyd.model.runner import ModelRunner

torch.set_num_threads(1)

BLOCK = 5  # odd: blocks end part-way through prompts and chunks


def prompt_of(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49152, (length,), generator=g).tolist()


def exact_logprobs(hf, hf64, ids: list[int]) -> Reference:
    """transformers' log_softmax(logits) at every position of ``ids`` in float64, and the bound on a float32
    computation's error, measured with the float32 model."""
    with torch.inference_mode():
        x = torch.tensor([ids])
        return Reference.measure(torch.log_softmax(hf64(x).logits[0], -1),
                                 torch.log_softmax(hf(x).logits[0].float(), -1))


def check_scored(scored: list[TokenLogprob], ref: Reference, ids: list[int], start: int, k: int,
                 what: str) -> int:
    """``scored`` are the logprobs of positions start, start + 1, ... against the tokens after them; the
    number of top alternatives whose id was decided (and checked)."""
    positions = list(range(start, start + len(scored)))
    targets = [ids[p + 1] for p in positions]
    assert [o.token for o in scored] == targets, what
    assert all(len(o.top) == k for o in scored), what
    exact, bound = ref.exact[positions], ref.bound
    Reference(exact[range(len(targets)), targets], bound).check(
        torch.tensor([o.logprob for o in scored], dtype=torch.float64), f"{what}: logprobs")
    decided = 0
    for j, o in enumerate(scored):
        delta = exact[j] - exact[j, targets[j]]
        low, high = 1 + int((delta > 2 * bound).sum()), int((delta > -2 * bound).sum())
        assert low <= o.rank <= high, f"{what}: position {positions[j]}: rank {o.rank} outside [{low}, {high}]"
        if not k:
            continue
        ids_top = [t for t, _ in o.top]
        Reference(exact[j, ids_top], bound).check(torch.tensor([v for _, v in o.top], dtype=torch.float64),
                                                  f"{what}: position {positions[j]}: top values")
        best = exact[j].topk(k + 1)
        gaps = (best.values[:-1] - best.values[1:]) > 2 * bound
        if gaps[k - 1]:
            assert set(ids_top) == set(best.indices[:k].tolist()), f"{what}: position {positions[j]}: top ids"
        for i in range(k):
            if gaps[i] and (i == 0 or gaps[i - 1]):
                assert ids_top[i] == int(best.indices[i]), f"{what}: position {positions[j]}: top {i}"
                decided += 1
    return decided


@pytest.fixture(scope="module")
def tiny_shared(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir, torch.float32, num_blocks=128, max_seq_len=128, block_size=BLOCK)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    return runner, hf, copy.deepcopy(hf).double().eval()


@pytest.fixture(params=["fast", "general"])
def tiny(request, tiny_shared):
    runner, hf, hf64 = tiny_shared
    runner.use_fast_path(request.param == "fast")
    yield runner, hf, hf64, request.param
    runner.use_fast_path(True)
    assert runner.pool.num_used == 0, "a test left blocks held"


def scattered(runner: ModelRunner, n: int, seed: int) -> list[int]:
    """``n`` blocks out of order, as a request gets them after others came and went."""
    alloc = runner.pool.blocks
    others = alloc.allocate(alloc.num_free - alloc.num_evictable)
    random.Random(seed).shuffle(others)
    alloc.release(others)
    return alloc.allocate(n)


def test_every_prompt_position_is_transformers_log_softmax(tiny):
    runner, hf, hf64, path = tiny
    prompt = prompt_of(40, 1)
    ref = exact_logprobs(hf, hf64, prompt)
    table = scattered(runner, runner.pool.layout.blocks_for(len(prompt)), 1)
    try:
        rows = runner.prefill_many([(table, prompt, 0)])
        scored_rows, scored = runner.prefill_scored([(table, prompt, 0)], [(prompt[1:], MAX_LOGPROBS)])
    finally:
        runner.pool.blocks.release(table)
    assert torch.equal(scored_rows, rows)  # the rows prefill_many returns, bit for bit
    assert len(scored) == 1 and len(scored[0]) == len(prompt) - 1
    decided = check_scored(scored[0], ref, prompt, 0, MAX_LOGPROBS, path)
    assert decided > len(prompt) * MAX_LOGPROBS // 2  # (the comparison of top ids is not vacuous)


def test_a_chunked_prefill_scores_what_one_call_scores(tiny):
    runner, hf, hf64, path = tiny
    prompt = prompt_of(43, 2)
    ref = exact_logprobs(hf, hf64, prompt)
    one_table = scattered(runner, runner.pool.layout.blocks_for(len(prompt)), 2)
    table = scattered(runner, runner.pool.layout.blocks_for(len(prompt)), 3)
    chunked: list[TokenLogprob] = []
    try:
        one_rows, one = runner.prefill_scored([(one_table, prompt, 0)], [(prompt[1:], 3)])
        for start, end in ((0, 7), (7, 19), (19, 26), (26, len(prompt))):
            # each chunk scores its positions against the next tokens: the next chunk's first one included
            rows, scored = runner.prefill_scored([(table, prompt[:end], start)], [(prompt[start + 1 : end + 1], 3)])
            assert len(scored[0]) == min(end, len(prompt) - 1) - start
            chunked += scored[0]
    finally:
        runner.pool.blocks.release(one_table + table)
    assert [o.token for o in chunked] == [o.token for o in one[0]] == prompt[1:]
    check_scored(chunked, ref, prompt, 0, 3, f"{path}, chunked")
    check_scored(one[0], ref, prompt, 0, 3, f"{path}, one call")
    assert_paths_close(torch.tensor([o.logprob for o in chunked]), torch.tensor([o.logprob for o in one[0]]),
                       ref.bound, f"{path}: chunked vs one call")
    assert_paths_close(rows, one_rows, ref.bound, f"{path}: the last chunk's row")


def test_parts_in_one_pass_are_scored_each_as_asked(tiny):
    runner, hf, hf64, path = tiny
    a, b, c = prompt_of(30, 3), prompt_of(21, 4), prompt_of(12, 5)
    tables = [scattered(runner, runner.pool.layout.blocks_for(len(p)), i) for i, p in enumerate((a, b, c))]
    try:
        runner.prefill(tables[1], b[:10])  # b's first chunk; this pass is its second, ending its prompt
        parts = [(tables[0], a, 0), (tables[1], b, 10), (tables[2], c, 0)]
        rows, scored = runner.prefill_scored(parts, [(a[1:20], 2), None, (c[1:], 0)])
        assert scored[1] is None
        rows_b, scored_b = runner.prefill_scored(parts, [None, (b[11:], 4), None])
        assert torch.equal(rows, runner.prefill_many(parts)) and torch.equal(rows_b, rows)
        assert scored_b[0] is None and scored_b[2] is None
    finally:
        runner.pool.blocks.release([x for t in tables for x in t])
    assert len(scored[0]) == 19 and len(scored[2]) == 11 and len(scored_b[1]) == 10
    assert all(o.top == () for o in scored[2])
    check_scored(scored[0], exact_logprobs(hf, hf64, a), a, 0, 2, f"{path}, a")
    check_scored(scored_b[1], exact_logprobs(hf, hf64, b), b, 10, 4, f"{path}, b after its first chunk")
    check_scored(scored[2], exact_logprobs(hf, hf64, c), c, 0, 0, f"{path}, c")


def test_bad_scores_are_refused_before_anything_is_written(tiny):
    runner, _, _, _ = tiny
    prompt = prompt_of(12, 6)
    table = runner.pool.blocks.allocate(runner.pool.layout.blocks_for(len(prompt)))
    before = runner.pool.tensor.clone()
    try:
        for scores in ([(prompt[1:], MAX_LOGPROBS + 1)], [(prompt + [3], 1)], [(prompt[1:], 1)] * 2,
                       [([runner.vocab_size], 1)]):
            with pytest.raises(ValueError):
                runner.prefill_scored([(table, prompt, 0)], scores)
        assert torch.equal(runner.pool.tensor, before)
    finally:
        runner.pool.blocks.release(table)


@pytest.mark.parametrize("path", ["fast", "general"])
def test_a_prompt_longer_than_a_slice_is_scored_a_slice_at_a_time(tiny_long_model_dir, monkeypatch, path):
    runner = ModelRunner(tiny_long_model_dir, torch.float32, num_blocks=24, max_seq_len=384, block_size=16)
    runner.use_fast_path(path == "fast")
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_long_model_dir), dtype=torch.float32).eval()
    prompt = prompt_of(PROMPT_SLICE + 45, 7)
    owner, name = (runner.fast_path, "logits") if path == "fast" else (runner._general, "logits")
    logits_of, sizes = getattr(owner, name), []

    def spy(x):
        sizes.append(x.reshape(-1, x.shape[-1]).shape[0])
        return logits_of(x)

    monkeypatch.setattr(owner, name, spy)
    table = runner.pool.blocks.allocate(runner.pool.layout.blocks_for(len(prompt)))
    rows, scored = runner.prefill_scored([(table, prompt, 0)], [(prompt[1:], 1)])
    runner.pool.blocks.release(table)
    assert max(sizes) <= PROMPT_SLICE and sum(sizes) == len(prompt)  # every position's slice, and the last row
    check_scored(scored[0], exact_logprobs(hf, copy.deepcopy(hf).double().eval(), prompt), prompt, 0, 1, path)
