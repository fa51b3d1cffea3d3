"""`xpyd bench calibrate`: measure the real engine (`ModelRunner`) for the simulated one's timing profile.

Prefill: one forward pass of N new tokens after C cached ones, over a grid of (N, C); decode: one step of a
batch of B requests whose contexts total T tokens (T / B each), over a grid of (B, T). Each point: a warm-up
pass, then the median of a few timed ones. Only the time is measured, so the KV the passes attend over is
whatever the pool holds (no prefix is computed first: its values do not change the time). The result is a
profile dict (`xpyd.model.sim.profile`: the tables plus the model, machine, dtype, threads and date) for
`--engine sim --sim-profile FILE`.

Outside the sim package on purpose: this module runs torch and the model; only the CLI imports it, and the
real engine's modules load only when a measurement starts (so `--help` answers at once).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from xpyd.model.sim.profile import SimProfile, Table

__all__ = ["DEFAULT_GRID", "QUICK_GRID", "Grid", "add_arguments", "calibrate", "main"]

BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class Grid:
    prefill_new: tuple[int, ...]  # new tokens of a prefill pass
    prefill_cached: tuple[int, ...]  # tokens already cached before them
    decode_batch: tuple[int, ...]  # requests of a decode step
    decode_context: tuple[int, ...]  # context tokens of the whole batch (each request: context / batch)
    repeats: int = 3  # timed passes per point (their median is kept)
    warmup: int = 1  # untimed passes before them

    def __post_init__(self) -> None:
        for name, low in (("prefill_new", 1), ("prefill_cached", 0), ("decode_batch", 1), ("decode_context", 1)):
            axis = getattr(self, name)
            if not axis or any(isinstance(v, bool) or not isinstance(v, int) or v < low for v in axis) \
                    or list(axis) != sorted(set(axis)):
                raise ValueError(f"grid {name} must be strictly increasing ints >= {low}, got {axis!r}")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError("a grid needs repeats >= 1 and warmup >= 0")

    @property
    def max_tokens(self) -> int:
        """The longest sequence a pass of the grid holds."""
        return max(self.prefill_new[-1] + self.prefill_cached[-1], max(self._contexts()))

    def blocks(self) -> int:
        """KV blocks that hold the largest pass of the grid."""
        prefill = -(-(self.prefill_new[-1] + self.prefill_cached[-1]) // BLOCK_SIZE)
        decode = max(b * -(-max(1, t // b) // BLOCK_SIZE) for b in self.decode_batch for t in self.decode_context)
        return max(prefill, decode)

    def _contexts(self) -> list[int]:
        return [max(1, t // b) for b in self.decode_batch for t in self.decode_context]


# ~2 minutes for the default model in float32 on one thread of a 2-core machine; past the grid, linear.
DEFAULT_GRID = Grid(prefill_new=(16, 128, 512), prefill_cached=(0, 1024, 4096),
                    decode_batch=(1, 4, 16), decode_context=(64, 1024, 8192), repeats=5)
QUICK_GRID = Grid(prefill_new=(16, 128), prefill_cached=(0, 256), decode_batch=(1, 4), decode_context=(64, 512),
                  repeats=2)


def calibrate(model: str | Path | None, dtype: str = "float32", threads: int | None = None,
              grid: Grid = DEFAULT_GRID, progress: Callable[[str], None] | None = None) -> dict:
    """Measure the model (a folder, a .gguf file, None: the default model) on ``grid``; the profile dict.
    ValueError for an unknown dtype, a bad thread count, or a grid longer than the model's context."""
    import torch  # the real engine: only here, so that the command's --help needs none of it

    from xpyd.model.loader import ensure_converted
    from xpyd.model.runner import ModelRunner

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype not in dtypes:
        raise ValueError(f"dtype must be one of {sorted(dtypes)}, not {dtype!r}")
    if threads is not None:
        if threads < 1:
            raise ValueError("threads must be >= 1")
        torch.set_num_threads(threads)
    say = progress or (lambda line: None)
    resolved = ensure_converted(None if model is None else str(model), progress=False)
    runner = ModelRunner(resolved.path, dtypes[dtype], num_blocks=grid.blocks(), max_seq_len=grid.max_tokens,
                         block_size=BLOCK_SIZE)
    if runner.max_model_len < grid.max_tokens:
        raise ValueError(f"the grid needs {grid.max_tokens} tokens of context, the model has {runner.max_model_len}")
    runner.warmup()
    rng = random.Random(0)
    ids = [rng.randrange(runner.vocab_size) for _ in range(grid.max_tokens)]

    def timed(run: Callable[[], object]) -> float:
        for _ in range(grid.warmup):
            run()
        times = []
        for _ in range(grid.repeats):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    alloc = runner.pool.blocks
    prefill = []
    for new in grid.prefill_new:
        row = []
        for cached in grid.prefill_cached:
            blocks = alloc.allocate(runner.pool.layout.blocks_for(cached + new))
            row.append(timed(lambda: runner.prefill(blocks, ids[: cached + new], start=cached)))
            alloc.release(blocks)
            say(f"prefill {new:>6} new after {cached:>6} cached: {row[-1] * 1e3:9.1f} ms")
        prefill.append(row)
    decode = []
    for batch in grid.decode_batch:
        row = []
        for context in grid.decode_context:
            each = max(1, context // batch)
            tables = [alloc.allocate(runner.pool.layout.blocks_for(each)) for _ in range(batch)]
            tokens = ids[:batch]
            row.append(timed(lambda: runner.decode(tables, tokens, [each - 1] * batch)))
            for table in tables:
                alloc.release(table)
            say(f"decode batch {batch:>4}, {context:>6} context tokens: {row[-1] * 1e3:9.1f} ms")
        decode.append(row)
    profile = SimProfile(
        prefill=Table(tuple(grid.prefill_new), tuple(grid.prefill_cached), tuple(tuple(r) for r in prefill)),
        decode=Table(tuple(grid.decode_batch), tuple(grid.decode_context), tuple(tuple(r) for r in decode)),
        model=resolved.served_name, machine=_machine(), dtype=dtype, threads=torch.get_num_threads(),
        created=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        notes=f"xpyd bench calibrate: median of {grid.repeats} passes after {grid.warmup} warm-up per point; "
              f"device cpu; {'lean' if runner.fast_path_active else 'general'} forward; torch {torch.__version__}",
    )
    return profile.to_dict()


def _machine() -> str:
    """The CPU's model name, cores and OS, e.g. 'Intel(R) Xeon(R) Processor, 2 cores, x86_64 Linux'."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores, {platform.machine()} {platform.system()}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="Hugging Face safetensors folder or .gguf file (default: SmolLM2-135M-Instruct, as "
                             "the workers)")
    parser.add_argument("--out", required=True, type=Path, metavar="FILE", help="the profile to write (JSON)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="weights and KV dtype (default %(default)s)")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="torch threads (default: half the cores, as a worker's default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="a small grid (seconds, for a smoke test) instead of the default one (minutes)")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="xpyd bench calibrate",
        description="Measure this machine's real engine for the simulated one (--engine sim --sim-profile FILE): "
                    "prefill time vs new and cached tokens, decode step time vs batch and context tokens, medians "
                    "of a few passes per grid point. Writes a profile (JSON; format in docs/sim.md).")
    add_arguments(parser)
    args = parser.parse_args(argv)
    grid = QUICK_GRID if args.quick else DEFAULT_GRID
    try:
        if not args.out.parent.is_dir():
            raise ValueError(f"--out: no folder {args.out.parent}")
        data = calibrate(args.model, args.dtype, args.threads, grid, progress=lambda s: print(s, file=sys.stderr))
        SimProfile.from_dict(data).save(args.out)
    except (ValueError, FileNotFoundError) as e:
        print(f"xpyd bench calibrate: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0
