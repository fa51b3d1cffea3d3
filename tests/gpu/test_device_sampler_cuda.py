"""DeviceSampler on CUDA: the CPU sampler's tokens, one upload and one copy of the ids back per step, no
other synchronisation, and a device part that a CUDA graph can capture.

The exactness bound is tests/unit/test_device_sampler.py's (it assumes CUDA's float32 exp within 2 ulp and
a correctly rounded division, as torch builds without fast math).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.unit.test_device_sampler import compare_with_cpu, logits_without_ties, random_params
from xpyd.model.gpu.sampler import DeviceSampler, draw_rows, sample_from_draws
from xpyd.model.sampling import SamplingParams, make_generator

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MIXED = [
    SamplingParams(),
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.7, top_k=50),
    SamplingParams(top_p=0.9),
    SamplingParams(temperature=1.2, top_k=200, top_p=0.8),
    SamplingParams(temperature=1e-6),
]


@pytest.mark.parametrize("vocab, batches", [(49152, (1, 8, 32, 64)), (128256, (1, 8, 32, 64))])
def test_same_tokens_and_streams_as_the_cpu_sampler(vocab, batches):
    compared = skipped = 0
    for trial, batch in enumerate(batches):
        g = torch.Generator().manual_seed(7 * vocab + trial)
        logits = logits_without_ties(batch, vocab, seed=trial + 3 * vocab).cuda()
        params = [random_params(vocab, g) for _ in range(batch)]
        seeds = [int(torch.randint(2**62, (), generator=g)) for _ in range(batch)]
        c, s = compare_with_cpu(logits, params, seeds)
        compared, skipped = compared + c, skipped + s
    assert compared >= 40 and skipped <= compared // 5, (compared, skipped)


def _memcpys(fn) -> dict[str, list[str]]:
    """The CUDA memcpy events ``fn`` causes, by direction."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    if not any(e.device_type == torch.autograd.DeviceType.CUDA for e in events):
        pytest.skip("the profiler recorded no CUDA activity (CUPTI unavailable?): cannot count copies")
    names = [e.name for e in events if e.name.startswith("Memcpy")]
    return {d: [n for n in names if n.startswith(f"Memcpy {d}")] for d in ("HtoD", "DtoH")}


def _syncs(fn) -> int:
    """How many synchronising CUDA operations ``fn`` makes (torch's sync debug mode warns once each)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught)


def _mixed_step(batch: int = 64, vocab: int = 128256):
    logits = logits_without_ties(batch, vocab, seed=1).cuda().to(torch.bfloat16)
    params = [MIXED[i % len(MIXED)] for i in range(batch)]
    DeviceSampler.sample(logits, params, [make_generator(i) for i in range(batch)])  # warm: allocations
    return logits, params, [make_generator(i) for i in range(batch)]


def test_one_pinned_upload_and_one_copy_back():
    logits, params, gens = _mixed_step()
    out: list[list[int]] = []
    copies = _memcpys(lambda: out.append(DeviceSampler.sample(logits, params, gens)))
    assert len(copies["HtoD"]) == 1 and "Pinned" in copies["HtoD"][0], copies
    assert len(copies["DtoH"]) == 1, copies
    assert len(out[0]) == 64


def test_only_the_ids_synchronise():
    logits, params, gens = _mixed_step()
    assert _syncs(lambda: DeviceSampler.sample_device(logits, params, gens)) == 0
    assert _syncs(lambda: DeviceSampler.sample(logits, params, gens)) == 1


def test_all_greedy_uploads_nothing():
    logits = logits_without_ties(16, 49152, seed=2).cuda()
    params = [SamplingParams(temperature=0)] * 16
    gens = [make_generator(i) for i in range(16)]
    states = [g.get_state().clone() for g in gens]
    DeviceSampler.sample(logits, params, gens)
    out: list[list[int]] = []
    copies = _memcpys(lambda: out.append(DeviceSampler.sample(logits, params, gens)))
    assert copies["HtoD"] == [] and len(copies["DtoH"]) == 1, copies
    assert out[0] == torch.argmax(logits, dim=-1).tolist()
    assert all(torch.equal(g.get_state(), s) for g, s in zip(gens, states))


def test_the_device_part_replays_in_a_cuda_graph():
    """Captured once for a parameter mix, replayed with new draws: the eager tokens."""
    batch, vocab = 32, 49152
    params = [MIXED[i % len(MIXED)] for i in range(batch)]
    logits = logits_without_ties(batch, vocab, seed=4).cuda()
    static_rows = draw_rows(params, [make_generator(i) for i in range(batch)], vocab, pin=True).cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            sample_from_draws(logits, params, static_rows)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_ids = sample_from_draws(logits, params, static_rows)
    for step in range(3):
        seeds = [1000 * step + i for i in range(batch)]
        rows = draw_rows(params, [make_generator(s) for s in seeds], vocab, pin=True)
        static_rows.copy_(rows, non_blocking=True)
        graph.replay()
        eager = DeviceSampler.sample(logits, params, [make_generator(s) for s in seeds])
        assert static_ids.tolist() == eager
