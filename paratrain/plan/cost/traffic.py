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
from paratrain.parallel.base import Strategy
from paratrain.parallel.buckets import buffer_numel, padded_numel
from paratrain.parallel.ddp import DDP
from paratrain.parallel.pipeline import Pipeline
from paratrain.parallel.single import Single
from paratrain.parallel.zero import ZeRO
from paratrain.plan.cost.layouts import data_parallel_layout, stage_layout, trainable, zero3_flats, zero12_layout


@dataclass(frozen=True)
class Traffic:
    """One rank's messages per step (module docstring); sizes in elements and bytes."""

    buckets: list[tuple[int, int]] = field(default_factory=list)  # reduced in this order: (elements, bytes);
    # zero3: its units in forward order, each gathered and then reduced
    gathers: list[int] = field(default_factory=list)  # zero1/2: bytes gathered back after the step


def traffic(model: nn.Module, strategy: Strategy, *, world: int, local_world: int | None = None) -> Traffic:
    """What `strategy` sends on each of `world` ranks training `model` (possibly on the meta device)."""
    if isinstance(strategy, Single):
        return Traffic()
    if isinstance(strategy, Pipeline):
        return _pipeline(model, strategy)
    held = trainable(model)
    one_group = {p: 0 for p in held}  # the planner's optimizer has one param group
    if isinstance(strategy, ZeRO) and strategy.stage == 3:
        return _zero3(model, strategy, world, one_group)
    if isinstance(strategy, ZeRO):
        reduction, layout, _ = zero12_layout(held, strategy, world, one_group)
        buckets = [_sized(b, reduction.pad_to) for b in layout]
        return Traffic(buckets=buckets, gathers=[nbytes for _, nbytes in buckets])
    if isinstance(strategy, DDP):
        reduction, layout = data_parallel_layout(held, strategy, local_world or world)
        return Traffic(buckets=[_sized(b, reduction.pad_to) for b in layout])
    raise ConfigError(f"no traffic model for strategy {strategy.name!r}")


def _sized(bucket: list[nn.Parameter], pad_to: int) -> tuple[int, int]:
    n = buffer_numel(bucket, pad_to)
    return n, n * bucket[0].dtype.itemsize


def _zero3(model: nn.Module, strategy: ZeRO, world: int, group_of: dict[nn.Parameter, int]) -> Traffic:
    units = zero3_flats(model, strategy, group_of)
    out = []
    for name in [""] + [name for name in units if name]:  # the root's forward starts first
        if flats := units[name]:
            elements = sum(padded_numel(sum(p.numel() for p in f), world) for f in flats)
            out.append((elements, elements * (strategy.param_dtype or flats[0][0].dtype).itemsize))
    return Traffic(buckets=out)


def _pipeline(model: nn.Module, strategy: Pipeline) -> Traffic:
    """The stage with the most parameters: the one the others wait for."""
    stages = [list({id(p): p for p in held if p.requires_grad}.values()) for held in strategy.holdings(model)]
    fullest = max(stages, key=lambda ps: sum(p.numel() for p in ps))
    return Traffic(buckets=[_sized(b, 1) for b in stage_layout(fullest)])
