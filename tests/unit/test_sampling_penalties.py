"""Penalties, logit_bias, min_tokens and min_p (vLLM's semantics) in the torch sampler, checked against float64
references written here and against transformers' own processors where they mean the same; the simulated
engine's sampler defines them too, deterministically, and continues a request across workers."""

from __future__ import annotations

import math

import pytest
import torch

from xpyd.model.sampling import adjust_logits, make_generator, sample, skip_draw
from xpyd.model.sampling_params import SamplingParams, TokenHistory
from xpyd.model.sim.sampler import SimGenerator, SimSampler

VOCAB = 64


def _history(prompt, output) -> TokenHistory:
    return TokenHistory(prompt, list(output)).sync()


def _reference(logits: torch.Tensor, p: SamplingParams, prompt, output) -> torch.Tensor:
    """vLLM's order in float64, written out token by token."""
    x = logits.double().clone()
    if len(output) < p.min_tokens:
        for t in p.min_tokens_ids:
            x[t] = -math.inf
    for t, b in p.logit_bias:
        x[t] += b
    seen = set(prompt) | set(output)
    for t in range(x.numel()):
        if t in seen:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        n = output.count(t)
        x[t] -= p.frequency_penalty * n + (p.presence_penalty if n else 0.0)
    return x


PARAMS = [
    SamplingParams(temperature=0, presence_penalty=1.5),
    SamplingParams(temperature=0, frequency_penalty=0.7),
    SamplingParams(temperature=0, frequency_penalty=-0.5, presence_penalty=-1.0),
    SamplingParams(temperature=0, repetition_penalty=1.8),
    SamplingParams(temperature=0, repetition_penalty=0.6),
    SamplingParams(temperature=0, logit_bias=((3, 5.0), (9, -100.0), (63, 2.5))),
    SamplingParams(temperature=0, min_tokens=5, min_tokens_ids=frozenset({0, 7})),
    SamplingParams(temperature=0, presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3,
                   logit_bias=((5, 1.0),), min_tokens=3, min_tokens_ids=frozenset({2})),
]


@pytest.mark.parametrize("params", PARAMS)
def test_adjusted_logits_match_a_float64_reference(params):
    gen = torch.Generator().manual_seed(5)
    prompt = [1, 4, 4, 9, 30, 2]
    for step in range(12):
        output = torch.randint(0, VOCAB, (step,), generator=gen).tolist()
        logits = torch.randn(VOCAB, generator=gen) * 4
        got = adjust_logits(logits, params, _history(prompt if params.needs_prompt else (), output))
        ref = _reference(logits, params, prompt, output)
        finite = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(got), finite)
        assert torch.allclose(got[finite].double(), ref[finite], rtol=0, atol=1e-5)
        assert sample(logits[None], [params], [None], [_history(prompt, output)]) == [int(ref.argmax())]


def test_the_repetition_penalty_is_transformers_over_prompt_and_output():
    from transformers import RepetitionPenaltyLogitsProcessor

    prompt, output = [3, 3, 8, 21], [8, 40, 41]
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    theirs = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits[None].clone())[0]
    ours = adjust_logits(logits, SamplingParams(repetition_penalty=1.7), _history(prompt, output))
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-6)
    # presence and frequency read the output only: a prompt token is not penalized
    only = adjust_logits(logits, SamplingParams(presence_penalty=2.0), _history(prompt, output))
    assert only[3] == logits[3] and only[40] == logits[40] - 2.0


def test_min_p_keeps_transformers_min_p_set_and_draws_as_a_float64_reference():
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper

    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    p = SamplingParams(temperature=0.8, min_p=0.1, seed=11)
    scores = TemperatureLogitsWarper(0.8)(None, logits[None].clone())
    kept = torch.isfinite(MinPLogitsWarper(0.1)(None, scores)[0])
    assert 1 < int(kept.sum()) < VOCAB  # (the case means something)
    probs = torch.softmax(logits.double() / 0.8, -1)
    probs = torch.where(probs >= 0.1 * probs.max(), probs, 0)
    cdf = torch.cumsum(probs, -1)
    agree = 0
    for seed in range(300):
        token = sample(logits[None], [p], [make_generator(seed)], [None])[0]
        u = float(torch.rand((), generator=make_generator(seed)))
        assert kept[token]
        ref = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
        if abs(float(cdf[min(ref, VOCAB - 1)]) - u * float(cdf[-1])) > 1e-6:
            assert token == ref, seed
            agree += 1
    assert agree > 290


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.zeros(VOCAB)
    logits[7] = 10.0  # the stop token would win
    p = SamplingParams(temperature=0, min_tokens=2, min_tokens_ids=frozenset({7}))
    assert sample(logits[None], [p], [None], [_history((), [])]) != [7]
    assert sample(logits[None], [p], [None], [_history((), [1])]) != [7]
    assert sample(logits[None], [p], [None], [_history((), [1, 1])]) == [7]


def test_plain_rows_are_sampled_from_the_raw_logits():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(9))
    plain = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_p=0.9, seed=1)]
    assert all(p.plain for p in plain) and not SamplingParams(min_p=0.1).plain
    got = sample(logits[:2], plain, [None, make_generator(1)])
    assert got[0] == int(logits[0].argmax())
    assert got == sample(logits[:2], plain, [None, make_generator(1)], [None, None])


def test_a_token_history_reads_only_new_output():
    output: list[int] = []
    h = TokenHistory([5, 3, 5], output)
    assert h.prompt_ids == (3, 5) and h.sync().counts == {} and h.n_output == 0
    output += [4, 4, 9]
    assert h.sync().counts == {4: 2, 9: 1} and h.n_output == 3
    output.append(4)
    assert h.sync().counts == {4: 3, 9: 1} and h.n_output == 4


def test_sampling_params_validate_and_clamp():
    assert SamplingParams(logit_bias=((1, 500.0), (2, -500.0))).logit_bias == ((1, 100.0), (2, -100.0))
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0), dict(min_p=1.5),
                dict(min_tokens=-1), dict(logit_bias=((1, 1.0), (1, 2.0))), dict(min_tokens_ids=frozenset({-1}))):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# --- the simulated engine's sampler --------------------------------------------------------------------------

SIM = SimSampler(1000, [2])


def _digest(i: int) -> bytes:
    return i.to_bytes(8, "little")


def test_sim_plain_sampling_is_unchanged_and_adjusted_sampling_is_deterministic():
    greedy = SamplingParams(temperature=0)
    for i in range(50):
        d = _digest(i * 7919)
        first = SIM.sample([d], [greedy], [None])[0]
        logits = SIM.logits(d, SamplingParams(temperature=0, presence_penalty=0.1), _history((), []))
        assert next(iter(logits)) == first and logits[first] == 0.0  # the greedy token leads the candidates
        p = SamplingParams(temperature=0.9, presence_penalty=0.5, seed=3)
        h = _history((), [first, first])
        assert SIM.sample([d], [p], [SimGenerator(3)], [h]) == SIM.sample([d], [p], [SimGenerator(3)], [h])


def test_sim_logit_bias_penalties_and_min_tokens_move_the_greedy_token():
    d = _digest(123456789)
    base = SIM.sample([d], [SamplingParams(temperature=0)], [None])[0]
    forced = SamplingParams(temperature=0, logit_bias=((777, 100.0),))
    assert SIM.sample([d], [forced], [None], [None]) == [777]
    assert SIM.sample([d], [SamplingParams(temperature=0, logit_bias=((2, 100.0),))], [None], [None]) == [base]
    repeated = SamplingParams(temperature=0, presence_penalty=2.0)
    other = SIM.sample([d], [repeated], [None], [_history((), [base])])[0]
    assert other != base  # the generated token lost 2 logits: the next candidate (-1) wins
    assert other == list(SIM.logits(d, repeated, _history((), [])))[1]
    banned = SamplingParams(temperature=0, min_tokens=1, min_tokens_ids=frozenset({base}))
    assert SIM.sample([d], [banned], [None], [_history((), [])]) == [other]
    assert SIM.sample([d], [banned], [None], [_history((), [9])]) == [base]
    rep = SamplingParams(temperature=0, repetition_penalty=2.0)  # the leading logit is 0: a penalty leaves it
    assert SIM.sample([d], [rep], [None], [_history([base], [])]) == [base]


def test_sim_seeded_sampling_continues_across_workers():
    """Prefill samples token 1 (one draw); decode skips that draw and continues: the colocated tokens."""
    p = SamplingParams(temperature=1.2, top_k=4, min_p=0.05, frequency_penalty=0.8, seed=99)
    digests = [_digest(1000 + i) for i in range(10)]
    together, g = [], SimGenerator(99)
    for d in digests:
        together.append(SIM.sample([d], [p], [g], [_history((), together)])[0])
    apart, prefill, decode = [], SimGenerator(99), SimGenerator(99)
    apart.append(SIM.sample([digests[0]], [p], [prefill], [_history((), [])])[0])
    SIM.skip_draw(decode)
    for d in digests[1:]:
        apart.append(SIM.sample([d], [p], [decode], [_history((), apart)])[0])
    assert apart == together and len(set(together)) > 1


def test_torch_seeded_sampling_continues_across_workers():
    p = SamplingParams(temperature=1.0, presence_penalty=1.0, min_p=0.02, seed=4)
    rows = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(2))
    together, g = [], make_generator(4)
    for r in rows:
        together.append(sample(r[None], [p], [g], [_history((), together)])[0])
    apart, decode = [sample(rows[0][None], [p], [make_generator(4)], [_history((), [])])[0]], make_generator(4)
    skip_draw(decode)
    for r in rows[1:]:
        apart.append(sample(r[None], [p], [decode], [_history((), apart)])[0])
    assert apart == together
