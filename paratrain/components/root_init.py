"""Models that initialise from their root (torchtitan's `init_weights()`), built on the meta device:
the values one process gets, for only the part of the model a rank holds.

[Note: an init from the root]
`setup(model, optimizer, init="init_weights")` stands for what one process writes:

    torch.manual_seed(seed); model.to_empty(device="cpu"); model.init_weights()

The method draws the whole model's random numbers in one stream, each tensor's depending on how
many every tensor before it drew (and `nn.init.trunc_normal_` redraws what falls outside its
bounds, so that count depends on the values). So a rank that holds a part (a ZeRO-3 unit, a
pipeline stage) calls the method on the whole model as it was built, with the tensors of its part
real and every other one a stand-in: a real tensor of the same shape, stride and dtype whose
memory is shared by all the stand-ins of a dtype (the largest of them, once). Each draw then
takes what it takes on one process, and the part's tensors get their values; the stand-ins'
values are thrown away. The method runs once for each part a rank builds (once per ZeRO-3 unit,
once per pipeline stage, once for a whole model), each time drawing the whole model's numbers.

What the part's values are computed from must be in the part: a tensor of the part computed from a
stand-in (a buffer copied from another module's weight) is refused, naming both, as a tensor the
method leaves unset is (components/materialize.py).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from paratrain.errors import ConfigError


class RootInit:
    """The whole model's layout, read while it is whole, to run its root's `method` later for any
    part of it (`run`)."""

    def __init__(self, model: nn.Module, method: str):
        if not callable(getattr(type(model), method, None)):
            raise ConfigError(f"setup(..., init={method!r}) calls the model's own {method}() once, but "
                              f"{type(model).__name__} has no method {method!r}: name the model's "
                              "initialisation method, or pass init_fn=fn to set each module's tensors")
        self.model, self.method = model, method
        # every module's children and tensors by name, as built (a pipeline stage and a ZeRO-3
        # unit later drop or replace some of them)
        self.layout = [(m, dict(m._modules), dict(m._parameters), dict(m._buffers)) for m in model.modules()]
        self.names: dict[int, str] = {}
        for path, module in model.named_modules(remove_duplicate=False):
            for name, t in itertools.chain(module._parameters.items(), module._buffers.items()):
                if t is not None:
                    self.names.setdefault(id(t), f"{path + '.' if path else ''}{name}")
        self.specs = {id(t): (t.shape, t.stride(), t.dtype) for _, _, ps, bs in self.layout
                      for t in itertools.chain(ps.values(), bs.values()) if t is not None}

    def run(self, seed: int, held: list[torch.Tensor]) -> None:
        """Call the root's method once, seeded with `seed`, on the model as built: the tensors
        `held` (real, on the CPU) get their values; every other tensor is a stand-in."""
        mine = {id(t) for t in held}
        stand_ins = self._stand_ins(mine)
        saved = [self._put_whole(entry, stand_ins) for entry in self.layout]
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad(), _Taint(stand_ins.values(), held, self.names):
                torch.manual_seed(seed)
                getattr(self.model, self.method)()
            reassigned = [self._take_reassigned(entry, mine, stand_ins) for entry in self.layout]
        finally:
            for (module, *_), before in zip(self.layout, saved):
                module._modules, module._parameters, module._buffers, shadowed = before
                module.__dict__.update(shadowed)
        for original, new in itertools.chain.from_iterable(reassigned):
            original.detach().copy_(new.detach())

    def _stand_ins(self, mine: set[int]) -> dict[int, torch.Tensor]:
        """A stand-in for every tensor not in `mine`, all of a dtype on one shared storage."""
        others = {i: spec for i, spec in self.specs.items() if i not in mine}
        extent = {}  # dtype → elements the largest stand-in spans
        for shape, stride, dtype in others.values():
            span = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
            extent[dtype] = max(extent.get(dtype, 0), span)
        scratch = {dtype: torch.empty(n, dtype=dtype) for dtype, n in extent.items()}
        originals = {id(t): t for _, _, ps, bs in self.layout for t in itertools.chain(ps.values(), bs.values())
                     if t is not None}
        out = {}
        for i, (shape, stride, dtype) in others.items():
            view = scratch[dtype].as_strided(shape, stride)
            out[i] = nn.Parameter(view, requires_grad=originals[i].requires_grad) \
                if isinstance(originals[i], nn.Parameter) else view
        return out

    @staticmethod
    def _put_whole(entry, stand_ins: dict[int, torch.Tensor]) -> tuple:
        """Give a module its children and tensors as built (stand-ins for the tensors not held),
        hiding attributes that shadow them (ZeRO-3's flat views); returns what to put back."""
        module, modules, params, buffers = entry
        before = (module._modules, module._parameters, module._buffers)
        module._modules = dict(modules)
        module._parameters = {n: stand_ins.get(id(t), t) if t is not None else None for n, t in params.items()}
        module._buffers = {n: stand_ins.get(id(t), t) if t is not None else None for n, t in buffers.items()}
        shadowed = {n: module.__dict__.pop(n) for n in (*modules, *params, *buffers) if n in module.__dict__}
        return (*before, shadowed)

    def _take_reassigned(self, entry, mine: set[int], stand_ins: dict[int, torch.Tensor]) -> list:
        """(held tensor, the tensor the method assigned in its place): torchtitan's init_weights
        assigns a new `freqs_cis`, whose values the held buffer takes."""
        module, _, params, buffers = entry
        out = []
        for now, built in ((module._parameters, params), (module._buffers, buffers)):
            for name, original in built.items():
                new = now.get(name)
                if original is None or id(original) not in mine or new is original:
                    continue
                label = self.names[id(original)]
                if new is None or new.shape != original.shape or new.dtype != original.dtype:
                    raise ConfigError(f"{type(self.model).__name__}.{self.method}() replaced {label} with "
                                      f"{'None' if new is None else f'a tensor of shape {tuple(new.shape)}, {new.dtype}'}; "
                                      f"a meta-built model keeps each tensor's shape ({tuple(original.shape)}) "
                                      "and dtype: assign one like it, or set it in place")
                if _reads_stand_in(new, stand_ins.values()):
                    raise ConfigError(f"{type(self.model).__name__}.{self.method}() computes {label} from "
                                      "tensors of another part of the model, which this rank does not hold")
                out.append((original, new))
        return out


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t.numel()}


def _reads_stand_in(t: torch.Tensor, stand_ins) -> bool:
    return t.numel() > 0 and t.untyped_storage().data_ptr() in _storages(stand_ins)


class _Taint(TorchDispatchMode):
    """Refuses a write to a held tensor computed from a stand-in, naming both ([Note: an init
    from the root]). Fires on every aten op the root's method runs; a tensor is tainted when it
    lives on a stand-in's storage or an op that read a tainted one made it."""

    def __init__(self, stand_ins, held: list[torch.Tensor], names: dict[int, str]):
        super().__init__()
        self.scratch, self.held = _storages(stand_ins), _storages(held)
        self.held_names = {t.untyped_storage().data_ptr(): names[id(t)] for t in held if t.numel()}
        self.tainted = torch.utils.weak.WeakIdKeyDictionary()

    def _dirty(self, t: torch.Tensor) -> bool:
        return t in self.tainted or (t.numel() > 0 and not t.is_meta
                                     and t.untyped_storage().data_ptr() in self.scratch)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        dirty = [t for t in inputs if self._dirty(t)]
        out = func(*args, **kwargs)
        if dirty:
            for t in _written(func, args, kwargs):
                where = t.untyped_storage().data_ptr() if t.numel() and not t.is_meta else None
                if where in self.held and not self._dirty(t):
                    raise ConfigError(f"the model's init computes {self.held_names[where]} from tensors of another "
                                      "part of the model, which this rank does not hold (a ZeRO-3 unit or a "
                                      "pipeline stage of its own): compute it from what its own module holds")
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.tainted[t] = True
        return out


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an aten op writes in place (its schema's mutable arguments)."""
    out = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        out += [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    return out
