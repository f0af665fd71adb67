"""An emulated Kubernetes cluster on this machine, for the end-to-end tests and `kvpolicy demo`.

An API server over real HTTP on 127.0.0.1 (kmock, extended with a real state layer), GPU node pools, and a kubelet
stand-in that runs Deployments and Jobs as local processes. See README.md beside this file.
"""

from kvpolicy_dev.devcluster.apiserver import EmulatedApiServer, Fault, WriteRecord
from kvpolicy_dev.devcluster.cluster import DevCluster, ThreadedDevCluster, default_pools, kubeconfig_text
from kvpolicy_dev.devcluster.nodes import CPU_POOL, POOL_LABEL, NodePool
from kvpolicy_dev.devcluster.runners import (
    GPU_MODELS,
    GPU_PRODUCT_LABEL,
    ContainerRunner,
    NoProcessRunner,
    SimulatorRunner,
)
from kvpolicy_dev.devcluster.store import ApiError

__all__ = [
    "CPU_POOL",
    "GPU_MODELS",
    "GPU_PRODUCT_LABEL",
    "POOL_LABEL",
    "ApiError",
    "ContainerRunner",
    "DevCluster",
    "EmulatedApiServer",
    "Fault",
    "NoProcessRunner",
    "NodePool",
    "SimulatorRunner",
    "ThreadedDevCluster",
    "WriteRecord",
    "default_pools",
    "kubeconfig_text",
]
