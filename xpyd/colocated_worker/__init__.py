"""The colocated role (the single-server baseline): prefill and decode in one continuous batch.

Owns: the engine (`engine`), its scheduler (`scheduler`) and the process entry (`main`).

May import: xpyd.worker, xpyd.model, xpyd.discovery and the leaf modules; never another role or the
proxy.
"""
