"""ModelRunner over the paged KV pool vs transformers: same tokens (SmolLM2, fp32) and same logits (tiny
models).

Requests hold block tables as a worker's do: blocks scattered over a pool where other requests came and
went (out of order, holding stale KV), grown a block at a time while decoding, and, for a cached prefix,
the first blocks of another request's table (shared), with prefill computing only the tokens after
them (`start`). Every test ends with no block held.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.numerics import Reference, assert_decided, assert_paths_close
from xpyd.model.kv_blocks import BlockAllocator
from xpyd.model.kv_pool import KVPool
from xpyd.model.llama_fast import FastLlama
from xpyd.prefix_hash import block_hashes, hash_seed
from xpyd.model.runner import ModelRunner, UnsupportedModel
from xpyd.model.tokenizer import encode_chat, encode_prompt, load_tokenizer

torch.set_num_threads(1)

NEW_TOKENS = 32
TINY_BLOCK = 5  # the tiny runner's block size: odd, so blocks end part-way through prompts and steps


# --- requests as a worker holds them ----------------------------------------------------------------------

def scattered(pool: KVPool, n: int, seed: int = 0) -> list[int]:
    """``n`` fresh blocks as a request gets them after others came and went: out of order, not adjacent,
    holding stale KV. (Only the plain free blocks are shuffled: cached ones stay cached.)"""
    alloc = pool.blocks
    others = alloc.allocate(alloc.num_free - alloc.num_evictable)
    random.Random(seed).shuffle(others)
    alloc.release(others)  # the free list hands them out again in this order
    return alloc.allocate(n)


@dataclass(eq=False)
class Seq:
    """One request: its prompt, its blocks in token order, and what it generated."""

    prompt: list[int]
    table: list[int]
    start: int = 0  # leading prompt tokens whose KV is already in the table (a cached prefix)
    out: list[int] = field(default_factory=list)  # greedy tokens
    logits: list[torch.Tensor] = field(default_factory=list)  # the logits each of them was picked from


def new_seq(pool: KVPool, prompt: list[int], seed: int = 0, prefix: list[int] = ()) -> Seq:
    """A request whose first blocks are ``prefix`` (another request's full blocks: shared, acquired here)
    and the rest of its prompt's blocks fresh and scattered."""
    pool.blocks.acquire(prefix)
    fresh = scattered(pool, pool.layout.blocks_for(len(prompt)) - len(prefix), seed)
    return Seq(prompt, list(prefix) + fresh, start=len(prefix) * pool.layout.block_size)


def prefill(runner: ModelRunner, seq: Seq) -> None:
    logits = runner.prefill(seq.table, seq.prompt, start=seq.start)
    assert logits.shape == (runner.vocab_size,) and logits.dtype == torch.float32
    seq.logits.append(logits)
    seq.out.append(int(logits.argmax()))


def decode(runner: ModelRunner, seqs: list[Seq]) -> None:
    """One decode step of ``seqs`` together; a request whose next token starts a block gets one first."""
    positions = [len(s.prompt) + len(s.out) - 1 for s in seqs]
    for s, pos in zip(seqs, positions):
        if len(s.table) < runner.pool.layout.blocks_for(pos + 1):
            s.table += runner.pool.blocks.allocate(1)
    logits = runner.decode([s.table for s in seqs], [s.out[-1] for s in seqs], positions)
    assert logits.shape == (len(seqs), runner.vocab_size) and logits.dtype == torch.float32
    for s, row in zip(seqs, logits):
        s.logits.append(row)
        s.out.append(int(row.argmax()))


def release(pool: KVPool, seqs: list[Seq]) -> None:
    for s in seqs:
        pool.blocks.release(s.table)
        s.table = []


def every_attention_path(runner: ModelRunner, prompts: list[list[int]], steps: int = 6) -> tuple[dict, dict]:
    """The same requests prefilled and decoded ``steps`` steps through each attention path of a bfloat16 runner
    (the native kernels, torch's matmul and SDPA attention, the general path), each over fresh blocks of the same
    pool: (logits [requests, steps + 1, vocab], tokens) by path. The "kernel" and "matmul" paths prefill with
    the native prefill kernel (where it builds), "sdpa" with torch's SDPA. Every block is released again."""
    logits, tokens = {}, {}
    runner.use_fast_path(True)
    default_prefill, default_decode = runner.fast_path.prefill_attention, runner.fast_path.decode_attention
    for path in ("kernel", "matmul", "sdpa", "general"):
        runner.use_fast_path(path != "general")
        if path != "general":
            runner.fast_path.decode_attention = path
            runner.fast_path.prefill_attention = "sdpa" if path == "sdpa" else default_prefill
        seqs = [new_seq(runner.pool, p, seed=i) for i, p in enumerate(prompts)]
        try:
            for s in seqs:
                prefill(runner, s)
            for _ in range(steps):
                decode(runner, seqs)
        finally:
            release(runner.pool, seqs)
        logits[path] = torch.stack([torch.stack(s.logits) for s in seqs])
        tokens[path] = [s.out for s in seqs]
    assert runner.pool.num_used == 0
    runner.use_fast_path(True)  # (as it was)
    runner.fast_path.prefill_attention, runner.fast_path.decode_attention = default_prefill, default_decode
    return logits, tokens


def run(runner: ModelRunner, seqs: list[Seq | Callable[[], Seq]], n: int,
        join_at: list[int] | None = None) -> list[list[int]]:
    """``n`` greedy tokens of each of ``seqs``: seq i is prefilled before decode step join_at[i] (default
    0; in list order within a step) and then decodes in one batch with the others. A function in
    ``seqs`` makes its request when it joins (replaced by it in the list): one that shares blocks of
    another, prefilled by then. Releases them all."""
    join_at = join_at or [0] * len(seqs)
    try:
        step = 0
        while any(callable(s) or len(s.out) < n for s in seqs):
            for i, when in enumerate(join_at):
                if when == step:
                    if callable(seqs[i]):
                        seqs[i] = seqs[i]()
                    prefill(runner, seqs[i])
            live = [s for s in seqs if not callable(s) and s.out and len(s.out) < n]
            if live:
                decode(runner, live)
            step += 1
        return [s.out for s in seqs]
    finally:
        release(runner.pool, [s for s in seqs if not callable(s)])


def greedy(runner: ModelRunner, prompt: list[int], n: int, seed: int = 0) -> list[int]:
    return run(runner, [new_seq(runner.pool, prompt, seed)], n)[0]


def assert_no_block_held(runner: ModelRunner) -> None:
    assert runner.pool.num_used == 0 and runner.pool.used_bytes() == 0
    runner.pool.blocks.check()


def hf_generate(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             pad_token_id=2)
    return out[0, len(prompt):].tolist()


def exact_logits(hf, hf64, ids: list[int]) -> Reference:
    """transformers' logits at every position of ``ids`` in float64 (``hf64``: the same weights), and the
    bound on a float32 computation's error, measured with the float32 model ``hf`` (tests/numerics.py)."""
    with torch.inference_mode():
        return Reference.measure(hf64(torch.tensor([ids])).logits[0], hf(torch.tensor([ids])).logits[0])


def exact_last_logits(hf, hf64, ids: list[int]) -> Reference:
    ref = exact_logits(hf, hf64, ids)
    return Reference(ref.exact[-1], ref.bound)


def assert_exact_greedy(hf, hf64, prompt: list[int], tokens: list[int], what: str = "") -> None:
    """``tokens`` are what exact greedy decoding of ``prompt`` gives, each step decided by more than the
    float32 error, so every float32 path (transformers', the runner's, batched or not) gives them too."""
    ref = exact_logits(hf, hf64, prompt + tokens[:-1])
    assert_decided(Reference(ref.exact[len(prompt) - 1 :], ref.bound), tokens, what)


def float64_copy(hf):
    return copy.deepcopy(hf).double().eval()


def fresh(runner: ModelRunner) -> ModelRunner:
    """``runner`` as a new one, whatever a test before left in it (blocks held, prefixes cached, another
    attention): a shared runner carries no failure from one test into the next, and a test's leak check
    (`assert_no_block_held`) sees only what that test allocated."""
    alloc = runner.pool.blocks
    runner.pool.blocks = BlockAllocator(alloc.num_blocks, caching=alloc.caching)
    runner.use_fast_path(True)
    runner.fast_path.decode_attention = "sdpa"  # float32's (these runners are all float32)
    return runner


def prompt_of(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49152, (length,), generator=g).tolist()


# --- SmolLM2 (the default model), float32: token-for-token against transformers' generate -----------------

def smol_reference(hf, hf64, prompt: list[int]) -> tuple[list[int], Reference]:
    """transformers' greedy tokens for ``prompt``, and the exact (float64) logits each was picked from, with
    the float32 bound; every step is decided by more than twice the bound (`assert_decided`), so any
    float32 path gives these tokens on any CPU."""
    tokens = hf_generate(hf, prompt, NEW_TOKENS)
    ref = exact_logits(hf, hf64, prompt + tokens[:-1])
    rows = Reference(ref.exact[len(prompt) - 1 :], ref.bound)
    assert_decided(rows, tokens, "SmolLM2 reference")
    return tokens, rows


class References(Mapping):
    """transformers' greedy tokens by prompt name, computed in a thread of this process while the tests run
    the runner (each computes on one thread: the machine has two cores); reading one waits for it.
    ``logits(name)``: the exact logits of each step and the float32 bound."""

    def __init__(self, futures: dict[str, Future]) -> None:
        self._futures = futures

    def __getitem__(self, name: str) -> list[int]:
        ref = self._futures[name].result()[0]
        assert len(ref) == NEW_TOKENS and 2 not in ref, f"{name}: pick a prompt that does not hit eos early"
        return ref

    def logits(self, name: str) -> Reference:
        return self._futures[name].result()[1]

    def __iter__(self) -> Iterator[str]:
        return iter(self._futures)

    def __len__(self) -> int:
        return len(self._futures)


@pytest.fixture(scope="module")
def smol_shared(smollm_dir):
    tok = load_tokenizer(smollm_dir)
    hf = AutoModelForCausalLM.from_pretrained(str(smollm_dir), dtype=torch.float32).eval()
    hf64 = float64_copy(hf)
    prompts = {
        "plain": encode_prompt(tok, "The three most important inventions of the twentieth century were"),
        "chat": encode_chat(tok, [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]),
        "non_ascii": encode_prompt(tok, "Voici une recette de crème brûlée (クレームブリュレ) 🍮 :"),
    }
    with ThreadPoolExecutor(1, thread_name_prefix="reference") as ex:
        refs = References({name: ex.submit(smol_reference, hf, hf64, p) for name, p in prompts.items()})
        runner = ModelRunner(smollm_dir, torch.float32, num_blocks=64, max_seq_len=256)
        assert runner.block_size == 16
        yield runner, prompts, refs


@pytest.fixture
def smol(smol_shared):
    runner, prompts, refs = smol_shared
    return fresh(runner), prompts, refs


@pytest.mark.parametrize("name", ["plain", "chat", "non_ascii"])
def test_smollm_greedy_matches_generate(smol, name):
    runner, prompts, refs = smol
    assert greedy(runner, prompts[name], NEW_TOKENS, seed=len(name)) == refs[name]
    assert_no_block_held(runner)


def test_smollm_batched_decode_with_different_lengths_matches_generate(smol):
    runner, prompts, refs = smol
    names = ["plain", "chat", "non_ascii"]
    assert len({len(prompts[n]) for n in names}) == 3
    seqs = [new_seq(runner.pool, prompts[n], seed=i) for i, n in enumerate(names)]
    assert run(runner, seqs, NEW_TOKENS, join_at=[0, 3, 7]) == [refs[n] for n in names]
    assert_no_block_held(runner)


def test_smollm_prompt_reusing_another_requests_cached_blocks_matches_generate(smol, smollm_dir):
    """A chat is answered and its full blocks cached under their chain hashes; after it ended, another chat
    finds the block of the system prompt they share by its hash, prefills only the rest (from token 16)
    and generates what transformers does for the whole prompt (what the cold prefill does:
    test_smollm_greedy_matches_generate)."""
    runner, prompts, refs = smol
    pool, bs, alloc = runner.pool, runner.block_size, runner.pool.blocks
    tok = load_tokenizer(smollm_dir)
    seed = hash_seed("smollm-test", bs)
    first = Seq(encode_chat(tok, [{"role": "user", "content": "What is the capital of France?"}]), [])
    first.table = first_blocks = scattered(pool, pool.layout.blocks_for(len(first.prompt)), seed=7)
    try:
        prefill(runner, first)
        for block, h in zip(first.table, block_hashes(first.prompt, bs, seed)):
            assert alloc.commit(block, h)
        while first.out[-1] not in runner.eos_token_ids and len(first.out) < 12:
            decode(runner, [first])
    finally:
        release(pool, [first])
    assert tok.decode(first.out[: first.out.index(2)]) == "The capital of France is Paris."
    assert runner.eos_token_ids == frozenset({2})

    prompt = prompts["chat"]
    hits = alloc.match(block_hashes(prompt, bs, seed)[: (len(prompt) - 1) // bs])
    assert hits == first_blocks[:1] and alloc.ref(hits[0]) == 0  # the shared system prompt's block, cached, unheld
    second = new_seq(pool, prompt, seed=8, prefix=hits)
    assert second.start == 16
    assert run(runner, [second], NEW_TOKENS)[0] == refs["chat"]
    assert_no_block_held(runner)
    alloc.clear_cache()


def prefill_chunked(runner: ModelRunner, seq: Seq, chunk: int) -> None:
    """``seq``'s prompt computed ``chunk`` tokens at a time, each chunk continuing from the KV of the ones
    before it (what a prefill worker does with --prefill-chunk); the last chunk's logits pick the token."""
    for start in range(seq.start, len(seq.prompt), chunk):
        logits = runner.prefill(seq.table, seq.prompt[: start + chunk], start=start)
    seq.logits.append(logits)
    seq.out.append(int(logits.argmax()))


def test_smollm_chunked_prompts_match_generate(smol, name="chat"):
    """A prompt shorter than the chunk, exactly one chunk, and many chunks (5 tokens: block boundaries
    fall inside chunks and chunks inside blocks) all generate what transformers does for the whole prompt."""
    runner, prompts, refs = smol
    prompt = prompts[name]
    for chunk in (len(prompt) + 3, len(prompt), 5):
        seq = new_seq(runner.pool, prompt, seed=chunk)
        try:
            prefill_chunked(runner, seq, chunk)
            while len(seq.out) < NEW_TOKENS:
                decode(runner, [seq])
        finally:
            release(runner.pool, [seq])
        assert seq.out == refs[name], f"chunk {chunk}"
    assert_no_block_held(runner)


def test_smollm_prompts_sharing_one_forward_match_generate(smol):
    """Three requests in one packed forward pass (one a first chunk, one the rest of a prompt whose first
    chunk ran alone before, one a whole prompt), then decoding together: each generates what transformers
    does for it alone."""
    runner, prompts, refs = smol
    names = ["plain", "chat", "non_ascii"]
    seqs = [new_seq(runner.pool, prompts[n], seed=20 + i) for i, n in enumerate(names)]
    plain, chat, other = seqs
    try:
        runner.prefill(chat.table, chat.prompt[:7])  # chat's first chunk, alone
        logits = runner.prefill_many([(plain.table, plain.prompt[:9], 0),
                                      (chat.table, chat.prompt, 7),
                                      (other.table, other.prompt, 0)])
        assert logits.shape == (3, runner.vocab_size)
        for seq, row in ((chat, logits[1]), (other, logits[2])):
            seq.out.append(int(row.argmax()))
        plain.out.append(int(runner.prefill(plain.table, plain.prompt, start=9).argmax()))  # plain's second chunk
        while len(plain.out) < NEW_TOKENS:
            decode(runner, seqs)
    finally:
        release(runner.pool, seqs)
    assert [s.out for s in seqs] == [refs[n] for n in names]
    assert_no_block_held(runner)


def test_one_forward_refuses_two_parts_writing_one_block(smol):
    runner, prompts, _ = smol
    seq = new_seq(runner.pool, prompts["plain"], seed=3)
    try:
        with pytest.raises(ValueError, match="same KV block"):
            runner.prefill_many([(seq.table, seq.prompt[:4], 0), (seq.table, seq.prompt, 4)])
        with pytest.raises(ValueError, match="at least one part"):
            runner.prefill_many([])
    finally:
        release(runner.pool, [seq])
    assert_no_block_held(runner)


def test_smollm_decode_batch_sharing_prefix_blocks_matches_generate(smol):
    """Requests holding the same physical prefix blocks decode in one batch with others: a chat and the
    same chat prefilled after the last full block of the first one's (start 32 of 42 tokens), the French
    prompt and the same after its first block, and the plain prompt; each generates what transformers
    does, and a prefill from a shared prefix gives the cold prefill's logits."""
    runner, prompts, refs = smol
    pool = runner.pool
    chat, french = new_seq(pool, prompts["chat"], seed=1), new_seq(pool, prompts["non_ascii"], seed=2)
    seqs = [chat, lambda: new_seq(pool, prompts["chat"], seed=3, prefix=chat.table[:2]),
            french, lambda: new_seq(pool, prompts["non_ascii"], seed=4, prefix=french.table[:1]),
            new_seq(pool, prompts["plain"], seed=5)]
    outs = run(runner, seqs, NEW_TOKENS, join_at=[0, 0, 2, 2, 5])
    assert [s.start for s in seqs] == [0, 32, 0, 16, 0]
    assert outs == [refs["chat"], refs["chat"], refs["non_ascii"], refs["non_ascii"], refs["plain"]]
    for cold, warm, name in ((seqs[0], seqs[1], "chat"), (seqs[2], seqs[3], "non_ascii")):
        first = refs.logits(name)
        Reference(first.exact[0], first.bound).check_pair(warm.logits[0], cold.logits[0], name)
    assert_no_block_held(runner)


# --- tiny random Llama: logits against a full transformers forward at every step ---------------------------

@pytest.fixture(scope="module")
def tiny_made() -> dict[int, ModelRunner]:
    return {}


@pytest.fixture
def tiny_runners(tiny_model_dir, tiny_made):
    """runner(block_size): one float32 tiny runner per block size (640 tokens of KV), made on first use
    and shared by the module's tests, handed to each test `fresh`."""
    fresh_here: set[int] = set()

    def runner(block_size: int = TINY_BLOCK) -> ModelRunner:
        if block_size not in tiny_made:
            tiny_made[block_size] = ModelRunner(tiny_model_dir, torch.float32, num_blocks=640 // block_size,
                                                max_seq_len=128, block_size=block_size)
        if block_size not in fresh_here:
            fresh_here.add(block_size)
            fresh(tiny_made[block_size])
        return tiny_made[block_size]

    return runner


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dir):
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    return hf, float64_copy(hf)


@pytest.fixture
def tiny(tiny_runners, tiny_hf):
    runner = tiny_runners()
    yield runner, tiny_hf
    assert_no_block_held(runner)


def test_a_test_that_stops_holding_blocks(tiny_runners):
    """What a failing test leaves in the module's shared runner: blocks held, a prefix cached, another
    attention (the next test gets the runner fresh)."""
    runner = tiny_runners()
    held = runner.pool.blocks.allocate(3)
    assert runner.pool.blocks.commit(held[0], 12345)
    runner.fast_path.decode_attention = "matmul"
    assert runner.pool.num_used == 3


def test_the_next_test_gets_the_shared_runner_fresh(tiny_runners):
    runner = tiny_runners()
    assert runner.pool.num_used == 0 and runner.pool.blocks.num_cached == 0
    assert runner.pool.blocks.num_free == runner.pool.layout.num_blocks
    assert runner.fast_path.decode_attention == "sdpa"
    runner.pool.blocks.check()


def test_tiny_prefill_and_decode_logits_match_forward(tiny):
    runner, (hf, hf64) = tiny
    seq = new_seq(runner.pool, prompt_of(11, 0), seed=1)
    prefill(runner, seq)
    for _ in range(12):
        decode(runner, [seq])
    ref = exact_logits(hf, hf64, seq.prompt + seq.out[:-1])  # each position's logits see only what came before
    for step, logits in enumerate(seq.logits):
        Reference(ref.exact[10 + step], ref.bound).check(logits, f"step {step}")
    assert len(seq.table) == runner.pool.layout.blocks_for(11 + 12) == 5
    assert len(set(seq.out)) > 1  # the random model is not constant, so a broken cache would show
    release(runner.pool, [seq])


def test_tiny_greedy_matches_generate(tiny):
    runner, (hf, hf64) = tiny
    prompt = prompt_of(9, 1)
    ref = hf_generate(hf, prompt, 40)
    assert_exact_greedy(hf, hf64, prompt, ref)  # so any float32 path generates it
    assert greedy(runner, prompt, len(ref), seed=2) == ref


def test_tiny_batched_equals_single(tiny):
    runner, (hf, hf64) = tiny
    prompts = [prompt_of(5, 2), prompt_of(17, 3), prompt_of(2, 4)]
    single = [greedy(runner, p, 20, seed=i) for i, p in enumerate(prompts)]
    for p, tokens in zip(prompts, single):
        assert_exact_greedy(hf, hf64, p, tokens)  # batched or not, float32 rounding cannot change them
    seqs = [new_seq(runner.pool, p, seed=10 + i) for i, p in enumerate(prompts)]
    assert run(runner, seqs, 20, join_at=[0, 2, 9]) == single


def test_freed_blocks_reuse_ignores_stale_kv(tiny):
    runner, (hf, hf64) = tiny
    pool = runner.pool
    long_prompt, short_prompt = prompt_of(60, 5), prompt_of(4, 6)
    fresh = greedy(runner, short_prompt, 15)
    assert_exact_greedy(hf, hf64, short_prompt, fresh)
    tables = []
    while pool.blocks.num_free >= 12:  # (nearly) every block gets a long, unrelated context
        tables.append(scattered(pool, 12, seed=len(tables)))
        runner.prefill(tables[-1], long_prompt)
    for table in tables:
        pool.blocks.release(table)
    assert greedy(runner, short_prompt, 15, seed=3) == fresh
    # and batched next to a long request, in blocks that held other tokens
    seqs = [new_seq(pool, long_prompt, seed=4), new_seq(pool, short_prompt, seed=5)]
    assert run(runner, seqs, 15)[1] == fresh


def test_pool_holds_the_same_kv_as_transformers(tiny):
    """The K/V of every token sits at row t % block_size of block table[t // block_size], cold or after a
    shared prefix (the second request computes tokens 5.. into its own blocks)."""
    runner, (hf, hf64) = tiny
    pool, bs = runner.pool, runner.block_size
    first = prompt_of(12, 7)
    a = new_seq(pool, first, seed=6)
    prefill(runner, a)
    b = new_seq(pool, first[:bs] + prompt_of(7, 8), seed=7, prefix=a.table[:1])
    prefill(runner, b)
    for seq in (a, b):
        with torch.inference_mode():
            cache, cache64 = (m(torch.tensor([seq.prompt]), use_cache=True).past_key_values for m in (hf, hf64))
        rows = [(seq.table[t // bs], t % bs) for t in range(len(seq.prompt))]
        for layer in range(2):
            for kv in (0, 1):
                ref32, ref64 = ((c.layers[layer].keys if kv == 0 else c.layers[layer].values)[0] for c in (cache, cache64))
                ours = torch.stack([pool.tensor[block, :, layer, kv, row] for block, row in rows], 1)
                Reference.measure(ref64, ref32).check(ours, f"layer {layer} {'KV'[kv]}")  # [kv_heads, seq, head_dim]
    release(pool, [a, b])


def _copy_blocks(src: ModelRunner, src_blocks: list[int], dst: ModelRunner, dst_blocks: list[int]) -> None:
    """What the transfer engine does: the bytes of src's blocks, as byte ranges, into dst's blocks."""
    data = b"".join(bytes(src.pool.buffer()[r.offset : r.end]) for r in src.pool.byte_ranges(src_blocks))
    at = 0
    for r in dst.pool.byte_ranges(dst_blocks):
        dst.pool.buffer()[r.offset : r.end] = data[at : at + r.length]
        at += r.length
    assert at == len(data)


def test_kv_moved_by_block_bytes_decodes_the_same(tiny, tiny_model_dir):
    """Prefill in one pool, the blocks' bytes into other blocks of another pool, decode there; then a
    second request sharing the first one's leading block: prefill computes and moves only the rest, the
    decode side reuses the block it already holds."""
    prefill_runner, (hf, hf64) = tiny
    bs = prefill_runner.block_size
    decode_runner = ModelRunner(tiny_model_dir, torch.float32, num_blocks=24, max_seq_len=64, block_size=bs)
    assert decode_runner.pool.layout.compat() == prefill_runner.pool.layout.compat()
    first = prompt_of(13, 8)
    prompts = [first, first[:bs] + prompt_of(9, 10)]  # (prompts whose every step is decided: assert_exact_greedy)
    src = new_seq(prefill_runner.pool, prompts[0], seed=1)
    prefill(prefill_runner, src)
    src2 = new_seq(prefill_runner.pool, prompts[1], seed=2, prefix=src.table[:1])
    prefill(prefill_runner, src2)
    dst = new_seq(decode_runner.pool, prompts[0], seed=3)
    dst2 = new_seq(decode_runner.pool, prompts[1], seed=4, prefix=dst.table[:1])
    assert dst.table != src.table
    _copy_blocks(prefill_runner, src.table, decode_runner, dst.table)
    _copy_blocks(prefill_runner, src2.table[1:], decode_runner, dst2.table[1:])
    release(prefill_runner.pool, [src, src2])
    dst.out, dst2.out = src.out, src2.out
    for _ in range(10):
        decode(decode_runner, [dst, dst2])
    release(decode_runner.pool, [dst, dst2])
    for p, tokens in zip(prompts, (dst.out, dst2.out)):
        assert_exact_greedy(hf, hf64, p, tokens)  # so a single-pool run must give them too
    assert [dst.out, dst2.out] == [greedy(prefill_runner, p, 11) for p in prompts]
    assert_no_block_held(decode_runner)


def test_prefill_refuses_what_it_cannot_compute_and_writes_nothing(tiny):
    runner, _ = tiny
    pool, bs = runner.pool, runner.block_size
    table = scattered(pool, 2, seed=9)  # 10 tokens
    other = new_seq(pool, prompt_of(7, 10), seed=11, prefix=table[:1])  # holds table's first block too
    unheld = pool.blocks.allocate(1)
    pool.blocks.release(unheld)
    six = list(range(3, 9))
    before = pool.tensor.clone()
    bad = [
        (table, [], 0, "outside"),
        (table, [1] * (runner.max_model_len + 1), 0, "outside"),
        (table[1:], [runner.vocab_size], 0, "vocabulary"),
        (table, [5, 6, 7], 3, "at least one token"),  # start >= n: nothing to compute
        (table, [5, 6, 7], 7, "at least one token"),
        (table, [5, 6, 7], -1, "at least one token"),
        (table, six, 2.0, "start"),
        (table[:1], six, 0, "cannot hold"),  # a table too short for the prompt
        ([], [5], 0, "cannot hold"),
        ([table[0], pool.layout.num_blocks], six, 0, "does not exist"),  # a block past the pool's end
        ([table[0], -1], six, 0, "does not exist"),
        ([table[0], True], six, 0, "does not exist"),
        (table + [10**6], six, 0, "does not exist"),  # even past what the prompt needs
        ([table[0], table[0]], six, 0, "twice"),
        (table, six, 0, "shared by 2"),  # it would overwrite the other request's prefix
        ([table[0], unheld[0]], six, bs, "not held"),  # (reading the shared block is fine)
    ]
    for blocks, ids, start, match in bad:
        with pytest.raises(ValueError, match=match):
            runner.prefill(blocks, ids, start=start)
    assert torch.equal(pool.tensor, before)
    pool.blocks.release(table)
    release(pool, [other])


def test_decode_refuses_bad_batches_and_warmup_leaves_nothing_held(tiny):
    runner, _ = tiny
    pool, bs = runner.pool, runner.block_size
    a = new_seq(pool, [5, 6, 7], seed=12)
    prefill(runner, a)
    before = pool.tensor.clone()
    bad = [
        ([a.table], [1], [bs], "cannot hold"),  # position 5 needs a second block
        ([a.table, a.table], [1, 2], [3, 3], "same KV row"),  # one request twice
        ([a.table, [a.table[0]]], [1, 2], [3, 3], "same KV row"),  # two tables, one block, one row
        ([a.table], [1, 2], [3], "equally long"),
        ([], [], [], "non-empty"),
        ([[pool.layout.num_blocks]], [1], [0], "does not exist"),
        ([[-1]], [1], [0], "does not exist"),
        ([a.table + [None]], [1], [3], "does not exist"),
        ([a.table], [1], [-1], "position"),
        ([a.table], [1], [runner.max_model_len], "position"),
        ([a.table], [runner.vocab_size], [3], "vocabulary"),
    ]
    for tables, ids, positions, match in bad:
        with pytest.raises(ValueError, match=match):
            runner.decode(tables, ids, positions)
    b = new_seq(pool, [5, 6, 7, 8], seed=13, prefix=a.table)  # (shares a's partly filled block: a caller's bug)
    for positions in ([3, 3], [3, 4]):  # both would write one row, or b read the row a writes
        with pytest.raises(ValueError, match="same KV row|shared by 2"):
            runner.decode([a.table, b.table], [1, 2], positions)
    with pytest.raises(ValueError, match="shared by 2"):
        runner.decode([a.table], [1], [3])
    assert torch.equal(pool.tensor, before)
    release(pool, [a, b])
    runner.warmup()


def test_bfloat16_runs_close_to_transformers(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir, torch.bfloat16, num_blocks=8, max_seq_len=64, block_size=4)
    assert runner.pool.tensor.dtype == torch.bfloat16 and runner.pool.layout.dtype == "bfloat16"
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.bfloat16).eval()
    a = new_seq(runner.pool, prompt_of(10, 9), seed=1)
    prefill(runner, a)
    b = new_seq(runner.pool, a.prompt[:8] + prompt_of(3, 10), seed=2, prefix=a.table[:2])
    prefill(runner, b)  # from token 8 on, after a's first two blocks
    for seq in (a, b):
        with torch.inference_mode():
            theirs = hf(torch.tensor([seq.prompt])).logits[0, -1].float()
        assert torch.corrcoef(torch.stack([seq.logits[0], theirs]))[0, 1] > 0.99
    release(runner.pool, [a, b])
    assert_no_block_held(runner)


# --- a prompt after a cached prefix: the acceptance tests for the model layer ----------------------

@pytest.mark.parametrize("block_size,length,blocks", [
    (1, 37, 1), (1, 37, 18), (1, 37, 36),
    (5, 37, 1), (5, 37, 4), (5, 37, 7), (5, 35, 6),
    (16, 37, 1), (16, 37, 2), (16, 32, 1),
])
def test_prefill_after_shared_prefix_blocks_equals_cold_prefill(tiny_runners, tiny_hf, block_size, length, blocks):
    """Request b's first ``blocks`` blocks are request a's (a shares b's prompt up to there, not after);
    b's prefill from ``start = blocks * block_size`` (up to the last full block b can reuse: at least one
    token is computed) gives the logits of b's cold prefill and of transformers; then a and b decode
    side by side and generate what a cold prefill and transformers' generate do."""
    runner, (hf, hf64) = tiny_runners(block_size), tiny_hf
    pool = runner.pool
    start = blocks * block_size
    seed = 2000 + 100 * block_size + blocks  # prompts whose every step is decided (assert_exact_greedy)
    a_prompt = prompt_of(length, seed)
    b_prompt = a_prompt[:start] + prompt_of(length - start, seed + 1)
    assert b_prompt[start] != a_prompt[start]
    cold = new_seq(pool, b_prompt, seed=1)
    prefill(runner, cold)
    release(pool, [cold])

    a = new_seq(pool, a_prompt, seed=2)
    prefill(runner, a)
    shared = pool.tensor[a.table[:blocks]].clone()
    b = new_seq(pool, b_prompt, seed=3, prefix=a.table[:blocks])
    assert b.start == start and set(b.table[blocks:]).isdisjoint(a.table)
    prefill(runner, b)
    assert torch.equal(pool.tensor[a.table[:blocks]], shared)  # b wrote only into its own blocks
    try:
        for _ in range(9):
            decode(runner, [b, a])
    finally:
        release(pool, [a, b])
    ref = exact_logits(hf, hf64, b_prompt + b.out[:-1])
    first, last = (Reference(ref.exact[i], ref.bound) for i in (length - 1, -1))
    first.check_pair(b.logits[0], cold.logits[0], "b after the shared prefix, and b cold")
    last.check(b.logits[-1], "b's last step")
    assert_exact_greedy(hf, hf64, a_prompt, a.out, "a")  # so transformers' generate and any float32 path give them
    assert_exact_greedy(hf, hf64, b_prompt, b.out, "b")
    assert a.out == hf_generate(hf, a_prompt, 10)
    assert b.out == hf_generate(hf, b_prompt, 10) == greedy(runner, b_prompt, 10, seed=4)
    assert_no_block_held(runner)


# --- other Llama-family architectures and refusals ---------------------------------------------------------

def _save_tiny(tmp_path, config_cls, model_cls, **extra):
    config = config_cls(vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        initializer_range=0.5, **extra)
    torch.manual_seed(0)
    model = model_cls(config).eval()
    model.save_pretrained(tmp_path)
    return model


def _logits_match_forward_cold_and_after_a_prefix(runner: ModelRunner, hf, prompt: list[int], cold: int) -> None:
    """prompt[:cold] prefilled, the rest decoded, each step against transformers; then a second request
    with the first two blocks of the first one's table, prefilled from there to cold + 5."""
    pool = runner.pool
    ref = exact_logits(hf, float64_copy(hf), prompt)  # each position's logits see only the tokens up to it
    at = lambda pos: Reference(ref.exact[pos], ref.bound)
    a = new_seq(pool, prompt[:cold], seed=1)
    prefill(runner, a)
    b = new_seq(pool, prompt[: cold + 5], seed=2, prefix=a.table[:2])
    at(cold - 1).check(a.logits[0], "a's prefill")
    for pos in range(cold, len(prompt)):
        a.out[-1] = prompt[pos]  # teacher-forced: the prompt's next token, not the model's
        decode(runner, [a])
        at(pos).check(a.logits[-1], f"a's step at {pos}")
    prefill(runner, b)
    at(cold + 4).check(b.logits[0], "b's prefill after a's blocks")
    release(pool, [a, b])
    assert_no_block_held(runner)


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "llama-rope-scaled"])
def test_other_llama_family_models(tmp_path, arch):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if arch == "qwen2":  # q/k/v biases
        hf = _save_tiny(tmp_path, Qwen2Config, Qwen2ForCausalLM)
    elif arch == "mistral":
        hf = _save_tiny(tmp_path, MistralConfig, MistralForCausalLM, sliding_window=None)
    else:
        hf = _save_tiny(tmp_path, LlamaConfig, LlamaForCausalLM, attention_bias=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    runner = ModelRunner(tmp_path, torch.float32, num_blocks=12, max_seq_len=256)
    assert runner.fast_path_active, runner.fast_path_reason  # the lean forward covers all three
    prompt = torch.randint(0, 500, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    _logits_match_forward_cold_and_after_a_prefix(runner, hf, prompt, 60)


# --- the lean forward (llama_fast) against the general HF-module path ---------------------------------------

def _both_paths(runner: ModelRunner, prompts: list[list[int]], steps: int, shared: int) -> list[list[Seq]]:
    """Each prompt prefilled, then all decoded in one batch, on each path; the last prompt starts with the
    first prompt's first ``shared`` blocks and is prefilled after them, out of the first one's blocks.
    The requests (tokens and logits), per path."""
    results = []
    pool = runner.pool
    for fast in (True, False):
        runner.use_fast_path(fast)
        seqs = [new_seq(pool, p, seed=i) for i, p in enumerate(prompts[:-1])]
        try:
            for s in seqs:
                prefill(runner, s)
            seqs.append(new_seq(pool, prompts[-1], seed=len(prompts), prefix=seqs[0].table[:shared]))
            prefill(runner, seqs[-1])
            for _ in range(steps):
                decode(runner, seqs)
        finally:
            release(pool, seqs)
        results.append(seqs)
    runner.use_fast_path(True)
    return results


def test_fast_path_matches_general_path_float32(tiny):
    """Both paths compute transformers' logits to within float32 error, at every step of every request, and
    so pick the same tokens (each decided by more than that error)."""
    runner, (hf, hf64) = tiny
    assert runner.fast_path_active and runner.fast_path_reason is None
    prompts = [prompt_of(23, 10), prompt_of(6, 11), prompt_of(41, 12)]
    prompts.append(prompts[0][:20] + prompt_of(9, 13))
    fast, general = _both_paths(runner, prompts, steps=8, shared=4)
    for path, seqs in (("fast", fast), ("general", general)):
        assert [len(s.logits) for s in seqs] == [9] * 4
        for i, s in enumerate(seqs):
            ref = exact_logits(hf, hf64, s.prompt + s.out[:-1])
            rows = Reference(ref.exact[len(s.prompt) - 1 :], ref.bound)
            for step, logits in enumerate(s.logits):
                Reference(rows.exact[step], rows.bound).check(logits, f"{path} path, request {i}, step {step}")
            assert_decided(rows, s.out, f"{path} path, request {i}")
    assert [s.out for s in fast] == [s.out for s in general]


@pytest.mark.parametrize("attention", ["kernel", "matmul"])
def test_fast_path_close_to_general_path_bfloat16(tiny_model_dir, attention):
    runner = ModelRunner(tiny_model_dir, torch.bfloat16, num_blocks=16, max_seq_len=64, block_size=4)
    assert runner.fast_path_active
    runner.fast_path.decode_attention = attention
    prompts = [prompt_of(12, 13), prompt_of(5, 14)]
    prompts.append(prompts[0][:8] + prompt_of(3, 15))
    fast, general = _both_paths(runner, prompts, steps=4, shared=2)
    for a, b in zip(*([row for s in seqs for row in s.logits] for seqs in (fast, general))):
        assert torch.corrcoef(torch.stack([a, b]))[0, 1] > 0.99
    assert_no_block_held(runner)


def test_model_the_fast_path_does_not_cover_falls_back(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = _save_tiny(tmp_path, LlamaConfig, LlamaForCausalLM, hidden_act="gelu_pytorch_tanh")
    runner = ModelRunner(tmp_path, torch.float32, num_blocks=24, max_seq_len=128, block_size=4)
    assert not runner.fast_path_active and "activation" in runner.fast_path_reason
    with pytest.raises(ValueError, match="activation"):
        runner.use_fast_path(True)
    prompt = torch.randint(0, 500, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    _logits_match_forward_cold_and_after_a_prefix(runner, hf, prompt, 25)


def test_unsupported_architectures_are_refused(tmp_path):
    from transformers import GPT2Config, MistralConfig

    GPT2Config().save_pretrained(tmp_path / "gpt2")
    with pytest.raises(UnsupportedModel, match="gpt2"):
        ModelRunner(tmp_path / "gpt2", torch.float32, num_blocks=1, max_seq_len=64)
    MistralConfig(sliding_window=32).save_pretrained(tmp_path / "mistral")
    with pytest.raises(UnsupportedModel, match="sliding"):
        ModelRunner(tmp_path / "mistral", torch.float32, num_blocks=1, max_seq_len=64)


# --- batched decode attention: every request sees only its own KV ----------------------------------------

def _tables(pool: KVPool, layout: str, lengths: list[int]) -> list[list[int]]:
    """Block tables for requests of ``lengths`` tokens: adjacent and ascending, scattered, or interleaved
    (one block each in turn)."""
    need = [pool.layout.blocks_for(n) for n in lengths]
    if layout == "ascending":
        everything = pool.blocks.allocate(pool.blocks.num_free)
        pool.blocks.release(sorted(everything))  # handed out again lowest first
        run_ = pool.blocks.allocate(sum(need))
        assert run_ == list(range(run_[0], run_[0] + len(run_)))
        return [run_[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(need))]
    if layout == "scattered":
        return [scattered(pool, n, seed=i) for i, n in enumerate(need)]
    tables: list[list[int]] = [[] for _ in need]
    for round_ in range(max(need)):
        for table, n in zip(tables, need):
            if round_ < n:
                table += pool.blocks.allocate(1)
    return tables


@pytest.mark.parametrize("attention", ["sdpa", "matmul"])
@pytest.mark.parametrize("layout", ["ascending", "scattered", "interleaved", "shared-prefix"])
def test_batched_decode_over_any_block_layout_equals_single_requests(tiny_runners, tiny_hf, layout, attention):
    """Blocks anywhere in the pool, in any order, shared or not, stale KV everywhere else: the batch
    attends over each request's own blocks through its table, as a request decoded alone does."""
    runner = tiny_runners(4)
    pool = runner.pool
    stale = scattered(pool, pool.blocks.num_free, seed=1)
    for i in range(0, len(stale) - 8, 8):  # stale KV everywhere, which the masks must ignore
        runner.prefill(stale[i : i + 8], prompt_of(30, 40 + i))
    pool.blocks.release(stale)
    head = prompt_of(4, 49)  # one block
    prompts = [head + prompt_of(3 + 5 * i, 50 + i) for i in range(3)]
    if layout == "shared-prefix":  # the others hold the first one's first block, and compute after it
        seqs = [new_seq(pool, prompts[0], seed=2)]
        prefill(runner, seqs[0])
        seqs += [new_seq(pool, p, seed=3 + i, prefix=seqs[0].table[:1]) for i, p in enumerate(prompts[1:])]
    else:
        seqs = [Seq(p, t) for p, t in zip(prompts, _tables(pool, layout, [len(p) for p in prompts]))]
    runner.fast_path.decode_attention = attention
    try:
        for s in seqs:
            if not s.out:
                prefill(runner, s)
            s.table += pool.blocks.allocate(pool.layout.blocks_for(len(s.prompt) + 1) - len(s.table))
        batched = runner.decode([s.table for s in seqs], [s.out[0] for s in seqs], [len(p) for p in prompts])
        for i, s in enumerate(seqs):
            alone = runner.decode([s.table], [s.out[0]], [len(s.prompt)])[0]
            # M=1 vs M=B GEMMs round apart: each within float32 error of the exact step
            exact_last_logits(*tiny_hf, s.prompt + s.out[:1]).check_pair(batched[i], alone, f"request {i}")
    finally:
        runner.fast_path.decode_attention = "sdpa"
        release(pool, seqs)
    assert_no_block_held(runner)


@pytest.mark.parametrize("attention", ["sdpa", "matmul"])
def test_ragged_batch_attends_per_request_and_equals_single_requests(tiny_runners, tiny_hf, attention):
    """One long prompt among short ones: padding every request to the longest would cover rows x longest
    (3 x 50 > 2 x 59 live tokens), so each request attends over its own live KV; results equal
    single-request steps."""
    runner = tiny_runners()
    runner.fast_path.decode_attention = attention
    seqs = [new_seq(runner.pool, prompt_of(n, 80 + n), seed=n) for n in (49, 4, 3)]
    try:
        for s in seqs:
            prefill(runner, s)
        positions = [len(s.prompt) for s in seqs]
        for s, pos in zip(seqs, positions):
            s.table += runner.pool.blocks.allocate(runner.pool.layout.blocks_for(pos + 1) - len(s.table))
        batched = runner.decode([s.table for s in seqs], [s.out[0] for s in seqs], positions)
        for i, s in enumerate(seqs):
            alone = runner.decode([s.table], [s.out[0]], [positions[i]])[0]
            exact_last_logits(*tiny_hf, s.prompt + s.out[:1]).check_pair(batched[i], alone, f"request {i}")
    finally:
        runner.fast_path.decode_attention = "sdpa"
        release(runner.pool, seqs)
    assert_no_block_held(runner)


def test_matmul_decode_attention_equals_sdpa(tiny, tiny_model_dir):
    """The matmul attention (bfloat16's fallback) computes what SDPA does, for single and batched steps,
    over tables sharing a prefix block."""
    runner, hfs = tiny
    assert runner.fast_path.decode_attention == "sdpa"  # float32 keeps transformers' kernel
    prompts = [prompt_of(7 + 9 * i, 60 + i) for i in range(3)]
    prompts[2][:5] = prompts[1][:5]
    seqs = [new_seq(runner.pool, p, seed=i) for i, p in enumerate(prompts[:2])]
    try:
        for s in seqs:
            prefill(runner, s)
        seqs.append(new_seq(runner.pool, prompts[2], seed=2, prefix=seqs[1].table[:1]))
        prefill(runner, seqs[2])
        tables, first, positions = [s.table for s in seqs], [s.out[0] for s in seqs], [len(p) for p in prompts]
        for s, pos in zip(seqs, positions):
            s.table += runner.pool.blocks.allocate(runner.pool.layout.blocks_for(pos + 1) - len(s.table))
        results = {}
        for attention in ("sdpa", "matmul"):
            runner.fast_path.decode_attention = attention
            results[attention] = [runner.decode(tables, first, positions),
                                  runner.decode(tables[1:2], first[1:2], positions[1:2])]
    finally:
        release(runner.pool, seqs)
    exact = [exact_last_logits(*hfs, p + [t]) for p, t in zip(prompts, first)]
    for attention, (batch, one) in results.items():
        for i, row in enumerate(batch):
            exact[i].check(row, f"{attention}, request {i} in the batch")
        exact[1].check(one[0], f"{attention}, request 1 alone")
    bf16 = ModelRunner(tiny_model_dir, torch.bfloat16, num_blocks=1, max_seq_len=64).fast_path
    assert bf16.decode_attention == "kernel"  # the native kernel (tests/integration/test_native_kernels.py)
    with pytest.raises(ValueError, match="decode_attention"):
        FastLlama(runner.model, 64, torch.float32, decode_attention="flash")


def test_forward_passes_hold_the_cpu_board_and_release_it_when_done(tiny_model_dir, tmp_path, monkeypatch):
    from xpyd.worker import cpu_share

    monkeypatch.setattr(cpu_share, "BOARD_DIR", tmp_path)
    runner = ModelRunner(tiny_model_dir, torch.float32, num_blocks=4, max_seq_len=64)
    runner.cpu_share = share = cpu_share.CpuShare("runner-test", cores=2)
    marks = []
    read = lambda: cpu_share._SLOT.unpack_from(share._map, share.slot * cpu_share._SLOT.size)[1]
    original = runner.fast_path.on_layer

    def on_layer():
        original()
        marks.append(read() - time.monotonic_ns())

    runner.fast_path.on_layer = on_layer
    table = runner.pool.blocks.allocate(1)
    token = int(runner.prefill(table, prompt_of(9, 70)).argmax())
    assert marks and min(marks) > 10**9  # held into the future during every layer
    assert read() <= time.monotonic_ns()  # released: an ordinary mark once the pass ended
    marks.clear()
    runner.decode([table], [token], [9])
    assert marks and min(marks) > 10**9 and read() <= time.monotonic_ns()
    with pytest.raises(ValueError):
        runner.decode([table], [token], [40])  # refused (the table holds 16 tokens): the board is not left holding
    assert read() <= time.monotonic_ns()
    runner.pool.blocks.release(table)
    assert_no_block_held(runner)
