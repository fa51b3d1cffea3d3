"""DeviceSampler (xpyd/model/gpu/sampler.py) picks the CPU sampler's tokens with the same random stream.

The batched code runs here on CPU tensors: the very code a CUDA worker runs, on another device.

Exactness and its one exception. Both samplers compute the same float32 scores (logits / T is one
correctly rounded division either way) and float32 probabilities; they differ in how these are summed
(softmax over a masked width; DeviceSampler's prefix sums in float64 on any device, the CPU sampler's
double-accumulated and rounded to float32), so each normalised cdf entry is off the exact (float64) one
by at most

    bound = 2 * sum_i p_i * delta_i + 2 * eps

with delta_i = eps * (|s_i - max s| / 2 + 3) the relative error of one float32 probability (the rounded
difference s_i - max, exp within 2 ulp, the division by the sum within 1 ulp; the sum's own error is a
factor common to every entry and cancels in cdf / cdf[-1]), counted twice for the normalisation, and
2 * eps for rounding the prefix sum to float32 and the product u * cdf[-1]. A draw farther than 2 * bound
from both ends of its exact interval (and a top-p whose exact "mass before" is farther than 2 * bound
from every token's, or whose unsure tokens' mass is added to the distance) picks the same token in both;
the tests assert equality for all such rows, and that they are nearly all rows, so they cannot pass by
excluding them. The logits have no ties (normal quantiles in a random order), so the sorted order is
unique. tests/gpu/test_device_sampler_cuda.py runs the same comparison with the logits on CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch

from xpyd.model.gpu.sampler import DeviceSampler
from xpyd.model.sampling import SamplingParams, TorchSampler, make_generator, skip_draw

EPS = torch.finfo(torch.float32).eps


def logits_without_ties(batch: int, vocab: int, seed: int) -> torch.Tensor:
    """float32 [batch, vocab], each row normal quantiles times a scale in [1, 5], in a random order:
    no two entries of a row are equal."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.arange(vocab, dtype=torch.float64) + 0.5) / vocab
    z = math.sqrt(2) * torch.erfinv(2 * q - 1)
    rows = []
    for _ in range(batch):
        scale = 1 + 4 * torch.rand((), generator=g, dtype=torch.float64)
        rows.append((z * scale)[torch.randperm(vocab, generator=g)])
    return torch.stack(rows).float()


def random_params(vocab: int, g: torch.Generator) -> SamplingParams:
    def pick(options):
        return options[int(torch.randint(len(options), (), generator=g))]

    kind = pick(["greedy", "temperature", "top_k", "top_p", "top_k_top_p"])
    if kind == "greedy":
        return SamplingParams(temperature=pick([0.0, 1e-6]))
    temperature = pick([0.5, 0.8, 1.0, 1.3])
    top_k = pick([1, 2, 10, 50, 1000, vocab, vocab + 5]) if "top_k" in kind else 0
    top_p = pick([0.3, 0.8, 0.95, 0.999]) if "top_p" in kind else 1.0
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)


def near_boundary(row: torch.Tensor, params: SamplingParams, u: float) -> bool:
    """Whether the draw, or the top-p cut, lies within 2 * bound (module docstring) of a boundary of the
    exact float64 distribution of ``row``'s float32 scores."""
    scores = (row.float() / params.temperature).double()
    vocab = scores.numel()
    if 0 < params.top_k < vocab:
        scores = torch.sort(scores, descending=True).values[: params.top_k]
    elif params.top_p < 1:
        scores = torch.sort(scores, descending=True).values
    p = torch.softmax(scores, dim=-1)
    gap = (scores.max() - scores).abs()
    bound = 2 * float((p * EPS * (gap / 2 + 3)).sum()) + 2 * EPS
    tol = 2 * bound
    unsure = torch.zeros_like(p, dtype=torch.bool)
    if params.top_p < 1:
        before = torch.cumsum(p, dim=-1) - p
        # tokens either sampler may cut or keep; they are a run at the end of the kept head
        unsure = (before - params.top_p).abs() < tol
        p = p.masked_fill(before >= params.top_p, 0.0)
    kept = float(p.sum())
    unsure_mass = float(p[unsure].sum())
    # keeping or cutting the unsure tokens rescales the normalised cdf by at most this much
    tol += unsure_mass / (kept - unsure_mass)
    cdf = torch.cumsum(p, dim=-1) / kept
    j = min(int(torch.searchsorted(cdf, torch.tensor(u, dtype=torch.float64), right=True)), cdf.numel() - 1)
    lower = float(cdf[j - 1]) if j > 0 else 0.0
    upper = float(cdf[j])
    return bool(unsure[j]) or u - lower < tol or upper - u < tol


def compare_with_cpu(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int]) -> tuple[int, int]:
    """Sample ``logits`` (on any device) with DeviceSampler and their CPU copy with TorchSampler, from
    generators of the same seeds; assert the same token for every row away from a boundary and the same
    next draw from every generator after. Returns (sampled rows compared, rows near a boundary)."""
    ref_gens, dev_gens = [make_generator(s) for s in seeds], [make_generator(s) for s in seeds]
    expected = TorchSampler.sample(logits.cpu(), params, ref_gens)
    got = DeviceSampler.sample(logits, params, dev_gens)
    assert len(got) == len(params) and all(isinstance(t, int) for t in got)
    compared = skipped = 0
    for i, p in enumerate(params):
        u = float(torch.rand((), generator=make_generator(seeds[i])))  # the row's one draw
        if not p.greedy and near_boundary(logits[i].cpu(), p, u):
            skipped += 1
            continue
        compared += not p.greedy
        assert got[i] == expected[i], (i, p, u)
    # the streams moved alike: one draw per sampled row, none per greedy row
    assert [float(torch.rand((), generator=r)) for r in ref_gens] == [
        float(torch.rand((), generator=d)) for d in dev_gens
    ]
    return compared, skipped


@pytest.mark.parametrize("vocab, batches", [(1000, (1, 5, 32)), (49152, (1, 8, 32)), (128256, (1, 3, 16, 32))])
def test_same_tokens_and_streams_as_the_cpu_sampler(vocab, batches):
    compared = skipped = 0
    for trial, batch in enumerate(batches):
        g = torch.Generator().manual_seed(1000 * vocab + trial)
        logits = logits_without_ties(batch, vocab, seed=trial + vocab)
        params = [random_params(vocab, g) for _ in range(batch)]
        seeds = [int(torch.randint(2**62, (), generator=g)) for _ in range(batch)]
        c, s = compare_with_cpu(logits, params, seeds)
        compared, skipped = compared + c, skipped + s
    assert compared >= 20 and skipped <= compared // 5, (compared, skipped)  # sampled rows compared


def test_many_small_batches_exact():
    """Many rows over a small vocabulary, where boundaries are far apart: every mix of kinds per batch."""
    vocab, compared, skipped = 64, 0, 0
    for trial in range(200):
        g = torch.Generator().manual_seed(trial)
        batch = 1 + trial % 32
        logits = logits_without_ties(batch, vocab, seed=trial)
        params = [random_params(vocab, g) for _ in range(batch)]
        c, s = compare_with_cpu(logits, params, list(range(trial * 100, trial * 100 + batch)))
        compared, skipped = compared + c, skipped + s
    assert compared > 2000 and skipped <= compared // 100, (compared, skipped)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_the_argmax_and_never_draws(dtype):
    logits = logits_without_ties(6, 500, seed=3).to(dtype)
    params = [SamplingParams(temperature=t) for t in (0.0, 1e-6, 9.99e-6, 0.0, 0.0, 1e-7)]
    gens = [make_generator(7 + i) for i in range(6)]
    states = [g.get_state().clone() for g in gens]
    assert DeviceSampler.sample(logits, params, gens) == torch.argmax(logits, dim=-1).tolist()
    assert all(torch.equal(g.get_state(), s) for g, s in zip(gens, states))
    # mixed with sampled rows, the greedy rows still take no draw
    params[2] = SamplingParams(temperature=1.0, top_k=5)
    got = DeviceSampler.sample(logits, params, gens)
    assert [got[i] for i in (0, 1, 3, 4, 5)] == [int(torch.argmax(logits[i])) for i in (0, 1, 3, 4, 5)]
    assert all(torch.equal(g.get_state(), s) for i, (g, s) in enumerate(zip(gens, states)) if i != 2)
    assert not torch.equal(gens[2].get_state(), states[2])


def test_rows_list_and_tensor_agree():
    logits = logits_without_ties(5, 300, seed=11)
    params = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(top_k=7, temperature=0.7),
              SamplingParams(top_p=0.6), SamplingParams(top_k=40, top_p=0.9)]
    as_tensor = DeviceSampler.sample(logits, params, [make_generator(s) for s in range(5)])
    as_rows = DeviceSampler.sample(list(logits.unbind(0)), params, [make_generator(s) for s in range(5)])
    assert as_rows == as_tensor
    ids = DeviceSampler.sample_device(logits, params, [make_generator(s) for s in range(5)])
    assert ids.dtype == torch.int64 and ids.shape == (5,) and ids.device == logits.device
    assert ids.tolist() == as_tensor


def test_a_seeded_request_continues_its_stream_across_workers():
    """Prefill samples the first token (one draw); decode makes the generator from the seed, skips that
    draw, and samples the rest: the tokens of one generator sampling every step."""
    logits = logits_without_ties(6, 200, seed=5)
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    one = make_generator(p.seed)
    straight = [DeviceSampler.sample(logits[i : i + 1], [p], [one])[0] for i in range(6)]
    prefill = DeviceSampler.sample(logits[:1], [p], [make_generator(p.seed)])
    decode_gen = DeviceSampler.new_generator(p.seed)
    DeviceSampler.skip_draw(decode_gen)
    decode = [DeviceSampler.sample(logits[i : i + 1], [p], [decode_gen])[0] for i in range(1, 6)]
    assert prefill + decode == straight
    # and the CPU sampler's stream is the same one
    cpu_gen = make_generator(p.seed)
    skip_draw(cpu_gen)
    assert [TorchSampler.sample(logits[i : i + 1], [p], [cpu_gen])[0] for i in range(1, 6)] == decode


def test_top_k_keeps_exactly_k_tokens_per_row_and_draws_once():
    """Three near-equal leaders, rows of k 1, 2 and 3 in one batch (one top-k at width 3, masked per
    row): k 1 always takes the first, k 2 both leaders and never the third, k 3 all three."""
    batch = 96
    logits = torch.full((batch, 1000), -20.0)
    logits[:, 10], logits[:, 20], logits[:, 30] = 5.0, 4.99, 4.98
    ks = [1 + i % 3 for i in range(batch)]
    gens = [make_generator(s) for s in range(batch)]
    got = DeviceSampler.sample(logits, [SamplingParams(top_k=k, temperature=0.6) for k in ks], gens)
    assert {t for t, k in zip(got, ks) if k == 1} == {10}
    assert {t for t, k in zip(got, ks) if k == 2} == {10, 20}
    assert {t for t, k in zip(got, ks) if k == 3} == {10, 20, 30}
    fresh = [make_generator(s) for s in range(batch)]
    for f in fresh:
        skip_draw(f)
    assert [float(torch.rand((), generator=g)) for g in gens] == [float(torch.rand((), generator=f)) for f in fresh]


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="logits \\[B, vocab\\]"):
        DeviceSampler.sample(torch.zeros(2, 10), [SamplingParams()], [make_generator(0)])
    with pytest.raises(ValueError, match="logits \\[B, vocab\\]"):
        DeviceSampler.sample(torch.zeros(10), [SamplingParams()], [make_generator(0)])
