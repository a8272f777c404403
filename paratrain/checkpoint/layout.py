"""The canonical, world-size-free view of a model and optimizer that checkpoints store.

[Note: the canonical layout]
Every parameter is stored flattened to 1-D under "model/<name>" (its name in the user's own
model), every buffer as it is under "buffers/<name>", and every optimizer state tensor of a
parameter's size under "optim/<name>/<key>", flattened the same way; scalar state (Adam's "step")
is "optim/<name>/<key>", 0-d. Strategies that hold whole parameters (single, DDP, ZeRO 1-2 for
parameters) give whole tensors, which torch.distributed.checkpoint writes once, from the lowest
rank holding each (replicas' buffers may differ: rank 0's are written); a pipeline stage
gives the whole tensors of its own layers (a stage's names are the model's), so the stages
together write the model, and each reads back only its own. Sharded holders
(ZeRO-1/2 optimizer state, ZeRO-3 parameters and state) give, for each parameter, the pieces of
its flattened form that this rank's flat shard holds, as a ShardedTensor whose chunks are those
pieces; no rank gathers anything. Loading builds the same view for the new layout and the
checkpoint reader fills the pieces the new layout asks for from whatever was written: so a
checkpoint loads under another world size and another strategy. Every rank records the same
name → shape map of the whole model (a pipeline stage gathers it from the other stages).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from paratrain.parallel.base import CheckpointLayout, FlatLayout, ParallelModule


def layout_of(model: nn.Module) -> CheckpointLayout:
    """What this rank holds of `model`: a parallel wrapper says (its `checkpoint_layout`); a plain
    module is held whole."""
    return model.checkpoint_layout() if isinstance(model, ParallelModule) else CheckpointLayout.whole(model)


def state_entries(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                  optim_keys: dict[str, torch.dtype] | None = None) -> tuple[dict, dict]:
    """The checkpoint entries of `model` and `optimizer` (tensors to write, or to load into),
    and the name → shape map. `optim_keys`, when loading, are the optimizer state entries the
    checkpoint holds ("optim/<name>/<key>" → dtype): state missing here is created for each
    parameter the checkpoint has it for (not for one that had none: frozen, or never used), so
    it can be filled in place."""
    layout = layout_of(model)
    entries = {f"model/{n}": p.detach().view(-1) for n, p in layout.params.items()}
    entries.update({f"buffers/{n}": b for n, b in layout.buffers.items()})
    names = {p: n for n, p in layout.params.items()}
    if layout.params_in_flat:
        for shard, flat in layout.flat.items():
            entries.update(_sharded("model/{}", shard.detach(), flat, layout.shapes))
    if optimizer is not None:
        def stored_as(param: torch.Tensor) -> list[str] | None:
            flat = layout.flat.get(param)
            return [n for n, *_ in flat.slots] if flat else [names[param]] if param in names else None

        for param, state in _optimizer_states(optimizer, optim_keys, stored_as):
            flat = layout.flat.get(param)
            for key, value in state.items():
                if not torch.is_tensor(value):
                    continue
                if value.dim() == 0:  # the same on every parameter a holder steps
                    targets = [n for n, *_ in flat.slots] if flat else [names[param]]
                    entries.update({f"optim/{n}/{key}": value for n in targets})
                elif flat is not None:
                    entries.update(_sharded("optim/{}/" + key, value, flat, layout.shapes))
                else:
                    entries[f"optim/{names[param]}/{key}"] = value.view(-1)
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


def _sharded(pattern: str, local: torch.Tensor, layout: FlatLayout, shapes: dict) -> dict:
    """One ShardedTensor per parameter the flat shard touches: this rank's pieces are views of
    `local` (so loading writes straight into it), every rank's pieces are the global metadata."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties

    everyone: dict[str, list[ShardMetadata]] = {}
    for rank in range(layout.world):
        for name, param_offset, _, length in layout.pieces(rank):
            everyone.setdefault(name, []).append(
                ShardMetadata([param_offset], [length], f"rank:{rank}/{local.device.type}"))
    out = {}
    flat = local.reshape(-1)
    with warnings.catch_warnings():  # ShardedTensor is deprecated for DTensor, which cannot
        warnings.simplefilter("ignore")  # describe pieces at arbitrary offsets
        for name, param_offset, local_offset, length in layout.pieces(layout.rank):
            piece = flat[local_offset:local_offset + length]
            meta = ShardedTensorMetadata(everyone[name], torch.Size([shapes[name].numel()]),
                                         TensorProperties(dtype=local.dtype))
            shard = Shard(piece, ShardMetadata([param_offset], [length], f"rank:{layout.rank}/{local.device.type}"))
            out[pattern.format(name)] = ShardedTensor._init_from_local_shards_and_global_metadata([shard], meta)
        for name in everyone.keys() - {n for n, *_ in layout.pieces(layout.rank)}:
            meta = ShardedTensorMetadata(everyone[name], torch.Size([shapes[name].numel()]),
                                         TensorProperties(dtype=local.dtype))
            out.setdefault(pattern.format(name),
                           ShardedTensor._init_from_local_shards_and_global_metadata([], meta))
    return out
