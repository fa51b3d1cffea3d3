"""``xpyd bench``: the serving benchmark (default mode) and ``xpyd bench transfer`` (KV transfer).

Wiring: ``p = sub.add_parser("bench"); add_arguments(p)`` then ``run(args)``. Standalone:
``python -m xpyd.bench.main --url ...``.

A serving run: config (exit 2 if inconsistent) -> prompts (exit 2 if they cannot be built) ->
``GET /v1/models`` (exit 1 if nothing answers; gives the default model) -> warmup (not counted) ->
the measured arrival process -> metrics -> table on stdout, ``--json``, ``--plot`` -> exit 0, also
when some requests failed (they are reported).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Iterator

from tqdm import tqdm

from xpyd.bench import plot
from xpyd.bench.client import (Endpoint, EndpointUnreachable, NotOpenAI, RequestResult, StreamingClient,
                               fetch_model_names)
from xpyd.bench.config import BenchConfig, SharedPrefixConfig, StallConfig, Workload, config_from_args
from xpyd.bench.conversation import Conversation, MultiTurnConfig, build_conversations
from xpyd.bench.metrics import summarize, summarize_turns, summarize_workers
from xpyd.bench.overhead import summarize_overhead
from xpyd.bench.phases import summarize_phases
from xpyd.bench.report import build_report, format_table, request_records, write_json
from xpyd.bench.runner import Timed, closed_loop, conversations, open_loop, prefill_stall, timed
from xpyd.bench.trace import MOONCAKE_BLOCK_SIZE, TraceRequests, load_trace, send_offsets, trace_stats
from xpyd.bench.workload import (LABEL_ALL, LABEL_LONG, LABEL_SHORT, WORDS, PromptBuilder, RequestSpec,
                                 TokenizerPromptBuilder, WordPromptBuilder, cycle_to, fixed_requests,
                                 iter_fixed, load_jsonl, poisson_offsets, random_requests,
                                 shared_prefix_requests)

DESCRIPTION = """\
Benchmark a serving endpoint (xpyd, vLLM, llama.cpp: anything OpenAI-compatible) with streaming
requests and report TTFT, TPOT, ITL, E2E (mean/p50/p90/p99), throughput and goodput.

modes:
  xpyd bench --url URL ...        serving benchmark (the options below)
  xpyd bench transfer ...         KV transfer benchmark (xpyd bench transfer --help)

examples:
  xpyd bench --url http://127.0.0.1:8000 --num-requests 64 --concurrency 4 \\
      --input-len 256 --output-len 64 --slo ttft=500ms,itl=50ms --json out.json --plot plots/
  xpyd bench --url http://127.0.0.1:8000 --workload prefill-stall --num-requests 40 --json stall.json
  xpyd bench --url http://127.0.0.1:8000 --workload shared-prefix --num-prefixes 4 --prefix-len 1024 \\
      --input-len 64 --output-len 32 --num-requests 64 --concurrency 4 --tokenizer PATH
  xpyd bench --url http://127.0.0.1:8000 --endpoint chat --workload multi-turn --conversations 8 \\
      --turns 4 --prefix-len 512 --input-len 64 --output-len 32 --think-time 1 --concurrency 4
  xpyd bench --url http://127.0.0.1:8000 --trace conversation_trace.jsonl --max-requests 200 \\
      --time-scale 10 --tokenizer PATH --slo ttft=2s,tpot=100ms --json trace.json

The prefix-cache hit rate (sum of usage.prompt_tokens_details.cached_tokens / sum of prompt_tokens) is
reported when the server sends cached_tokens (vLLM: --enable-prompt-tokens-details), else "n/a".

Per worker: against an xpyd proxy started with --expose-worker-names (`xpyd up --expose-worker-names`),
each answer names its workers (x-xpyd-workers: opaque names, never addresses) and the report adds, per
prefill, decode or colocated worker, its requests, completed/failed, goodput (requests/s and output
tokens/s), SLO attainment under --slo and TTFT/TPOT p50/p99 (text, and "workers" in --json). Trace replay
too. Without the header (any other server) there is no per-worker section.

What the proxy adds: against an xpyd proxy started with --expose-worker-timing, each stream ends with its
workers' own timing (an SSE comment) and the report adds the workers' TTFT, the proxy-added TTFT (client
minus worker, per request), the workers' ITL and the client's over the same gaps, p50/p99 and their ratio
(text, and "proxy_overhead" in --json; per request with --include-requests). Through a P/D proxy it also says
where each TTFT went: the proxy's ingress, prefill's parse, queue, compute and respond, the network between
them, the proxy's egress (they add up to the proxy's TTFT), what is left of the client's TTFT, and the decode
worker's phases to token 2 (text, and "phases" in --json; per request with --include-requests). So does a
colocated proxy (the worker's parse, queue, compute, respond and its first decode step), and with --no-stream
(from each answer's X-Xpyd-Timing header: the split of the time to the answer, with the wait for its last
token) or --n (the split follows choice 0, with the wait for the other choices' first tokens).

Exit status: 0 when the run completed (failed requests are reported, not fatal), 2 for bad
arguments, 1 when the endpoint cannot be reached at all."""


class _TransferParser(argparse.ArgumentParser):
    """The ``transfer`` mode's parser: imports xpyd.bench.transfer_bench and lets it add its options
    the first time it is used, so ``xpyd bench`` alone never imports it."""

    _loaded = False

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        try:
            from xpyd.bench import transfer_bench
        except ImportError as e:
            self.error(f"the transfer benchmark (xpyd.bench.transfer_bench) is not available: {e}")
        transfer_bench.add_arguments(self)

    def parse_known_args(self, args=None, namespace=None):
        self._load()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._load()
        return super().format_help()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    if parser.description is None:
        parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    modes = parser.add_subparsers(dest="bench_mode", metavar="[transfer]", parser_class=_TransferParser)
    modes.add_parser("transfer", help="benchmark the KV transfer engine instead (own options: "
                                      "xpyd bench transfer --help)")

    g = parser.add_argument_group("target")
    g.add_argument("--url", help="server base URL, e.g. http://127.0.0.1:8000 (required)")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="/v1/completions or /v1/chat/completions (default: %(default)s)")
    g.add_argument("--model", help="model name to send (default: the first of GET URL/v1/models)")
    g.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="per-request timeout, whole stream (default: %(default)s)")
    g.add_argument("--no-stream", action="store_true",
                   help="ask for JSON answers (stream: false): TTFT is then the whole answer's arrival, with no "
                        "ITL; against an xpyd proxy with --expose-worker-timing each answer's phases come in its "
                        "X-Xpyd-Timing header (default: streamed)")
    g.add_argument("--n", type=int, default=1, metavar="N",
                   help="choices per request (OpenAI's n); the token counts are every choice's and a stream's "
                        "chunks are every choice's, interleaved (default: %(default)s)")

    g = parser.add_argument_group("load")
    g.add_argument("--num-requests", type=int, metavar="N",
                   help="measured requests (required; multi-turn: --conversations x --turns, which it must "
                        "equal if given)")
    m = g.add_mutually_exclusive_group()
    m.add_argument("--concurrency", type=int, metavar="C",
                   help="closed loop: C requests in flight at all times (default: 1; multi-turn: C "
                        "conversations in flight, default: all)")
    m.add_argument("--rate", type=float, metavar="R",
                   help="open loop: Poisson arrivals at R requests/s (exponential gaps from --seed)")
    g.add_argument("--duration", type=float, metavar="SECONDS",
                   help="stop issuing requests after this long (in-flight ones finish; at most N anyway)")
    g.add_argument("--warmup", type=int, default=0, metavar="N",
                   help="requests sent before measuring, at --concurrency (1 with --rate), not counted "
                        "(default: 0)")
    g.add_argument("--seed", type=int, default=0, help="seed for prompts and arrivals (default: 0)")

    g = parser.add_argument_group("workload")
    g.add_argument("--workload", choices=[w.value for w in Workload],
                   help="fixed: --input-len/--output-len; random: lengths uniform in the ranges; jsonl: "
                        "--prompts; prefill-stall: short streams + Poisson long prompts; shared-prefix: "
                        "shared prefixes + unique suffixes; multi-turn: conversations; trace: --trace "
                        "(default: trace with --trace, else fixed)")
    g.add_argument("--input-len", type=int, metavar="TOKENS",
                   help="prompt tokens (default: 128; prefill-stall short class: 64; shared-prefix: the "
                        "suffix, 64; multi-turn: each question, 64)")
    g.add_argument("--output-len", type=int, metavar="TOKENS",
                   help="max_tokens, exact thanks to ignore_eos (default: 128; shared-prefix and "
                        "multi-turn: 32; jsonl: lines without max_tokens)")
    g.add_argument("--input-len-range", metavar="A:B", help="random: prompt tokens in [A, B]")
    g.add_argument("--output-len-range", metavar="A:B", help="random: output tokens in [A, B]")
    g.add_argument("--prompts", metavar="FILE.jsonl",
                   help='jsonl: one {"prompt": ...} or {"messages": [...]} a line, optional "max_tokens"')
    g.add_argument("--tokenizer", metavar="PATH",
                   help="HF tokenizer folder of the served model: exact prompt lengths (without it, "
                        "common words at about one token each)")

    g = parser.add_argument_group("prefill-stall workload")
    d = StallConfig()
    g.add_argument("--stall-long-input", type=int, default=d.long_input, metavar="TOKENS",
                   help="long prompt tokens (default: %(default)s)")
    g.add_argument("--stall-long-output", type=int, default=d.long_output, metavar="TOKENS",
                   help="long request output tokens (default: %(default)s)")
    g.add_argument("--stall-long-rate", type=float, default=d.long_rate, metavar="R",
                   help="long prompts per second, Poisson (default: %(default)s)")
    g.add_argument("--stall-short-concurrency", type=int, metavar="C",
                   help=f"short streams in flight (default: --concurrency, else {d.short_concurrency})")

    g = parser.add_argument_group("shared-prefix and multi-turn workloads (prefix-cache reuse)")
    sp, mt = SharedPrefixConfig(), MultiTurnConfig()
    g.add_argument("--prefix-len", type=int, metavar="TOKENS",
                   help=f"shared-prefix: tokens of each shared prefix (default: {sp.prefix_len}); multi-turn: "
                        f"the context that opens each conversation's first message (default: {mt.prefix_len})")
    g.add_argument("--num-prefixes", type=int, metavar="N",
                   help=f"shared-prefix: distinct prefixes, assigned to the requests round-robin (default: "
                        f"{sp.num_prefixes})")
    g.add_argument("--conversations", type=int, metavar="N",
                   help=f"multi-turn: conversations (default: --concurrency, else {mt.conversations})")
    g.add_argument("--turns", type=int, metavar="T", help=f"multi-turn: turns a conversation (default: {mt.turns})")
    g.add_argument("--think-time", type=float, metavar="SECONDS",
                   help=f"multi-turn: pause between a conversation's turns, exponential with this mean "
                        f"from --seed; 0: none (default: {mt.think_time_s})")
    g.add_argument("--shared-context", action="store_true",
                   help="multi-turn: every conversation opens with the same context (default: each its own)")

    g = parser.add_argument_group("trace replay (Mooncake format)")
    g.add_argument("--trace", metavar="FILE.jsonl",
                   help='replay a trace: one {"timestamp": ms, "input_length": N, "output_length": M, '
                        '"hash_ids": [...]} a line; each request is sent at its timestamp (from the first '
                        "one's) with a prompt of input_length tokens whose blocks repeat where the hash ids "
                        "do, and max_tokens = output_length (exact: ignore_eos). With --tokenizer the "
                        "prompts are token ids (exact blocks); without, common words (about a token each). "
                        "Completions endpoint only")
    g.add_argument("--time-scale", type=float, metavar="X",
                   help="replay speed: a request goes (its timestamp - the first one's) / X after the start, "
                        "so 2.0 runs twice as fast and 0.5 half as fast (default: 1, the trace's own pace)")
    g.add_argument("--max-requests", type=int, metavar="N",
                   help="replay the first N requests of the trace (default: all); the run lasts as long as "
                        "their timestamps say, divided by --time-scale")
    g.add_argument("--trace-block-size", type=int, metavar="TOKENS",
                   help=f"tokens per hash id (default: {MOONCAKE_BLOCK_SIZE}, Mooncake's)")

    g = parser.add_argument_group("output")
    g.add_argument("--slo", metavar="K=V,...",
                   help="SLOs for goodput and SLO attainment (per worker too, against an xpyd proxy with "
                        "--expose-worker-names): ttft, tpot, itl (every gap), e2e; units us/ms/s, bare = ms "
                        "(e.g. ttft=500ms,itl=50ms,e2e=2s)")
    g.add_argument("--json", metavar="PATH", help="write the results as JSON")
    g.add_argument("--plot", metavar="DIR",
                   help="write latency CDFs and ITL over time as PNGs (needs matplotlib: pip install 'xpyd[plot]')")
    g.add_argument("--include-requests", action="store_true",
                   help="put every request's timeline into the JSON (with the workers that served it, when "
                        "the server names them)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


@dataclass(frozen=True, slots=True)
class Plan:
    """What to send: the measured requests (short class for prefill-stall), long prompts, warmup;
    or, for multi-turn, the conversations (their requests are built as the answers come)."""

    specs: Sequence[RequestSpec]
    warmup: list[RequestSpec]
    long_specs: Iterator[RequestSpec] | None = None
    conversations: list[Conversation] | None = None
    trace: TraceRequests | None = None  # trace replay: the same requests as specs, with their records


def build_plan(config: BenchConfig) -> Plan:
    builder: PromptBuilder = (TokenizerPromptBuilder.from_path(config.tokenizer_path)
                              if config.tokenizer_path else WordPromptBuilder())
    rng, warm_rng = random.Random(config.seed), random.Random(config.seed + 7919)
    n, w = config.num_requests, config.warmup
    if config.trace is not None:  # warmup: unrelated requests of --input-len / --output-len
        tc = config.trace
        vocab = builder.token_ids() if isinstance(builder, TokenizerPromptBuilder) else WORDS
        requests = TraceRequests(load_trace(tc.path, tc.block_size, tc.max_requests), tc.block_size, vocab,
                                 config.seed)
        return Plan(requests, fixed_requests(builder, w, config.input_len, config.output_len, warm_rng),
                    trace=requests)
    if config.workload is Workload.JSONL:
        loaded = load_jsonl(config.prompts_path, config.endpoint is Endpoint.CHAT, config.output_len)
        return Plan(cycle_to(loaded, n), cycle_to(loaded, w))
    if config.workload is Workload.RANDOM:
        return Plan(random_requests(builder, n, config.input_range, config.output_range, rng),
                    random_requests(builder, w, config.input_range, config.output_range, warm_rng))
    chat = config.endpoint is Endpoint.CHAT
    if config.workload is Workload.SHARED_PREFIX:  # warmup: prefixes of its own, the measured stay cold
        shape = (config.shared_prefix.num_prefixes, config.shared_prefix.prefix_len, config.input_len,
                 config.output_len)
        return Plan(shared_prefix_requests(builder, n, *shape, rng, chat),
                    shared_prefix_requests(builder, w, *shape, warm_rng, chat))
    if config.workload is Workload.MULTI_TURN:  # warmup: unrelated single requests
        convs = build_conversations(builder, config.multi_turn, config.input_len, config.output_len, chat,
                                    config.seed)
        warmup = fixed_requests(builder, w, config.input_len, config.output_len, warm_rng)
        return Plan([], warmup, conversations=convs)
    label = LABEL_SHORT if config.workload is Workload.PREFILL_STALL else LABEL_ALL
    specs = fixed_requests(builder, n, config.input_len, config.output_len, rng, label)
    warmup = fixed_requests(builder, w, config.input_len, config.output_len, warm_rng, label)
    if config.workload is not Workload.PREFILL_STALL:
        return Plan(specs, warmup)
    longs = iter_fixed(builder, config.stall.long_input, config.stall.long_output,
                       random.Random(config.seed + 1), LABEL_LONG)
    return Plan(specs, warmup, longs)


async def _resolve_model(config: BenchConfig) -> str:
    """The model to send; raises EndpointUnreachable, or NotOpenAI when it cannot be determined."""
    try:
        names = await fetch_model_names(config.url, config.api_key, timeout_s=min(config.timeout_s, 10.0))
    except NotOpenAI:
        if config.model:  # reachable, just no usable model list: the given name will do
            return config.model
        raise
    if config.model:
        return config.model
    if not names:
        raise NotOpenAI(f"{config.url}/v1/models lists no model: pass --model")
    return names[0]


async def _measure(config: BenchConfig, plan: Plan, client: StreamingClient) -> Timed:
    bar = tqdm(total=config.num_requests, unit="req", desc="bench", file=sys.stderr, disable=not config.progress)
    counts = {"failed": 0, "long": 0}

    def on_done(r: RequestResult) -> None:
        counts["failed"] += not r.ok
        if r.label == LABEL_LONG:
            counts["long"] += 1
        else:
            bar.update(1)
        bar.set_postfix({k: v for k, v in counts.items() if v}, refresh=False)

    deadline = None if config.duration_s is None else time.perf_counter() + config.duration_s
    try:
        if plan.long_specs is not None:
            phase = prefill_stall(client.send, plan.specs, config.stall.short_concurrency, plan.long_specs,
                                  config.stall.long_rate, config.seed, deadline, on_done)
        elif plan.conversations is not None:
            phase = conversations(client.send, (c.dialogue() for c in plan.conversations),
                                  config.effective_concurrency, deadline, on_done)
        elif plan.trace is not None:
            offsets = send_offsets(plan.trace.records, config.trace.time_scale)
            phase = open_loop(client.send, plan.specs, offsets, deadline, on_done)
        elif config.rate is not None:
            offsets = poisson_offsets(config.rate, len(plan.specs), config.seed)
            phase = open_loop(client.send, plan.specs, offsets, deadline, on_done)
        else:
            phase = closed_loop(client.send, plan.specs, config.effective_concurrency, deadline, on_done)
        return await timed(phase)
    finally:
        bar.close()


async def _bench(config: BenchConfig, plan: Plan) -> tuple[str, Timed, int]:
    model = await _resolve_model(config)
    async with StreamingClient(config.url, config.endpoint, model, timeout_s=config.timeout_s,
                               max_connections=config.max_connections, api_key=config.api_key,
                               stream=config.stream, n=config.n) as client:
        warmup_failed = 0
        if plan.warmup:
            warm = await closed_loop(client.send, plan.warmup, min(config.effective_concurrency, len(plan.warmup)))
            warmup_failed = sum(not r.ok for r in warm)
        measured = await _measure(config, plan, client)
    return model, measured, warmup_failed


def _error(msg: str, code: int) -> int:
    print(f"xpyd bench: error: {msg}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    if getattr(args, "bench_mode", None) == "transfer":
        from xpyd.bench import transfer_bench

        return transfer_bench.run(args)
    try:
        config = config_from_args(args)
        if config.plot_dir is not None:
            plot.check_available()  # matplotlib is optional: refuse now, not after the run
        plan = build_plan(config)
    except ValueError as e:  # includes WorkloadError
        return _error(str(e), 2)
    try:
        model, measured, warmup_failed = asyncio.run(_bench(config, plan))
    except (EndpointUnreachable, NotOpenAI) as e:
        return _error(str(e), 1)
    trace = (trace_stats(plan.trace.records, config.trace.block_size).as_dict(config.trace.time_scale)
             if plan.trace is not None else None)
    return _report(config, model, measured, warmup_failed, trace)


def _report(config: BenchConfig, model: str, measured: Timed, warmup_failed: int, trace: dict | None = None) -> int:
    results = sorted(measured.results, key=lambda r: r.send_time)
    overall = summarize(results, measured.duration_s, config.slo)
    classes = ({lab: summarize([r for r in results if r.label == lab], measured.duration_s, config.slo)
                for lab in (LABEL_SHORT, LABEL_LONG)} if config.workload is Workload.PREFILL_STALL else {})
    turns = (summarize_turns(results, config.num_requests) if config.workload is Workload.MULTI_TURN
             else None)
    workers = summarize_workers(results, measured.duration_s, config.slo)  # None unless the server names them
    overhead = summarize_overhead(results)  # None unless the server sends the workers' own timing
    phases = summarize_phases(results)  # None unless it splits the TTFT too (a P/D proxy)
    described = config.describe() | {"model": model}
    print(format_table(overall, classes, described, model, turns, trace, workers, overhead, phases))
    report = build_report(overall, classes, described, model, warmup_failed, turns, trace, workers, overhead,
                          phases)
    if config.include_requests:
        report["requests"] = request_records(results, measured.start)
        # The run's start on the machine's monotonic clock (time.perf_counter): another process on this
        # machine can place its own events (a worker killed, a fault injected) on the requests' timelines.
        report["start_perf_counter"] = measured.start
    if config.json_path is not None:
        write_json(config.json_path, report)
        print(f"results: {config.json_path}")
    if config.plot_dir is not None:
        title = f"{config.workload.value}, {model}"
        for path in plot.write_plots(results, measured.start, config.plot_dir, title):
            print(f"plot: {path}")
    if overall.completed == 0:
        print("xpyd bench: warning: every request failed (see errors above)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="xpyd bench")
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
