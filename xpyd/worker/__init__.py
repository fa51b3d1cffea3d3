"""The worker runtime that every role's process is built on.

Owns: the process main (`main.run_worker`: model, KV pool, transfer backend, HTTP API, etcd
registration, drain on SIGTERM, exit when the engine failed), the worker HTTP API (`http_api`), the
engine thread shell (`loop`) and the engine base (`engine`), how a failure is contained to one request
(`faults`), the request states (`request`), what a request carries through an engine
(`work_item`) and one forward pass plus sampling (`stepping`), the config (`config`), metrics
(`metrics`), core sharing between workers on one host (`cpu_share`), heap tuning (`malloc_tuning`) and
the glue between the KV pool and the transfer backend (`kv_staging`).

May import: xpyd.model, xpyd.transfer, xpyd.signal, xpyd.discovery, xpyd.api and the leaf modules.
Never a role package (prefill_worker, decode_worker, colocated_worker): they build on this.
"""
