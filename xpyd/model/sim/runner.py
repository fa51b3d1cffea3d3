"""`SimRunner`: the real runner's interface (`xpyd.model.runner.ModelRunner`) with a simulated forward pass.

The KV pool is a real one in host memory (`HostKVPool`: block manager, prefix cache, KV events, transfers of
its real bytes), one "layer" of ``kv_token_bytes`` per token (by default the model's real KV size, so a
transfer moves as many bytes as the real engine would). A forward pass writes each new token's record
(`records`: a digest chained over the sequence) into the token's row and returns, per request, the digest of
its last token; the sampler (`sampler`) makes the next token from it. Tokens are thus a deterministic function
of the token sequence (and the seed when sampling): prefill/decode, colocated, cached and cold all give the
same tokens, and KV that was not transferred, or transferred wrong, is an error naming the position.

`prefill_scored` is `prefill_many` that also scores prompt positions (`xpyd.model.logprobs`): each position's
row is the digest of its record, scored as the sampler scores a row.

What a pass verifies before it writes anything (ValueError otherwise, nothing written):
- prefill: the batch is well formed (as ModelRunner), and the cached prefix [0, start) of each part holds
  exactly the records of its tokens (the whole chain: O(start) hashes), except for the next chunk of a prompt
  whose chunk before this runner wrote: then the record at start - 1 and a digest of the tokens [0, start)
  are compared with what it remembers (a chunked prompt costs O(length), not O(length^2 / chunk));
- decode: the batch is well formed; each request's positions [0, pos) hold one unbroken chain of records, all
  of them the first time this runner sees the request at this place, else only the record at pos - 1, which
  this runner wrote itself at the previous step (it remembers, per request, the last record it wrote).

Each pass takes the profile's time for its size (`profile.SimProfile`) divided by ``speedup``, counted from
when it started (its own work is part of it): ``time.sleep``, so the GIL is free meanwhile. ``speedup`` inf:
no simulated time.

The model folder is read with json only (config.json, generation_config.json if present): no torch, no
transformers (a simulated worker stays light).
"""

from __future__ import annotations

import dataclasses

import json
import math
import time
from array import array
from collections import OrderedDict
from hashlib import blake2b
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from xpyd.model import batch_checks
from xpyd.model.block_tables import BlockTables
from xpyd.model.fingerprint import weights_fingerprint
from xpyd.model.kv_layout import HostKVPool, KVLayout
from xpyd.model.logprobs import ScoreSpec, TokenLogprob, check_scores
from xpyd.model.sim.profile import SimProfile, default_profile
from xpyd.model.sim.records import ZERO_DIGEST, KVRecords, chain, digest_after, record_of
from xpyd.model.sim.sampler import SimSampler

__all__ = ["ModelFacts", "SimRunner"]

REMEMBERED = 4096  # requests whose last written record a runner remembers (the oldest is dropped past this)


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the simulated engine takes from a model folder's config.json (and generation_config.json)."""

    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: frozenset[int]
    kv_token_bytes: int  # the real engine's KV bytes per token in 16-bit floats
    kv_rows: int = 0  # K/V rows per token (layers x 2 x KV heads; a latent's: layers): an int8 row adds its scale

    @classmethod
    def read(cls, model_dir: Path) -> ModelFacts:
        config = _json(Path(model_dir) / "config.json")
        if "vocab_size" not in config and isinstance(config.get("text_config"), dict):
            config = {**config, **config["text_config"]}  # a multimodal wrapper: its language model's facts
        try:
            heads = config["num_attention_heads"]
            kv_heads = config.get("num_key_value_heads") or heads
            head_dim = config.get("head_dim") or config["hidden_size"] // heads
            rows = config["num_hidden_layers"] * 2 * kv_heads
            token_bytes = rows * head_dim * 2
            if config.get("kv_lora_rank"):  # multi-head latent attention: one latent per token and layer
                rows = config["num_hidden_layers"]
                token_bytes = rows * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 2
            facts = cls(vocab_size=config["vocab_size"], max_position_embeddings=config["max_position_embeddings"],
                        eos_token_ids=frozenset(), kv_token_bytes=token_bytes, kv_rows=rows)
        except (KeyError, TypeError, ZeroDivisionError) as e:
            raise ValueError(f"{model_dir}/config.json lacks what the simulated engine needs: {e!r}") from None
        for name in ("vocab_size", "max_position_embeddings", "kv_token_bytes"):
            value = getattr(facts, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{model_dir}/config.json: {name} must be a positive int, got {value!r}")
        eos: set[int] = set()
        generation = Path(model_dir) / "generation_config.json"
        for source in ((_json(generation),) if generation.is_file() else ()) + (config,):
            value = source.get("eos_token_id")
            values = value if isinstance(value, list) else [value]
            eos.update(v for v in values if isinstance(v, int) and not isinstance(v, bool))
        return dataclasses.replace(facts, eos_token_ids=frozenset(eos))


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


class SimRunner:
    def __init__(self, model_dir: Path, *, num_blocks: int, max_seq_len: int, block_size: int = 16,
                 caching: bool = True, kv_token_bytes: int | None = None, profile: SimProfile | None = None,
                 speedup: float = 1.0, buffer: memoryview | None = None, zeroed: bool = False) -> None:
        facts = ModelFacts.read(Path(model_dir))
        if kv_token_bytes is None:
            kv_token_bytes = facts.kv_token_bytes
        if isinstance(kv_token_bytes, bool) or not isinstance(kv_token_bytes, int) or kv_token_bytes < 32 \
                or kv_token_bytes % 4:
            raise ValueError(f"kv_token_bytes must be a multiple of 4, at least 32 (a token's 16-byte record "
                             f"in its K half), got {kv_token_bytes!r}")
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
            raise ValueError(f"max_seq_len must be a positive int, got {max_seq_len!r}")
        if isinstance(speedup, bool) or not isinstance(speedup, (int, float)) or not speedup > 0:
            raise ValueError(f"speedup must be a number > 0 (inf: no simulated time), got {speedup!r}")
        self.identity = f"sim:{weights_fingerprint(Path(model_dir))}:{kv_token_bytes}"
        self.config = None  # no transformers config: nothing of the real model is loaded
        self.max_model_len = min(max_seq_len, facts.max_position_embeddings)
        self.vocab_size = facts.vocab_size
        self.eos_token_ids = frozenset(e for e in facts.eos_token_ids if 0 <= e < facts.vocab_size)
        self.block_size = block_size
        self.kv_token_bytes = kv_token_bytes
        self.pool = HostKVPool(KVLayout(num_layers=1, num_kv_heads=1, head_dim=kv_token_bytes // 4, dtype="float16",
                                        num_blocks=num_blocks, block_size=block_size),
                               buffer=buffer, caching=caching, zeroed=zeroed)
        # Token t's K half: row t % block_size of its block (half a token's bytes); its record starts there.
        self._records = KVRecords(self.pool.buffer(), self.pool.layout.block_bytes, kv_token_bytes // 2, block_size)
        self.sampler = SimSampler(self.vocab_size, self.eos_token_ids)
        self.profile = profile if profile is not None else default_profile()
        self.speedup = float(speedup)
        self.cpu_share = None  # the worker may set it; a simulated pass uses no core to speak of
        # (block, position) -> (the record this runner wrote there last for some request, and when a prefill
        # wrote it, a digest of the request's tokens up to it)
        self._written: OrderedDict[tuple[int, int], tuple[bytes, bytes | None]] = OrderedDict()

    def prefill(self, blocks: list[int], token_ids: list[int], start: int = 0) -> bytes:
        """Run ``token_ids`` from ``start`` on (the records of [0, start) already in ``blocks``): write the
        records of [start, n); the digest of token n - 1 (its row, for the sampler)."""
        return self.prefill_many([(blocks, token_ids, start)])[0]

    def prefill_many(self, parts: Sequence[tuple[list[int], list[int], int]]) -> list[bytes]:
        """Several requests' prompts (or chunks of them) in one pass: each part is (blocks, token_ids, start)
        as in `prefill`; one row per part. Every part is checked before anything is written."""
        started = time.monotonic()
        records, new, cached = self._prefill(parts)
        self._take(started, self.profile.prefill_seconds(new, cached))
        return [r[-1][:8] for r in records]

    def prefill_scored(self, parts: Sequence[tuple[list[int], list[int], int]],
                       scores: Sequence[ScoreSpec | None]) -> tuple[list[bytes], list[list[TokenLogprob] | None]]:
        """`prefill_many`, and the prompt logprobs ``scores`` asks (`xpyd.model.logprobs`): for part i with
        ``(targets, k)``, position start + j scored against targets[j] from its own record's digest, as the
        sampler scores a row; None for a part without. Checked before anything is written."""
        started = time.monotonic()
        specs = check_scores(parts, scores, self.vocab_size)
        records, new, cached = self._prefill(parts)
        scored = [None if spec is None else
                  self.sampler.logprobs([r[:8] for r in part[: len(spec[0])]], spec[0], [spec[1]] * len(spec[0]))
                  for part, spec in zip(records, specs)]
        self._take(started, self.profile.prefill_seconds(new, cached))
        return [r[-1][:8] for r in records], scored

    def decode(self, tables: list[list[int]], token_ids: list[int], positions: list[int]) -> list[bytes]:
        """One step for a batch: token i sits at positions[i] of the request whose blocks are tables[i];
        positions [0, positions[i]) must hold its records. One row (the new record's digest) per request;
        ValueError, and nothing written, for a bad batch or KV that does not hold a chain of records."""
        started = time.monotonic()
        rows = self._decode(tables, token_ids, positions)
        self._take(started, self.profile.decode_seconds(len(rows), sum(positions) + len(positions)))
        return rows

    def decode_rows(self, tables: BlockTables, rows: list[int], token_ids: list[int],
                    positions: list[int]) -> list[bytes]:
        """`decode` for requests whose blocks are kept in ``tables`` (this pool's): request i's are row rows[i]
        (as `ModelRunner.decode_rows`: O(batch) checks; the rows are read as lists, which the records need)."""
        started = time.monotonic()
        batch_checks.decode_rows(self.pool.layout, self.pool.blocks, self.max_model_len, tables, rows, token_ids,
                                 positions)
        rows_out = self._decode_checked([tables.blocks(r) for r in rows], self._ids(token_ids), positions)
        self._take(started, self.profile.decode_seconds(len(rows_out), sum(positions) + len(positions)))
        return rows_out

    def warmup(self) -> None:
        """One tiny prefill + decode through the pool (no simulated time)."""
        blocks = self.pool.blocks.allocate(self.pool.layout.blocks_for(5))
        try:
            self._prefill([(blocks, [0, 1, 2, 3], 0)])
            self._decode([blocks], [4], [4])
        finally:
            self._written.clear()
            self.pool.blocks.release(blocks)

    def _prefill(self, parts: Sequence[tuple[list[int], list[int], int]]) -> tuple[list[list[bytes]], int, int]:
        """Check, then write every part's new records; each part's records of [start, n), the new and the
        cached token counts."""
        tables = batch_checks.prefill_parts(self.pool.layout, self.pool.blocks, self.max_model_len, parts)
        checked = [(t, self._ids(token_ids), start) for t, (_, token_ids, start) in zip(tables, parts)]
        planned = []
        for table, ids, start in checked:  # every cached prefix verified before anything is written
            planned.append((table, ids, start, chain(ids[start:], start, self._prefix(table, ids, start))))
        for table, ids, start, records in planned:
            self._records.write(table, start, records)
            last = len(ids) - 1
            self._remember((table[last // self.block_size], last), records[-1], _tokens_digest(ids))
        new = sum(len(ids) - start for _, ids, start in checked)
        return [p[3] for p in planned], new, sum(start for _, _, start in checked)

    def _decode(self, tables: list[list[int]], token_ids: list[int], positions: list[int]) -> list[bytes]:
        tables = batch_checks.decode_batch(self.pool.layout, self.pool.blocks, self.max_model_len, tables, token_ids,
                                           positions)
        return self._decode_checked(tables, self._ids(token_ids), positions)

    def _decode_checked(self, tables: list[list[int]], ids: list[int], positions: list[int]) -> list[bytes]:
        bs = self.block_size
        previous = [self._before(t, p) for t, p in zip(tables, positions)]  # verified before any write
        rows = []
        for table, token, pos, digest in zip(tables, ids, positions, previous):
            digest = digest_after(digest, token, pos)
            record = record_of(digest, token)
            self._records.write(table, pos, (record,))
            self._remember((table[pos // bs], pos), record, None)
            rows.append(digest)
        return rows

    def _prefix(self, table: list[int], ids: list[int], start: int) -> bytes:
        """digest_{start-1} of a prefill part, its records [0, start) verified against its tokens: in full,
        unless this runner's own last prefill of these very tokens ended at start - 1 (the chunk before) and
        its record is still in place."""
        if start == 0:
            return ZERO_DIGEST
        mine = self._written.get((table[(start - 1) // self.block_size], start - 1))
        if mine is not None and mine[1] is not None and self._records.read(table, start - 1) == mine[0] \
                and mine[1] == _tokens_digest(ids[:start]):
            return mine[0][:8]
        return self._records.verify_tokens(table, ids, start)

    def _before(self, table: list[int], pos: int) -> bytes:
        """digest_{pos-1} of a decode request, its records verified (see the module's docstring)."""
        if pos == 0:
            return ZERO_DIGEST
        key = (table[(pos - 1) // self.block_size], pos - 1)
        mine = self._written.pop(key, None)
        if mine is not None and self._records.read(table, pos - 1) == mine[0]:
            return mine[0][:8]  # the record this runner wrote at the previous step, still in place
        return self._records.verify_chain(table, pos)

    def _remember(self, key: tuple[int, int], record: bytes, tokens: bytes | None) -> None:
        self._written[key] = (record, tokens)
        self._written.move_to_end(key)
        if len(self._written) > REMEMBERED:
            self._written.popitem(last=False)

    def _take(self, started: float, seconds: float) -> None:
        """Sleep until the pass has taken its simulated time (``seconds`` / speedup since ``started``)."""
        if math.isinf(self.speedup):
            return
        left = seconds / self.speedup - (time.monotonic() - started)
        if left > 0:
            time.sleep(left)

    def _ids(self, token_ids: Sequence[int]) -> list[int]:
        ids = list(token_ids)
        for t in ids:
            if type(t) is not int or not 0 <= t < self.vocab_size:
                raise ValueError(f"token id {t!r} outside the vocabulary [0, {self.vocab_size})")
        return ids


def _tokens_digest(ids: list[int]) -> bytes:
    """A digest of a token sequence (ids already checked to be in the vocabulary), computed in C."""
    return blake2b(array("q", ids).tobytes(), digest_size=16).digest()
