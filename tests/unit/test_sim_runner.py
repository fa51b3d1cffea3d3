"""The simulated runner: tokens a deterministic function of the sequence (P/D = colocated, cached = cold, seeded
sampling across workers), KV corruption caught and named, the bad batches ModelRunner refuses, EOS never
sampled, simulated time, and no torch."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from xpyd.model.block_tables import BlockTables
from xpyd.model.fingerprint import weights_fingerprint
from xpyd.model.sampling_params import SamplingParams
from xpyd.model.sim import SimProfile, SimRunner
from xpyd.model.sim.records import RECORD_BYTES

VOCAB = 40
EOS = (2, 7, 39)
BS = 4
GREEDY = SamplingParams(temperature=0)
PROMPT = [5, 9, 1, 30, 12, 12, 3, 0, 8, 22, 17]  # 11 tokens: three blocks, the last partly filled


def _model(tmp_path: Path, vocab: int = VOCAB, eos=EOS, generation: bool = True) -> Path:
    """A model folder as the simulated engine reads it: config.json (+ generation_config.json) and a
    safetensors file for the weights' fingerprint (header only)."""
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    config = {"model_type": "llama", "vocab_size": vocab, "max_position_embeddings": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64, "eos_token_id": eos[0]}
    (folder / "config.json").write_text(json.dumps(config))
    if generation:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": list(eos[1:])}))
    header = b'{"__metadata__":{"format":"pt"}}'
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    return folder


def _profile(prefill: float = 0.0, decode: float = 0.0) -> SimProfile:
    return SimProfile.from_dict({
        "format": "xpyd-sim-profile/1", "model": "test", "machine": "test", "dtype": "float32", "threads": 1,
        "created": "2026-01-01T00:00:00Z",
        "prefill": {"new_tokens": [1], "cached_tokens": [0], "seconds": [[prefill]]},
        "decode": {"batch": [1], "context_tokens": [1], "seconds": [[decode]]}})


def _runner(folder: Path, num_blocks: int = 16, speedup: float = float("inf"), **kw) -> SimRunner:
    return SimRunner(folder, num_blocks=num_blocks, max_seq_len=48, block_size=BS,
                     profile=kw.pop("profile", _profile()), speedup=speedup, **kw)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return _model(tmp_path)


def _generate(runner: SimRunner, blocks: list[int], prompt: list[int], steps: int, params=GREEDY,
              generator=None, first: int | None = None) -> list[int]:
    """Prefill ``prompt`` into ``blocks`` (unless ``first`` is given: the prompt's KV is there already and
    ``first`` its first token), then decode ``steps`` tokens; every token."""
    if first is None:
        row = runner.prefill(blocks, prompt)
        first = runner.sampler.sample([row], [params], [generator])[0]
    tokens = [first]
    for _ in range(steps):
        rows = runner.decode([blocks], [tokens[-1]], [len(prompt) + len(tokens) - 1])
        tokens += runner.sampler.sample(rows, [params], [generator])
    return tokens


def _copy_blocks(src: SimRunner, src_blocks: list[int], dst: SimRunner, dst_blocks: list[int]) -> None:
    """What a KV transfer does: every byte of each block into the other pool's block."""
    size = src.pool.layout.block_bytes
    for a, b in zip(src_blocks, dst_blocks):
        dst.pool.buffer()[b * size : (b + 1) * size] = src.pool.buffer()[a * size : (a + 1) * size]


def test_tokens_are_a_function_of_the_token_sequence(model):
    a, b = _runner(model), _runner(model, num_blocks=32)
    blocks_a = a.pool.blocks.allocate(6)
    b.pool.blocks.allocate(9)  # other block ids
    blocks_b = b.pool.blocks.allocate(6)
    assert blocks_a != blocks_b
    tokens = _generate(a, blocks_a, PROMPT, steps=10)
    assert _generate(b, blocks_b, PROMPT, steps=10) == tokens
    other = _generate(a, a.pool.blocks.allocate(6), PROMPT[:-1] + [PROMPT[-1] + 1], steps=10)
    assert other != tokens  # a different sequence, different tokens (the row is not a constant)
    assert len(set(tokens)) > 3


def test_a_prefill_after_a_cached_prefix_equals_a_cold_one(model):
    cold, warm = _runner(model), _runner(model)
    blocks_cold = cold.pool.blocks.allocate(3)
    row_cold = cold.prefill(blocks_cold, PROMPT)
    for start in (4, 6):  # the prefix in whole blocks, and ending inside one
        blocks = warm.pool.blocks.allocate(3)
        warm.prefill(blocks, PROMPT[:start])
        row = warm.prefill(blocks, PROMPT, start=start)
        assert row == row_cold
        assert [warm._records.read(blocks, i) for i in range(len(PROMPT))] == \
               [cold._records.read(blocks_cold, i) for i in range(len(PROMPT))]
    chunked = warm.pool.blocks.allocate(3)  # prefill_many, chunk by chunk
    rows = [warm.prefill_many([(chunked, PROMPT[:end], start)])[0] for start, end in ((0, 3), (3, 8), (8, 11))]
    assert rows[-1] == row_cold


def test_prefill_on_one_runner_and_decode_on_another_equals_colocated(model):
    colocated = _generate(a := _runner(model), a.pool.blocks.allocate(6), PROMPT, steps=12)
    prefill, decode = _runner(model), _runner(model, num_blocks=24)
    p_blocks = prefill.pool.blocks.allocate(3)
    first = prefill.sampler.sample([prefill.prefill(p_blocks, PROMPT)], [GREEDY], [None])[0]
    decode.pool.blocks.allocate(5)
    d_blocks = decode.pool.blocks.allocate(6)
    _copy_blocks(prefill, p_blocks, decode, d_blocks)
    assert _generate(decode, d_blocks, PROMPT, steps=12, first=first) == colocated


def test_seeded_sampling_across_runners_equals_one_runner(model):
    params = SamplingParams(temperature=0.8, seed=1234)
    a = _runner(model, num_blocks=32)
    blocks = a.pool.blocks.allocate(6)
    whole = _generate(a, blocks, PROMPT, steps=12, params=params, generator=a.sampler.new_generator(params.seed))
    assert whole != _generate(a, a.pool.blocks.allocate(6), PROMPT, steps=12)  # not the greedy tokens
    assert whole != _generate(a, a.pool.blocks.allocate(6), PROMPT, steps=12, params=params,
                              generator=a.sampler.new_generator(99))  # the seed matters
    p_gen = a.sampler.new_generator(params.seed)
    p_blocks = a.pool.blocks.allocate(3)
    first = a.sampler.sample([a.prefill(p_blocks, PROMPT)], [params], [p_gen])[0]
    b = _runner(model, num_blocks=20)
    d_blocks = b.pool.blocks.allocate(6)[::-1]
    _copy_blocks(a, p_blocks, b, d_blocks)
    d_gen = b.sampler.new_generator(params.seed)
    b.sampler.skip_draw(d_gen)
    assert _generate(b, d_blocks, PROMPT, steps=12, params=params, generator=d_gen, first=first) == whole


def _transferred(model: Path) -> tuple[SimRunner, list[int], int]:
    """PROMPT's KV prefilled on one runner and copied into another's blocks; that runner, its blocks, the first
    token."""
    a, b = _runner(model), _runner(model)
    p_blocks = a.pool.blocks.allocate(3)
    first = a.sampler.sample([a.prefill(p_blocks, PROMPT)], [GREEDY], [None])[0]
    d_blocks = b.pool.blocks.allocate(4)
    _copy_blocks(a, p_blocks, b, d_blocks)
    return b, d_blocks, first


@pytest.mark.parametrize("position", [0, 5, len(PROMPT) - 1])
@pytest.mark.parametrize("byte", [0, 7, 8, 11, 12, 15, None])  # None: the whole row zeroed
def test_a_corrupted_record_fails_decode_naming_its_position(model, position, byte):
    runner, blocks, first = _transferred(model)
    at = runner._records.offset(blocks, position)
    memory = runner.pool.buffer()
    if byte is None:
        memory[at : at + RECORD_BYTES] = bytes(RECORD_BYTES)
    else:
        memory[at + byte] ^= 0x10
    healthy = runner.pool.blocks.allocate(2)  # a request before it in the batch, its KV intact
    runner.prefill(healthy, PROMPT[:5])
    before = bytes(memory)
    with pytest.raises(ValueError, match=f"KV at position {position} does not hold what its tokens make"):
        runner.decode([healthy, blocks], [1, first], [5, len(PROMPT)])
    assert bytes(memory) == before  # nothing written, not even the healthy request's record


def test_a_record_changed_after_this_runner_wrote_it_is_caught(model):
    runner = _runner(model)
    blocks = runner.pool.blocks.allocate(4)
    tokens = _generate(runner, blocks, PROMPT, steps=2)  # decode wrote positions 11 and 12
    at = runner._records.offset(blocks, 12)
    runner.pool.buffer()[at + 3] ^= 1
    with pytest.raises(ValueError, match="KV at position 12 "):
        runner.decode([blocks], [tokens[-1]], [13])


def test_a_cached_prefix_that_holds_other_tokens_or_nothing_is_refused(model):
    runner = _runner(model)
    blocks = runner.pool.blocks.allocate(3)
    runner.prefill(blocks, PROMPT[:8])
    other = PROMPT[:6] + [PROMPT[6] + 1] + PROMPT[7:]
    before = bytes(runner.pool.buffer())
    with pytest.raises(ValueError, match="KV at position 6 does not hold .*holds token 3, the request has 4"):
        runner.prefill(blocks, other, start=8)
    with pytest.raises(ValueError, match="KV at position 8 does not hold .*all zeros"):
        runner.prefill(blocks, PROMPT, start=10)
    assert bytes(runner.pool.buffer()) == before
    runner.pool.buffer()[runner._records.offset(blocks, 7) + 9] ^= 4  # the last record of the chunk before
    with pytest.raises(ValueError, match="KV at position 7 does not hold .*torn or altered"):
        runner.prefill(blocks, PROMPT, start=8)


def test_bad_batches_are_refused_and_nothing_is_written(model):
    runner = _runner(model, num_blocks=8)
    blocks = runner.pool.blocks.allocate(3)
    runner.prefill(blocks, PROMPT)
    free = runner.pool.blocks.allocate(1)
    before = bytes(runner.pool.buffer())
    bad_prefills = [
        ([blocks[0], 99, blocks[2]], PROMPT, 0, "KV block 99 does not exist"),
        ([blocks[0], blocks[0], blocks[2]], PROMPT, 0, "a block appears twice"),
        (blocks, PROMPT, len(PROMPT), "start is an int in"),
        (blocks, PROMPT, -1, "start is an int in"),
        (blocks, PROMPT[:-1] + [VOCAB], 0, "outside the vocabulary"),
        (blocks, PROMPT[:-1] + [-1], 0, "outside the vocabulary"),
        (blocks[:2], PROMPT, 0, "cannot hold 11 tokens"),
        (blocks, [], 0, "prompt of 0 tokens"),
    ]
    for table, ids, start, message in bad_prefills:
        with pytest.raises(ValueError, match=message):
            runner.prefill(table, ids, start)
    with pytest.raises(ValueError, match="at least one part"):
        runner.prefill_many([])
    with pytest.raises(ValueError, match="write the same KV block"):
        runner.prefill_many([(blocks, PROMPT, 0), (blocks, PROMPT, 0)])
    bad_decodes = [
        ([[blocks[0], blocks[1], 99]], [1], [11], "KV block 99 does not exist"),
        ([[blocks[0], blocks[1], blocks[1]]], [1], [11], "a block appears twice"),
        ([blocks], [VOCAB], [11], "outside the vocabulary"),
        ([blocks], [1], [48], "outside \\[0, 48\\)"),
        ([blocks, blocks], [1, 2], [11, 11], "same KV row"),
        ([blocks], [1, 2], [11], "equally long"),
        ([blocks], [1], [True], "outside \\[0, 48\\)"),
    ]
    for tables, ids, positions, message in bad_decodes:
        with pytest.raises(ValueError, match=message):
            runner.decode(tables, ids, positions)
    runner.pool.blocks.release(free)
    with pytest.raises(ValueError, match="not held by any request"):
        runner.decode([free], [1], [0])
    runner.pool.blocks.acquire(blocks[2:])  # another request holds the block of position 11 too
    with pytest.raises(ValueError, match=f"KV block {blocks[2]} is shared by 2 requests"):
        runner.decode([blocks], [1], [11])
    with pytest.raises(ValueError, match=f"KV block {blocks[2]} is shared by 2 requests"):
        runner.prefill(blocks, PROMPT, start=8)
    assert bytes(runner.pool.buffer()) == before


def test_eos_is_never_sampled_and_every_other_token_is(model):
    runner = _runner(model)
    sampler = runner.sampler
    assert runner.eos_token_ids == frozenset(EOS)  # config.json's and generation_config.json's
    digests = [i.to_bytes(8, "little") for i in range(400)] + [(2**64 - 1 - i).to_bytes(8, "little")
                                                               for i in range(400)]
    greedy = sampler.sample(digests, [GREEDY] * len(digests), [None] * len(digests))
    gen = sampler.new_generator(5)
    sampled = sampler.sample(digests, [SamplingParams(temperature=1.0)] * len(digests), [gen] * len(digests))
    for tokens in (greedy, sampled):
        assert set(tokens) == set(range(VOCAB)) - set(EOS)


def test_identity_names_the_weights_and_the_kv_size(model):
    runner = _runner(model)
    assert runner.kv_token_bytes == 2 * 2 * 2 * 16 * 2  # layers x K/V x kv heads x head_dim x 2 bytes
    assert runner.pool.layout.token_bytes == runner.kv_token_bytes
    assert runner.identity == f"sim:{weights_fingerprint(model)}:256"
    assert _runner(model, kv_token_bytes=64).identity == f"sim:{weights_fingerprint(model)}:64"
    assert runner.max_model_len == 48 and runner.vocab_size == VOCAB and runner.config is None
    for bad in (30, 66, 0, True):
        with pytest.raises(ValueError, match="kv_token_bytes"):
            _runner(model, kv_token_bytes=bad)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="speedup"):
            _runner(model, speedup=bad)
    runner.warmup()
    assert runner.pool.num_used == 0


def test_a_pass_takes_its_profile_time_over_the_speedup(model):
    runner = _runner(model, profile=_profile(prefill=0.2), speedup=4)
    started = time.monotonic()
    runner.prefill_many([(runner.pool.blocks.allocate(3), PROMPT, 0)])
    assert time.monotonic() - started >= 0.05


def test_speedup_inf_never_sleeps(model, monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    runner = _runner(model, profile=_profile(prefill=5.0, decode=5.0), speedup=float("inf"))
    _generate(runner, runner.pool.blocks.allocate(4), PROMPT, steps=3)
    assert slept == []
    runner = _runner(model, profile=_profile(prefill=5.0, decode=2.0), speedup=2)
    _generate(runner, runner.pool.blocks.allocate(4), PROMPT, steps=1)
    assert len(slept) == 2 and 2.0 < slept[0] <= 2.5 and 0.5 < slept[1] <= 1.0  # (less the passes' own time)


def test_a_simulated_runner_imports_no_torch(tiny_model_dir):
    code = ("import sys; from pathlib import Path; from xpyd.model.sim import SimRunner; "
            f"r = SimRunner(Path({str(tiny_model_dir)!r}), num_blocks=4, max_seq_len=32); "  # the built-in profile
            "r.warmup(); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules), r.vocab_size)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "[]"


def test_a_pass_is_timed_at_its_whole_size(model, monkeypatch):
    """Prefill: the new and the cached tokens summed over the parts; decode: the batch and its context tokens."""
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    profile = SimProfile.from_dict({**_profile().to_dict(),
                                    "prefill": {"new_tokens": [0, 100], "cached_tokens": [0, 100],
                                                "seconds": [[0, 10], [100, 110]]},  # 1 s per new, 0.1 s per cached
                                    "decode": {"batch": [0, 10], "context_tokens": [0, 100],
                                               "seconds": [[0, 1000], [1000, 2000]]}})  # 100 s a request, 10 a token
    runner = _runner(model, num_blocks=24, profile=profile, speedup=10)
    first, second = runner.pool.blocks.allocate(3), runner.pool.blocks.allocate(3)
    runner.prefill(first, PROMPT[:8])
    slept.clear()
    runner.prefill_many([(second, PROMPT[:5], 0), (first, PROMPT, 8)])  # 5 + 3 new, 8 cached: 8.8 s / 10
    runner.decode([first, second], [1, 2], [11, 5])  # 2 requests, 12 + 6 tokens: 380 s / 10
    assert len(slept) == 2
    assert 0.83 < slept[0] <= 0.88 and 35 < slept[1] <= 38  # (less the passes' own time)


def test_a_runner_over_given_memory_keeps_its_kv_there(model):
    size = 8 * BS * 256  # blocks x tokens x the model's KV bytes per token
    memory = memoryview(bytearray(b"\x01" * size))
    runner = _runner(model, num_blocks=8, buffer=memory)
    blocks = runner.pool.blocks.allocate(3)
    row = runner.prefill(blocks, PROMPT)
    at = runner._records.offset(blocks, len(PROMPT) - 1)
    assert bytes(memory[at : at + 8]) == row  # the last token's digest, in that memory
    with pytest.raises(ValueError, match="the layout needs"):
        _runner(model, num_blocks=8, buffer=memoryview(bytearray(size - 1)))


def test_decode_over_kept_block_tables_equals_decode_over_lists(model):
    """Rows of `BlockTables` grown step by step (as `KVCache.grow` does) give the tokens and records of
    `decode` over lists; a bad step over rows is refused with nothing written."""
    lists, kept = _runner(model), _runner(model)
    prompts = [PROMPT, PROMPT[:6] + [4, 4]]
    tables = BlockTables(kept.pool.layout.num_blocks, rows=1, width=1)
    seqs = []
    for prompt in prompts:
        a, b = lists.pool.blocks.allocate(3), kept.pool.blocks.allocate(3)
        first = lists.sampler.sample([lists.prefill(a, prompt)], [GREEDY], [None])[0]
        assert kept.sampler.sample([kept.prefill(b, prompt)], [GREEDY], [None])[0] == first
        seqs.append((prompt, a, b, tables.open(b), [first]))
    for _ in range(9):  # across block boundaries: 11 -> 20 and 8 -> 17 tokens
        for prompt, a, b, row, out in seqs:
            if (len(prompt) + len(out) - 1) // BS == len(a):
                a += lists.pool.blocks.allocate(1)
                grown = kept.pool.blocks.allocate(1)
                b += grown
                tables.extend(row, grown)
        positions = [len(p) + len(o) - 1 for p, _, _, _, o in seqs]
        ids = [o[-1] for *_, o in seqs]
        want = lists.decode([a for _, a, *_ in seqs], ids, positions)
        got = kept.decode_rows(tables, [s[3] for s in seqs], ids, positions)
        assert got == want
        for (*_, out), token in zip(seqs, lists.sampler.sample(want, [GREEDY] * 2, [None] * 2)):
            out.append(token)
    assert tables.capacity == 2 and tables.width == 8 and [tables.blocks(s[3]) for s in seqs] == [s[2] for s in seqs]
    before = bytes(kept.pool.buffer())
    rows = [s[3] for s in seqs]
    for bad_rows, ids, positions, message in [([rows[0], rows[0]], [1, 1], [19, 19], "row appears twice"),
                                              ([rows[0]], [1], [20], "5 KV blocks cannot hold position 20"),
                                              ([rows[0]], [VOCAB], [19], "outside the vocabulary"),
                                              ([7], [1], [19], "row 7 is not an open row")]:
        with pytest.raises(ValueError, match=message):
            kept.decode_rows(tables, bad_rows, ids, positions)
    assert bytes(kept.pool.buffer()) == before


def test_a_simulated_decode_step_through_the_kv_cache_imports_no_torch_and_no_numpy(tiny_model_dir):
    code = ("import sys; from pathlib import Path; from xpyd.model.sim import SimRunner; "
            "from xpyd.worker.kv_cache import KVCache; "
            f"r = SimRunner(Path({str(tiny_model_dir)!r}), num_blocks=4, max_seq_len=32); "
            "c = KVCache(r.pool.blocks, r.block_size, seed=0); kv = c.admit([], 5, 0); "
            "r.prefill(kv.blocks, [1, 2, 3]); c.grow(kv, 4); "
            "print(len(r.decode_rows(c.tables, [c.table_row(kv)], [4], [3])), "
            "sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "[]"]


def test_a_latent_attention_models_kv_size_is_its_latents(tmp_path):
    """DeepSeek-V2 (multi-head latent attention): one latent of kv_lora_rank + qk_rope_head_dim per token and
    layer, not a K and a V per head."""
    from xpyd.model.sim.runner import ModelFacts

    config = {"model_type": "deepseek_v2", "vocab_size": 100, "max_position_embeddings": 64, "hidden_size": 64,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8,
              "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 24}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert ModelFacts.read(tmp_path).kv_token_bytes == 3 * (32 + 8) * 2
