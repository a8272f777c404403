"""paratrain: every classic parallelism strategy for PyTorch, small, readable, proved by parity."""

from paratrain.errors import CommError, ConfigError, ParatrainError, UsageError
from paratrain.topology import Topology, destroy, node_groups

__all__ = [
    "CommError", "ConfigError", "ParatrainError", "UsageError",
    "Topology", "destroy", "node_groups",
]

from paratrain.parallel.ddp import DistributedDataParallel  # noqa: E402

__all__ += ["DistributedDataParallel"]
