"""Loading a consolidated weights file into a model, whatever wraps it, one tensor at a time.

    pt.load_weights(session.model, "model.safetensors")   # or a torch state dict file, a dict

The source is a `.safetensors` file, a directory of them (transformers' sharded checkpoints), a
file `torch.save`d from a state dict (read with `weights_only=True` and `mmap=True`), or a dict
of tensors. Its keys are the plain model's state-dict keys.

What each rank reads is what it holds, in the canonical layout checkpoints use (checkpoint/layout.py):
a rank holding a parameter whole reads it whole; a ZeRO-3 rank reads only the boxes of each
parameter its shard holds, and a tensor-parallel rank its slice — from a safetensors file, the
rows that contain them, so no rank ever holds a whole model, nor a whole tensor it does not own;
a pipeline stage reads its own layers. A tied weight is found under any of its names (transformers' files keep one of them).

Nothing is written until everything has been checked: every rank learns every rank's names
(one small all-gather of names and shapes), so every rank finds the same missing, unexpected and
mis-shaped keys and raises the same error, listing them. With `strict=False` missing and unexpected
keys are allowed (a missing one keeps its value) — a mis-shaped one never is. Values are cast to
the model's dtype (a bf16 file loads into fp32 weights).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Union

import torch
from torch import nn

from paratrain.checkpoint.files import all_gather
from paratrain.checkpoint.layout import layout_of, loaded, state_entries
from paratrain.errors import ConfigError
from paratrain.parallel.base import names_by_first

Source = Union[str, os.PathLike, Mapping[str, torch.Tensor]]


@torch.no_grad()
def load_weights(model: nn.Module, source: Source, *, strict: bool = True) -> None:
    """Load the weights in `source` into `model` (a plain module or any paratrain wrapper), in
    place. A collective when a process group is up: every rank calls it with the same source.
    Raises ConfigError, having changed nothing, when keys are missing, unexpected or mis-shaped."""
    reader = open_weights(source)
    entries, _ = state_entries(model, None)
    names = _model_names(model)
    found = _check(names, reader, strict, source)
    for key, target in entries.items():
        kind, name = key.split("/", 1)
        if name not in found:  # strict=False, or a buffer the state dict does not hold
            continue
        if hasattr(target, "local_shards"):  # the boxes of it this rank holds (ZeRO-3, tp)
            for shard in target.local_shards():
                shard.tensor.copy_(reader.read_box(found[name], shard.metadata.shard_offsets,
                                                   shard.metadata.shard_sizes))
        else:
            target.copy_(reader.read(found[name]).view(target.shape))
    loaded(model)


def _model_names(model: nn.Module) -> dict[str, Any]:
    """The whole model's state-dict names, from every rank's layout: parameter shapes, a tied
    parameter's other names, and the buffers a state dict holds with their shapes."""
    layout = layout_of(model)
    mine = {"params": dict(layout.shapes), "aliases": dict(layout.aliases),
            "buffers": {n: b.shape for n, b in layout.saved_buffers().items()}}
    everyone = all_gather(mine)
    return {part: {k: v for rank in everyone for k, v in rank[part].items()} for part in mine}


def _check(names: dict[str, Any], reader: "WeightsReader", strict: bool, source: Source) -> dict[str, str]:
    """Model name → the source key to read it from; raises listing every problem."""
    every_name = names_by_first(names["aliases"])
    found, missing, misshaped = {}, [], []
    wanted = {**names["params"], **names["buffers"]}
    for name, shape in wanted.items():
        keys = [k for k in every_name.get(name, [name]) if k in reader.keys]
        if not keys:
            missing.append(name)
            continue
        found[name] = keys[0]
        misshaped += [f"{k}: {tuple(reader.shape(k))} in the file, {tuple(shape)} in the model"
                      for k in keys if reader.shape(k) != tuple(shape)]
    unexpected = sorted(reader.keys - wanted.keys() - names["aliases"].keys())
    problems = [f"{len(misshaped)} mis-shaped: {_listed(misshaped)}"] if misshaped else []
    if strict:
        problems += [f"{len(missing)} missing: {_listed(missing)}"] if missing else []
        problems += [f"{len(unexpected)} unexpected: {_listed(unexpected)}"] if unexpected else []
    if problems:
        raise ConfigError(f"cannot load {_named(source)} into this model, nothing was loaded: "
                          f"{'; '.join(problems)}. The keys must be the plain model's state_dict() keys "
                          "(strip a prefix such as 'module.' or 'model.' first)"
                          + ("; pass strict=False to load the keys that match" if not misshaped else ""))
    return found


def _listed(items: list[str], most: int = 8) -> str:
    return ", ".join(items[:most]) + (f" (and {len(items) - most} more)" if len(items) > most else "")


def _named(source: Source) -> str:
    return str(source) if isinstance(source, (str, os.PathLike)) else "the given state dict"


class WeightsReader:
    """Reads the tensors of a weights source by key, a tensor or a box of one at a time."""

    def __init__(self, tensors: Mapping[str, Any], shapes: dict[str, tuple[int, ...]]):
        self.tensors = tensors  # key → a tensor, or a _SafeTensor (read when indexed)
        self._shapes = shapes
        self.keys = set(shapes)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key]

    def read(self, key: str) -> torch.Tensor:
        value = self.tensors[key]
        return value if torch.is_tensor(value) else value.whole()

    def read_box(self, key: str, offsets: list[int], sizes: list[int]) -> torch.Tensor:
        """The box of the tensor at `offsets` of `sizes` (checkpoint/layout.py `boxes`), reading
        only the rows that hold it (a 0-d tensor is stored as one element)."""
        if not self._shapes[key]:
            return self.read(key).reshape(sizes)
        rows = self.tensors[key][offsets[0]:offsets[0] + sizes[0]]
        for dim in range(1, len(sizes)):
            rows = rows.narrow(dim, offsets[dim], sizes[dim])
        return rows


def open_weights(source: Source) -> WeightsReader:
    """A reader over `source` (see the module docstring); raises ConfigError naming what is wrong."""
    if isinstance(source, Mapping):
        tensors = {k: v for k, v in source.items() if torch.is_tensor(v)}
        return WeightsReader(tensors, {k: tuple(v.shape) for k, v in tensors.items()})
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"there is no weights file at {path}: pass a .safetensors file, a directory of them, "
                          "or a file torch.save'd from a state dict")
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise ConfigError(f"{path} is a directory without .safetensors files: pass the file itself")
    if files[0].suffix == ".safetensors":
        return _safetensors(files)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # pickle, zip and mmap errors all mean the same to the user
        raise ConfigError(f"cannot read {path} as a torch state dict ({type(e).__name__}: {e}); pass a "
                          ".safetensors file, or a file written by torch.save(model.state_dict(), path)") from e
    if not isinstance(state, Mapping):
        raise ConfigError(f"{path} holds a {type(state).__name__}, not a state dict: save model.state_dict()")
    return open_weights(state)


def _safetensors(files: list[Path]) -> WeightsReader:
    try:
        from safetensors import safe_open
    except ImportError:
        raise ConfigError("reading .safetensors needs the safetensors package: pip install safetensors "
                          "(or paratrain[export])") from None
    tensors, shapes = {}, {}
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as e:  # a truncated or foreign file: safetensors' own message says which
            raise ConfigError(f"cannot read {file} as safetensors: {e}") from e
        for key in handle.keys():
            if key in tensors:
                raise ConfigError(f"{key!r} is in two files of {file.parent}: pass one file, or a directory "
                                  "holding one model's shards")
            tensors[key] = _SafeTensor(handle, key)
            shapes[key] = tuple(handle.get_slice(key).get_shape())
    return WeightsReader(tensors, shapes)


class _SafeTensor:
    """One tensor of a safetensors file, read when indexed: `[a:b]` reads rows a..b only."""

    def __init__(self, handle: Any, key: str):
        self.handle, self.key = handle, key

    def __getitem__(self, index: slice) -> torch.Tensor:
        return self.handle.get_slice(self.key)[index]

    def whole(self) -> torch.Tensor:
        return self.handle.get_tensor(self.key)
