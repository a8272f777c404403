"""The strategies' own layout code run on meta stand-ins: which buckets, owners' slices, units
and stages a model's parameters fall into under each strategy, as the strategies lay them out
(the functions named are theirs). memory.py counts the bytes of these layouts, traffic.py the
messages they send.

Under `reused()` (plan/search.py, which plans hundreds of layouts of the same cut copies) each
layout is made once per model, strategy and world: they are pure functions of those, and the
walks over a 70B model's modules took most of a search's time."""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

from paratrain.distributed.grid import NodeGroups
from paratrain.parallel.buckets import AllReduce, Reduction, assign, default_caps
from paratrain.parallel.ddp import DDP, bucket_caps
from paratrain.parallel.grad_sync import first_grad_layout, rebuilds
from paratrain.parallel.hierarchical import Hierarchical, HierarchicalReduction
from paratrain.parallel.zero import ZeRO
from paratrain.parallel.zero.owner_reduction import OwnerReduction
from paratrain.parallel.zero.units import flats_by_unit, owners_by_param, params_by_unit

_reused: dict | None = None  # (function, key of its arguments) -> (the arguments, kept alive, and the result)


@contextmanager
def reused() -> Iterator[None]:
    """Make each layout once while this lasts (module docstring); the models and parameters it
    is given must not change meanwhile (their requires_grad, dtypes or structure)."""
    global _reused
    outer = _reused
    _reused = {} if outer is None else outer
    try:
        yield
    finally:
        _reused = outer


def _key(value: Any) -> Any:
    """Modules and tensors by identity (the cache holds them, so an id is not reused), settings
    by their repr (a strategy's repr names every field)."""
    if isinstance(value, (nn.Module, torch.Tensor)):
        return id(value)
    if isinstance(value, (list, tuple)):
        return tuple(_key(v) for v in value)
    if isinstance(value, dict):
        return tuple((_key(k), _key(v)) for k, v in value.items())
    return value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)


def _memo(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _reused is None:
            return fn(*args, **kwargs)
        key = (fn.__name__, _key(args), _key(kwargs))
        if key not in _reused:
            _reused[key] = ((args, kwargs), fn(*args, **kwargs))
        return _reused[key][1]
    return wrapper


@_memo
def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of `model` that get gradients, in registration order."""
    return [p for p in model.parameters() if p.requires_grad]


def bucket_layout(params: list[nn.Parameter], caps: list[int], reduction: Reduction, find_unused: bool,
                   arrival: list[nn.Parameter] | None) -> list[list[nn.Parameter]]:
    """The buckets the gradients live in at rest: rebuilt in arrival order (grad_sync.py), or the
    first layout when they never are."""
    if rebuilds(reduction, find_unused):
        return assign(arrival if arrival is not None else params[::-1], caps, reduction.key)
    return first_grad_layout(params, caps, reduction, find_unused)


@_memo
def data_parallel_layout(trainable: list[nn.Parameter], strategy: DDP, local_world: int,
                         arrival: list[nn.Parameter] | None = None) -> tuple[Reduction, list[list[nn.Parameter]]]:
    """DDP's (hierarchical's: padded to the node's size) reduction and gradient buckets at rest."""
    reduction: Reduction = AllReduce()
    if isinstance(strategy, Hierarchical):
        reduction = HierarchicalReduction(NodeGroups(None, None, tuple(range(local_world)), ()))
    return reduction, bucket_layout(trainable, bucket_caps(strategy.bucket_cap_mb, None), reduction,
                                    strategy.find_unused_parameters, arrival)


def meta_like(params: list[nn.Parameter], dtype: torch.dtype | None) -> dict[nn.Parameter, nn.Parameter]:
    """Stand-ins of `params` on the meta device, cast to `dtype` as ZeRO casts them before laying
    out its buckets (the caps are in bytes, so the layout depends on the dtype)."""
    return {p: nn.Parameter(torch.empty(p.shape, dtype=dtype or p.dtype, device="meta")) for p in params}


@_memo
def zero12_layout(trainable: list[nn.Parameter], strategy: ZeRO, world: int, group_of: dict[nn.Parameter, int]
                  ) -> tuple[OwnerReduction, list[list[nn.Parameter]], dict[nn.Parameter, nn.Parameter]]:
    """ZeRO-1/2's owners' reduction and buckets, laid out on stand-ins in param_dtype, and each
    stand-in's original parameter."""
    stand = meta_like(trainable, strategy.param_dtype)
    reduction = OwnerReduction(group=None, rank=0, world=world, group_of={s: group_of[p] for p, s in stand.items()})
    layout = first_grad_layout(list(stand.values()), bucket_caps(strategy.bucket_cap_mb, None), reduction,
                               find_unused=False)
    return reduction, layout, {s: p for p, s in stand.items()}


@_memo
def zero3_flats(model: nn.Module, strategy: ZeRO, group_of: dict[nn.Parameter, int]
                ) -> dict[str, list[list[nn.Parameter]]]:
    """Each ZeRO-3 unit's flat shards' parameters (stage3.py), the wrap policy's units in model
    order, then the root ("")."""
    return flats_by_unit(params_by_unit(owners_by_param(model), strategy.wrap_policy.select(model)), group_of)


def stage_layout(trainable: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """A pipeline stage's gradient buckets, which its replicas all-reduce (stage.py)."""
    return first_grad_layout(trainable, default_caps(), AllReduce(), find_unused=True)
