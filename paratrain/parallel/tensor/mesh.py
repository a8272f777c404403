"""`Mesh`: tensor parallelism inside each layer, composed with a data-parallel strategy over the
ranks that hold the same slices.

    session = pt.Session(strategy=pt.Mesh(tp=2, dp="zero3"))     # world 4: 2 tp × 2 dp
    model, optimizer, loader = session.setup(model, optimizer, loader)

setup, on every rank (collective):
    1. the plan (plan.py) is resolved and checked against the whole model;
    2. a model built on the meta device gets the planned layers' values whole, by the
       initialisation rule (components/materialize.py), so each slice is what one process would
       hold there; any other model is first made equal across the tp group (rank 0's values);
    3. the planned layers are cut (parallelize.py), the optimizer rebuilt for the slices;
    4. the data-parallel strategy wraps the cut model over the "dp" group of the grid: the ranks
       with the same tp rank (distributed/grid.py), which hold the same slices; or, with `pp`,
       the pipeline cuts it into stages, its p2p between ranks of the same tp rank.

With `cp`, each sequence is cut over the cp group (parallel/context/): the wrappers above see
dp × cp as their data-parallel ranks (a cp rank's gradient is of its part of every sequence, so
they are averaged over both), and a ContextParallelModel around them cuts each batch and routes
attention; the ranks of one cp group read the same batches.

So the ranks of one tp group read the same batches (they are one data-parallel replica), and the
gradients of the cut layers are averaged over dp only: their slices differ across tp. A replicated
parameter gets the same gradient on every tp rank (ops.py's f and g see to it) and takes the same
step, so it stays equal without communication; tests check that it does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from paratrain.components.materialize import Materializer, MetaInit, direct_tensors, has_meta, whole
from paratrain.components.optim import check_optimizer_owns, clip_grad_norm_over, rebuild_optimizer
from paratrain.distributed.comm import broadcast_coalesced
from paratrain.distributed.grid import ProcessGrid
from paratrain.distributed.topology import Topology
from paratrain.errors import ConfigError
from paratrain.parallel.base import CheckpointLayout, ParallelModule, Slice, Strategy, Wrapping
from paratrain.parallel.context import ContextParallelModel
from paratrain.parallel.ddp import DDP
from paratrain.parallel.hierarchical import Hierarchical
from paratrain.parallel.pipeline import Pipeline, PipelineStage
from paratrain.parallel.single import SingleDevice
from paratrain.parallel.tensor.layers import ColwiseLinear
from paratrain.parallel.tensor.parallelize import Cut, parallelize
from paratrain.parallel.tensor.plan import plan_for
from paratrain.parallel.tensor.sequence import SequenceParallel
from paratrain.parallel.zero import ZeRO

CP_MODES = ("ring", "all-to-all", "all-gather")

# what may run over the tp groups, by name (the registry's names for these five)
PIPELINE_REPLICAS = ("ddp", "zero1", "zero2")  # what a pipeline's replicas may run (pipeline/sharded.py)
DATA_PARALLEL = {"ddp": DDP, "hierarchical": Hierarchical, "zero1": functools.partial(ZeRO, stage=1),
                 "zero2": functools.partial(ZeRO, stage=2), "zero3": functools.partial(ZeRO, stage=3)}


@dataclass(frozen=True)
class Mesh(Strategy):
    """Tensor parallelism over `tp` adjacent ranks, data parallelism (`dp`, any data-parallel
    strategy by name or object) over the rest of the world; with `pp`, a pipeline of
    tensor-parallel stages, its replicas the data-parallel ranks."""

    tp: int = 1  # ranks that split each planned layer; adjacent ranks, one node
    dp: Any = "ddp"  # "ddp", "hierarchical", "zero1", "zero2", "zero3" or such a strategy object
    tp_plan: Mapping[str, str] | None = None  # module pattern → style; None: the model's (plan.py)
    pp: Pipeline | None = None  # a pipeline of tensor-parallel stages (its replicas are the dp ranks)
    cp: int = 1  # ranks that split each sequence (parallel/context/)
    cp_mode: str = "ring"  # "ring" (K, V passed around), "all-to-all" (heads scattered: Ulysses), "all-gather"
    cp_positions: bool = True  # under cp, torch.arange(local length) gives the tokens' global positions
    replicate: int = 1  # hybrid sharding (dp="zero1" to "zero3"): groups that each hold the whole sharded model
    sequence_parallel: bool = False  # outside the cut layers, activations cut along the sequence over tp
    loss_parallel: bool = False  # the head's logits stay cut by the vocabulary; cross-entropy across tp

    name = "mesh"

    def __post_init__(self):
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ConfigError(f"Mesh(tp=...) is the number of ranks that split each layer, a positive integer; "
                              f"got {self.tp!r}")
        if not isinstance(self.cp, int) or self.cp < 1:
            raise ConfigError(f"Mesh(cp=...) is the number of ranks that split each sequence, a positive integer; "
                              f"got {self.cp!r}")
        if self.cp_mode not in CP_MODES:
            raise ConfigError(f"Mesh(cp_mode={self.cp_mode!r}): choose {', '.join(map(repr, CP_MODES[:-1]))} or "
                              f"{CP_MODES[-1]!r}")
        if not isinstance(self.replicate, int) or self.replicate < 1:
            raise ConfigError(f"Mesh(replicate=...) is the number of groups that each hold the whole sharded model, "
                              f"a positive integer; got {self.replicate!r}")
        for flag in ("sequence_parallel", "loss_parallel"):
            if getattr(self, flag) not in (True, False):
                raise ConfigError(f"Mesh({flag}=...) is True or False; got {getattr(self, flag)!r}")
        if self.loss_parallel and (self.tp == 1 or self.pp is not None):
            raise ConfigError("Mesh(loss_parallel=True) keeps the logits cut over the tp ranks: it needs tp > 1, "
                              "and does not compose with pp yet")
        if self.sequence_parallel and (self.tp == 1 or self.pp is not None or self.cp > 1):
            raise ConfigError("Mesh(sequence_parallel=True) cuts the sequence over the tp ranks: it needs tp > 1, "
                              "and does not compose with pp or cp yet")
        if self.cp > 1 and self.pp is not None:
            raise ConfigError("Mesh(cp=..., pp=...) is not supported yet: a pipeline's stages would each pass "
                              "their part of the sequence; use cp with dp and tp")
        if self.tp_plan is not None:
            object.__setattr__(self, "tp_plan", dict(self.tp_plan))
        inner = self.data_parallel()  # refuse an unknown name now, not at setup
        if self.replicate > 1 and (inner.name not in ("zero1", "zero2", "zero3") or self.pp is not None
                                   or self.cp > 1):
            raise ConfigError(f"Mesh(replicate={self.replicate}) is hybrid sharding: ZeRO within each group, "
                              f"gradients all-reduced across the groups; it takes dp='zero1', 'zero2' or 'zero3' "
                              f"(got {self.dp!r}) and does not compose with pp or cp yet")
        if self.pp is not None and (not isinstance(self.pp, Pipeline) or inner.name not in PIPELINE_REPLICAS):
            raise ConfigError(f"Mesh(pp=...) takes a pt.Pipeline(stages=..., microbatches=...), whose replicas "
                              f"average their gradients (dp='ddp') or shard the optimizer (dp='zero1' or "
                              f"'zero2'); got pp={self.pp!r}, dp={self.dp!r}")
        if self.pp is not None and inner.name != "ddp" and self.tp > 1:
            raise ConfigError(f"Mesh(tp={self.tp}, pp=..., dp={self.dp!r}): a pipeline of tensor-parallel stages "
                              "takes dp='ddp' yet; with tp=1 its replicas may run zero1 or zero2")

    def __hash__(self) -> int:
        return hash((self.tp, str(self.dp), self.pp, self.cp, self.cp_mode, self.cp_positions, self.replicate,
                     self.sequence_parallel, self.loss_parallel, tuple(sorted((self.tp_plan or {}).items()))))

    def data_parallel(self) -> Strategy:
        """The data-parallel strategy object `dp` names."""
        inner = self.dp if isinstance(self.dp, Strategy) else DATA_PARALLEL.get(self.dp, lambda: None)()
        if inner is None or inner.name not in DATA_PARALLEL:
            raise ConfigError(f"Mesh(dp={self.dp!r}): the data-parallel strategy over the tp groups must be "
                              f"one of {sorted(DATA_PARALLEL)} (a name, or such a strategy object)")
        return inner

    def grid(self, topology: Topology) -> ProcessGrid:
        return ProcessGrid(topology, pp=self.pp.stages if self.pp is not None else 1, tp=self.tp, cp=self.cp,
                           replicate=self.replicate)

    def setup(self, model: nn.Module, optimizer, grid: ProcessGrid, *, init: MetaInit | None = None):
        # the ranks of a cp group average their gradients as data-parallel ranks do (each holds
        # part of every sequence): the wrappers below see dp × cp as their data-parallel ranks
        data_grid = grid if self.cp == 1 else ProcessGrid(grid.topology, pp=grid.pp, tp=grid.tp)
        if self.tp > 1:
            wrapped, optimizer = self._tensor_parallel(model, optimizer, data_grid, init)
        else:
            wrapped, optimizer = self._data_parallel(model, optimizer, data_grid, init)
        if self.cp == 1:
            return wrapped, optimizer
        cp_group, _ = grid.group("cp")
        return ContextParallelModel(wrapped, cp_group, grid.coords()["cp"], self.cp, replicas=grid.dp,
                                    replica_index=grid.replica, mode=self.cp_mode,
                                    arange_positions=self.cp_positions), optimizer

    def _data_parallel(self, model: nn.Module, optimizer, grid: ProcessGrid, init: MetaInit | None):
        inner = self.data_parallel()
        if self.pp is not None:  # the pipeline cuts the model; its replicas run `inner`
            return self.pp.setup(model, optimizer, grid, init=init, replicas=inner)
        if grid.dp == 1 and inner.name == "ddp":  # nothing to average: no DDP hooks
            return SingleDevice(whole(model, init).to(grid.topology.device)), optimizer
        return inner.setup(model, optimizer, grid, init=init)

    def _tensor_parallel(self, model: nn.Module, optimizer, grid: ProcessGrid, init: MetaInit | None):
        plan = plan_for(model, self.tp_plan, self.tp)
        if optimizer is not None:
            check_optimizer_owns(optimizer, model.parameters())
        tp_group, _ = grid.group("tp")
        # the ranks that hold the rest of what this one holds: a pipeline's other stages, ZeRO's
        # other shards, and the tp slices (made now, on every rank)
        # (under hybrid sharding a ZeRO-3 shard is held by its "shard" group; the replicas hold copies)
        holders, _ = grid.group("pp" if self.pp is not None else "shard" if grid.replicate > 1 else "dp", "tp")
        device = grid.topology.device
        modules = dict(model.named_modules())
        if has_meta(model):  # the planned layers whole by the rule, to be sliced
            Materializer(model, init).materialize([t for name in plan.styles for t in direct_tensors(modules[name])])
        else:
            model.to(device)
            broadcast_coalesced([*model.parameters(), *model.buffers()], tp_group)
        cut = parallelize(model, plan, tp_group, grid.tp_rank, self.tp)
        sequence = SequenceParallel(model, tp_group) if self.sequence_parallel else None
        if self.loss_parallel:
            _keep_logits_cut(model)
        for name in plan.styles:
            model.get_submodule(name).to(device)
        if optimizer is not None:
            optimizer = _rebuilt(optimizer, cut)
        if self.pp is not None:
            inner, optimizer = self.pp.setup(model, optimizer, grid, init=init)
        else:
            inner, optimizer = self._data_parallel(model, optimizer, grid, init)
        if sequence is not None:
            sequence.hook_gradients(inner.module)
        return TensorParallelModel(inner, cut, tp_group, holders, grid.tp_rank), optimizer


def _keep_logits_cut(model: nn.Module) -> None:
    """Loss parallelism (loss.py): the column-parallel heads at the top of the model keep their
    logits cut by the vocabulary while training."""
    heads = [m for name, m in model.named_children() if isinstance(m, ColwiseLinear)]
    if not heads:
        raise ConfigError(f"Mesh(loss_parallel=True) needs the model's head, a linear layer at the top of "
                          f"{type(model).__name__}, cut 'colwise' (or 'colwise_rep') in the plan")
    for head in heads:
        head.loss_parallel = True


def _scaled(shape: torch.Size, dim: int, parts: int) -> torch.Size:
    return torch.Size(d * parts if i == dim else d for i, d in enumerate(shape))


def _rebuilt(optimizer: torch.optim.Optimizer, cut: Cut) -> torch.optim.Optimizer:
    """`optimizer` for the cut model: each replaced parameter by its successor."""
    stateful = [p for p in cut.replaced if optimizer.state.get(p)]
    if stateful:
        raise ConfigError("the optimizer already holds state (a step was taken) for layers tensor parallelism "
                          "cuts: pass a fresh optimizer to setup and load a checkpoint after it")
    groups = []
    for group in optimizer.param_groups:
        seen, params = set(), []
        for p in group["params"]:
            new = cut.replaced.get(p, p)
            if id(new) not in seen:
                seen.add(id(new))
                params.append(new)
        groups.append(params)
    rebuilt = rebuild_optimizer(optimizer, groups)
    for p, state in optimizer.state.items():
        if p not in cut.replaced:
            rebuilt.state[p] = state
    return rebuilt


class TensorParallelModel(Wrapping):
    """A model whose planned layers are cut over tp, wrapped by a data-parallel strategy over dp
    (`inner`); the protocol (parallel/base.py) is the inner wrapper's, with the tp slices made
    whole where the protocol speaks of the whole model."""

    def __init__(self, inner: ParallelModule, cut: Cut, tp_group, holders, tp_rank: int):
        super().__init__(inner, replicas=inner.replicas, replica_index=inner.replica_index)
        self.shard_dims, self.tp_group, self.holders, self.tp_rank = cut.shard_dims, tp_group, holders, tp_rank

    def local_grads(self) -> tuple[list[torch.Tensor], Any]:
        """The inner wrapper's gradients; the ranks holding the rest are the tp group's, and
        the data-parallel group's too when the inner wrapper shards (ZeRO)."""
        grads, group = self.inner.local_grads()
        return grads, self.tp_group if group is None else self.holders

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The norm of the whole model's gradient: a cut layer's slices summed over tp, a
        replicated parameter counted once (by tp rank 0), over whatever the inner wrapper holds."""
        grads, group = self.local_grads()
        return clip_grad_norm_over(self._counted(), max_norm, group, scale_also=grads)

    def _counted(self) -> list[torch.Tensor]:
        layout = self.inner.checkpoint_layout()
        mine = lambda name: name in self.shard_dims or self.tp_rank == 0  # noqa: E731
        tied = self.inner.tied.not_counted() if isinstance(self.inner, PipelineStage) else set()  # counted on one stage
        if not layout.flat:
            return [p.grad for n, p in layout.params.items() if p.grad is not None and mine(n) and id(p) not in tied]
        counted = []
        for shard, flat in layout.flat.items():
            if shard.grad is not None:
                grad = shard.grad.view(-1)
                counted += [grad[at:at + length] for name, _, at, length in flat.pieces(flat.rank) if mine(name)]
        return counted

    def checkpoint_layout(self) -> CheckpointLayout:
        """The inner wrapper's layout, each cut parameter a slice of the whole, which `shapes`
        gives (checkpoint/layout.py): so a checkpoint loads at another tp, or none."""
        layout = self.inner.checkpoint_layout()
        tp = dist.get_world_size(self.tp_group)
        slices = {n: Slice(self.shard_dims[n], self.tp_rank, tp) for n in layout.shapes if n in self.shard_dims}
        shapes = {n: _scaled(s, slices[n].dim, tp) if n in slices else s for n, s in layout.shapes.items()}
        return replace(layout, shapes=shapes, slices=slices)

    def state_pieces(self) -> Iterator[dict[str, torch.Tensor]]:
        """The inner wrapper's pieces, each cut tensor gathered whole over tp (collective)."""
        for piece in self.inner.state_pieces():
            yield {k: self._whole(v, self.shard_dims[k]) if k in self.shard_dims else v for k, v in piece.items()}

    def _whole(self, value: torch.Tensor, dim: int) -> torch.Tensor:
        parts = [torch.empty_like(value) for _ in range(dist.get_world_size(self.tp_group))]
        dist.all_gather(parts, value.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=dim)
