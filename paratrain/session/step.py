"""One optimizer step over whatever part of the gradients each rank holds, and the checks that
keep a bad number from reaching the parameters (Session.step and Session.backward call these).

Per optimizer step, on the gradients `local_grads()` returns (parallel/base.py), and on the
losses of its micro-batches (LossLog: recorded as they come, read here in the same wait for the
device as the gradients, so a micro-batch costs none):

    normalise   token-weighted losses: × world / Σ weight (components/accumulation.py)
    unscale     fp16: ÷ the loss scale; an inf or nan on any holder skips the step (components/precision.py)
    check       otherwise a non-finite loss, or gradient anywhere, stops the run, naming the
                micro-batch or the parameters, before the optimizer steps: replicated strategies
                hold the same averaged gradients everywhere, so each rank checks its own (and its
                losses); sharded ones sum their gradients and all-reduce that one number
                over the holders (a NaN or an infinity anywhere survives the sum), or, when
                every rank saw each reduction whole (DDP; ZeRO on gloo), each sums those as
                they complete (ParallelModule.reduced_finite; buckets.ReducedSums): a small
                model every one whole, a large one its 1/N of each, and all-reduces the sum.
                Each test of a sum is on the host, math.isfinite(sum.item()), one wait for
                the device per step; with a fused optimizer on a GPU (DeviceCheck) the test
                is the optimizer's found_inf instead: its kernels skip the step on the
                device, and the host reads the verdict one optimizer step later.
                With clipping the global norm is that check.
                Under fp16 a non-finite gradient is an overflow (skip); a non-finite loss still
                stops the run.
    clip        by the global norm (clip_grad_norm_)
    step        and zero the gradients
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch

from paratrain.components.accumulation import TokenWeights
from paratrain.components.optim import skips_on_device
from paratrain.components.precision import GradScaler
from paratrain.distributed.comm import sum_over
from paratrain.errors import UsageError
from paratrain.parallel.base import ParallelModule


class StepResult(NamedTuple):
    stepped: bool  # False: fp16 skipped the step, its gradients overflowed (on every rank)
    grad_norm: torch.Tensor | None  # the global norm before clipping, when clipping computed it


class LossLog:
    """The losses of the micro-batches since the last optimizer step, kept on the device until
    the step reads them with its gradients (Session(nan_check=True))."""

    def __init__(self, accumulate: int, rank: int):
        self.accumulate, self.rank = accumulate, rank
        self.items: list[tuple[torch.Tensor, int, int]] = []  # (loss, micro-batch, epoch)

    def add(self, loss: torch.Tensor, micro_step: int, epoch: int) -> None:
        self.items.append((loss.detach(), micro_step, epoch))

    def total(self) -> torch.Tensor | None:
        """Their sum in fp32: finite exactly when each is (short of 1e38). An fp32 scalar, the
        common case, goes in as it is: each op here costs microseconds on the host, per step."""
        losses = [loss if loss.dtype == torch.float32 and loss.dim() == 0 else loss.float().reshape(())
                  for loss, _, _ in self.items]
        return (losses[0] if len(losses) == 1 else torch.stack(losses).sum()) if losses else None

    def error(self) -> UsageError | None:
        """The first non-finite loss, as the error to raise (reads each: the failing path only)."""
        for loss, micro_step, epoch in self.items:
            value = loss.float().mean().item()
            if not math.isfinite(value):
                return UsageError(
                    f"the loss is {value} at optimizer step {micro_step // self.accumulate} (micro-batch "
                    f"{micro_step}, epoch {epoch}) on rank {self.rank}; the optimizer did not step and the "
                    "step's gradients were dropped. Lower the learning rate, clip gradients "
                    "(Session(max_grad_norm=...)), check this batch's inputs and targets, or pass "
                    "Session(nan_check=False) to go on regardless")
        return None


def optimizer_step(model: ParallelModule, optimizer: torch.optim.Optimizer, *, weights: TokenWeights,
                   scaler: GradScaler | None, max_grad_norm: float | None, check_finite: bool,
                   before_step: Callable[[], None] | None = None, losses: LossLog | None = None,
                   on_device: DeviceCheck | None = None) -> StepResult:
    """Normalise, unscale, check, clip, step and zero the gradients; `before_step()` sees the
    gradients as the optimizer is about to read them (`paratrain verify` records them there).
    `losses`: the micro-batches' losses, checked with the gradients when check_finite.
    `on_device`: check without waiting (DeviceCheck); it first raises the previous step's error."""
    if on_device is not None and on_device.pending is not None:
        try:
            on_device.raise_pending()
        except UsageError:  # this step's gradients and losses go with the error, as at the bad step
            optimizer.zero_grad(set_to_none=True)
            if losses is not None:
                losses.items.clear()
            raise
    factor = weights.normaliser()
    skip, norm, found, flag = False, None, None, None  # the check's total; its found_inf on the device
    reduced_finite = model.reduced_finite()  # every step: it starts the next step's count too
    loss = losses.total() if check_finite and losses is not None else None
    try:
        if scaler is not None:  # unscale before clipping: max_grad_norm is in true units
            grads, group = model.local_grads()
            if loss is not None and not torch.isfinite(loss):  # overflow skips; a NaN loss stops
                raise _non_finite(model, "loss", losses)
            skip = scaler.unscale_(grads, group, factor=factor)
        elif factor != 1.0 or (check_finite and max_grad_norm is None):
            # read to scale them, or to check them when the reductions were not summed
            grads, group = model.local_grads() if factor != 1.0 or reduced_finite is None else ([], None)
            _scale(grads, factor)
            if check_finite and max_grad_norm is None:
                found = _finite_total(grads, group, reduced_finite, loss)
                if on_device is None and not math.isfinite(found.item()):
                    raise _non_finite(model, "gradient", losses)
        if max_grad_norm is not None and not skip:
            norm = model.clip_grad_norm_(max_grad_norm)
            if check_finite:  # the norm is global: every rank agrees on it
                found = norm if loss is None else norm + loss.to(norm.device)
                if on_device is None and not torch.isfinite(found):
                    raise _non_finite(model, "gradient norm", losses)
        if on_device is not None and found is not None:
            flag = on_device.start(found, losses)
    except UsageError:  # the loop may catch it and go on: the next step must not inherit a NaN
        optimizer.zero_grad(set_to_none=True)
        raise
    finally:
        if losses is not None:
            losses.items.clear()
    if before_step is not None:
        before_step()
    if not skip:  # every rank agrees: the flags were reduced over the gradients' holders
        if flag is not None:
            _step_unless(optimizer, flag)
        else:
            optimizer.step()
    if scaler is not None:
        scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(not skip, norm)


class DeviceCheck:
    """The finite check without a wait for the device, where that wait costs (Session(nan_check=
    True) with an optimizer whose fused kernels take `found_inf`, on a GPU: `wanted`).

    Waiting for the device at each step leaves the GPU idle while the host then launches the
    optimizer's kernels (a few percent of a GPT step on a GPU: bench/gpu_check.py measures it).
    Here the check's total stays on the device: its non-finiteness is the optimizer's
    `found_inf` (as torch's GradScaler hands it), so the fused kernels leave the parameters and
    the optimizer state as they were. The flag is copied to the host without waiting and read
    at the next optimizer step, save, load, end of a progress() pass or close(), whichever comes
    first: the error is the same (a non-finite loss named by its micro-batch) but arrives one
    step later, and a non-finite gradient is not named by parameter (its gradients are gone)."""

    def __init__(self) -> None:
        self.pending: tuple[torch.Tensor, Any, LossLog] | None = None  # (host flag, event, losses)

    @staticmethod
    def wanted(optimizer: torch.optim.Optimizer | None, scaler: GradScaler | None, nan_check: bool) -> bool:
        """Checked on the device: an optimizer that skips a step there (fused Adam and AdamW:
        optim.skips_on_device) stepping CUDA tensors only; fp16's scaler keeps its own skip."""
        return (nan_check and scaler is None and optimizer is not None and skips_on_device(optimizer)
                and all(p.is_cuda for group in optimizer.param_groups for p in group["params"]))

    def start(self, total: torch.Tensor, losses: LossLog | None) -> torch.Tensor:
        """The found_inf flag of `total` (1.0: not finite), its copy to the host started;
        `losses` (the step's) are kept to name a non-finite one."""
        flag = torch.isfinite(total).logical_not().float()
        held = LossLog(losses.accumulate, losses.rank) if losses is not None else LossLog(1, 0)
        held.items = list(losses.items) if losses is not None else []
        self.pending = (*host_copy(flag), held)
        return flag

    def raise_pending(self) -> None:
        """Raise the error of the last checked step, if its flag says so (a wait only when the
        device has not yet reached the end of that step)."""
        if self.pending is None:
            return
        flag, event, losses = self.pending
        self.pending = None
        if event is not None:
            event.synchronize()
        if flag.item():
            step = losses.items[-1][1] // losses.accumulate if losses.items else "?"
            raise losses.error() or UsageError(  # averaged gradients may carry another rank's NaN loss
                f"a gradient was NaN or infinite at optimizer step {step} although the loss was finite; the "
                "fused optimizer skipped that step on the device, so the parameters and the optimizer's state "
                "are as they were before it, and no checkpoint will hold it. The check ran on the device and "
                "was read a step later, when the gradients were gone: an optimizer without fused=True has the "
                "check name the parameters. Lower the learning rate, clip gradients (Session(max_grad_norm="
                "...)), look for a division by zero or a log of 0 in the model, or pass "
                "Session(nan_check=False) to go on regardless.").echoing()


def host_copy(value: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """`value` on its way to the host, and the CUDA event that says it has arrived (None on the
    CPU: the copy is done)."""
    if value.device.type != "cuda":
        return value.detach(), None
    with torch.cuda.device(value.device):  # the copy and its event on the stream of value's GPU
        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        host.copy_(value.detach(), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    return host, event


def _step_unless(optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> None:
    """optimizer.step() with `flag` as its found_inf: the fused kernels skip the update (and
    undo the step count) on the device when it is 1."""
    optimizer.found_inf = flag
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


def _scale(grads: list[torch.Tensor], factor: float) -> None:
    if factor != 1.0:
        torch._foreach_mul_(grads, factor)


def _finite_total(grads: list[torch.Tensor], group: Any, reduced_finite: torch.Tensor | None = None,
                  loss: torch.Tensor | None = None) -> torch.Tensor:
    """A 0-dim tensor, finite exactly when every gradient on every holder and `loss` (this
    rank's, LossLog.total) are: one fused norm, and one all-reduce of a scalar when the gradients
    are split between ranks (group is not None), unless every rank saw every reduction whole and
    summed it (`reduced_finite`, ParallelModule.reduced_finite)."""
    if reduced_finite is not None:
        return reduced_finite if loss is None else reduced_finite + loss.to(reduced_finite.device)
    # a sum is the cheapest full read, and NaN and inf survive it (finite values summing past the
    # float range would be a false alarm, at gradients of 1e38)
    sums = [g.sum() for g in grads] if len(grads) < 8 else list(torch._foreach_norm(grads))
    if loss is not None and sums and (loss.dtype, loss.device) == (sums[0].dtype, sums[0].device):
        sums.append(loss)  # in the same sum: no op of its own
        loss = None
    if len({(n.dtype, n.device) for n in sums}) > 1:  # offloaded or mixed-dtype holders
        sums = [n.float().cpu() for n in sums]
    total = torch.stack(sums).sum() if sums else torch.zeros(())
    if loss is not None:
        total = total.float() + loss.to(total.device)
    return sum_over(total.float(), group)


def _non_finite(model: ParallelModule, what: str, losses: LossLog | None) -> UsageError:
    """A non-finite loss of this rank's, named by its micro-batch, else the gradients."""
    loss_error = losses.error() if losses is not None else None
    if loss_error is not None:
        return loss_error
    names = [n for n, p in model.module.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    where = f": {', '.join(names[:5])} on this rank" if names else " (on another rank's share)"
    peers = (" Gradients are averaged over ranks: another rank's error may name a non-finite loss as the "
             "cause.") if model.replicas > 1 else ""
    error = UsageError(f"a {what} is NaN or infinite although the loss was finite{where}; the optimizer "
                       "did not step, the step's gradients were dropped and no checkpoint will hold it. Lower "
                       "the learning rate, clip gradients (Session(max_grad_norm=...)), look for a division by "
                       f"zero or a log of 0 in the model, or pass Session(nan_check=False) to go on regardless.{peers}")
    return error.echoing() if model.replicas > 1 else error
