"""Sampling: greedy, seeded determinism, one draw per token (skip_draw), filters, validation."""

import pytest
import torch

from xpyd.model.sampling import SamplingParams, make_generator, sample, skip_draw

torch.set_num_threads(1)

VOCAB = 50


def logits_seq(steps: int, batch: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randn(batch, VOCAB, generator=g) * 3 for _ in range(steps)]


def run(params: SamplingParams, steps: int = 20, generator=None) -> list[int]:
    g = generator if generator is not None else make_generator(params.seed)
    return [sample(x, [params], [g])[0] for x in logits_seq(steps)]


def test_greedy_is_argmax_and_draws_nothing():
    x = torch.tensor([[0.1, 2.0, -1.0, 1.9]])
    g = make_generator(7)
    state = g.get_state()
    assert sample(x, [SamplingParams(temperature=0)], [g]) == [1]
    assert torch.equal(g.get_state(), state)


def test_same_seed_same_tokens_and_different_seed_differs():
    p = SamplingParams(temperature=1.0, seed=42)
    a, b = run(p), run(p)
    assert a == b
    assert run(SamplingParams(temperature=1.0, seed=43)) != a
    assert len(set(a)) > 1  # really sampling, not argmax


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, seed=5),
    SamplingParams(temperature=1.2, top_k=10, seed=5),
    SamplingParams(temperature=1.0, top_p=0.7, seed=5),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=5),
])
def test_skip_draw_reproduces_the_stream_from_the_second_token(params):
    full = run(params)
    # the decode worker: same seed, skips the draw the prefill worker made for token 1
    g = make_generator(params.seed)
    skip_draw(g)
    rest = [sample(x, [params], [g])[0] for x in logits_seq(20)[1:]]
    assert rest == full[1:]


def test_exactly_one_draw_per_sampled_token():
    g, ref = make_generator(3), make_generator(3)
    for params in (SamplingParams(temperature=1.0), SamplingParams(top_k=5), SamplingParams(top_p=0.5)):
        sample(logits_seq(1)[0], [params], [g])
        skip_draw(ref)
        assert torch.equal(g.get_state(), ref.get_state())


def test_top_k_1_equals_greedy():
    greedy = run(SamplingParams(temperature=0))
    assert run(SamplingParams(temperature=1.5, top_k=1, seed=9)) == greedy


def test_tiny_top_p_equals_greedy():
    assert run(SamplingParams(temperature=1.0, top_p=1e-6, seed=9)) == run(SamplingParams(temperature=0))


def test_top_k_only_picks_from_the_k_best():
    x = logits_seq(1)[0]
    best = set(torch.topk(x[0], 3).indices.tolist())
    g = make_generator(0)
    picks = {sample(x, [SamplingParams(temperature=5.0, top_k=3)], [g])[0] for _ in range(200)}
    assert picks <= best and len(picks) > 1


def test_top_p_keeps_the_smallest_head_reaching_p():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = make_generator(0)
    picks = {sample(x, [SamplingParams(top_p=0.8)], [g])[0] for _ in range(300)}
    assert picks == {0, 1}  # 0.5 + 0.3 reaches 0.8; tokens 2 and 3 are cut


def test_batch_rows_are_independent():
    x = logits_seq(1, batch=3)[0]
    params = [SamplingParams(temperature=0), SamplingParams(seed=1), SamplingParams(top_k=1, seed=2)]
    gens = [make_generator(p.seed) for p in params]
    out = sample(x, params, gens)
    assert out[0] == int(x[0].argmax())
    assert out[2] == int(x[2].argmax())
    g1 = make_generator(1)
    assert out[1] == sample(x[1:2], [params[1]], [g1])[0]


def test_unseeded_generators_differ():
    a = [make_generator(None) for _ in range(2)]
    assert not torch.equal(a[0].get_state(), a[1].get_state())


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-0.1), dict(temperature=float("nan")), dict(temperature=float("inf")),
    dict(top_p=0.0), dict(top_p=1.1), dict(top_k=-1), dict(top_k=2.5), dict(top_k=True),
    dict(seed=-1), dict(seed=2**64), dict(seed="1"), dict(temperature="1"),
])
def test_validation(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        sample(torch.zeros(2, VOCAB), [SamplingParams()], [make_generator(0)])


@pytest.mark.parametrize("tiny", [1e-320, 1e-9, 9.9e-6])
def test_tiny_temperatures_are_greedy_not_overflow(tiny):
    """1/T would overflow the scores to inf/NaN; like vLLM, such temperatures mean greedy."""
    x = torch.tensor([[0.1, 2.0, -1.0, 1.9]])
    g = make_generator(7)
    state = g.get_state()
    assert SamplingParams(temperature=tiny, seed=7).greedy
    assert sample(x, [SamplingParams(temperature=tiny, seed=7)], [g]) == [1]
    assert torch.equal(g.get_state(), state)
    assert not SamplingParams(temperature=1e-5).greedy
