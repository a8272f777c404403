"""One optimizer step over whatever part of the gradients each rank holds, and the checks that
keep a bad number from reaching the parameters (Session.step and Session.backward call these).

Per optimizer step, on the gradients `local_grads()` returns (parallel/base.py):

    normalise   token-weighted losses: × replicas / Σ weight (accumulation.py)
    unscale     fp16: ÷ the loss scale; an inf or nan on any holder skips the step (precision.py)
    check       otherwise a non-finite gradient anywhere stops the run on every rank, naming it,
                before the optimizer steps: replicated strategies hold the same averaged
                gradients everywhere, so each rank checks its own; sharded ones reduce one flag
                over the holders, or, when every rank saw each reduction whole and the model is
                small, each sums those (ParallelModule.reduced_finite); DDP sums each bucket as
                its all-reduce completes (buckets.AllReduce). With clipping the global
                norm is that check.
    clip        by the global norm (clip_grad_norm_)
    step        and zero the gradients
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from paratrain.accumulation import TokenWeights
from paratrain.comm import group_device
from paratrain.errors import UsageError
from paratrain.parallel.base import ParallelModule
from paratrain.precision import GradScaler


class StepResult(NamedTuple):
    stepped: bool  # False: fp16 skipped the step, its gradients overflowed (on every rank)
    grad_norm: torch.Tensor | None  # the global norm before clipping, when clipping computed it


def optimizer_step(model: ParallelModule, optimizer: torch.optim.Optimizer, *, weights: TokenWeights,
                   scaler: GradScaler | None, max_grad_norm: float | None, check_finite: bool,
                   before_step: Callable[[], None] | None = None) -> StepResult:
    """Normalise, unscale, check, clip, step and zero the gradients; `before_step()` sees the
    gradients as the optimizer is about to read them (`paratrain verify` records them there)."""
    factor = weights.normaliser(model.replicas)
    skip, norm = False, None
    reduced_finite = model.reduced_finite()  # every step: it starts the next step's count too
    if scaler is not None or factor != 1.0 or (check_finite and max_grad_norm is None):
        grads, group = model.local_grads()
        if scaler is not None:  # unscale before clipping: max_grad_norm is in true units
            skip = scaler.unscale_(grads, group, factor=factor)
        else:
            _scale(grads, factor)
            if check_finite and max_grad_norm is None and not _all_finite(grads, group, reduced_finite):
                raise _non_finite(model, "gradient")
    if max_grad_norm is not None and not skip:
        norm = model.clip_grad_norm_(max_grad_norm)
        if check_finite and not torch.isfinite(norm):  # the norm is global: every rank agrees
            raise _non_finite(model, "gradient norm")
    if before_step is not None:
        before_step()
    if not skip:  # every rank agrees: the flags were reduced over the gradients' holders
        optimizer.step()
    if scaler is not None:
        scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(not skip, norm)


def _scale(grads: list[torch.Tensor], factor: float) -> None:
    if factor != 1.0:
        torch._foreach_mul_(grads, factor)


def _all_finite(grads: list[torch.Tensor], group: Any, reduced_finite: torch.Tensor | None = None) -> bool:
    """Whether every gradient on every holder is finite: one fused norm, and one small
    all-reduce when the gradients are split between ranks (group is not None), unless every
    rank saw every reduction whole and summed it (`reduced_finite`, ParallelModule.reduced_finite)."""
    if reduced_finite is not None:
        return bool(reduced_finite.item())
    # a sum is the cheapest full read, and NaN and inf survive it (finite values summing past the
    # float range would be a false alarm, at gradients of 1e38)
    sums = [g.sum() for g in grads] if len(grads) < 8 else torch._foreach_norm(grads)
    if len({(n.dtype, n.device) for n in sums}) > 1:  # offloaded or mixed-dtype holders
        sums = [n.float().cpu() for n in sums]
    bad = (~torch.isfinite(torch.stack(sums).sum() if sums else torch.zeros(()))).float()
    if group is not None:
        bad = bad.to(group_device(group))
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    return not bool(bad.item())


def _non_finite(model: ParallelModule, what: str) -> UsageError:
    names = [n for n, p in model.module.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    where = f": {', '.join(names[:5])} on this rank" if names else " (on another rank's share)"
    return UsageError(f"a {what} is NaN or infinite although the loss was finite{where}; the optimizer "
                      "did not step and no checkpoint will hold it. Lower the learning rate, clip "
                      "gradients (Session(max_grad_norm=...)), look for a division by zero or a log of 0 "
                      "in the model, or pass Session(nan_check=False) to go on regardless")


def check_finite_loss(loss: torch.Tensor, where: Callable[[], str]) -> None:
    """Stop before a NaN or infinite loss reaches the parameters (`where()`: the step and rank).
    The loss is one number (check_loss): reading it is one host sync, as the progress bar's is."""
    if not math.isfinite(loss.item()):
        raise UsageError(f"the loss is {loss.detach().float().mean().item()} at {where()}; the optimizer "
                         "did not step. Lower the learning rate, clip gradients (Session(max_grad_norm=...)), "
                         "check this batch's inputs and targets, or pass Session(nan_check=False) to go on "
                         "regardless")
