"""Discovery: which workers exist and how to reach them.

Owns: the worker record (`types.WorkerInfo`, `Role`), the `Registry` protocol (`base`) with its static
(`static`, addresses on the command line) and etcd implementations (`etcd`: list + watch + resync;
`etcd_registration`: a worker's key under a kept-alive lease), the online planner's state that the proxy's
/cluster shows (`planner_state`: the bounded struct; `planner_etcd`: its writer and the proxy's watch), a local etcd
for `xpyd up` (`local_etcd`) and `xpyd status` (`status`).

May import: aetcd, msgspec, the standard library and the leaf modules; no model, no worker, no role.
"""

import os

# gRPC (under aetcd) restarts its poller thread in a forked child when fork support is on; a child that then
# closes its inherited descriptors before exec (subprocess.Popen: close_fds, preexec_fn) can abort on that
# poller's closed epoll descriptor (grpc/grpc#43055: grpcio >= 1.81). Every process that talks to etcd and
# starts children (xpyd up restarting a worker, a test starting a cluster) forks with gRPC live, and none of
# them uses gRPC in a child, so its fork handlers are off unless the environment says otherwise. Set here,
# before anything imports grpc.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
