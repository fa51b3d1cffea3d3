"""The learned cost of a prefill step: the fit recovers how a step's time grows with its tokens and the
attention pairs they compute, stays >= 0, and says how many tokens fit in what time is left."""

from __future__ import annotations

import random

import pytest

from xpyd.prefill_worker.step_cost import MIN_STEPS, Coefficients, StepCost, pairs


def test_pairs_count_a_chunks_attention_over_its_prefix_and_itself():
    assert pairs(0, 1) == 1
    assert pairs(0, 4) == 1 + 2 + 3 + 4
    assert pairs(10, 2) == 11 + 12


def test_nothing_is_known_before_min_steps_then_the_fit_recovers_the_coefficients():
    true = Coefficients(overhead=0.02, per_token=4e-4, per_pair=6e-7)
    cost = StepCost(decay=1.0)
    rng = random.Random(0)
    for i in range(40):
        chunks = [(rng.randrange(0, 1900), rng.choice([64, 128, 512]))] + [(0, 128)] * rng.randrange(0, 3)
        if i < MIN_STEPS - 1:
            assert not cost.known
            with pytest.raises(ValueError, match="no step cost"):
                cost.step_seconds(chunks)
        cost.observe(chunks, true.overhead + sum(true.chunk_seconds(s, n) for s, n in chunks))
    got = cost.coefficients
    assert got.overhead == pytest.approx(true.overhead, rel=1e-3)
    assert got.per_token == pytest.approx(true.per_token, rel=1e-3)
    assert got.per_pair == pytest.approx(true.per_pair, rel=1e-3)
    assert cost.step_seconds([(1024, 512)]) == pytest.approx(0.02 + 512 * 4e-4 + pairs(1024, 512) * 6e-7)


def test_recent_steps_count_more_so_the_fit_follows_a_change():
    cost = StepCost(decay=0.8)
    for i in range(30):
        start, n = (i % 4) * 256, 128 + 64 * (i % 3)
        cost.observe([(start, n)], n * 2e-3)  # 2 ms a token
    for i in range(30):
        start, n = (i % 4) * 256, 128 + 64 * (i % 3)
        cost.observe([(start, n)], n * 1e-3)  # twice as fast now
    assert cost.coefficients.per_token == pytest.approx(1e-3, rel=0.01)
    for i in range(60):
        start, n = (i % 4) * 256, 128 + 64 * (i % 3)
        cost.observe([(start, n)], n * 2e-3)  # and slower again: a lasting change is followed, if slowly
    assert cost.coefficients.per_token == pytest.approx(2e-3, rel=0.01)


def test_coefficients_stay_non_negative_when_a_term_does_not_matter():
    cost = StepCost(decay=1.0)
    rng = random.Random(1)
    for _ in range(50):  # per token only, and noisy: a free fit would give some term a small negative value
        chunks = [(rng.randrange(0, 2000), rng.randrange(1, 512))]
        cost.observe(chunks, chunks[0][1] * 1e-3 * rng.uniform(0.9, 1.1))
    c = cost.coefficients
    assert min(c.overhead, c.per_token, c.per_pair) >= 0
    assert c.per_token == pytest.approx(1e-3, rel=0.1)


def test_tokens_within_is_the_longest_chunk_that_fits_in_the_time():
    per_token = Coefficients(0.0, 1.0, 0.0)
    assert per_token.tokens_within(500, 10.0) == 10
    assert per_token.tokens_within(0, 0.0) == 0
    per_pair = Coefficients(0.0, 0.0, 1.0)
    assert per_pair.tokens_within(0, 10.0) == 4  # 1+2+3+4 = 10
    assert per_pair.tokens_within(0, 9.99) == 3
    assert per_pair.tokens_within(10, 23.0) == 2  # 11+12
    assert per_pair.tokens_within(10, 10.0) == 0
    both = Coefficients(5.0, 2.0, 1.0)  # (the overhead is the step's, not a chunk's)
    assert both.chunk_seconds(3, 2) == 2 * 2 + 4 + 5
    assert both.tokens_within(3, 13.0) == 2


def test_bad_values_are_refused():
    with pytest.raises(ValueError):
        Coefficients(0.0, -1e-3, 0.0)
    with pytest.raises(ValueError):
        StepCost(decay=0.0)
    with pytest.raises(ValueError):
        StepCost().observe([(0, 1)], float("nan"))


def test_stalls_move_the_fit_a_little_only():
    true = Coefficients(overhead=0.01, per_token=5e-4, per_pair=8e-7)
    cost = StepCost()
    shapes = [[(0, 128)], [(0, 512)], [(512, 512)], [(1024, 512)], [(1536, 364)], [(0, 128), (0, 128)]]
    rng = random.Random(2)
    for i in range(200):  # a third of the steps stalled, by up to 20 times their time (others on the cores)
        chunks = shapes[i % len(shapes)]
        stall = rng.uniform(1, 20) if rng.random() < 0.3 and i >= MIN_STEPS else 1.0
        cost.observe(chunks, stall * (true.overhead + sum(true.chunk_seconds(s, n) for s, n in chunks)))
    def truly(chunks):
        return true.overhead + sum(true.chunk_seconds(s, n) for s, n in chunks)

    for chunks in shapes:  # near the unhindered time (a stall counts as 1.1 times it), nowhere near a stall's
        assert truly(chunks) <= cost.step_seconds(chunks) < 1.2 * truly(chunks)
    # and what the scheduler sizes chunks by, how steps compare, holds
    late, first = [(1024, 512)], [(0, 512)]
    assert cost.step_seconds(late) / cost.step_seconds(first) == pytest.approx(truly(late) / truly(first), rel=0.05)
