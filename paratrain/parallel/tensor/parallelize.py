"""Cut a model by its plan, in place: each planned module is replaced by its tensor-parallel
layer (layers.py) holding this rank's slice. The model's other modules are left whole, and are
replicated: every tp rank holds and updates the same values, since the layers' all-reduces give
every rank the same activations and the same gradients outside the cut layers.

A weight tied between planned modules (a vocabulary-parallel embedding and a column-parallel LM
head both split the vocabulary, dimension 0) stays tied: the second module gets the first's
slice. Tied across a planned and an unplanned module, or split two ways, it is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from paratrain.errors import ConfigError
from paratrain.parallel.tensor.layers import ColwiseLinear, RowwiseLinear, TensorParallel, VocabEmbedding
from paratrain.parallel.tensor.plan import COLWISE, GATHERED, Plan


@dataclass
class Cut:
    """What parallelize() did: the split parameters by every name the model gives them, with the
    dimension split, and each replaced parameter's successor (to rebuild the optimizer)."""

    shard_dims: dict[str, int]
    replaced: dict[nn.Parameter, nn.Parameter]


def build(module: nn.Module, style: str, group, tp_rank: int, tp: int) -> TensorParallel:
    if isinstance(module, nn.Embedding):
        return VocabEmbedding(module, group, tp_rank, tp)
    if style in (COLWISE, GATHERED):
        return ColwiseLinear(module, group, tp_rank, tp, gather_output=style == GATHERED)
    return RowwiseLinear(module, group, tp_rank, tp)


def parallelize(model: nn.Module, plan: Plan, group, tp_rank: int, tp: int) -> Cut:
    """Replace each module of `plan` by its layer holding this rank's slice (values real, not meta)."""
    names_of: dict[int, list[str]] = {}  # id(parameter) → every name it has, before the cut
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    replaced: dict[nn.Parameter, nn.Parameter] = {}
    dims: dict[int, int] = {}  # id(old parameter) → the dimension it was split along
    for name, style in plan.styles.items():
        old = _module(model, name)
        new = build(old, style, group, tp_rank, tp)
        for pname, dim in new.shard_dim.items():
            before, after = getattr(old, pname, None), getattr(new, pname, None)
            if before is None:
                continue
            if id(before) in dims:  # tied to a module cut before: take its slice, if cut alike
                if dims[id(before)] != dim:
                    raise ConfigError(f"{name}.{pname} is tied to {names_of[id(before)][0]}, which the plan "
                                      "splits along another dimension: give both styles that split the "
                                      "tied weight alike (an embedding 'rowwise' with an LM head 'colwise')")
                setattr(new, pname, replaced[before])
            else:
                dims[id(before)] = dim
                replaced[before] = after
        bias = getattr(old, "bias", None)
        if bias is not None and "bias" not in new.shard_dim:  # whole, but a new tensor: the optimizer steps it
            replaced[bias] = new.bias
        parent, _, leaf = name.rpartition(".")
        setattr(_module(model, parent) if parent else model, leaf, new)
    held = {id(p) for p in model.parameters()}
    for old in replaced:
        if id(old) in held:  # still held by a module the plan does not cut
            raise ConfigError(f"{names_of[id(old)][0]} is tied to {', '.join(names_of[id(old)][1:])}; the plan cuts "
                              "one of them only: cut each module that holds it (an embedding 'rowwise' with "
                              "its LM head 'colwise'), or none")
    shard_dims = {n: dims[pid] for pid, ns in names_of.items() if pid in dims for n in ns}
    return Cut(shard_dims, replaced)


def _module(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name) if name else model
