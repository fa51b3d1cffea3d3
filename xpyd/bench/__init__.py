"""``xpyd bench``: benchmarks.

Serving benchmark (any OpenAI-compatible endpoint), one module per job:

- ``workload``: request specs (prompts of exact token lengths, shared prefixes, jsonl files) and
  Poisson arrival times;
- ``conversation``: multi-turn conversations, whose requests are built from the previous answers;
- ``trace``: Mooncake-format traces (timestamps, lengths, hash ids) turned into timed requests whose
  prompts share exactly the blocks the hash ids say, and the trace's own statistics;
- ``client``: one aiohttp session; each streaming request becomes a ``RequestResult`` timeline;
- ``runner``: arrival processes (closed loop, open loop at given times: Poisson or a trace's, prefill-stall,
  conversations);
- ``metrics``: TTFT / TPOT / ITL / E2E distributions, throughput, SLOs and goodput, prefix-cache hit
  rates (pure);
- ``report`` / ``plot``: JSON, printed table, PNGs;
- ``config`` / ``main``: the CLI (``add_arguments`` / ``run``).

``transfer_bench`` (KV transfer engine benchmark) is reached as ``xpyd bench transfer``.

May import: aiohttp, xpyd.transfer (the transfer benchmark) and the leaf modules; no worker, model or
proxy code: it is a client of any OpenAI-compatible server.
"""
