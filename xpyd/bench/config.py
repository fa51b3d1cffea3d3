"""The serving benchmark's configuration: one dataclass, built once from the CLI and checked."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from xpyd.bench.client import Endpoint
from xpyd.bench.metrics import SLO
from xpyd.bench.workload import parse_range


class Workload(str, Enum):
    FIXED = "fixed"  # every request --input-len / --output-len
    RANDOM = "random"  # lengths uniform over --input-len-range / --output-len-range
    JSONL = "jsonl"  # prompts from --prompts
    PREFILL_STALL = "prefill-stall"  # short streams at fixed concurrency + Poisson long prompts


DEFAULT_LENS = {Workload.PREFILL_STALL: (64, 128)}  # others: (128, 128)


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

    @property
    def effective_concurrency(self) -> int:
        """Workers of the closed loop (the short class for prefill-stall)."""
        if self.workload is Workload.PREFILL_STALL:
            return self.stall.short_concurrency
        return self.concurrency or 1

    @property
    def max_connections(self) -> int:
        """Enough connections that the client never queues a request the arrival process sent."""
        if self.workload is Workload.PREFILL_STALL:
            return self.stall.short_concurrency + 64  # long prompts are rare; 64 in flight is a meltdown
        if self.rate is not None:
            return max(self.num_requests, 1)
        return self.effective_concurrency

    def describe(self) -> dict:
        """The configuration as JSON (for the report); the API key is never included."""
        out = {
            "url": self.url, "endpoint": self.endpoint.value, "model": self.model,
            "workload": self.workload.value, "num_requests": self.num_requests,
            "concurrency": None if self.rate is not None else self.effective_concurrency,
            "rate": self.rate, "input_len": self.input_len, "output_len": self.output_len,
            "input_len_range": list(self.input_range) if self.input_range else None,
            "output_len_range": list(self.output_range) if self.output_range else None,
            "prompts": str(self.prompts_path) if self.prompts_path else None,
            "tokenizer": str(self.tokenizer_path) if self.tokenizer_path else None,
            "warmup": self.warmup, "duration_s": self.duration_s, "seed": self.seed,
            "timeout_s": self.timeout_s, "slo_ms": self.slo.as_ms(),
        }
        if self.workload is Workload.PREFILL_STALL:
            out["stall"] = {"long_input": self.stall.long_input, "long_output": self.stall.long_output,
                            "long_rate": self.stall.long_rate,
                            "short_concurrency": self.stall.short_concurrency}
        return out


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Raises ValueError with a message naming the flag for anything inconsistent."""
    if args.url is None:
        raise ValueError("--url is required")
    if args.num_requests is None:
        raise ValueError("--num-requests is required")
    workload = Workload(args.workload)
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
        url=args.url, num_requests=args.num_requests, endpoint=Endpoint(args.endpoint), model=args.model,
        workload=workload, concurrency=args.concurrency, rate=args.rate, input_len=input_len,
        output_len=output_len, input_range=input_range, output_range=output_range,
        prompts_path=Path(args.prompts) if args.prompts else None,
        tokenizer_path=Path(args.tokenizer) if args.tokenizer else None, warmup=args.warmup,
        duration_s=args.duration, seed=args.seed, timeout_s=args.timeout, api_key=args.api_key,
        slo=SLO.parse(args.slo or ""), json_path=Path(args.json) if args.json else None,
        plot_dir=Path(args.plot) if args.plot else None, progress=not args.no_progress,
        include_requests=args.include_requests, stall=stall,
    )
