"""Running a local cluster: child processes under one :class:`~.supervisor.Supervisor`, and waiting for
them to listen (:mod:`.net`). What ``pdserve up`` builds on. Also the Kubernetes API's view of the worker
pools (:mod:`.k8s`, not imported here: it needs the ``kubernetes`` package)."""

from common.cluster.net import free_port, wait_for_grpc_health, wait_for_tcp
from common.cluster.supervisor import ManagedProcess, Supervisor, find_redis_server

__all__ = ["ManagedProcess", "Supervisor", "find_redis_server", "free_port", "wait_for_grpc_health", "wait_for_tcp"]
