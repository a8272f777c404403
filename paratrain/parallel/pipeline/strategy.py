"""`Pipeline`: the strategy that trains a model cut into stages on different ranks, with Session.

    session = pt.Session(strategy=pt.Pipeline(stages=4, schedule="1f1b", microbatches=8))
    model, optimizer, loader = session.setup(nn.Sequential(...), optimizer, loader)
    for batch in session.progress(loader):
        loss = session.train_step(batch, loss_fn)      # the same loop as every strategy

Ranks form one grid, `arange(world).view(stages, replicas)` (distributed/grid.py; pp is its
outermost axis, as in torchtitan's mesh): a column is one pipeline (rank r is stage r // replicas
of replica r % replicas), a row holds one stage's replicas, which average their gradients. So
world 4 with stages=2 is 2 stages × 2 replicas, ranks {0, 1} stage 0 and {2, 3} stage 1.
All stages of a replica read the same batches; the first uses the inputs, the last the targets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paratrain.components.materialize import Materializer, MetaInit, has_meta
from paratrain.components.optim import rebuild_optimizer
from paratrain.distributed import comm
from paratrain.distributed.comm import broadcast_coalesced
from paratrain.distributed.grid import ProcessGrid
from paratrain.distributed.topology import Topology
from paratrain.errors import ConfigError
from paratrain.parallel.base import Strategy, uncompiled
from paratrain.parallel.ddp import bucket_caps
from paratrain.parallel.pipeline.actions import Action, with_comm
from paratrain.parallel.pipeline.adapters import cut_for
from paratrain.parallel.pipeline.check import check
from paratrain.parallel.pipeline.cut import Cut
from paratrain.parallel.pipeline.partition import BALANCES, layer_costs
from paratrain.parallel.pipeline.plan import StagePlan, plan_cut, plan_sequential
from paratrain.parallel.pipeline.schedules import SCHEDULES
from paratrain.parallel.pipeline.sharded import ShardedReplicas
from paratrain.parallel.pipeline.stage import PipelineStage
from paratrain.parallel.pipeline.tied import TiedWeights, holders
from paratrain.parallel.zero.optim import param_groups_of
from paratrain.parallel.zero.stage12 import ShardedOptimizer


@dataclass(frozen=True)
class Pipeline(Strategy):
    """Pipeline parallelism over `stages` ranks, data parallelism over the rest of the world."""

    name = "pipeline"
    stages: int = 2  # ranks in one pipeline; must divide the world size (the rest are replicas)
    schedule: str = "1f1b"  # "gpipe", "1f1b", "interleaved-1f1b" or "zb-h1" (schedules.py)
    microbatches: int = 4  # micro-batches per replica batch; must divide the replica's batch size
    virtual: int = 1  # chunks per rank (interleaved-1f1b): the model is cut into stages × virtual
    balance: str = "layers"  # cut an nn.Sequential by "layers", "params" or measured "time"
    sample: Any = None  # balance="time" only: an input batch, or a function that returns one
    layers: str | None = None  # another model: the nn.ModuleList or nn.ModuleDict of blocks to cut (cut.py)
    split_at: tuple[str, ...] | None = None  # the blocks where stages 1 … S-1 begin, e.g. ("blocks.2",)
    cut: Cut | None = None  # how to run that model's parts; default: its pipeline_embed/_head

    def __post_init__(self):
        if self.stages < 1 or self.microbatches < 1:
            raise ConfigError(f"Pipeline needs stages >= 1 and microbatches >= 1; got "
                              f"stages={self.stages}, microbatches={self.microbatches}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown pipeline schedule {self.schedule!r}; choose one of {sorted(SCHEDULES)}")
        if not isinstance(self.virtual, int) or self.virtual < 1 or (self.virtual > 1 and self.stages < 2):
            raise ConfigError(f"Pipeline(virtual={self.virtual!r}) is the number of chunks each of the stages "
                              "holds, a positive integer, and more than one needs stages >= 2")
        SCHEDULES[self.schedule].refuse(self.stages, self.virtual, self.microbatches)  # refuse its settings now
        if self.balance not in BALANCES:
            raise ConfigError(f"balance must be one of {BALANCES}; got {self.balance!r}")
        if self.split_at is not None:
            object.__setattr__(self, "split_at", tuple(self.split_at))  # hashable
    def grid(self, topology: Topology) -> ProcessGrid:
        """Rows of `stages` ranks are pipelines; the rest of the world is replicas."""
        return ProcessGrid(topology, pp=self.stages)

    def setup(self, model: nn.Module, optimizer, grid: ProcessGrid, *, init: MetaInit | None = None,
              replicas: Strategy | None = None):
        """This rank's stage on its device, its replicas starting from the first replica's
        parameters, its tied weights from the lowest stage holding them, and the optimizer
        rebuilt for the stage (`stage_optimizer`). Collective: every rank asks the grid for the
        same groups, in the same order.

        replicas: how a stage's replicas share their work: None (or DDP) average their
        gradients; a ZeRO stage 1 or 2 strategy (`pt.Mesh(pp=..., dp="zero1")`) shards the
        optimizer state, and the gradients under stage 2, over them (sharded.py)."""
        entire = model if isinstance(model, nn.Module) else nn.ModuleList(model)  # or a list of stages
        names = {p: n for n, p in entire.named_parameters()}  # a tied weight: its first name
        materializer = Materializer(entire, init) if has_meta(entire) else None  # read while whole
        plan = self._plan(model)
        tied = self._tied_ranks(plan.holdings)
        zero = _zero_stage(replicas, optimizer, bool(tied))
        chunks = [c * self.stages + grid.stage for c in range(self.virtual)]  # this rank's virtual stages
        chunk_params = [plan.holdings[k] for k in chunks]
        module, runs = plan.build(chunks)
        if materializer is not None:  # a meta-built model: this stage's parts only (components/materialize.py)
            materializer.materialize([*module.parameters(), *module.buffers()])
        module = module.to(grid.topology.device)
        mine = set(module.parameters())  # names of this stage's only: the other stages' weights are freed
        names = {p: n for p, n in names.items() if p in mine}
        (pipe_group, _), (dp_group, _) = grid.group("pp"), grid.group("dp")
        tied_weights = TiedWeights()
        for ranks in sorted(set(tied.values())):  # every rank makes every group, in order
            group, _ = grid.stages_group(ranks)
            for p in module.parameters():
                if tied.get(id(p)) == ranks:
                    tied_weights.add(p, group, lowest=grid.stage == ranks[0])
        broadcast_coalesced([*module.parameters(), *module.buffers()], dp_group)
        tied_weights.broadcast()
        optimizer = stage_optimizer(optimizer, module) if optimizer is not None else None
        sharded, holders = None, None
        if zero:
            holders, _ = grid.group("pp", "dp")
            if grid.dp > 1:
                sharded = ShardedReplicas(chunk_params, names, dp_group, stage=zero,
                                          group_of=param_groups_of(module, optimizer),
                                          caps=bucket_caps(replicas.bucket_cap_mb, None),
                                          collectives=replicas.collectives)
        stage = PipelineStage(module, stage=grid.stage, stages=self.stages, schedule=SCHEDULES[self.schedule],
                              microbatches=self.microbatches, pipe_group=pipe_group, dp_group=dp_group,
                              device=grid.topology.device, runs=runs, tied=tied_weights, names=names,
                              loss=plan.loss, virtual=self.virtual, chunk_params=chunk_params,
                              ordered_pairs=grid.topology.backend == "nccl", sharded=sharded, holders=holders)
        return stage, ShardedOptimizer(optimizer, sharded) if sharded is not None else optimizer

    def action_lists(self) -> list[list[Action]]:
        """Each rank's checked action list for one step (actions.py, check.py)."""
        lists = with_comm(SCHEDULES[self.schedule].order(self.stages, self.virtual, self.microbatches),
                          self.stages, self.virtual)
        check(lists, self.stages, self.virtual, self.microbatches, name=self.schedule)
        return lists

    def holdings(self, model: nn.Module) -> list[list[nn.Parameter]]:
        """Each stage's parameters (with `virtual`, all its chunks'), as setup() cuts `model`
        (which may be on the meta device); a weight tied across stages is in each stage holding
        it. Local (no collective) except for balance="time", which measures on this rank and takes
        rank 0's costs."""
        chunks = self._plan(model).holdings
        return [[p for k in range(s, len(chunks), self.stages) for p in chunks[k]] for s in range(self.stages)]

    def _tied_ranks(self, holdings: list[list[nn.Parameter]]) -> dict[int, tuple[int, ...]]:
        """id of each weight tied across ranks → the ranks holding it; refused where two chunks
        of one rank hold it (each chunk averages its own gradients over the replicas)."""
        tied = {}
        for pid, stages in holders(holdings).items():
            ranks = tuple(sorted({k % self.stages for k in stages}))
            if len(ranks) < len(stages):
                raise ConfigError(f"a weight is shared by virtual stages {list(stages)}, two of which are chunks of "
                                  f"one rank; with virtual={self.virtual} choose other stages or tie other layers")
            tied[pid] = ranks
        return tied

    def _plan(self, model: nn.Module) -> StagePlan:
        if uncompiled(model) is not model:
            raise ConfigError("torch.compile(model) wraps the model in one compiled module, which a pipeline "
                              "cannot cut into stages: compile the layers in place instead "
                              "(`for layer in model: layer.compile()`) before setup")
        if isinstance(model, (nn.Sequential, list, tuple, nn.ModuleList)) and self.layers is None:
            costs = None  # one per layer; None: every layer costs 1
            if isinstance(model, nn.Sequential) and self.balance != "layers":
                costs = layer_costs(model, self.balance, self.sample)
                if self.balance == "time":  # times differ between ranks, cuts must not: take rank 0's
                    costs = comm.broadcast_object(costs)
            return plan_sequential(model, self.stages * self.virtual, costs)
        return plan_cut(model, self.stages * self.virtual, cut_for(model, self.layers, self.cut), self.split_at,
                        self.balance)


def _zero_stage(replicas: Strategy | None, optimizer, tied: bool) -> int:
    """0 where the replicas average their gradients (DDP), else the ZeRO stage they run; refused
    where the pipeline cannot run it (the same verdict on every rank: nothing here differs)."""
    if replicas is None or replicas.name == "ddp":
        return 0
    if replicas.name not in ("zero1", "zero2"):
        raise ConfigError(f"a pipeline's replicas average their gradients (ddp) or shard the optimizer (zero1, "
                          f"zero2); got {replicas.name!r}. ZeRO-3 would gather each chunk's parameters for every "
                          "micro-batch: use zero2, which shards gradients and optimizer state")
    if replicas.param_dtype is not None or replicas.offload:
        raise ConfigError(f"a pipeline's {replicas.name} replicas keep no master copies yet: leave "
                          "ZeRO(param_dtype=None, offload=False), and use pt.Session(precision='bf16') for "
                          "mixed precision")
    if optimizer is None:
        raise ConfigError(f"{replicas.name} shards the optimizer: pass it to setup(model, optimizer, …)")
    if tied:
        raise ConfigError(f"a weight tied across pipeline stages cannot be sharded by {replicas.name} yet (each "
                          "stage's slices of it would differ): untie it, or use dp='ddp'")
    return replicas.stage


def stage_optimizer(optimizer: torch.optim.Optimizer, stage: nn.Module) -> torch.optim.Optimizer:
    """The user built `optimizer` from the whole model; this rank steps only `stage`. So it is
    rebuilt: the same class and hyperparameters, each parameter group keeping only this stage's
    parameters (possibly none), state carried over."""
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
