"""The decode role: pulls a request's KV from its prefill worker and runs the continuous decode batch.

Owns: the engine (`engine`), its scheduler (`scheduler`), the schedule of readiness questions to
prefill (`poll_schedule`) and the process entry (`main`).

May import: xpyd.worker, xpyd.model, xpyd.transfer, xpyd.signal, xpyd.discovery and the leaf modules;
never another role or the proxy.
"""
