"""paratrain: every classic parallelism strategy for PyTorch, small, readable, proved by parity.

    import paratrain as pt
    session = pt.Session(strategy="ddp")
    model, optimizer, loader = session.setup(model, optimizer, loader)
    for batch in session.progress(loader):
        loss = session.train_step(batch, loss_fn)

Public names only. Importing paratrain changes nothing in torch: the flight recorder's hooks and
the worker are installed where a job starts (a `Session`, each rank `paratrain run` starts,
`pt.install_flight_recorder()` for a loop that uses the wrappers alone).

`pt.testing` (run a function on N real ranks, compare what they trained) loads with the package,
for parity checks of one's own.
"""

from paratrain import testing
from paratrain.checkpoint.weights import load_weights
from paratrain.components.activation_checkpointing import checkpoint_activations
from paratrain.components.contrastive import Gathered, gather_embeddings, nt_xent_loss
from paratrain.components.materialize import materialize
from paratrain.components.metrics import MetricsLogger, mean_metrics
from paratrain.components.precision import GradScaler
from paratrain.data.batch import UnevenBatchWarning
from paratrain.data.sampler import DistributedSampler, partition
from paratrain.debug.flight_hooks import install as install_flight_recorder
from paratrain.distributed.comm import all_gather_with_grad, broadcast_object
from paratrain.distributed.grid import NodeGroups, ProcessGrid, node_groups
from paratrain.distributed.ring import ring_all_reduce
from paratrain.distributed.topology import Topology, destroy
from paratrain.errors import CheckpointError, CommError, ConfigError, ParatrainError, UsageError
from paratrain.parallel.base import ParallelModule, Strategy, full_state_dict
from paratrain.parallel.context import positions
from paratrain.parallel.ddp import DDP, DistributedDataParallel
from paratrain.parallel.dp import DP, DataParallel
from paratrain.parallel.hierarchical import Hierarchical, HierarchicalDataParallel
from paratrain.parallel.model_parallel import LayersOnDevices, ModelParallel
from paratrain.parallel.pipeline import Cut, Pipeline, PipelineStage
from paratrain.parallel.single import Single
from paratrain.parallel.tensor import ColwiseLinear, Mesh, RowwiseLinear, VocabEmbedding
from paratrain.parallel.zero import WrapPolicy, ZeRO, shard
from paratrain.session.autolog import Logging
from paratrain.session.hooks import StepHook
from paratrain.session.session import Session
from paratrain.session.watch import StepWarning, StepWarnings

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "CommError", "ConfigError", "ParatrainError", "UsageError",
    "Topology", "ProcessGrid", "NodeGroups", "destroy", "node_groups",
    "all_gather_with_grad", "broadcast_object", "mean_metrics", "ring_all_reduce",
    "gather_embeddings", "nt_xent_loss", "Gathered",
    "DistributedSampler", "partition",
    "DistributedDataParallel", "DataParallel", "HierarchicalDataParallel", "LayersOnDevices",
    "PipelineStage", "ColwiseLinear", "RowwiseLinear", "VocabEmbedding",
    "shard", "full_state_dict", "WrapPolicy",
    "GradScaler", "MetricsLogger", "Logging", "StepWarning", "StepWarnings", "UnevenBatchWarning",
    "checkpoint_activations",
    "materialize", "load_weights", "install_flight_recorder",
    "Session", "StepHook", "Strategy", "ParallelModule", "Single", "Cut", "DP", "DDP", "Hierarchical", "ZeRO", "ModelParallel", "Pipeline",
    "Mesh", "positions", "testing",
]
