"""The serving benchmark's configuration: one dataclass, built once from the CLI and checked."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from xpyd.bench.client import Endpoint
from xpyd.bench.conversation import MultiTurnConfig
from xpyd.bench.metrics import SLO
from xpyd.bench.trace import TraceConfig, load_trace
from xpyd.bench.workload import parse_range


class Workload(str, Enum):
    FIXED = "fixed"  # every request --input-len / --output-len
    RANDOM = "random"  # lengths uniform over --input-len-range / --output-len-range
    JSONL = "jsonl"  # prompts from --prompts
    PREFILL_STALL = "prefill-stall"  # short streams at fixed concurrency + Poisson long prompts
    SHARED_PREFIX = "shared-prefix"  # a few long prefixes, each request one of them + its own suffix
    MULTI_TURN = "multi-turn"  # conversations whose every turn carries the history with the answers
    TRACE = "trace"  # a Mooncake-format trace replayed at its timestamps (--trace FILE)


DEFAULT_LENS = {Workload.PREFILL_STALL: (64, 128), Workload.SHARED_PREFIX: (64, 32),
                Workload.MULTI_TURN: (64, 32)}  # others: (128, 128)


@dataclass(frozen=True, slots=True)
class StallConfig:
    """The prefill-stall scenario: ``short_concurrency`` steady short streams (the run's
    --num-requests, --input-len/--output-len) while long prompts arrive as a Poisson process until the
    short class has finished. Defaults suit a 2-core CPU box serving SmolLM2-135M."""

    long_input: int = 1024
    long_output: int = 16
    long_rate: float = 0.25
    short_concurrency: int = 4  # also the default when neither this nor --concurrency is given

    def __post_init__(self) -> None:
        if self.long_input < 1 or self.long_output < 1 or self.short_concurrency < 1:
            raise ValueError("--stall-long-input, --stall-long-output and --stall-short-concurrency must be >= 1")
        if not self.long_rate > 0:
            raise ValueError(f"--stall-long-rate must be > 0, got {self.long_rate}")


@dataclass(frozen=True, slots=True)
class SharedPrefixConfig:
    """The shared-prefix workload (``vllm bench serve --dataset-name prefix_repetition``'s shape:
    num_prefixes / prefix_len, suffix_len = --input-len, output_len = --output-len); prefixes are
    assigned round-robin (``workload.shared_prefix_requests``)."""

    num_prefixes: int = 4
    prefix_len: int = 1024

    def __post_init__(self) -> None:
        if self.num_prefixes < 1 or self.prefix_len < 1:
            raise ValueError("--num-prefixes and --prefix-len must be >= 1")


@dataclass(frozen=True, slots=True)
class BenchConfig:
    url: str
    num_requests: int
    endpoint: Endpoint = Endpoint.COMPLETIONS
    model: str | None = None  # None: the first of GET /v1/models
    workload: Workload = Workload.FIXED
    concurrency: int | None = None  # closed loop with this many workers ...
    rate: float | None = None  # ... or Poisson arrivals at this rate (req/s); neither: concurrency 1
    input_len: int = 128
    output_len: int = 128
    input_range: tuple[int, int] | None = None
    output_range: tuple[int, int] | None = None
    prompts_path: Path | None = None
    tokenizer_path: Path | None = None
    warmup: int = 0
    duration_s: float | None = None
    seed: int = 0
    timeout_s: float = 300.0
    api_key: str | None = None
    slo: SLO = field(default_factory=SLO)
    json_path: Path | None = None
    plot_dir: Path | None = None
    progress: bool = True
    include_requests: bool = False
    stall: StallConfig = field(default_factory=StallConfig)
    shared_prefix: SharedPrefixConfig = field(default_factory=SharedPrefixConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    trace: TraceConfig | None = None  # with --workload trace (given by --trace FILE)
    stream: bool = True  # False (--no-stream): JSON answers, the client's TTFT is the answer's arrival
    n: int = 1  # choices per request (--n)

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://, got {self.url!r}")
        if self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}")
        if self.concurrency is not None and self.rate is not None:
            raise ValueError("give --concurrency or --rate, not both")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"--rate must be > 0, got {self.rate}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("--input-len and --output-len must be >= 1")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if self.n < 1:
            raise ValueError(f"--n must be >= 1, got {self.n}")
        if self.n > 1 and self.workload is Workload.MULTI_TURN:
            raise ValueError("--n > 1 does not go with multi-turn (the next turn is built from one answer)")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"--duration must be > 0, got {self.duration_s}")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout must be > 0, got {self.timeout_s}")
        if (self.workload is Workload.JSONL) != (self.prompts_path is not None):
            raise ValueError("--prompts FILE goes with --workload jsonl (and jsonl needs --prompts)")
        if self.workload is not Workload.RANDOM and (self.input_range or self.output_range):
            raise ValueError("--input-len-range / --output-len-range go with --workload random")
        if self.workload is Workload.PREFILL_STALL and self.rate is not None:
            raise ValueError("prefill-stall has its own arrivals: --stall-short-concurrency for the short "
                             "streams and --stall-long-rate for the long prompts, not --rate")
        if self.workload is Workload.MULTI_TURN:
            self._check_multi_turn()
        if (self.workload is Workload.TRACE) != (self.trace is not None):
            raise ValueError("--trace FILE goes with --workload trace (the default when --trace is given)")
        if self.trace is not None:
            if self.concurrency is not None or self.rate is not None:
                raise ValueError("a trace sends each request at its timestamp: no --concurrency or --rate "
                                 "(--time-scale speeds it up)")
            if self.endpoint is not Endpoint.COMPLETIONS:
                raise ValueError("--trace needs --endpoint completions (prompts of exact token blocks)")

    def _check_multi_turn(self) -> None:
        mt = self.multi_turn
        if self.rate is not None:
            raise ValueError("multi-turn runs conversations in a closed loop: --concurrency (conversations "
                             "in flight), not --rate")
        if self.num_requests != mt.conversations * mt.turns:
            raise ValueError(f"multi-turn sends --conversations x --turns = {mt.conversations} x {mt.turns} = "
                             f"{mt.conversations * mt.turns} requests; --num-requests {self.num_requests} "
                             f"disagrees (leave it out)")
        if self.concurrency is not None and self.concurrency > mt.conversations:
            raise ValueError(f"--concurrency {self.concurrency} > --conversations {mt.conversations}: a "
                             f"conversation has one request in flight at a time")

    @property
    def effective_concurrency(self) -> int:
        """Workers of the closed loop (the short class for prefill-stall)."""
        if self.workload is Workload.PREFILL_STALL:
            return self.stall.short_concurrency
        if self.workload is Workload.MULTI_TURN:  # conversations in flight: all of them by default
            return self.concurrency or self.multi_turn.conversations
        return self.concurrency or 1

    @property
    def max_connections(self) -> int:
        """Enough connections that the client never queues a request the arrival process sent."""
        if self.workload is Workload.PREFILL_STALL:
            return self.stall.short_concurrency + 64  # long prompts are rare; 64 in flight is a meltdown
        if self.rate is not None or self.workload is Workload.TRACE:
            return max(self.num_requests, 1)
        return self.effective_concurrency

    def describe(self) -> dict:
        """The configuration as JSON (for the report); the API key is never included."""
        out = {
            "url": self.url, "endpoint": self.endpoint.value, "model": self.model,
            "workload": self.workload.value, "num_requests": self.num_requests,
            "concurrency": (None if self.rate is not None or self.workload is Workload.TRACE
                            else self.effective_concurrency),
            "rate": self.rate, "input_len": self.input_len, "output_len": self.output_len,
            "input_len_range": list(self.input_range) if self.input_range else None,
            "output_len_range": list(self.output_range) if self.output_range else None,
            "prompts": str(self.prompts_path) if self.prompts_path else None,
            "tokenizer": str(self.tokenizer_path) if self.tokenizer_path else None,
            "warmup": self.warmup, "duration_s": self.duration_s, "seed": self.seed,
            "timeout_s": self.timeout_s, "slo_ms": self.slo.as_ms(), "stream": self.stream, "n": self.n,
        }
        if self.workload is Workload.PREFILL_STALL:
            out["stall"] = {"long_input": self.stall.long_input, "long_output": self.stall.long_output,
                            "long_rate": self.stall.long_rate,
                            "short_concurrency": self.stall.short_concurrency}
        if self.workload is Workload.SHARED_PREFIX:
            sp = self.shared_prefix
            out["shared_prefix"] = {"num_prefixes": sp.num_prefixes, "prefix_len": sp.prefix_len,
                                    "suffix_len": self.input_len, "assignment": "round-robin"}
        if self.workload is Workload.MULTI_TURN:
            mt = self.multi_turn
            out["multi_turn"] = {"conversations": mt.conversations, "turns": mt.turns,
                                 "prefix_len": mt.prefix_len, "shared_context": mt.shared_context,
                                 "think_time_s": mt.think_time_s, "think_time": "exponential"}
        if self.trace is not None:
            tc = self.trace
            out["trace"] = {"path": str(tc.path), "time_scale": tc.time_scale, "max_requests": tc.max_requests,
                            "block_size": tc.block_size}
        return out


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Raises ValueError with a message naming the flag for anything inconsistent."""
    if args.url is None:
        raise ValueError("--url is required")
    workload = _workload(args)
    _check_workload_flags(args, workload)
    trace = _trace_config(args, workload)
    shared_prefix = SharedPrefixConfig(**_given(num_prefixes=args.num_prefixes, prefix_len=args.prefix_len))
    multi_turn = MultiTurnConfig()
    if workload is Workload.MULTI_TURN:  # conversations: --conversations, else --concurrency, else 4
        conc = args.concurrency if args.concurrency is not None and args.concurrency >= 1 else None
        multi_turn = MultiTurnConfig(**_given(
            conversations=args.conversations if args.conversations is not None else conc,
            turns=args.turns, prefix_len=args.prefix_len, think_time_s=args.think_time),
            shared_context=args.shared_context)
    num_requests = args.num_requests
    if num_requests is None and workload is Workload.MULTI_TURN:
        num_requests = multi_turn.conversations * multi_turn.turns
    if trace is not None:  # the trace is read (and checked) now: a bad line is a bad argument
        num_requests = len(load_trace(trace.path, trace.block_size, trace.max_requests))
    if num_requests is None:
        raise ValueError("--num-requests is required")
    d_in, d_out = DEFAULT_LENS.get(workload, (128, 128))
    input_len = args.input_len if args.input_len is not None else d_in
    output_len = args.output_len if args.output_len is not None else d_out
    input_range = parse_range(args.input_len_range) if args.input_len_range else None
    output_range = parse_range(args.output_len_range) if args.output_len_range else None
    if workload is Workload.RANDOM:  # a range not given is the fixed length
        input_range = input_range or (input_len, input_len)
        output_range = output_range or (output_len, output_len)
    short = next((c for c in (args.stall_short_concurrency, args.concurrency) if c is not None), None)
    stall = StallConfig(long_input=args.stall_long_input, long_output=args.stall_long_output,
                        long_rate=args.stall_long_rate,
                        **({} if short is None else {"short_concurrency": short}))
    return BenchConfig(
        url=args.url, num_requests=num_requests, endpoint=Endpoint(args.endpoint), model=args.model,
        workload=workload, concurrency=args.concurrency, rate=args.rate, input_len=input_len,
        output_len=output_len, input_range=input_range, output_range=output_range,
        prompts_path=Path(args.prompts) if args.prompts else None,
        tokenizer_path=Path(args.tokenizer) if args.tokenizer else None, warmup=args.warmup,
        duration_s=args.duration, seed=args.seed, timeout_s=args.timeout, api_key=args.api_key,
        slo=SLO.parse(args.slo or ""), json_path=Path(args.json) if args.json else None,
        plot_dir=Path(args.plot) if args.plot else None, progress=not args.no_progress,
        include_requests=args.include_requests, stall=stall, shared_prefix=shared_prefix, multi_turn=multi_turn,
        trace=trace, stream=not args.no_stream, n=args.n,
    )


_TRACE_ONLY = {"--time-scale": "time_scale", "--max-requests": "max_requests",
               "--trace-block-size": "trace_block_size"}
_NOT_WITH_TRACE = {"--num-requests": "num_requests", "--input-len": "input_len", "--output-len": "output_len",
                   "--input-len-range": "input_len_range", "--output-len-range": "output_len_range",
                   "--concurrency": "concurrency", "--rate": "rate"}


def _workload(args: argparse.Namespace) -> Workload:
    """--workload, else trace when --trace is given, else fixed."""
    if args.workload is None:
        return Workload.TRACE if args.trace is not None else Workload.FIXED
    workload = Workload(args.workload)
    if args.trace is not None and workload is not Workload.TRACE:
        raise ValueError(f"--trace replays a trace: it does not go with --workload {workload.value}")
    return workload


def _trace_config(args: argparse.Namespace, workload: Workload) -> TraceConfig | None:
    if args.trace is None:
        for flag, attr in _TRACE_ONLY.items():
            if getattr(args, attr) is not None:
                raise ValueError(f"{flag} goes with --trace FILE")
        if workload is Workload.TRACE:
            raise ValueError("--workload trace needs --trace FILE")
        return None
    for flag, attr in _NOT_WITH_TRACE.items():
        if getattr(args, attr) is not None:
            raise ValueError(f"{flag} does not go with --trace: the trace gives each request's lengths and send "
                             f"time (--max-requests N replays the first N, --time-scale X runs X times as fast)")
    return TraceConfig(**_given(path=Path(args.trace), time_scale=args.time_scale, max_requests=args.max_requests,
                                block_size=args.trace_block_size))


def _given(**values) -> dict:
    """The keyword arguments that were given (not None): the others keep the dataclass defaults."""
    return {k: v for k, v in values.items() if v is not None}


_WORKLOAD_FLAGS = {  # flag: (attribute, the workloads it goes with)
    "--num-prefixes": ("num_prefixes", (Workload.SHARED_PREFIX,)),
    "--prefix-len": ("prefix_len", (Workload.SHARED_PREFIX, Workload.MULTI_TURN)),
    "--conversations": ("conversations", (Workload.MULTI_TURN,)),
    "--turns": ("turns", (Workload.MULTI_TURN,)),
    "--think-time": ("think_time", (Workload.MULTI_TURN,)),
    "--shared-context": ("shared_context", (Workload.MULTI_TURN,)),
}


def _check_workload_flags(args: argparse.Namespace, workload: Workload) -> None:
    for flag, (attr, workloads) in _WORKLOAD_FLAGS.items():
        value = getattr(args, attr)
        if value is not None and value is not False and workload not in workloads:
            names = " or ".join(w.value for w in workloads)
            raise ValueError(f"{flag} goes with --workload {names}")
