"""``xpyd plan``: the offline SLO planner.

Given a timing profile (`xpyd.model.sim.profile`), a request trace and an SLO, it answers how many prefill and
decode workers, and which decode batch size, meet the SLO at the least workers, with the goodput it predicts.
One module per job:

- ``slo``: the SLO (``ttft=2s,itl=50ms,attainment=0.95``) as a validated dataclass, and whether a request meets it;
- ``workload``: the requests the model replays (arrival, lengths, prefix block ids), from a Mooncake trace;
- ``prefix_lru``: one prefill worker's prefix cache, a bounded LRU of blocks;
- ``prefill_model`` / ``decode_model``: one worker of each role, stepped in simulated time (chunked prefill
  with shortest-remaining-first and aging; continuous-batching decode run as whole segments of steps);
- ``fleet_model``: the discrete-event model of a P/D fleet (routing, KV hand-off), per-request latencies;
- ``search``: the sweep over prefill:decode splits and batch sizes, and the cheapest that meets the SLO;
- ``main``: the CLI (``add_arguments`` / ``run``), its table and JSON.

The online planner (docs/planner.md, "Online planner") reuses the fleet model on the load it forecasts:

- ``observe``: one interval of a running cluster (arrivals/s, mean lengths, TTFT/ITL quantiles, queue) from two
  scrapes of the proxy's and the workers' Prometheus text;
- ``predict``: the next interval's load (rate EWMA, last rate plus trend, backlog);
- ``online_model``: how x prefill + y decode workers would do under a forecast (``FleetModel``; the real one
  runs ``fleet_model`` on a synthetic workload);
- ``controller``: start or drain a worker of a role, with hysteresis, a dwell time and ``max_workers``, each
  decision with its reason.

May import: numpy, the simulated engine's profile (`xpyd.model.sim.profile`) and the trace reader
(`xpyd.bench.trace`); no worker, proxy or network code.
"""
