"""What tensor parallelism, `pt.Mesh(tp, dp)`, changes in a plan (parallel/tensor/).

A rank holds 1/tp of each cut layer, and the data-parallel strategy runs over world / tp ranks on
that smaller model: so memory and the data-parallel traffic are those of `dp` on the cut model,
over the dp ranks (`cut_copy`: the model on the meta device with each cut parameter's rows 1/tp).
Which layers are cut is the model's plan (parallel/tensor/plan.py); a model without one is
planned with Megatron's cut (Shoeybi et al. 2019): every matrix of the repeated blocks, its
embedding and head replicated. What the plan cannot say, the planner takes from the papers:

    activations   a transformer layer saves s·b·h·(34 + 5as/h) bytes in 16-bit, of which
                  s·b·h·(10 + 24/t + 5as/(ht)) under tensor parallelism (Korthikanti et al. 2022,
                  Table 2): the per-rank activations are (10 + 24/tp) / 34 of the replica's. With
                  activation checkpointing what is kept are the blocks' inputs, which every tp rank
                  holds whole: the replica's, uncut (the one block recomputed at a time is cut,
                  left out). With sequence parallelism s·b·h·(34/t + 5as/(ht)) (Table 2): 1/tp of
                  the replica's, checkpointed or not (the blocks' inputs are cut along the sequence)
    compute       the blocks' FLOPs (probe's block_flops) run 1/tp on each rank; the rest
                  (embedding, head, loss) whole
    comm          per block, an all-reduce of its output (b·s·h) after attention and after the MLP
                  in forward and one for each in backward, once more in a recomputed forward; on
                  the critical path (nothing overlaps them), inside a node (Narayanan et al. 2021,
                  §3.2). Sequence parallelism sends an all-gather and a reduce-scatter instead of
                  each, the same bytes and the same time (a ring all-reduce is one of each)
"""

from __future__ import annotations

import copy
import weakref

import torch
from torch import nn

from paratrain.errors import ConfigError
from paratrain.parallel.base import Strategy
from paratrain.parallel.tensor.layers import ColwiseLinear, RowwiseLinear, VocabEmbedding
from paratrain.parallel.tensor.mesh import Mesh
from paratrain.parallel.tensor.plan import COLWISE, ROWWISE, plan_for
from paratrain.plan.cluster.cluster import Cluster
from paratrain.plan.cost import comm_model
from paratrain.plan.cost.comm_model import Group
from paratrain.plan.model.repeated_blocks import find_stack


def cut_modules(model: nn.Module, strategy: Mesh) -> dict[str, str]:
    """The modules `strategy` cuts and their styles: its plan's, or Megatron's cut where the
    model has no plan and none was given (module docstring; every parameter of each cut along
    its first dimension: a row-parallel layer's whole bias is counted cut, a few elements)."""
    try:
        return plan_for(model, strategy.tp_plan, strategy.tp).styles
    except ConfigError:
        if strategy.tp_plan is not None or getattr(model, "tp_plan", None):
            raise  # a plan that cannot cut the model: the session would refuse it too
    stack = find_stack(model)
    if stack is None:
        raise ConfigError(f"pt.Mesh(tp={strategy.tp}): the model has no plan and no stack of identical blocks "
                          "to cut as Megatron does; give it a tp_plan")
    names = [name for name, module in model.named_modules() if name.startswith(stack.name + ".")
             and any(p.dim() >= 2 for p in module.parameters(recurse=False))]
    for name in names:
        for pname, p in model.get_submodule(name).named_parameters(recurse=False):
            if p.dim() >= 2 and p.shape[0] % strategy.tp:
                raise ConfigError(f"tp={strategy.tp} does not divide {name}.{pname}'s {p.shape[0]} rows")
    return {name: COLWISE for name in names}


_CUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → {(tp, plan): its cut copy}


def cut_copy(model: nn.Module, strategy: Mesh) -> nn.Module:
    """A copy of `model` (on the meta device) holding what one tp rank holds: each cut
    parameter 1/tp along the dimension its layer splits (layers.py's shard_dim; Megatron's cut
    where the model has no plan: along the first), a parameter tied between cut modules cut once.
    Made once per model, width and plan: a plan's rows (every dp strategy, memory and time) only
    read it, as they read ModelSource.shared."""
    key = (strategy.tp, tuple(sorted((strategy.tp_plan or {}).items())))
    cuts = _CUTS.setdefault(model, {})
    if key not in cuts:
        cuts[key] = _cut(model, strategy)
    return cuts[key]


def _cut(model: nn.Module, strategy: Mesh) -> nn.Module:
    cut = copy.deepcopy(model)
    shrunk: dict[int, nn.Parameter] = {}
    for name, style in cut_modules(cut, strategy).items():
        module = cut.get_submodule(name)
        for pname, dim in _split_dims(module, style).items():
            p = getattr(module, pname, None)
            if p is None:
                continue
            if id(p) not in shrunk:
                shape = list(p.shape)
                shape[dim] //= strategy.tp
                shrunk[id(p)] = nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta"),
                                             requires_grad=p.requires_grad)
            setattr(module, pname, shrunk[id(p)])
    return cut


def _split_dims(module: nn.Module, style: str) -> dict[str, int]:
    """Which of `module`'s parameters its tensor-parallel layer splits, along which dimension."""
    if isinstance(module, nn.Embedding):
        return dict(VocabEmbedding.shard_dim)
    if isinstance(module, nn.Linear):
        return dict(RowwiseLinear.shard_dim if style == ROWWISE else ColwiseLinear.shard_dim)
    return {name: 0 for name, p in module.named_parameters(recurse=False) if p.dim() >= 1}


def inner_strategy(strategy: Mesh) -> Strategy:
    """What runs over the ranks that hold the same tp slices: the pipeline with `pp`, else the
    data-parallel strategy."""
    return strategy.pp if strategy.pp is not None else strategy.data_parallel()


def activation_fraction(tp: int, sequence_parallel: bool = False, checkpointed: bool = False) -> float:
    """A tp rank's activations over its replica's (module docstring)."""
    if sequence_parallel:
        return 1 / tp
    return 1.0 if checkpointed else (10 + 24 / tp) / 34


def compute_fraction(tp: int, block_flops: dict[str, int], flops_forward: int) -> float:
    """A tp rank's FLOPs over its replica's: the blocks' 1/tp, the rest whole."""
    blocks = sum(block_flops.values())
    if not flops_forward or not blocks:
        return 1.0
    kept = max(0.0, 1 - blocks / flops_forward)
    return kept + (1 - kept) / tp


def tp_seconds(block_output_bytes: dict[str, int], *, tp: int, dp: int, accumulate: int, recompute: bool,
               cluster: Cluster) -> float:
    """The tp all-reduces of one optimizer step (module docstring), on the slowest rank."""
    if tp == 1:
        return 0.0
    per_node = cluster.gpus_per_node or tp
    group = Group(tp, max(1, tp // per_node))
    per_block = 4 + (2 if recompute else 0)
    micro = [b / (dp * accumulate) for b in block_output_bytes.values()]
    return accumulate * per_block * sum(comm_model.all_reduce(b, group, cluster) for b in micro)
