"""A piece of a Mooncake-format trace scaled down for a small model: `xpyd plan` against the sim cluster.

    python scripts/scale_trace.py IN.jsonl OUT.jsonl --requests 40 --divide 16 --output-divide 8 --max-len 2000 \
        [--poisson-rate R --seed S]

Takes the first requests of IN (in timestamp order) whose scaled prompt + output fit --max-len, and writes them
with input_length / --divide and output_length / --output-divide (rounded up), timestamps unchanged. The hash
ids stay as they are: each now names a block of 512 / --divide tokens (replay with --trace-block-size 32 for
--divide 16), so the requests share the same prefixes, in fewer tokens. --poisson-rate R replaces the
timestamps (the release's come in 3-second steps, ten requests at a time) with Poisson arrivals at R requests
per second of trace time.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys

from xpyd.bench.trace import MOONCAKE_BLOCK_SIZE, load_trace


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("out")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--divide", type=int, default=16, help="input tokens and block size divided by this")
    p.add_argument("--output-divide", type=int, default=8)
    p.add_argument("--max-len", type=int, default=2000, help="scaled prompt + output tokens at most")
    p.add_argument("--poisson-rate", type=float, default=None, metavar="R",
                   help="Poisson arrivals at R requests/s instead of the trace's timestamps")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if MOONCAKE_BLOCK_SIZE % args.divide:
        print(f"--divide must divide {MOONCAKE_BLOCK_SIZE}", file=sys.stderr)
        return 2
    kept = []
    for r in load_trace(args.trace):
        inp, out = math.ceil(r.input_length / args.divide), math.ceil(r.output_length / args.output_divide)
        if inp + out <= args.max_len:
            ts = int(r.timestamp_ms) if r.timestamp_ms.is_integer() else r.timestamp_ms
            kept.append({"timestamp": ts, "input_length": inp, "output_length": out,
                         "hash_ids": list(r.hash_ids)})
        if len(kept) == args.requests:
            break
    if args.poisson_rate is not None:
        rng, t = random.Random(args.seed), 0.0
        for k in kept:
            k["timestamp"] = round(t * 1000.0, 3)
            t += rng.expovariate(args.poisson_rate)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(k) + "\n" for k in kept)
    print(f"{len(kept)} requests, block size {MOONCAKE_BLOCK_SIZE // args.divide}, span "
          f"{(kept[-1]['timestamp'] - kept[0]['timestamp']) / 1000:.1f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
