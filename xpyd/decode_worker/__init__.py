"""The decode role: pulls a request's KV from its prefill worker and runs the continuous decode batch.

Owns: the engine (`engine`: claims each request at its prefill worker, which pushes "ready"), its
scheduler (`scheduler`; a request as it tracks it and a chunk of what it computes here: `seq`), the prompts it
computes itself and the recomputes of the requests it preempts (`local_prefill`), the running batch's steps
(`batch`: room for the decode step by preemption, local prefill chunks, the decode step), what it asks its
prefill workers (`lookups`), its sessions with them and their requests failed with them (`peers`), the KV it
receives (`receives`) and the process entry (`main`).

May import: xpyd.worker, xpyd.model, xpyd.signal, xpyd.discovery and the leaf modules;
never another role or the proxy, nor xpyd.transfer: KV arrives through the KV connector
(xpyd.worker.kv_connector).
"""
