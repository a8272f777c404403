"""The collectives a tensor-parallel layer runs, as autograd functions whose backward is the
forward's conjugate (Megatron-LM, Shoeybi et al. 2019, §3: the operators f and g).

    copy_to(x)        f: identity forward; all-reduce of the gradient in backward. Before a
                      column-parallel layer: each rank's gradient for its input covers only its
                      own output columns, and the input's whole gradient is their sum.
    reduce_from(x)    g: all-reduce forward; identity backward. After a row-parallel layer: each
                      rank's product is a partial sum over its input columns.
    gather_last(x)    all-gather along the last dimension; backward keeps this rank's slice.
                      After a column-parallel layer whose output must be whole (an LM head).

Every one takes the tensor-parallel group; on a group of one rank each is the identity.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _last.release()  # the forward is over: keep nothing of it
        grad = grad.contiguous().clone()  # autograd may hand the same tensor to other branches
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        dist.all_reduce(x, group=group)  # in place: a matmul's fresh output, its backward needs not it
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.width = group, dist.get_rank(group), x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.narrow(-1, ctx.rank * ctx.width, ctx.width).contiguous(), None


class _LastCopy:
    """The last f applied: (input, its version, the group, the output). Attention's q, k and v
    projections (and an MLP's gate and up) are column-parallel layers reading one input, one
    after another; each applying f of its own would all-reduce that input's gradient three (two)
    times. Handing the same f output to each makes autograd sum their gradients first, so one
    all-reduce per input remains, as in Megatron's fused QKV (Narayanan et al. 2021 count one
    all-reduce per block half in backward). The input must be the same tensor object, unchanged
    (its version counter), in the same group and grad mode. The slot holds the output itself (a
    view of the input, which is alive anyway while the layers that read it run) and lets go of it
    when its backward runs, or the next f replaces it."""

    def __init__(self) -> None:
        self.slot: tuple | None = None

    def get(self, x: torch.Tensor, group) -> torch.Tensor | None:
        if self.slot is None:
            return None
        ref, version, held_group, out = self.slot
        return out if ref() is x and x._version == version and held_group is group else None

    def put(self, x: torch.Tensor, group, out: torch.Tensor) -> None:
        self.slot = (weakref.ref(x), x._version, group, out)

    def release(self) -> None:
        self.slot = None


_last = _LastCopy()


def copy_to(x: torch.Tensor, group) -> torch.Tensor:
    """Megatron's f: identity forward, all-reduce backward (one f per input tensor: _LastCopy)."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return x
    out = _last.get(x, group)
    if out is None:
        out = _CopyTo.apply(x, group)
        _last.put(x, group, out)
    return out


def reduce_from(x: torch.Tensor, group) -> torch.Tensor:
    """Megatron's g: all-reduce forward, identity backward."""
    return _ReduceFrom.apply(x.contiguous(), group)


def gather_last(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather along the last dimension; backward keeps this rank's slice."""
    return _GatherLast.apply(x, group)
