"""Optimizer helpers every strategy shares: rebuild an optimizer for other parameters, clip by
the global norm when each rank holds only part of the gradients, and say whether an optimizer
can skip a step on the device."""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from paratrain.distributed.comm import group_device
from paratrain.errors import ConfigError, UsageError


def check_optimizer_owns(optimizer: torch.optim.Optimizer, params) -> None:
    """Every tensor the optimizer steps must be one of `params` (the model's parameters, or its
    trainable ones where a strategy shards them): an optimizer made for another model, or for a
    copy, would step tensors training never touches."""
    owned = {id(p) for p in params}
    foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in owned]
    frozen = sum(1 for p in foreign if not p.requires_grad)
    if frozen:
        raise ConfigError(f"the optimizer holds {frozen} frozen parameter(s) (requires_grad=False), which this "
                          "strategy does not shard or step: create the optimizer from the trainable ones, "
                          "[p for p in model.parameters() if p.requires_grad]")
    if foreign:
        raise ConfigError(f"the optimizer holds {len(foreign)} tensor(s) that are not parameters of the "
                          "model passed with it; create the optimizer from model.parameters() of "
                          "that same model")


def rebuild_optimizer(optimizer: torch.optim.Optimizer,
                      groups: list[list[nn.Parameter]]) -> torch.optim.Optimizer:
    """A new optimizer of the same class whose param group i holds `groups[i]`, with the
    hyperparameters of `optimizer`'s group i. Sharded and pipeline strategies use it: the user
    made the optimizer for the whole model, a rank steps only its part. A group may be empty (a
    pipeline stage without that group's parameters): group i stays group i on every rank, so
    schedulers and checkpoints see the user's groups."""
    param_groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": params}
                    for group, params in zip(optimizer.param_groups, groups)]
    # the groups carry every hyperparameter; pass on only the defaults the constructor names
    # (AdamW's defaults hold `decoupled_weight_decay`, which its constructor does not take)
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    try:
        return type(optimizer)(param_groups, **defaults)
    except TypeError as e:  # a constructor that wants more than param groups and defaults
        raise ConfigError(f"cannot rebuild {type(optimizer).__name__} for this rank's parameters ({e}); "
                          "use a torch.optim optimizer, or one whose constructor takes "
                          "(param_groups, **defaults)") from None


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` honours a `found_inf` tensor by leaving the parameters and its
    state as they were (session/step.py, DeviceCheck): torch's Adam and AdamW with fused=True in every
    param group, whose fused kernels return at once when found_inf is 1 and undo the step count.
    Not fused SGD (its first step would keep momentum buffers it never wrote), nor optimizers of
    other kinds. A wrapper that steps another optimizer answers for it (`skips_on_device`)."""
    answer = getattr(optimizer, "skips_on_device", None)
    if answer is not None:
        return answer
    return (type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
            and getattr(optimizer, "_step_supports_amp_scaling", False)
            and all(group.get("fused") for group in optimizer.param_groups))


@torch.no_grad()
def clip_grad_norm_over(grads: list[torch.Tensor], max_norm: float, group=None, *,
                        scale_also: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Clip by the global norm when the ranks of `group` hold disjoint parts of the gradients
    (ZeRO shards, pipeline stages): sum the squares of this rank's parts, all-reduce, then scale
    as torch's `clip_grad_norm_` does (coefficient max_norm / (norm + 1e-6), clamped to 1).
    Zero padding adds nothing to the norm. `scale_also`: the gradients to scale, when they are
    more than those counted (a weight tied across pipeline stages counts once, scales on each)."""
    squares = torch.zeros((), dtype=torch.float64, device=group_device(group))
    for g in grads:
        squares += g.double().pow(2).sum().to(squares.device)
    dist.all_reduce(squares, group=group)
    norm = squares.sqrt().float()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads if scale_also is None else scale_also:
        g.mul_(scale.to(g.device, g.dtype))
    return norm


def retire_replaced(given: torch.optim.Optimizer | None, used: torch.optim.Optimizer | None,
                    strategy: str) -> None:
    """`used` replaced `given` (a sharded or pipeline strategy rebuilt it): stepping `given` from
    now on raises, and its param_groups become `used`'s, so a learning rate changed through it
    (by hand, or by a scheduler created on it after setup) reaches the optimizer that steps.
    A scheduler created on `given` before setup is refused: its state would follow the old one."""
    if given is None or used is given:
        return
    if hasattr(given.step, "_wrapped_by_lr_sched"):
        raise ConfigError(f"a learning-rate scheduler was created on the optimizer before setup(), but "
                          f"{strategy} replaces that optimizer, so the scheduler would change "
                          "the learning rate of one that no longer steps: create the scheduler from "
                          "the optimizer setup() returns")
    given.param_groups = used.param_groups

    def refuse(optimizer, args, kwargs):
        raise UsageError(f"this optimizer was passed to setup(), and {strategy} replaced it: step the "
                         "optimizer setup() returned (`model, optimizer, loader = session.setup(...)`); "
                         "this one would change nothing, or not the parameters that train")
    given.register_step_pre_hook(refuse)


class Given(NamedTuple):
    """What the user gave setup(), before any strategy cut, sharded or rebuilt it."""

    parameters: int  # of the whole model, tied weights counted once
    trainable: int
    optimizer: str | None  # the optimizer's class, e.g. "torch.optim.adam.Adam"


def describe(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Given:
    params = list(model.parameters())
    kind = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}" if optimizer is not None else None
    return Given(sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad), kind)
