"""The canonical, world-size-free view of a model and optimizer that checkpoints store.

[Note: the canonical layout]
Every parameter is stored under "model/<name>" (its name in the user's own model) at the shape
of the whole parameter, every buffer as it is under "buffers/<name>", and every optimizer state
tensor of a parameter's size under "optim/<name>/<key>" at the same shape; scalar state (Adam's
"step") is "optim/<name>/<key>", 0-d. (A 0-d parameter is stored as one element.) Strategies
that hold whole parameters (single, DDP, ZeRO 1-2 for parameters) give whole tensors, which
torch.distributed.checkpoint writes once, from the lowest rank holding each (replicas' buffers
may differ: rank 0's are written); a pipeline stage gives the whole tensors of its own layers (a
stage's names are the model's), so the stages together write the model, and each reads back
only its own. Partial holders give a ShardedTensor of the whole shape whose chunks are the boxes
they hold, as views of what they hold; no rank gathers anything:

    tensor parallelism   its slice of a cut parameter: one box, offset along the cut dimension
    flat shards          ZeRO-1/2 optimizer state, ZeRO-3 parameters and state: each piece of a
                         flattened parameter a shard holds, as the few boxes that make it up in
                         row-major order (`boxes`: a partial row, whole rows, a partial row);
                         under tensor parallelism, boxes of the slice, then offset as above

Loading builds the same view for the new layout and the checkpoint reader fills the boxes the
new layout asks for from whatever was written: so a checkpoint loads under another world size,
another strategy and another tp. Every rank records the same name → shape map of the whole model
(a pipeline stage gathers it from the other stages; tensor parallelism scales the cut dimension).

Format 1 checkpoints (paratrain before tensor parallelism) stored every parameter flattened to
1-D; `state_entries(..., flat=True)` asks for that view, which loads them into any layout that
holds no slices.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.errors import ConfigError
from paratrain.parallel.base import CheckpointLayout, FlatLayout, ParallelModule, Slice


def layout_of(model: nn.Module) -> CheckpointLayout:
    """What this rank holds of `model`: a parallel wrapper says (its `checkpoint_layout`); a plain
    module is held whole."""
    return model.checkpoint_layout() if isinstance(model, ParallelModule) else CheckpointLayout.whole(model)


def state_entries(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                  optim_keys: dict[str, torch.dtype] | None = None, *, flat: bool = False) -> tuple[dict, dict]:
    """The checkpoint entries of `model` and `optimizer` (tensors to write, or to load into),
    and the name → shape map. `optim_keys`, when loading, are the optimizer state entries the
    checkpoint holds ("optim/<name>/<key>" → dtype): state missing here is created for each
    parameter the checkpoint has it for (not for one that had none: frozen, or never used), so
    it can be filled in place. `flat`: the format 1 view, every parameter flattened."""
    layout = layout_of(model)
    if flat and layout.slices:
        raise ConfigError("this checkpoint was written in format 1 (paratrain before tensor parallelism), "
                          "which a tensor-parallel model cannot read: load it without tp and save it again")
    stored = _Stored(layout, flat)
    entries = {f"model/{n}": stored.held(n, p.detach()) for n, p in layout.params.items()}
    entries.update({f"buffers/{n}": b for n, b in layout.buffers.items()})
    names = {p: n for n, p in layout.params.items()}
    if layout.params_in_flat:
        for shard, flat_layout in layout.flat.items():
            entries.update(stored.sharded("model/{}", shard.detach(), flat_layout))
    if optimizer is not None:
        def stored_as(param: torch.Tensor) -> list[str] | None:
            flat_layout = layout.flat.get(param)
            return [n for n, *_ in flat_layout.slots] if flat_layout else [names[param]] if param in names else None

        for param, state in _optimizer_states(optimizer, optim_keys, stored_as):
            flat_layout = layout.flat.get(param)
            for key, value in state.items():
                if not torch.is_tensor(value):
                    continue
                if value.dim() == 0:  # the same on every parameter a holder steps
                    targets = [n for n, *_ in flat_layout.slots] if flat_layout else [names[param]]
                    entries.update({f"optim/{n}/{key}": value for n in targets})
                elif flat_layout is not None:
                    entries.update(stored.sharded("optim/{}/" + key, value, flat_layout))
                else:
                    entries[f"optim/{names[param]}/{key}"] = stored.held(names[param], value)
    return entries, layout.shapes


def loaded(model: nn.Module) -> None:
    """After values were written into the tensors `state_entries` gave: let the holder refresh
    what derives from them (ZeRO-1/2 master shards → the parameters). A collective."""
    after = layout_of(model).after_load
    if after is not None:
        after()


def _optimizer_states(optimizer, optim_keys, stored_as):
    # every optimizer a strategy returns steps its param_groups with its `state` (ZeRO 1-2's
    # ShardedOptimizer shares both with the optimizer it wraps)
    kinds = {entry.rsplit("/", 1)[1]: dtype for entry, dtype in (optim_keys or {}).items()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            names = stored_as(p)
            for key, dtype in kinds.items():
                if key not in state and (names is None or any(f"optim/{n}/{key}" in optim_keys for n in names)):
                    # a fresh optimizer: make the state the checkpoint fills
                    scalar = key in _SCALAR_KEYS
                    state[key] = torch.zeros((), dtype=dtype) if scalar else torch.zeros_like(p, dtype=dtype)
            yield p, state


_SCALAR_KEYS = {"step"}


Box = tuple[tuple[int, ...], tuple[int, ...], int]  # (offsets, sizes, where it starts in the range)


def boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Elements [start, stop) of a tensor of `shape`, flattened in row-major order, as boxes of
    it (at most 2·ndim − 1), each contiguous in that order, with its first element's position
    counted from `start`: a partial row, the whole rows, a partial row, recursively."""
    if not shape:
        return [((), (), 0)] if stop > start else []
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner  # the rows touched
    if first == last:  # within one row: the row's own boxes
        return [((first, *o), (1, *z), at) for o, z, at in boxes(shape[1:], start - first * inner, stop - first * inner)]
    out: list[Box] = []
    whole_from, whole_to = -(-start // inner), stop // inner
    if start % inner:
        out += [((first, *o), (1, *z), at) for o, z, at in boxes(shape[1:], start % inner, inner)]
    if whole_to > whole_from:
        out.append(((whole_from, *[0] * (len(shape) - 1)), (whole_to - whole_from, *shape[1:]),
                    whole_from * inner - start))
    if stop % inner:
        out += [((whole_to, *o), (1, *z), at + whole_to * inner - start) for o, z, at in boxes(shape[1:], 0, stop % inner)]
    return out


class _Stored:
    """How `layout`'s tensors are stored: at the whole parameter's shape (format 2), or
    flattened (`flat`: format 1)."""

    def __init__(self, layout: CheckpointLayout, flat: bool):
        self.layout, self.flat = layout, flat

    def shape(self, name: str, shape: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """The stored shape of `name` (or of its slice, `shape`)."""
        shape = tuple(self.layout.shapes[name] if shape is None else shape)
        return (math.prod(shape),) if self.flat or not shape else shape

    def held(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A parameter (or its state) this rank holds whole, or its tensor-parallel slice."""
        cut = self.layout.slices.get(name)
        if cut is None:
            return tensor.view(self.shape(name))  # a view: loading writes into it
        chunks = [(tuple(cut.offsets(tensor.shape, i)), tuple(tensor.shape)) for i in range(cut.parts)]
        return _sharded_tensor(self.shape(name), tensor, chunks, [(tuple(cut.offsets(tensor.shape)), tensor)])

    def sharded(self, pattern: str, local: torch.Tensor, flat: FlatLayout) -> dict:
        """One ShardedTensor per parameter the flat shard `local` touches: this rank's boxes are
        views of `local` (so loading writes straight into it); every holder's boxes (every
        shard's, and under tp every slice's) are the global metadata."""
        values = local.reshape(-1)
        shapes = {name: self.shape(name, shape) for name, _, shape in flat.slots}  # of what a shard slices
        chunks: dict[str, list] = {}
        held: dict[str, list] = {}
        for rank in range(flat.world):
            for name, param_offset, local_offset, length in flat.pieces(rank):
                cut = self.layout.slices.get(name)
                for offsets, sizes, at in boxes(shapes[name], param_offset, param_offset + length):
                    for i in range(cut.parts if cut else 1):
                        chunks.setdefault(name, []).append((_shifted(offsets, cut, shapes[name], i), sizes))
                    if rank == flat.rank:
                        start = local_offset + at
                        held.setdefault(name, []).append((_shifted(offsets, cut, shapes[name], None),
                                                          values[start:start + math.prod(sizes)].view(sizes)))
        return {pattern.format(name): _sharded_tensor(self.shape(name), local, every, held.get(name, []))
                for name, every in chunks.items()}


def _shifted(offsets: tuple[int, ...], cut: Slice | None, local: tuple[int, ...], index: int | None) -> tuple[int, ...]:
    """`offsets` within a tensor-parallel slice of shape `local` → within the whole parameter."""
    if cut is None:
        return offsets
    return tuple(o + s for o, s in zip(offsets, cut.offsets(torch.Size(local), index)))


def _sharded_tensor(size: tuple[int, ...], like: torch.Tensor, chunks: list, held: list) -> Any:
    """A ShardedTensor of global `size` made of `chunks` [(offsets, sizes)], of which this rank
    holds `held` [(offsets, tensor)] (no copy: DCP reads into them and writes from them). The
    chunks of replicas (tp peers' dp replicas, ZeRO-3's slices under tp) are listed once."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties

    # ShardedTensor counts a rank's local shards by the placements naming it (a global rank):
    # this rank's chunks name it, the others another rank (which of their holders, DCP's plan
    # never asks: it dedups what replicas write by the chunk's offsets)
    me, world = dist.get_rank(), dist.get_world_size()
    device, mine = str(like.device), {(tuple(o), tuple(t.shape)) for o, t in held}
    placed = {chunk: me if chunk in mine else (me + 1) % world for chunk in ((tuple(o), tuple(z)) for o, z in chunks)}
    meta = ShardedTensorMetadata([ShardMetadata(list(o), list(z), f"rank:{r}/{device}") for (o, z), r in placed.items()],
                                 torch.Size(size), TensorProperties(dtype=like.dtype))
    shards = [Shard(t, ShardMetadata(list(o), list(t.shape), f"rank:{me}/{device}")) for o, t in held]
    with warnings.catch_warnings():  # ShardedTensor is deprecated for DTensor, which cannot
        warnings.simplefilter("ignore")  # describe pieces at arbitrary offsets
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta)
