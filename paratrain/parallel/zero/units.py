"""How ZeRO stage 3 takes a model apart into units: which names each trainable parameter has,
which unit owns it, flattening its parameters into flat shards and releasing the originals; and
the states the sharded model moves through in a step."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from paratrain.errors import UsageError
from paratrain.parallel.zero.collectives import refuse_other_gathers
from paratrain.parallel.zero.flat_shard import FlatShard, ParamSlot
from paratrain.parallel.zero.wrap_policy import enclosing_modules


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


def owners_by_param(root: nn.Module) -> dict[nn.Parameter, list[tuple[str, nn.Module, str]]]:
    """Every (dotted name, module, attribute) under which each trainable parameter appears."""
    owners: dict[nn.Parameter, list[tuple[str, nn.Module, str]]] = {}
    for mod_name, module in root.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None and p.requires_grad:
                owners.setdefault(p, []).append((f"{mod_name}.{attr}" if mod_name else attr, module, attr))
    return owners


def innermost_unit(param_names: list[str], units: set[str]) -> str:
    """The deepest unit whose subtree holds every name the parameter has ("" is the root): the
    longest module path that is a unit and a prefix of each name. Looked up by the names' own
    prefixes, a few per name, not by scanning the units: llama-2-70b has 563 units under the
    default wrap policy and 723 parameters, and a scan cost `paratrain plan` 3 s of its 20."""
    common: set[str] | None = None
    for name in param_names:
        enclosing = set(enclosing_modules(name))
        common = enclosing if common is None else common & enclosing
    return max((u for u in common or () if u in units), key=len, default="")


def params_by_unit(owners, units: list[str]) -> dict[str, list[nn.Parameter]]:
    """Each unit's parameters (`owners`: owners_by_param's), for `units` then the root ("", last):
    a parameter belongs to the innermost unit holding every name it has (tied weights)."""
    by_unit: dict[str, list[nn.Parameter]] = {name: [] for name in units + [""]}
    unit_set = set(units)
    for p, places in owners.items():
        by_unit[innermost_unit([n for n, _, _ in places], unit_set)].append(p)
    return by_unit


OWN_FLAT_ELEMENTS = 1 << 20  # [Note: the root's big parameters]


def flats_by_unit(by_unit: dict[str, list[nn.Parameter]],
                  group_of: dict[nn.Parameter, int]) -> dict[str, list[list[nn.Parameter]]]:
    """Each unit's flat shards' parameters (`by_unit`: params_by_unit's), as stage3.py builds them
    and plan/cost/memory.py counts them: in the root of a model cut into units, each parameter of at
    least OWN_FLAT_ELEMENTS gets a flat of its own ([Note: the root's big parameters])."""
    wrapped = len(by_unit) > 1
    return {name: flats_of(params, group_of, alone=OWN_FLAT_ELEMENTS if wrapped and not name else None)
            for name, params in by_unit.items()}


def flats_of(params: list[nn.Parameter], group_of: dict[nn.Parameter, int],
             alone: int | None = None) -> list[list[nn.Parameter]]:
    """One unit's parameters as its flat shards hold them: per optimizer param group, in group
    order, each parameter of at least `alone` elements by itself, then the rest together."""
    flats = []
    for group in sorted({group_of[p] for p in params}):
        members = [p for p in params if group_of[p] == group]
        big = {id(p) for p in members if alone is not None and p.numel() >= alone}
        flats += [[p] for p in members if id(p) in big]
        flats += [rest] if (rest := [p for p in members if id(p) not in big]) else []
    return flats


# [Note: the root's big parameters]
# The root unit holds what no wrapped module does: a language model's embeddings, its head (tied
# to the token embedding or not) and the final norm, used at both ends of forward. Their
# gradients come whole, one use at a time: the head's at the start of backward, the embedding's
# at its end. In a flat of its own, unpadded, such a gradient becomes the flat's gradient buffer
# as autograd made it (flat_shard.py, `grad_arrived`), where a flat shared with the rest of the
# root copied it into a zeroed buffer of the whole root, holding both at once with the root's
# parameters gathered and the first block prefetched; and a tied weight's share from the head is
# reduced before the blocks' backward ([Note: a unit used twice]), the embedding's share filling
# a new buffer, again autograd's own (bench/big_model.py measures the peak against its formula,
# with activation checkpointing). Small parameters stay in one flat
# (each flat is one more collective per gather and per reduction); blocks keep one flat each,
# their gradients arriving together.


def build_units(module: nn.Module, names: list[str], group_of: dict[nn.Parameter, int],
                materialize: Callable[[str, nn.Module, list[nn.Parameter]], None],
                **flat_options) -> tuple[list[Unit], list[int]]:
    """The units `names` (WrapPolicy.select's), then the root, each with its flat shards
    (flats_by_unit), and the optimizer param group of each shard in that order.
    `materialize(name, unit module, its parameters)` runs before a unit is flattened (a
    meta-built model is made unit by unit: stage3.py)."""
    owners = owners_by_param(module)
    by_unit = params_by_unit(owners, names)
    flats = flats_by_unit(by_unit, group_of)
    units, groups = [], []
    for name, params in by_unit.items():
        unit_module = module.get_submodule(name) if name else module
        materialize(name, unit_module, params)
        units.append(Unit(name, unit_module, [flatten(members, owners, **flat_options) for members in flats[name]]))
        groups += [group_of[members[0]] for members in flats[name]]
    if dist.get_debug_level() == dist.DebugLevel.DETAIL:  # [Note: the same unit on every rank]
        labels = [(f"unit {u.name!r}" if u.name else "the root unit") + (f" flat {k}" if len(u.flats) > 1 else "")
                  for u in units for k in range(len(u.flats))]
        for index, flat in enumerate(f for u in units for f in u.flats):
            flat.gather_check = functools.partial(refuse_other_gathers, index, labels, flat.group, flat.full.device)
    return units, groups


def flatten(params: list[nn.Parameter], owners, **flat_options) -> FlatShard:
    """One FlatShard of `params` (`owners`: owners_by_param's); the modules' attributes become its
    leaves, and the original parameters are released."""
    slots, offset = [], 0
    for p in params:
        places = owners[p]
        slots.append(ParamSlot(tuple(n for n, _, _ in places), tuple((m, a) for _, m, a in places), p.shape, offset))
        offset += p.numel()
    flat = FlatShard(slots, [p.detach() for p in params], **flat_options)
    for p in params:
        for _, module, attr in owners[p]:
            del module._parameters[attr]  # from now on a plain attribute: the flat's leaf
        release(p)
    flat.install()
    return flat


def release(p: nn.Parameter) -> None:
    """Free an original parameter's memory and mark it, so an optimizer made from the unsharded
    model fails with advice instead of silently stepping nothing (see `_check_optimizer_step`)."""
    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    p._paratrain_sharded = True
    _install_optimizer_check()


@functools.cache
def _install_optimizer_check() -> None:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_check_optimizer_step)


def _check_optimizer_step(optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        if any(getattr(p, "_paratrain_sharded", False) for p in group["params"]):
            raise UsageError(
                "this optimizer was created from the model before ZeRO stage 3 sharded it, so it "
                "holds parameters that no longer exist; use the optimizer that "
                "paratrain.shard(model, optimizer, stage=3) returns (Session.setup does this), or "
                "create it from the sharded model's parameters()")


@dataclass
class Unit:
    """One unit: the module it is, and its flat shards (one per optimizer param group)."""

    name: str  # "" for the root
    module: nn.Module
    flats: list[FlatShard]
    backward_started: bool = False

    def reshard(self) -> None:
        """Free its gathered parameters (each flat keeps its shard)."""
        for flat in self.flats:
            flat.reshard()
