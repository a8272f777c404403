"""What each strategy sends in one step, from the same layouts memory.py reads (and the strategies
build): the gradient buckets it reduces, the slices it gathers back, the units it gathers.

    ddp, hierarchical   every bucket of grad_sync's layout, all-reduced (hierarchical: in three phases)
    zero1, zero2        the owners' buckets (padded to N, in param_dtype), reduced to their owners;
                        after the step the same bytes of parameters gathered back from the owners
    zero3               every unit (root first, then the wrap policy's units in model order): its
                        flats' padded bytes in param_dtype, gathered in forward and again in
                        backward, and its gradients reduced to the owners
    pipeline            the fullest stage's buckets (replicas all-reduce them); the activation at a cut
step_time.py turns these into seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from paratrain.errors import ConfigError
from paratrain.grid import NodeGroups
from paratrain.parallel.base import Strategy
from paratrain.parallel.buckets import AllReduce, buffer_numel, default_caps, padded_numel
from paratrain.parallel.ddp import DDP, bucket_caps
from paratrain.parallel.grad_sync import first_grad_layout
from paratrain.parallel.hierarchical import Hierarchical, HierarchicalReduction
from paratrain.parallel.pipeline import Pipeline
from paratrain.parallel.single import Single
from paratrain.parallel.zero import ZeRO
from paratrain.parallel.zero.owner_reduction import OwnerReduction
from paratrain.parallel.zero.units import flats_of, owners_by_param, params_by_unit
from paratrain.plan.memory import bucket_layout, meta_like


@dataclass(frozen=True)
class Traffic:
    """One rank's messages per step (module docstring); sizes in elements and bytes."""

    buckets: list[tuple[int, int]] = field(default_factory=list)  # reduced in this order: (elements, bytes)
    gathers: list[int] = field(default_factory=list)  # zero1/2: bytes gathered back after the step
    units: list[tuple[int, int]] = field(default_factory=list)  # zero3, forward order: (elements, bytes)


def traffic(model: nn.Module, strategy: Strategy, *, world: int, local_world: int | None = None) -> Traffic:
    """What `strategy` sends on each of `world` ranks training `model` (possibly on the meta device)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if isinstance(strategy, Single):
        return Traffic()
    if isinstance(strategy, Pipeline):
        return _pipeline(model, strategy)
    if isinstance(strategy, ZeRO):
        return _zero3(model, strategy, world) if strategy.stage == 3 else _zero12(trainable, strategy, world)
    if isinstance(strategy, DDP):
        reduction = AllReduce()
        if isinstance(strategy, Hierarchical):
            reduction = HierarchicalReduction(NodeGroups(None, None, tuple(range(local_world or world)), ()))
        layout = bucket_layout(trainable, bucket_caps(strategy.bucket_cap_mb, None), reduction,
                               strategy.find_unused_parameters, None)
        return Traffic(buckets=[_sized(b, reduction.pad_to) for b in layout])
    raise ConfigError(f"no traffic model for strategy {strategy.name!r}")


def _sized(bucket: list[nn.Parameter], pad_to: int) -> tuple[int, int]:
    n = buffer_numel(bucket, pad_to)
    return n, n * bucket[0].dtype.itemsize


def _zero12(trainable: list[nn.Parameter], strategy: ZeRO, world: int) -> Traffic:
    stand = list(meta_like(trainable, strategy.param_dtype).values())
    reduction = OwnerReduction(group=None, rank=0, world=world, group_of={s: 0 for s in stand})
    layout = first_grad_layout(stand, bucket_caps(strategy.bucket_cap_mb, None), reduction, find_unused=False)
    buckets = [_sized(b, reduction.pad_to) for b in layout]
    return Traffic(buckets=buckets, gathers=[nbytes for _, nbytes in buckets])


def _zero3(model: nn.Module, strategy: ZeRO, world: int) -> Traffic:
    units = params_by_unit(owners_by_param(model), strategy.wrap_policy.select(model))
    order = [""] + [name for name in units if name]  # the root's forward starts first
    out = []
    for name in order:
        trainable = [p for p in units[name] if p.requires_grad]
        if not trainable:
            continue
        flats = flats_of(trainable, {p: 0 for p in trainable})
        elements = sum(padded_numel(sum(p.numel() for p in f), world) for f in flats)
        out.append((elements, elements * (strategy.param_dtype or trainable[0].dtype).itemsize))
    return Traffic(buckets=out, units=out)


def _pipeline(model: nn.Module, strategy: Pipeline) -> Traffic:
    """The stage with the most parameters: the one the others wait for."""
    stages = [list({id(p): p for p in held if p.requires_grad}.values()) for held in strategy.holdings(model)]
    fullest = max(stages, key=lambda ps: sum(p.numel() for p in ps))
    layout = first_grad_layout(fullest, default_caps(), AllReduce(), find_unused=True)
    return Traffic(buckets=[_sized(b, 1) for b in layout])
