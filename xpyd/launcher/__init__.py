"""`xpyd up`: a local cluster of child processes (`up`), kept running by a supervisor (`supervisor`).

May import everything below the command line: the worker config and model loader (to convert the model
once), the local etcd, the proxy's config; the roles run as child processes, never imported.
"""

from xpyd.launcher.up import add_arguments, run

__all__ = ["add_arguments", "run"]
