"""paratrain: every classic parallelism strategy for PyTorch, small, readable, proved by parity.

    import paratrain as pt
    session = pt.Session(strategy="ddp")
    model, optimizer, loader = session.setup(model, optimizer, loader)
    for batch in session.progress(loader):
        loss = session.train_step(batch, loss_fn)
"""

from paratrain.launch import worker

worker.attach()  # first, before torch loads: under `paratrain run`, die with the launcher, leave notes

from paratrain.components.activation_checkpointing import checkpoint_activations  # noqa: E402
from paratrain.session.autolog import Logging  # noqa: E402
from paratrain.distributed.comm import all_gather_with_grad, broadcast_object  # noqa: E402
from paratrain.components.metrics import mean_metrics  # noqa: E402
from paratrain.components.contrastive import Gathered, gather_embeddings, nt_xent_loss
from paratrain.data.sampler import DistributedSampler, partition
from paratrain.errors import (
    CheckpointError,
    CommError,
    ConfigError,
    ParatrainError,
    UsageError,
)
from paratrain.distributed.grid import NodeGroups, ProcessGrid, node_groups
from paratrain.components.materialize import materialize
from paratrain.components.metrics import MetricsLogger
from paratrain.parallel.base import ParallelModule, Strategy, full_state_dict
from paratrain.parallel.ddp import DDP, DistributedDataParallel
from paratrain.parallel.dp import DP, DataParallel
from paratrain.parallel.hierarchical import Hierarchical, HierarchicalDataParallel
from paratrain.parallel.model_parallel import LayersOnDevices, ModelParallel
from paratrain.parallel.pipeline import Cut, Pipeline, PipelineStage
from paratrain.parallel.single import Single
from paratrain.parallel.zero import WrapPolicy, ZeRO, shard
from paratrain.components.precision import GradScaler
from paratrain.distributed.ring import ring_all_reduce
from paratrain.session.session import Session
from paratrain.session.watch import StepWarning, StepWarnings
from paratrain.distributed.topology import Topology, destroy
from paratrain.checkpoint.weights import load_weights

from paratrain.debug import flight_hooks  # noqa: E402

flight_hooks.install()  # every rank records its last collectives (debug/flight_recorder.py; PARATRAIN_FLIGHT_RECORDER=0: off)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "CommError", "ConfigError", "ParatrainError", "UsageError",
    "Topology", "ProcessGrid", "NodeGroups", "destroy", "node_groups",
    "all_gather_with_grad", "broadcast_object", "mean_metrics", "ring_all_reduce",
    "gather_embeddings", "nt_xent_loss", "Gathered",
    "DistributedSampler", "partition",
    "DistributedDataParallel", "DataParallel", "HierarchicalDataParallel", "LayersOnDevices",
    "PipelineStage",
    "shard", "full_state_dict", "WrapPolicy",
    "GradScaler", "MetricsLogger", "Logging", "StepWarning", "StepWarnings", "checkpoint_activations",
    "materialize", "load_weights",
    "Session", "Strategy", "ParallelModule", "Single", "Cut", "DP", "DDP", "Hierarchical", "ZeRO", "ModelParallel", "Pipeline",
]
