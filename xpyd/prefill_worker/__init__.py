"""The prefill role: prompt -> KV in the pool + first token; serves decode workers' lookups and sends
the KV.

Owns: the engine (`engine`), its scheduler (`scheduler`), the memory of recently ended requests
(`recent`) and the process entry (`main`: the worker runtime with this engine and a signal-plane ROUTER).

May import: xpyd.worker, xpyd.model, xpyd.signal, xpyd.discovery and the leaf modules;
never another role or the proxy, nor xpyd.transfer: KV moves through the KV connector
(xpyd.worker.kv_connector_send).
"""
