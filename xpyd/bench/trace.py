"""Trace replay: Mooncake-format request traces turned into timed requests with shared prefixes.

A trace is one JSON object a line (the Mooncake FAST'25 release's format)::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ...]}

``timestamp`` is milliseconds from the trace's start, the lengths are tokens, and ``hash_ids`` names
the prompt's blocks of ``block_size`` tokens (512 in Mooncake's traces; the last block may be
partial, so there are exactly ceil(input_length / block_size) ids). Two requests with the same id
share that block's tokens.

This module owns:

- ``load_trace``: reading and checking a trace (a bad line is a ``TraceError`` naming the file and
  line), the first ``max_requests`` requests, in timestamp order;
- ``trace_stats``: what the trace itself says (requests, mean lengths, and the prefix-sharing ratio:
  the input tokens in leading blocks an earlier request already had, over all input tokens; the hit
  rate an unbounded prefix cache would reach, an upper bound for a server's);
- ``TraceRequests``: the requests, built when asked for (a whole trace's prompts do not fit in
  memory). Each hash id maps to its own block of tokens drawn by ``random.Random`` seeded with the id
  (and ``--seed``) from the prompt builder's vocabulary, so the same id gives the same tokens in every
  run and every process; a partial last block is the first tokens of its id's block. With a
  tokenizer the prompt is a list of token ids (exact: no re-tokenization merges across block
  edges); without one it is text of common words, about one token each;
- ``send_offsets``: when each request goes, scaled by ``time_scale`` (2.0 replays twice as fast).
"""

from __future__ import annotations

import json
import math
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from xpyd.bench.workload import WORDS, RequestSpec, WorkloadError

MOONCAKE_BLOCK_SIZE = 512
_BLOCK_CACHE = 8192  # blocks kept built (a 512-token block of ids is ~4 KiB of references)
_SEED_STRIDE = 1 << 64  # seed s, id h -> random.Random(s * 2**64 + h): the default seed 0 is Random(h)


class TraceError(WorkloadError):
    """A trace that cannot be replayed: the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    line: int  # 1-based line in the trace file
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """``--trace FILE [--time-scale X] [--max-requests N] [--trace-block-size B]``."""

    path: Path
    time_scale: float = 1.0  # 2.0 sends every request at half its timestamp: twice as fast
    max_requests: int | None = None  # None: the whole trace
    block_size: int = MOONCAKE_BLOCK_SIZE

    def __post_init__(self) -> None:
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise ValueError(f"--time-scale must be a finite number > 0, got {self.time_scale}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"--max-requests must be >= 1, got {self.max_requests}")
        if self.block_size < 1:
            raise ValueError(f"--trace-block-size must be >= 1, got {self.block_size}")


def _int_field(obj: dict, key: str, where: str, minimum: int) -> int:
    if key not in obj:
        raise TraceError(f"{where}: missing field {key!r}")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise TraceError(f"{where}: {key!r} must be an integer, got {v!r}")
    if v < minimum:
        raise TraceError(f"{where}: {key!r} must be >= {minimum}, got {v}")
    return v


def parse_record(line: str, where: str, lineno: int, block_size: int) -> TraceRecord:
    """One trace line -> a record; ``TraceError`` (naming ``where``) for anything malformed."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not JSON: {e.msg}") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "timestamp" not in obj:
        raise TraceError(f"{where}: missing field 'timestamp'")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise TraceError(f"{where}: 'timestamp' must be a number of milliseconds >= 0, got {ts!r}")
    input_length = _int_field(obj, "input_length", where, 1)
    output_length = _int_field(obj, "output_length", where, 1)
    if "hash_ids" not in obj:
        raise TraceError(f"{where}: missing field 'hash_ids'")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0
                                            for h in ids):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers >= 0")
    need = -(-input_length // block_size)
    if len(ids) != need:
        raise TraceError(f"{where}: {len(ids)} hash_ids do not cover input_length {input_length} in blocks of "
                         f"{block_size} tokens (expected {need}; see --trace-block-size)")
    return TraceRecord(lineno, float(ts), input_length, output_length, tuple(ids))


def load_trace(path: str | Path, block_size: int = MOONCAKE_BLOCK_SIZE,
               max_requests: int | None = None) -> list[TraceRecord]:
    """The first ``max_requests`` requests of the trace (blank lines skipped), sorted by timestamp
    (stable: requests with one timestamp keep their order). Raises ``TraceError``."""
    path = Path(path)
    records: list[TraceRecord] = []
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if max_requests is not None and len(records) >= max_requests:
                    break
                if line.strip():
                    records.append(parse_record(line, f"{path}:{lineno}", lineno, block_size))
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not UTF-8 text: {e}") from None
    if not records:
        raise TraceError(f"{path}: no requests (expected one JSON object a line)")
    records.sort(key=lambda r: r.timestamp_ms)
    return records


@dataclass(frozen=True, slots=True)
class TraceStats:
    requests: int
    block_size: int
    total_input_tokens: int
    total_output_tokens: int
    shared_prefix_tokens: int  # input tokens in leading blocks an earlier request already had
    span_s: float  # last timestamp - first, in the trace's own time

    @property
    def mean_input_tokens(self) -> float:
        return self.total_input_tokens / self.requests

    @property
    def mean_output_tokens(self) -> float:
        return self.total_output_tokens / self.requests

    @property
    def prefix_sharing_ratio(self) -> float:
        """The prefix-cache hit rate an unbounded cache of ``block_size`` blocks would reach."""
        return self.shared_prefix_tokens / self.total_input_tokens

    def as_dict(self, time_scale: float) -> dict:
        return {"requests": self.requests, "block_size": self.block_size,
                "mean_input_tokens": self.mean_input_tokens, "mean_output_tokens": self.mean_output_tokens,
                "total_input_tokens": self.total_input_tokens, "total_output_tokens": self.total_output_tokens,
                "shared_prefix_tokens": self.shared_prefix_tokens,
                "prefix_sharing_ratio": self.prefix_sharing_ratio, "span_s": self.span_s,
                "time_scale": time_scale, "replay_span_s": self.span_s / time_scale}


def block_lengths(input_length: int, block_size: int) -> list[int]:
    """Tokens of each block of a prompt: full blocks, then the remainder (if any)."""
    full, rest = divmod(input_length, block_size)
    return [block_size] * full + ([rest] if rest else [])


def trace_stats(records: Sequence[TraceRecord], block_size: int) -> TraceStats:
    """Counts a request's block as shared when every block up to it is too and an earlier request had
    that id (as many of its tokens as the longest earlier block of that id: a partial block shares
    only what it has)."""
    if not records:
        raise ValueError("no trace records")
    seen: dict[int, int] = {}  # hash id -> the most tokens of its block any request had so far
    shared = 0
    for r in records:
        prefix = True
        for h, n in zip(r.hash_ids, block_lengths(r.input_length, block_size)):
            before = seen.get(h, 0)
            if prefix:
                shared += min(before, n)
                prefix = before >= n
            if n > before:
                seen[h] = n
    return TraceStats(len(records), block_size, sum(r.input_length for r in records),
                      sum(r.output_length for r in records), shared,
                      (records[-1].timestamp_ms - records[0].timestamp_ms) / 1000.0)


def send_offsets(records: Sequence[TraceRecord], time_scale: float) -> list[float]:
    """Seconds from the replay's start: (timestamp - the first's) / 1000 / ``time_scale``."""
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    t0 = records[0].timestamp_ms if records else 0.0
    return [(r.timestamp_ms - t0) / 1000.0 / time_scale for r in records]


class TraceRequests(Sequence[RequestSpec]):
    """The trace's requests, each built when it is asked for.

    ``vocab``: token ids (the prompt is a tuple of ids) or words (text joined by spaces). Block ``h`` is
    ``random.Random(seed * 2**64 + h).choices(vocab, k=block_size)``."""

    def __init__(self, records: Sequence[TraceRecord], block_size: int, vocab: Sequence[int] | Sequence[str],
                 seed: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not vocab:
            raise ValueError("an empty vocabulary")
        self._records = list(records)
        self._block_size = block_size
        self._vocab = list(vocab)
        self._ids = isinstance(self._vocab[0], int)
        self._seed = seed
        self._cache: OrderedDict[int, list] = OrderedDict()

    @classmethod
    def with_words(cls, records: Sequence[TraceRecord], block_size: int, seed: int = 0) -> TraceRequests:
        return cls(records, block_size, WORDS, seed)

    @property
    def records(self) -> list[TraceRecord]:
        return self._records

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        r = self._records[i]
        return RequestSpec(prompt=self.prompt(r.hash_ids, r.input_length), max_tokens=r.output_length,
                           input_len=r.input_length, trace_line=r.line)

    def block(self, hash_id: int) -> list:
        """The ``block_size`` tokens (ids or words) of ``hash_id``."""
        b = self._cache.get(hash_id)
        if b is not None:
            self._cache.move_to_end(hash_id)
            return b
        b = random.Random(self._seed * _SEED_STRIDE + hash_id).choices(self._vocab, k=self._block_size)
        self._cache[hash_id] = b
        if len(self._cache) > _BLOCK_CACHE:
            self._cache.popitem(last=False)
        return b

    def tokens(self, hash_ids: Sequence[int], input_length: int) -> list:
        """The prompt's ``input_length`` tokens: each id's block, the last one cut to what remains."""
        out: list = []
        for h, n in zip(hash_ids, block_lengths(input_length, self._block_size)):
            out.extend(self.block(h)[:n])
        if len(out) != input_length:
            raise ValueError(f"{len(hash_ids)} hash ids do not cover {input_length} tokens")
        return out

    def prompt(self, hash_ids: Sequence[int], input_length: int) -> tuple[int, ...] | str:
        toks = self.tokens(hash_ids, input_length)
        return tuple(toks) if self._ids else " ".join(toks)
