"""What ZeRO asks of the user's optimizer, checked once for every stage: it steps element by
element (so a flat shard of many parameters steps exactly as they would), and it holds every
trainable parameter of the model, in param groups each shard keeps."""

from __future__ import annotations

import torch
from torch import nn

from paratrain.components.optim import check_optimizer_owns, rebuild_optimizer
from paratrain.errors import ConfigError


def check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    """Refuse optimizers that look across whole tensors (LBFGS, Adafactor, Muon)."""
    whole_tensor = tuple(getattr(torch.optim, name) for name in ("LBFGS", "Adafactor", "Muon")
                         if hasattr(torch.optim, name))
    if isinstance(optimizer, whole_tensor):
        raise ConfigError(f"{type(optimizer).__name__} looks across whole tensors, so it cannot step "
                          "a flat shard exactly; use an element-wise optimizer (SGD, Adam, AdamW, …) "
                          "with ZeRO, or strategy 'ddp'")


def param_groups_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[nn.Parameter, int]:
    """Which param group of `optimizer` holds each trainable parameter of `model`; a clear error
    when the optimizer was made for another model or leaves parameters out."""
    check_elementwise(optimizer)
    check_optimizer_owns(optimizer, [p for p in model.parameters() if p.requires_grad])
    group_of = {p: i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p not in group_of]
    if missing:
        raise ConfigError(f"the optimizer does not hold {len(missing)} trainable parameter(s) "
                          f"({', '.join(missing[:5])}); pass them all, or set requires_grad=False")
    return group_of


def check_steps_on_cpu(optimizer: torch.optim.Optimizer) -> None:
    """Under offload the optimizer steps tensors in CPU memory: try one step of its class and
    settings on a one-element CPU tensor, and refuse it with the reason if it cannot (an
    optimizer written for CUDA tensors only, `fused=True` where torch lacks a CPU kernel)."""
    probe = torch.zeros(1, requires_grad=True)
    probe.grad = torch.ones(1)
    trial = rebuild_optimizer(optimizer, [[probe]] + [[] for _ in optimizer.param_groups[1:]])
    try:
        trial.step()
    except Exception as e:  # whatever the optimizer raises, the advice is the same
        raise ConfigError(f"offload steps the optimizer on the CPU, and {type(optimizer).__name__} cannot "
                          f"step a CPU tensor ({type(e).__name__}: {e}); use an optimizer that runs on "
                          "the CPU (torch.optim.AdamW, without fused=True on older torch), or offload=False") from e
