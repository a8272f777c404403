"""`Pipeline`: the strategy that trains a model cut into stages on different ranks, with Session.

    session = pt.Session(strategy=pt.Pipeline(stages=4, schedule="1f1b", microbatches=8))
    model, optimizer, loader = session.setup(nn.Sequential(...), optimizer, loader)
    for batch in session.progress(loader):
        loss = session.train_step(batch, loss_fn)      # the same loop as every strategy

Ranks form one grid, `arange(world).view(replicas, stages)` (picotron's layout): a row is one
pipeline (rank r is stage r % stages of replica r // stages), a column holds one stage's
replicas, which average their gradients. So world 4 with stages=2 is 2 stages × 2 replicas.
All stages of a replica read the same batches; the first uses the inputs, the last the targets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from paratrain import comm
from paratrain.comm import broadcast_coalesced
from paratrain.errors import ConfigError
from paratrain.optim import clip_grad_norm_over, rebuild_optimizer
from paratrain.parallel.pipeline.partition import BALANCES, layer_costs, split_model
from paratrain.parallel.pipeline.schedules import SCHEDULES
from paratrain.parallel.pipeline.stage import PipelineStage
from paratrain.strategy import Strategy
from paratrain.topology import Topology, groups_along


@dataclass(frozen=True)
class Pipeline(Strategy):
    """Pipeline parallelism over `stages` ranks, data parallelism over the rest of the world."""

    name = "pipeline"
    stages: int = 2  # ranks in one pipeline; must divide the world size (the rest are replicas)
    schedule: str = "1f1b"  # "gpipe" (all forward, then all backward) or "1f1b" (schedules.py)
    microbatches: int = 4  # micro-batches per replica batch; must divide the replica's batch size
    balance: str = "layers"  # cut an nn.Sequential by "layers", "params" or measured "time"
    sample: Any = None  # balance="time" only: an input batch, or a function that returns one

    def __post_init__(self):
        if self.stages < 1 or self.microbatches < 1:
            raise ConfigError(f"Pipeline needs stages >= 1 and microbatches >= 1; got "
                              f"stages={self.stages}, microbatches={self.microbatches}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown pipeline schedule {self.schedule!r}; choose one of {sorted(SCHEDULES)}")
        if self.balance not in BALANCES:
            raise ConfigError(f"balance must be one of {BALANCES}; got {self.balance!r}")

    def wrap(self, model: nn.Module, topology: Topology) -> PipelineStage:
        """This rank's stage on its device, its replicas starting from the first replica's
        parameters. Collective: every rank creates every group, in the same order."""
        replicas, _ = self.data_parallel(topology)
        grid = torch.arange(topology.world_size).view(replicas, self.stages)
        pipe_group, pipe_ranks = groups_along(grid, topology.rank, dim=1, timeout=topology.timeout_s)
        dp_group, _ = groups_along(grid, topology.rank, dim=0, timeout=topology.timeout_s)
        stage = pipe_ranks.index(topology.rank)
        pieces = self._cut(model)
        _refuse_weights_tied_across_stages(pieces)
        module = pieces[stage].to(topology.device)
        broadcast_coalesced([*module.parameters(), *module.buffers()], dp_group)
        return PipelineStage(module, stage=stage, stages=self.stages,
                             schedule=SCHEDULES[self.schedule], microbatches=self.microbatches,
                             pipe_group=pipe_group, dp_group=dp_group, device=topology.device)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module,
                       topology: Topology) -> torch.optim.Optimizer:
        """The user built `optimizer` from the whole model; this rank steps only its stage. So it
        is rebuilt: the same class and hyperparameters, each parameter group keeping only this
        stage's parameters (possibly none), state carried over."""
        return stage_optimizer(optimizer, self.unwrap(model))

    def no_sync(self, model: PipelineStage) -> ContextManager:
        return model.no_sync()

    def forward_backward(self, model: PipelineStage, inputs: Any, targets: Any,
                         loss_fn: Callable[[Any, Any], torch.Tensor], scale: float) -> torch.Tensor:
        """Run the schedule over the batch's micro-batches. Returns this replica's mean loss over
        the batch, computed on the last stage and broadcast to every stage of the pipeline."""
        return model.forward_backward(inputs, targets, loss_fn, scale)

    def clip_grad_norm(self, model: PipelineStage, max_norm: float) -> torch.Tensor:
        """Clip by the norm over all stages' gradients: squares summed over the pipeline group
        (replicas hold equal gradients after their all-reduce, so they are counted once)."""
        grads = [p.grad for p in model.module.parameters() if p.grad is not None]
        return clip_grad_norm_over(grads, max_norm, model.pipe_group)

    def local_grads(self, model: PipelineStage) -> tuple[list[torch.Tensor], Any]:
        """This stage's gradients; the other stages' are on the other ranks of the pipeline
        (replicas of a stage hold equal ones after their all-reduce, so every pipeline reaches
        the same verdict)."""
        return [p.grad for p in model.module.parameters() if p.grad is not None], model.pipe_group

    def data_parallel(self, topology: Topology) -> tuple[int, int]:
        if topology.world_size % self.stages:
            raise ConfigError(f"Pipeline(stages={self.stages}) does not divide the world size "
                              f"{topology.world_size}: start a multiple of {self.stages} processes "
                              f"(stages × replicas), or choose stages among "
                              f"{[d for d in range(1, topology.world_size + 1) if topology.world_size % d == 0]}")
        return topology.world_size // self.stages, topology.rank // self.stages

    def check_loader(self, loader: Any) -> None:
        """Fail at setup, not at the end of the first epoch: every batch a replica reads (the
        epoch's last one too, unless the loader drops it) must cut into equal micro-batches."""
        batch, m = loader.batch_size, self.microbatches
        if batch % m:
            raise ConfigError(f"Pipeline(microbatches={m}) cuts each replica's batch into {m} equal "
                              f"micro-batches, but each replica reads batches of {batch}: make the "
                              f"loader's batch size a multiple of {m} × the replicas, or change microbatches")
        samples = len(loader.sampler) if hasattr(loader.sampler, "__len__") else None
        last = samples % batch if samples is not None and not loader.drop_last else 0
        if last % m:
            raise ConfigError(f"the last batch of each epoch holds {last} samples per replica, which "
                              f"Pipeline(microbatches={m}) cannot cut into {m} equal micro-batches: "
                              "pass DataLoader(..., drop_last=True), or a batch size that divides "
                              "the dataset")

    def _cut(self, model: nn.Module) -> list[nn.Module]:
        costs = None  # one per layer; None: every layer costs 1
        if isinstance(model, nn.Sequential) and self.balance != "layers":
            costs = layer_costs(model, self.balance, self.sample)
            if self.balance == "time":  # times differ between ranks, cuts must not: take rank 0's
                costs = comm.broadcast_object(costs)
        return split_model(model, self.stages, costs=costs)


def _refuse_weights_tied_across_stages(pieces: list[nn.Module]) -> None:
    """A parameter held by two stages would be two copies, stepped apart: refuse it."""
    owner: dict[int, tuple[int, str]] = {}
    for index, piece in enumerate(pieces):
        for name, p in piece.named_parameters(remove_duplicate=False):
            first = owner.setdefault(id(p), (index, name))
            if first[0] != index:
                raise ConfigError(f"parameter {first[1]!r} of stage {first[0]} is tied to {name!r} of "
                                  f"stage {index}; weights tied across pipeline stages are not supported: "
                                  "cut the model so both users are on one stage, or untie them")


def stage_optimizer(optimizer: torch.optim.Optimizer, stage: nn.Module) -> torch.optim.Optimizer:
    """`optimizer` rebuilt for the parameters of `stage` (see Pipeline.wrap_optimizer)."""
    mine = {id(p) for p in stage.parameters()}
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if not mine:
        raise ConfigError("this pipeline stage has no parameters to optimise; cut the model "
                          "differently (Pipeline(balance='layers') or fewer stages)")
    if not mine <= held:
        raise ConfigError(f"the optimizer does not hold {len(mine - held)} parameter(s) of this "
                          "pipeline stage; create it from model.parameters() of the model passed "
                          "to setup()")
    rebuilt = rebuild_optimizer(optimizer, [[p for p in g["params"] if id(p) in mine]
                                            for g in optimizer.param_groups])
    for p in stage.parameters():
        if p in optimizer.state:
            rebuilt.state[p] = optimizer.state[p]
    return rebuilt
