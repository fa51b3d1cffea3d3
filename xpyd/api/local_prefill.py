"""A P/D request that its decode worker prefills itself (conditional disaggregation).

A remote prefill costs a second worker's queue, a KV transfer and a hop; for a short prompt, or one the decode
worker mostly caches already, that is more than computing it where it will be decoded. The proxy decides per
request (``xpyd.proxy.prefill_path``) and then calls the decode worker alone, with::

    kv_transfer_params: {"role": "decode", "local_prefill": true, "response": ..., "token_ids": true}
    X-Request-Id:       an id that names the decode worker as both workers (``~p~<its addr>~d~<its addr>``)

The decode worker tokenizes the prompt, computes it in chunks between its decode steps (its prefix cache
reused), samples the first token with the request's first random draw (so seeded sampling gives the tokens
the P/D path gives), and streams every token, 1..n, in the chunks the proxy named. Only the proxy sends the
key: a worker with a cluster token takes requests from it alone.
"""

from __future__ import annotations

LOCAL_PREFILL_KEY = "local_prefill"
