"""`xpyd up`: a local cluster of child processes (`up`), kept running by a supervisor (`supervisor`); and the
online planner that runs on it or on Kubernetes:

- ``planner_loop``: the loop (scrape, judge, start or drain through a ``Workers``), its state for /cluster;
- ``planner_options``: the flags `xpyd up --planner` and `xpyd planner` share, and the planner they make;
- ``planner_publish``: `xpyd up`'s writes of that state to its local etcd;
- ``kube``: Deployments' replicas through the Kubernetes API's scale subresource (aiohttp, in-cluster);
- ``planner_workers``: the ``Workers`` of `xpyd planner` (Deployments, or desired replicas for an autoscaler);
- ``planner_service``: the `xpyd planner` command.

May import everything below the command line: the worker config and model loader (to convert the model
once), the local etcd, the proxy's config; the roles run as child processes, never imported.
"""

from xpyd.launcher.up import add_arguments, run

__all__ = ["add_arguments", "run"]
