"""Discovery: which workers exist and how to reach them.

Owns: the worker record (`types.WorkerInfo`, `Role`), the `Registry` protocol (`base`) with its static
(`static`, addresses on the command line) and etcd implementations (`etcd`: list + watch + resync;
`etcd_registration`: a worker's key under a kept-alive lease), a local etcd for `xpyd up`
(`local_etcd`) and `xpyd status` (`status`).

May import: aetcd, the standard library and the leaf modules; no model, no worker, no role.
"""
