"""The collectives a tensor-parallel layer runs, as autograd functions whose backward is the
forward's conjugate (Megatron-LM, Shoeybi et al. 2019, §3: the operators f and g).

    copy_to(x)        f: identity forward; all-reduce of the gradient in backward. Before a
                      column-parallel layer: each rank's gradient for its input covers only its
                      own output columns, and the input's whole gradient is their sum.
    reduce_from(x)    g: all-reduce forward; identity backward. After a row-parallel layer: each
                      rank's product is a partial sum over its input columns.
    gather_last(x)    all-gather along the last dimension; backward keeps this rank's slice.
                      After a column-parallel layer whose output must be whole (an LM head).

Under sequence parallelism (sequence.py; Korthikanti et al. 2022, §4.2.2), activations outside
the cut layers are cut along the sequence, dimension SEQ (-2: (batch, sequence, hidden)), and f
and g become an all-gather and a reduce-scatter of the same bytes as g's all-reduce:

    gather_sequence(x)          ḡ: all-gather along the sequence forward; reduce-scatter of the
                                gradient backward. Before the column-parallel layers of a block.
    reduce_scatter_sequence(x)  g̅: reduce-scatter along the sequence forward; all-gather of the
                                gradient backward. After a row-parallel layer (for g).
    split_sequence(x)           this rank's part of the sequence; backward puts its gradient
                                there, zeros elsewhere (no communication): after an embedding
                                every rank computes whole, whose weight's gradient is then the
                                rank's part and is summed over tp with the other replicated ones.
    gather_sequence_whole(x)    all-gather along the sequence; backward keeps this rank's part.
                                The model's output, when its head ran on the parts.

They apply while autograd records (`sequence_cut()`), where the activations' memory is what
sequence parallelism saves; under torch.no_grad() (evaluation, sampling token by token, at any
length) the model runs as plain tensor parallelism, with f and g.

Every one takes the tensor-parallel group; on a group of one rank each is the identity.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from paratrain.distributed.comm import all_gather_cat, all_gather_with_grad, reduce_scatter
from paratrain.errors import UsageError

SEQ = -2  # the sequence dimension of the activations sequence parallelism cuts


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


class _Gather(torch.autograd.Function):
    """All-gather along `dim`; backward keeps this rank's slice (every rank's loss read the
    whole alike, so each one's gradient for it is already whole)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, dim: int) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.width, ctx.dim = group, dist.get_rank(group), x.shape[dim], dim
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.narrow(ctx.dim, ctx.rank * ctx.width, ctx.width).contiguous(), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return reduce_scatter(_parts(x, group).movedim(SEQ, 0), group=group).movedim(0, SEQ).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather_cat(grad, ctx.group, SEQ).contiguous(), None


class _SplitSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        size = _parts(x, group).shape[SEQ] // dist.get_world_size(group)
        ctx.shape, ctx.at, ctx.size = x.shape, dist.get_rank(group) * size, size
        return x.narrow(SEQ, ctx.at, size).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        whole = grad.new_zeros(ctx.shape)
        whole.narrow(SEQ, ctx.at, ctx.size).copy_(grad)
        return whole, None


def _parts(x: torch.Tensor, group) -> torch.Tensor:
    """`x`, refused unless tp divides its sequence."""
    tp = dist.get_world_size(group)
    if x.dim() < 2 or x.shape[SEQ] % tp:
        raise UsageError(f"sequence parallelism cuts dimension {SEQ} of the activations (batch, sequence, hidden) "
                         f"into tp={tp} parts, but got an activation of shape {tuple(x.shape)}: make the sequence "
                         f"length a multiple of {tp}, or leave sequence_parallel off")
    return x


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
    return _Gather.apply(x, group, -1)


def sequence_cut() -> bool:
    """Whether sequence parallelism cuts the activations now (module docstring)."""
    return torch.is_grad_enabled()


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """ḡ: all-gather along the sequence; the gradient reduce-scattered back (module docstring)."""
    return all_gather_with_grad(x, group, SEQ)


def reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Reduce-scatter along the sequence; the gradient all-gathered back."""
    return _ReduceScatterSequence.apply(x, group)


def split_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's part of the sequence; the gradient zero-padded back, with no communication."""
    return _SplitSequence.apply(x, group)


def gather_sequence_whole(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather along the sequence; backward keeps this rank's part."""
    return _Gather.apply(x, group, SEQ)
