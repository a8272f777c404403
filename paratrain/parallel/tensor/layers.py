"""Layers cut across tensor-parallel ranks (Megatron-LM's column- and row-parallel linear, and its
vocabulary-parallel embedding). Each is the module it replaces, holding only this rank's slice:
the same class family (an `nn.Linear`, an `nn.Embedding`), the same parameter names, so the
model's state-dict keys, ZeRO's units and the optimizer see an ordinary module of smaller shape.

    ColwiseLinear     weight rows (out_features) and bias split: y_r = x W_r^T + b_r, this rank's
                      output columns; the input arrives whole (f before it, ops.py)
    RowwiseLinear     weight columns (in_features) split, bias whole: y = g(x_r W_r^T) + b, the
                      input is this rank's columns (a ColwiseLinear's output)
    VocabEmbedding    rows (the vocabulary) split: each rank looks up the ids in its range, zeros
                      for the others, and g sums the ranks' rows

`shard_dim` says which dimension of each parameter is split (checkpoints and full_state_dict
gather along it); a parameter not listed is whole on every rank.

Under sequence parallelism (sequence.py sets `sequence`), a ColwiseLinear's input arrives whole
already ("gathered": its block gathered it) or is gathered here ("gather": an LM head), and the
row-parallel layers reduce-scatter their output along the sequence instead of all-reducing it
(while autograd records: ops.py `sequence_cut`; under no_grad as without it, and a "gathered"
layer's f is the identity there).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.errors import UsageError
from paratrain.parallel.tensor.loss import vocab_parallel
from paratrain.parallel.tensor.ops import (
    copy_to,
    gather_last,
    gather_sequence,
    reduce_from,
    reduce_scatter_sequence,
    sequence_cut,
)


class TensorParallel:
    """What every tensor-parallel layer knows: its group, this rank's place, and how it was cut."""

    shard_dim: ClassVar[dict[str, int]] = {}  # parameter name → the dimension split over tp
    style: ClassVar[str] = ""
    group = None
    tp_rank: int = 0
    tp: int = 1
    sequence: str | None = None  # under sequence parallelism: how its activations are cut (above)

    def _join(self, group, tp_rank: int, tp: int) -> None:
        self.group, self.tp_rank, self.tp = group, tp_rank, tp

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's partial sums, summed: whole, or this rank's part of the sequence."""
        return reduce_scatter_sequence(y, self.group) if self.sequence and sequence_cut() else reduce_from(y, self.group)


def piece(tensor: torch.Tensor, dim: int, tp_rank: int, tp: int) -> torch.Tensor:
    """This rank's contiguous 1/tp of `tensor` along `dim`, a copy."""
    size = tensor.shape[dim] // tp
    return tensor.detach().narrow(dim, tp_rank * size, size).clone()


def _param(value: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(value, requires_grad=like.requires_grad)


class ColwiseLinear(nn.Linear, TensorParallel):
    """A column-parallel `nn.Linear`: this rank's out_features / tp outputs. With
    `gather_output`, the outputs of every rank, whole (an LM head before a plain loss)."""

    shard_dim = {"weight": 0, "bias": 0}
    style = "colwise"

    def __init__(self, linear: nn.Linear, group, tp_rank: int, tp: int, gather_output: bool = False):
        nn.Module.__init__(self)
        self._join(group, tp_rank, tp)
        self.in_features, self.out_features = linear.in_features, linear.out_features // tp
        self.gather_output = gather_output
        self.weight = _param(piece(linear.weight, 0, tp_rank, tp), linear.weight)
        self.bias = _param(piece(linear.bias, 0, tp_rank, tp), linear.bias) if linear.bias is not None else None

    loss_parallel = False  # a head whose logits stay cut by the vocabulary while training (loss.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence is None:
            x = copy_to(x, self.group)
        elif self.sequence == "gather" and sequence_cut():
            x = gather_sequence(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        if self.loss_parallel:
            return vocab_parallel(y, self.group, self.tp_rank * self.out_features) if torch.is_grad_enabled() \
                else gather_last(y, self.group)
        return gather_last(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, tp={self.tp_rank}/{self.tp}" + (", gather_output" if self.gather_output else "")
                + (f", sequence {self.sequence}" if self.sequence else "") + (", loss_parallel" if self.loss_parallel else ""))


class RowwiseLinear(nn.Linear, TensorParallel):
    """A row-parallel `nn.Linear`: this rank's in_features / tp inputs; the output is whole."""

    shard_dim = {"weight": 1}
    style = "rowwise"

    def __init__(self, linear: nn.Linear, group, tp_rank: int, tp: int):
        nn.Module.__init__(self)
        self._join(group, tp_rank, tp)
        self.in_features, self.out_features = linear.in_features // tp, linear.out_features
        self.weight = _param(piece(linear.weight, 1, tp_rank, tp), linear.weight)
        self.bias = _param(linear.bias.detach().clone(), linear.bias) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise UsageError(f"a row-parallel linear layer takes this rank's {self.in_features} of its "
                             f"{self.in_features * self.tp} input features (a column-parallel layer's output), "
                             f"but got {x.shape[-1]}: put a 'colwise' layer before it in the plan, or "
                             "leave this layer out of the plan")
        y = self._reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp={self.tp_rank}/{self.tp}"


class VocabEmbedding(nn.Embedding, TensorParallel):
    """A vocabulary-parallel `nn.Embedding`: rows [tp_rank·V/tp, (tp_rank+1)·V/tp) here."""

    shard_dim = {"weight": 0}
    style = "rowwise"

    def __init__(self, embedding: nn.Embedding, group, tp_rank: int, tp: int):
        nn.Module.__init__(self)
        self._join(group, tp_rank, tp)
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings // tp, embedding.embedding_dim
        self.first = tp_rank * self.num_embeddings
        pad = embedding.padding_idx
        self.padding_idx = pad - self.first if pad is not None and 0 <= pad - self.first < self.num_embeddings else None
        self.max_norm, self.norm_type = None, 2.0
        self.scale_grad_by_freq, self.sparse = embedding.scale_grad_by_freq, False
        self.weight = _param(piece(embedding.weight, 0, tp_rank, tp), embedding.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.first) | (ids >= self.first + self.num_embeddings)
        local = (ids - self.first).masked_fill(outside, 0)
        rows = F.embedding(local, self.weight, self.padding_idx, None, 2.0, self.scale_grad_by_freq, False)
        return self._reduce(rows.masked_fill(outside.unsqueeze(-1), 0.0))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rows from {self.first}, tp={self.tp_rank}/{self.tp}"
