"""Loss parallelism (`pt.Mesh(tp=N, loss_parallel=True)`): the cross-entropy of logits cut by
the vocabulary over tp, without gathering them (Megatron-LM's vocab_parallel_cross_entropy;
torch's `loss_parallel` does the same for DTensor). A language model's logits, batch × sequence
× vocabulary, are its largest activation: gathered whole, each rank holds all of them and their
gradient; here each keeps its 1/tp.

With it, the plan's column-parallel head (a module at the top of the model) returns its slice of
the logits as a `VocabShard`, a tensor whose `F.cross_entropy` is computed across the tp ranks:

    max over the vocabulary      each rank's max, all-reduced (MAX)
    Σ exp(logit − max)           each rank's sum over its slice, all-reduced (SUM)
    the target's logit           from the rank whose slice holds it, all-reduced (SUM)
    loss = log Σ exp − (target logit − max), per token; backward: softmax − one-hot, per slice

Three all-reduces of batch × sequence numbers each, instead of gathering batch × sequence ×
vocabulary. So the user's own loss function, written for whole logits, runs unchanged:
reshapes that keep the vocabulary last (`logits.flatten(0, 1)`, slicing, `.float()`) give
VocabShards too. What would be wrong on a slice is refused by name: a reshape that moves the
vocabulary, a reduction (softmax, argmax, a sum, …), `ignore_index` aside the loss's other
options (class weights, label smoothing). While autograd does not record (evaluation, sampling)
the head gathers its logits whole, as without loss parallelism.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from paratrain.errors import UsageError

# what reads across the vocabulary: on one rank's slice it would be silently wrong
_ACROSS = {"softmax", "log_softmax", "argmax", "argmin", "max", "min", "amax", "amin", "topk", "sort", "argsort",
           "logsumexp", "sum", "mean", "nll_loss", "kl_div", "multinomial", "gather", "take_along_dim", "norm",
           "cumsum", "binary_cross_entropy_with_logits", "multi_margin_loss", "std", "var", "prod", "all", "any"}
_RESHAPES = {"__getitem__", "view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "transpose", "permute", "movedim",
             "swapaxes", "t", "mT", "unsqueeze", "squeeze", "expand", "narrow", "split", "chunk", "unbind"}


class VocabShard(torch.Tensor):
    """This rank's slice of logits cut by the vocabulary (module docstring). `vocab_parallel`
    makes one; the class it makes holds the tp group and where the slice starts."""

    group: Any = None
    first: int = 0  # the slice's first token id

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if func is F.cross_entropy:
            return _cross_entropy(cls, *args, **kwargs)
        if name in _ACROSS:
            raise UsageError(f"{name} of loss-parallel logits would read this rank's slice of the vocabulary "
                             f"only: under Mesh(loss_parallel=True) the training step's logits are cut by the "
                             "vocabulary, and only F.cross_entropy reads across it; compute this under "
                             "torch.no_grad() (the logits are whole there), or leave loss_parallel off")
        out = super().__torch_function__(func, types, args, kwargs)
        if name in _RESHAPES:
            _check_vocabulary_last(name, args[0], out)
        return out


def vocab_parallel(logits: torch.Tensor, group, first: int) -> VocabShard:
    """`logits`, this rank's slice starting at token id `first`, as a VocabShard."""
    return logits.as_subclass(_shard_class(group, first))


@functools.cache
def _shard_class(group, first: int) -> type:
    """The VocabShard class of one head's slice: made once, not at every forward."""
    return type("VocabShard", (VocabShard,), {"group": group, "first": first})


def _check_vocabulary_last(name: str, before: Any, after: Any) -> None:
    outs = after if isinstance(after, (tuple, list)) else [after]
    width = before.shape[-1] if before.dim() else 0
    for out in outs:
        if torch.is_tensor(out) and (out.dim() == 0 or out.shape[-1] != width):
            raise UsageError(f"{name} moves the vocabulary from the last dimension of loss-parallel logits "
                             f"({tuple(before.shape)} → {tuple(out.shape)}): each rank holds {width} of its "
                             "entries; keep it last (logits.flatten(0, 1), logits.view(-1, logits.shape[-1]))")


def _cross_entropy(cls, input: torch.Tensor, target: torch.Tensor, weight=None, size_average=None,
                   ignore_index: int = -100, reduce=None, reduction: str = "mean",
                   label_smoothing: float = 0.0) -> torch.Tensor:
    if weight is not None or label_smoothing or size_average is not None or reduce is not None:
        raise UsageError("F.cross_entropy of loss-parallel logits takes ignore_index and reduction only "
                         "(no class weights, no label smoothing): leave loss_parallel off for those")
    if reduction not in ("mean", "sum", "none"):
        raise UsageError(f"F.cross_entropy(reduction={reduction!r}): choose 'mean', 'sum' or 'none'")
    if input.dim() != 2 or target.dim() != 1 or target.is_floating_point():
        raise UsageError(f"F.cross_entropy of loss-parallel logits takes (tokens, vocabulary) logits and (tokens,) "
                         f"class ids, got {tuple(input.shape)} and {tuple(target.shape)}: flatten them first "
                         "(logits.flatten(0, 1), targets.flatten())")
    per_token = _VocabParallelCrossEntropy.apply(input.as_subclass(torch.Tensor), target, cls.group, cls.first,
                                                 ignore_index)
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / (target != ignore_index).sum()  # nan when every target is ignored, as torch's


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per token: log Σ_v exp(z_v) − z_target over the whole vocabulary, from each rank's slice
    of z (three all-reduces); 0 where the target is `ignore_index`."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group, first: int, ignore_index: int):
        z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        top = z.detach().amax(dim=-1)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = z - top.unsqueeze(-1)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(total, group=group)
        local = target - first
        here = (local >= 0) & (local < z.shape[-1])
        picked = shifted.gather(-1, local.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1) * here
        dist.all_reduce(picked, group=group)
        kept = target != ignore_index
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local, here & kept, kept)
        ctx.dtype = logits.dtype
        return ((total.log() - picked) * kept).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local, hit, kept = ctx.saved_tensors
        out = softmax * kept.unsqueeze(-1)
        rows = hit.nonzero().squeeze(-1)
        out[rows, local[rows]] -= 1.0
        return (out * grad.unsqueeze(-1)).to(ctx.dtype), None, None, None, None
