"""Logprobs of chosen tokens (xpyd.model.logprobs): the torch samplers' from hand-made float32 rows against a
float64 log_softmax, and the simulated engine's (SimSampler, SimRunner.prefill_scored) as a distribution over
the whole vocabulary whose prompt scores follow the records a prefill writes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.numerics import Reference
from xpyd.model.gpu.sampler import DeviceSampler
from xpyd.model.logprobs import MAX_LOGPROBS, TokenLogprob
from xpyd.model.sampling import TorchSampler
from xpyd.model.sampling_params import SamplingParams
from xpyd.model.sim import SimProfile, SimRunner, SimSampler
from xpyd.model.sim.sampler import CANDIDATES

INF = float("inf")


# --- the torch samplers -----------------------------------------------------------------------------------

def _exact_rank(exact: torch.Tensor, token: int, bound: float) -> tuple[int, int]:
    """The ranks a float32 path within ``bound`` of ``exact`` (one row, float64) may give ``token``: ids more
    than twice the bound above it are surely counted, ids more than twice below surely not."""
    delta = exact - exact[token]
    return 1 + int((delta > 2 * bound).sum()), int((delta > -2 * bound).sum())


def test_torch_logprobs_are_log_softmax_of_the_raw_row():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(4, 300, generator=g) * 4
    rows[2, ::3] = -INF  # a row with -inf logits (masked ids)
    tokens, ks = [17, 0, 3, 299], [0, 5, MAX_LOGPROBS, 1]  # row 2's token 3 is -inf
    out = TorchSampler.logprobs(rows, tokens, ks)
    exact = torch.log_softmax(rows.double(), dim=-1)
    finite = torch.isfinite(exact)
    ref = Reference.measure(exact[finite], torch.log_softmax(rows, dim=-1)[finite])
    assert [o.token for o in out] == tokens and [len(o.top) for o in out] == ks
    for i, (o, token) in enumerate(zip(out, tokens)):
        assert isinstance(o, TokenLogprob) and type(o.logprob) is float and type(o.rank) is int
        if token == 3 and i == 2:
            assert o.logprob == -INF and o.rank == 1 + int(finite[2].sum())
        else:
            Reference(exact[i, token], ref.bound).check(torch.tensor(o.logprob), f"row {i}")
            low, high = _exact_rank(exact[i], token, ref.bound)
            assert low <= o.rank <= high, (i, o.rank, low, high)
        ids = [t for t, _ in o.top]
        best = exact[i].topk(len(ids) + 1).values
        assert bool(((best[:-1] - best[1:]) > 2 * ref.bound).all())  # so any float32 path orders them alike
        assert ids == exact[i].topk(len(ids)).indices.tolist()
        for t, value in o.top:
            Reference(exact[i, t], ref.bound).check(torch.tensor(value), f"row {i}, top id {t}")
        assert [v for _, v in o.top] == sorted((v for _, v in o.top), reverse=True)
    assert out[3].top[0][0] == int(rows[3].argmax())


def test_ranks_count_only_strictly_greater_logprobs():
    row = torch.tensor([1.0, 3.0, 3.0, -INF, 0.5, 3.0])
    out = TorchSampler.logprobs(row.expand(6, 6), list(range(6)), [0] * 6)
    assert [o.rank for o in out] == [4, 1, 1, 6, 5, 1]
    assert all(o.top == () for o in out)
    assert out[1].logprob == out[2].logprob == out[5].logprob
    assert out[3].logprob == -INF


def test_top_alternatives_are_descending_with_ties_to_the_lower_id():
    vocab = 1000
    row = torch.zeros(vocab)
    row[[700, 900]] = 5.0  # two at the top, then 998 tied ids: topk may keep any of them
    row[[3, 40, 500]] = -INF
    wide = torch.full((vocab,), -INF)
    wide[[9, 4]] = torch.tensor([1.0, 2.0])  # two finite ids: the rest of a top 5 is -inf, lowest ids first
    out = TorchSampler.logprobs(torch.stack([row, row, wide, row]), [0, 700, 4, 3], [4, MAX_LOGPROBS, 5, 0])
    assert [t for t, _ in out[0].top] == [700, 900, 0, 1]
    assert [t for t, _ in out[1].top] == [700, 900, 0, 1, 2] + list(range(4, 19))  # (3 is -inf)
    assert out[0].rank == 3 and out[1].rank == 1 and out[1].top[0][1] == out[1].top[1][1] == out[1].logprob
    assert [t for t, _ in out[2].top] == [4, 9, 0, 1, 2] and out[2].top[2][1] == -INF
    assert out[2].rank == 1 and out[3].top == () and out[3].logprob == -INF and out[3].rank == vocab - 2
    shuffled = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))
    ties = torch.zeros(vocab).index_fill_(0, shuffled[:50], 1.0)  # 50 tied best ids in random places
    top = TorchSampler.logprobs(ties[None], [int(shuffled[0])], [MAX_LOGPROBS])[0].top
    assert [t for t, _ in top] == sorted(shuffled[:50].tolist())[:MAX_LOGPROBS]


def test_rows_as_a_list_and_the_device_sampler_give_the_same():
    rows = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    args = ([7, 8, 9], [2, 0, MAX_LOGPROBS])
    assert TorchSampler.logprobs(list(rows), *args) == TorchSampler.logprobs(rows, *args) \
        == DeviceSampler.logprobs(rows, *args)
    assert TorchSampler.logprobs([], [], []) == []


@pytest.mark.parametrize("tokens, ks", [([0], [MAX_LOGPROBS + 1]), ([0], [-1]), ([50], [1]), ([-1], [1]),
                                        ([0, 1], [1]), ([0], [True])])
def test_bad_tokens_or_ks_are_refused(tokens, ks):
    with pytest.raises(ValueError):
        TorchSampler.logprobs(torch.zeros(len(tokens), 50), tokens, ks)


# --- the simulated engine ---------------------------------------------------------------------------------

VOCAB = 40
EOS = (2, 7, 39)
BS = 4
PROMPT = [5, 9, 1, 30, 12, 12, 3, 0, 8, 22, 17, 4, 4, 31]


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A model folder as the simulated engine reads it (config.json, generation_config.json, a weights header)."""
    folder = tmp_path / "model"
    folder.mkdir()
    config = {"model_type": "llama", "vocab_size": VOCAB, "max_position_embeddings": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64, "eos_token_id": EOS[0]}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": list(EOS[1:])}))
    header = b'{"__metadata__":{"format":"pt"}}'
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    return folder


def _runner(model: Path, prefill_seconds: float = 0.0, speedup: float = INF) -> SimRunner:
    profile = SimProfile.from_dict({
        "format": "xpyd-sim-profile/1", "model": "test", "machine": "test", "dtype": "float32", "threads": 1,
        "created": "2026-01-01T00:00:00Z",
        "prefill": {"new_tokens": [1], "cached_tokens": [0], "seconds": [[prefill_seconds]]},
        "decode": {"batch": [1], "context_tokens": [1], "seconds": [[0.0]]}})
    return SimRunner(model, num_blocks=16, max_seq_len=48, block_size=BS, profile=profile, speedup=speedup)


DIGESTS = [bytes([i] * 8) for i in range(6)] + [(12345 * i).to_bytes(8, "little") for i in range(1, 6)]


@pytest.mark.parametrize("digest", DIGESTS)
def test_sim_logprobs_are_a_distribution_over_the_whole_vocabulary(digest):
    sampler = SimSampler(VOCAB, EOS)
    every = sampler.logprobs([digest] * VOCAB, list(range(VOCAB)), [0] * VOCAB)
    lp = [o.logprob for o in every]
    assert abs(math.fsum(math.exp(v) for v in lp) - 1) < 1e-9
    for o in every:
        assert o.rank == 1 + sum(v > o.logprob for v in lp)
    raw = sampler.logits(digest, SamplingParams(), None)  # the raw logits: candidates, the rest at -CANDIDATES
    for t in range(VOCAB):
        assert lp[t] - lp[0] == pytest.approx(raw.get(t, -CANDIDATES) - raw.get(0, -CANDIDATES), abs=1e-12)
    greedy = sampler.sample([digest], [SamplingParams(temperature=0)], [None])[0]
    assert every[greedy].rank == 1 and lp[greedy] == max(lp)
    top = sampler.logprobs([digest], [greedy], [MAX_LOGPROBS])[0].top
    assert list(top) == sorted(((t, lp[t]) for t in range(VOCAB)), key=lambda p: (-p[1], p[0]))[:MAX_LOGPROBS]
    assert top[0] == (greedy, lp[greedy]) and len({v for _, v in top[len(raw):]}) == 1  # the floor's, by id
    assert SimSampler(VOCAB, EOS).logprobs([digest] * VOCAB, list(range(VOCAB)), [3] * VOCAB) == \
        sampler.logprobs([digest] * VOCAB, list(range(VOCAB)), [3] * VOCAB)  # deterministic


def test_sim_logprobs_refuse_bad_tokens_and_ks():
    sampler = SimSampler(VOCAB, EOS)
    for tokens, ks in (([VOCAB], [0]), ([0], [MAX_LOGPROBS + 1]), ([0, 1], [0])):
        with pytest.raises(ValueError):
            sampler.logprobs([DIGESTS[0]] * len(tokens), tokens, ks)


def test_sim_prompt_logprobs_score_each_position_as_its_own_prefill_row(model):
    runner = _runner(model)
    blocks = runner.pool.blocks.allocate(4)
    targets = PROMPT[1:]
    rows, scored = runner.prefill_scored([(blocks, PROMPT, 0)], [(targets, 4)])
    assert rows == runner.prefill_many([(runner.pool.blocks.allocate(4), PROMPT, 0)])
    assert len(scored[0]) == len(PROMPT) - 1
    other = _runner(model)
    for pos, (target, o) in enumerate(zip(targets, scored[0])):
        held = other.pool.blocks.allocate(4)
        row = other.prefill(held, PROMPT[: pos + 1])  # the row position pos predicts from
        other.pool.blocks.release(held)
        assert o == other.sampler.logprobs([row], [target], [4])[0]
    assert len({o.logprob for o in scored[0]}) > 3  # (the positions' rows differ)


def test_sim_prompt_logprobs_of_a_chunked_prefill_equal_one_shot(model):
    runner = _runner(model)
    one = runner.prefill_scored([(runner.pool.blocks.allocate(4), PROMPT, 0)], [(PROMPT[1:], 2)])
    blocks = runner.pool.blocks.allocate(4)
    chunked = []
    for start, end in ((0, 3), (3, 8), (8, len(PROMPT))):  # each chunk scores its positions, the next chunk's first
        row, scored = runner.prefill_scored([(blocks, PROMPT[:end], start)], [(PROMPT[start + 1 : end + 1], 2)])
        chunked += scored[0]
    assert chunked == one[1][0] and row == one[0]


def test_sim_prefill_scored_scores_only_what_is_asked(model):
    runner = _runner(model)
    a, b = runner.pool.blocks.allocate(4), runner.pool.blocks.allocate(4)
    rows, scored = runner.prefill_scored([(a, PROMPT, 0), (b, PROMPT[:6], 0)], [None, (PROMPT[1:4], 0)])
    assert scored[0] is None and len(scored[1]) == 3 and all(o.top == () for o in scored[1])
    assert rows == [runner.prefill(a, PROMPT), runner.prefill(b, PROMPT[:6])]


@pytest.mark.parametrize("scores", [
    [(PROMPT[1:], MAX_LOGPROBS + 1)],  # k past the most
    [(PROMPT + [1], 1)],  # more targets than new positions
    [(PROMPT[1:], 1), None],  # not one per part
    [([VOCAB], 1)],  # a target outside the vocabulary
    [PROMPT[1:]],  # not (targets, k)
])
def test_sim_prefill_scored_refuses_bad_scores_and_writes_nothing(model, scores):
    runner = _runner(model)
    before = bytes(runner.pool.buffer())
    with pytest.raises(ValueError):
        runner.prefill_scored([(runner.pool.blocks.allocate(4), PROMPT, 0)], scores)
    assert bytes(runner.pool.buffer()) == before


def test_sim_prefill_scored_takes_the_prefill_time(model, monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    runner = _runner(model, prefill_seconds=2.0, speedup=2)
    runner.prefill_scored([(runner.pool.blocks.allocate(4), PROMPT, 0)], [(PROMPT[1:], 5)])
    assert len(slept) == 1 and 0.5 < slept[0] <= 1.0


def test_the_logprobs_interface_imports_no_torch():
    code = "import sys, xpyd.model.logprobs, xpyd.model.sim; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"]
