"""Sequence parallelism (`pt.Mesh(tp=N, sequence_parallel=True)`; Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", §4.2.2, as Megatron-LM and
torchtitan's plans run it): outside the cut layers, every activation is cut along the sequence
(dimension -2 of (batch, sequence, hidden)) over the tp ranks, so the norms, dropout and residual
adds of a block hold 1/tp of the activations tensor parallelism alone leaves whole on every rank.

Where the activations change form, after the model is cut (parallelize.py), on its modules:

    an embedding            a vocabulary-parallel one reduce-scatters its rows (for g's
                            all-reduce); one every rank holds whole keeps its part of the output
    a block's cut layers    the module holding a block's column-parallel layers (the attention,
                            the MLP: their parent) gathers its first tensor argument whole; its
                            row-parallel layer reduce-scatters the output back into parts
    the head                a column-parallel head (at the top of the model) gathers its own
                            input; else the model's output is gathered whole at the end

So a block's attention sees the whole sequence and infers it from the shape, as without sequence
parallelism. All of this holds while autograd records (training); under torch.no_grad() the
model runs as plain tensor parallelism, at any sequence length (ops.py `sequence_cut`). Forward moves the same bytes as tensor parallelism's all-reduces (an all-gather and
a reduce-scatter are each half an all-reduce), and so does backward.

Every parameter held whole and used on the parts (the norms' weights, a row-parallel layer's
bias, the embeddings and a head held whole) gets, from each rank, the gradient of its part of the
sequence: a hook sums it over tp as it is computed, before any data-parallel reduction sees it. A
parameter used both on the parts and inside a block's gathered region cannot be summed alike,
and is refused; so is a block nested in another block.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.errors import ConfigError, UsageError
from paratrain.parallel.tensor.layers import ColwiseLinear, RowwiseLinear, TensorParallel, VocabEmbedding
from paratrain.parallel.tensor.ops import gather_sequence, gather_sequence_whole, sequence_cut, split_sequence


class SequenceParallel:
    """What sequence parallelism did to a cut model: the names of the parameters whose
    gradients it sums over tp (`summed`), which `hook_gradients` hooks on the live parameters
    once the data-parallel wrapper has placed them."""

    def __init__(self, model: nn.Module, group) -> None:
        self.group = group
        modules = dict(model.named_modules())
        cut = {n: m for n, m in modules.items() if isinstance(m, TensorParallel)}
        heads = [n for n, m in cut.items() if isinstance(m, ColwiseLinear) and not n.rpartition(".")[0]]
        self.blocks = sorted({n.rpartition(".")[0] for n, m in cut.items() if isinstance(m, ColwiseLinear)} - {""})
        nested = [(a, b) for a in self.blocks for b in self.blocks if b.startswith(f"{a}.")]
        if nested:
            raise ConfigError(f"sequence parallelism gathers the input of each module holding column-parallel "
                              f"layers, and {nested[0][1]} sits inside {nested[0][0]}, another: name the cut layers "
                              "of one block level (the attention's and the MLP's projections)")
        if not self.blocks and not heads:
            raise ConfigError("sequence parallelism needs column-parallel layers in the plan, whose blocks it gathers")
        inside = lambda name: any(name == b or name.startswith(f"{b}.") for b in self.blocks)  # noqa: E731
        for name, m in cut.items():
            m.sequence = ("gathered" if inside(name) else "gather") if isinstance(m, ColwiseLinear) else "scatter"
            if isinstance(m, RowwiseLinear) and not inside(name):
                raise ConfigError(f"{name} is row-parallel outside every block of column-parallel layers: under "
                                  "sequence parallelism its input would be cut along the sequence, not its features")
        for name in self.blocks:
            modules[name].register_forward_pre_hook(self._gather_input, with_kwargs=True)
        for name, m in modules.items():
            if isinstance(m, nn.Embedding) and not isinstance(m, VocabEmbedding) and not inside(name):
                m.register_forward_hook(self._split_output)
        if not heads:
            model.register_forward_hook(self._gather_output)
        self.summed = self._summed(model, modules, inside)

    def _summed(self, model: nn.Module, modules: dict[str, nn.Module], inside) -> set[str]:
        """Every name of the parameters used on the sequence's parts (module docstring)."""
        names: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        on_parts = set()
        for name, m in modules.items():
            for pname, _ in m.named_parameters(recurse=False):
                full = f"{name}.{pname}" if name else pname
                cut_here = isinstance(m, TensorParallel) and pname in m.shard_dim
                if not inside(name) and not cut_here or isinstance(m, RowwiseLinear) and pname == "bias":
                    on_parts.add(full)
        summed = set()
        for every in names.values():
            parts = [n for n in every if n in on_parts]
            if parts and len(parts) < len(every):
                raise ConfigError(f"{every[0]} is used both on the sequence's parts ({parts[0]}) and where it is "
                                  f"whole ({[n for n in every if n not in on_parts][0]}), whose gradients sequence "
                                  "parallelism cannot sum alike: cut both modules (an embedding 'rowwise', its head "
                                  "'colwise_rep'), or leave sequence_parallel off")
            summed.update(parts)
        return summed

    def hook_gradients(self, model: nn.Module) -> None:
        """Sum the gradient of each parameter in `summed` over tp as autograd computes it (before
        it is accumulated, so DDP's and ZeRO's hooks see the sum). The tensors are looked up where
        the model's modules hold them now: ZeRO-3 replaced its parameters by views of its
        gathered buffers, one for each module that uses a tied one."""
        seen = set()
        for name in sorted(self.summed):
            owner, _, attr = name.rpartition(".")
            tensor = getattr(model.get_submodule(owner) if owner else model, attr)
            if id(tensor) not in seen and tensor.requires_grad:
                seen.add(id(tensor))
                tensor.register_hook(self._sum)

    def _sum(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()  # autograd may hand the same tensor to other branches
        dist.all_reduce(grad, group=self.group)
        return grad

    def _gather_input(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """A block's first tensor argument (positional, else keyword), gathered whole."""
        if not sequence_cut():
            return None
        for i, a in enumerate(args):
            if torch.is_tensor(a):
                return (*args[:i], gather_sequence(a, self.group), *args[i + 1:]), kwargs
        for k, v in kwargs.items():
            if torch.is_tensor(v):
                return args, {**kwargs, k: gather_sequence(v, self.group)}
        raise UsageError(f"sequence parallelism gathers the hidden states a {type(module).__name__} is given, "
                         "but it was called without a tensor")

    def _split_output(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        return split_sequence(output, self.group) if sequence_cut() else None

    def _gather_output(self, module: nn.Module, args: Any, output: Any) -> torch.Tensor | None:
        if not sequence_cut():
            return None
        if not torch.is_tensor(output):
            raise UsageError(f"under sequence parallelism the model's output is gathered along the sequence when its "
                             f"head is not cut, and {type(module).__name__} returned a {type(output).__name__}: "
                             "return the logits, or cut the head 'colwise_rep' in the plan")
        return gather_sequence_whole(output, self.group)
