"""Checkpoints through torch.distributed.checkpoint (DCP): sharded, reshardable, atomic, safe.

- Each rank writes its own shard of the canonical layout (state_layout.py), so a checkpoint
  loads under another world size and another strategy (DDP at 4 → ZeRO-3 at 2 → one process).
- A save writes into `<path>.partial`, and only when every rank has finished does rank 0 write
  `paratrain.json` and rename the directory to `<path>`: a crash mid-save leaves `<path>.partial`
  (ignored, removed by the next save) and every earlier checkpoint untouched.
- `save(..., keep=K)` into a root directory keeps the newest K `step-*` checkpoints.
- Loading never unpickles arbitrary objects: our own state is JSON in a uint8 tensor, and DCP's
  metadata file is read with an unpickler that admits only DCP's metadata classes.
- Paths must be on a file system every node sees (as DCP's FileSystemWriter requires).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from paratrain.errors import CheckpointError, ConfigError, UsageError
from paratrain.state_layout import state_entries

FORMAT = 1
MARKER = "paratrain.json"  # written last: a directory without it is not a checkpoint


def save(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         state: dict | None = None, rng: dict[str, torch.Tensor] | None = None) -> Path:
    """Write `model`, `optimizer`, the JSON-able `state` (step, sampler, …) and this rank's `rng`
    tensors to `path` atomically. A collective: every rank calls it."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    if _is_main():
        shutil.rmtree(partial, ignore_errors=True)  # a save that crashed earlier
    _barrier()
    entries, shapes = state_entries(model, optimizer)
    meta = {"format": FORMAT, "world_size": _world(), "shapes": {n: list(s) for n, s in shapes.items()},
            "param_groups": _hyperparameters(optimizer), "state": state or {}}
    entries["meta/json"] = _json_tensor(meta)
    entries.update({f"rng/{_rank()}/{k}": v for k, v in (rng or {}).items()})
    try:
        dcp.save(entries, storage_writer=dcp.FileSystemWriter(partial))
    except dcp.CheckpointException as e:  # a BaseException: turn it into an ordinary error
        raise CheckpointError(f"saving {path} failed ({str(e)[:500]}); it was left as {partial.name}, "
                              "and every checkpoint saved before is intact") from e
    if _is_main():
        (partial / MARKER).write_text(json.dumps({k: v for k, v in meta.items() if k != "shapes"}, indent=1))
        _replace(partial, path)
    _barrier()
    return path


def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load `path` into `model` and `optimizer` (in place, whatever strategy and world size wrote
    it). Returns {"state": …, "rng": this rank's rng tensors or {}}. A collective."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"there is no checkpoint at {path}: nothing exists there; pass the path save() "
                          "returned, or session.resume(root) to load the newest one if there is one")
    if not (path / MARKER).is_file():
        raise ConfigError(f"{path} is not a complete paratrain checkpoint (no {MARKER}): it may be a "
                          "save that was interrupted; use paratrain.checkpoint.latest(root)")
    reader = SafeReader(path)
    metadata = _read(reader.read_metadata, path)
    meta = _read_meta(path, metadata)
    optim_keys = _optimizer_keys(metadata) if optimizer is not None else None
    entries, shapes = state_entries(model, optimizer, optim_keys)
    _check_same_model(meta, shapes, path)
    rng = {k.split("/", 2)[2]: torch.empty(metadata.state_dict_metadata[k].size, dtype=torch.uint8)
           for k in metadata.state_dict_metadata if k.startswith(f"rng/{_rank()}/")}
    entries.update({f"rng/{_rank()}/{k}": v for k, v in rng.items()})
    _read(lambda: dcp.load(entries, storage_reader=reader), path)
    _apply_hyperparameters(optimizer, meta["param_groups"])
    return {"state": meta["state"], "rng": rng if meta["world_size"] == _world() else {}}


def export_safetensors(path: str | os.PathLike, state: dict[str, torch.Tensor]) -> Path | None:
    """Write a full (gathered) state dict as one `.safetensors` file for inference, on rank 0.
    Tied weights are written under each of their names."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ConfigError("exporting needs the safetensors package: pip install safetensors "
                          "(or paratrain[export])") from None
    if not _is_main():
        return None
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in state.items()}, str(partial))
    os.replace(partial, path)
    return path


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint `root/step-*`, or None."""
    done = sorted(p for p in Path(root).glob("step-*") if (p / MARKER).is_file())
    return done[-1] if done else None


def prune(root: str | os.PathLike, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints under `root` (rank 0 only)."""
    if _is_main():
        done = sorted(p for p in Path(root).glob("step-*") if (p / MARKER).is_file())
        for old in done[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)


class SafeReader(dcp.FileSystemReader):
    """DCP's reader, but its metadata file is unpickled with an allow-list of DCP's own classes."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        metadata.storage_meta = metadata.storage_meta or dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _MetadataUnpickler(pickle.Unpickler):
    _MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    _NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
              ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath")}

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if module in self._MODULES or (module, name) in self._NAMES or dtype:
            return super().find_class(module, name)
        raise UsageError(f"refusing to load {module}.{name} from checkpoint metadata: a checkpoint "
                         "holds only tensors and DCP's metadata")


def rng_state() -> dict[str, torch.Tensor]:
    """This process's random states as uint8 tensors (torch, CUDA, Python's random, NumPy's)."""
    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    plain = {"python": random.getstate(), "numpy": [kind, keys.tolist(), pos, has_gauss, gauss]}
    state = {"torch": torch.get_rng_state(),
             "plain": _json_tensor(plain)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    plain = _json_of(state["plain"])
    version, internal, gauss = plain["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def _read(fn, path: Path):
    try:
        return fn()
    except (ConfigError, UsageError):
        raise
    except (Exception, dcp.CheckpointException) as e:  # a damaged file, seen by DCP or the unpickler
        raise ConfigError(f"checkpoint {path} cannot be read ({type(e).__name__}: {str(e)[:300]}); it is "
                          "damaged or incomplete: load an earlier one (paratrain.checkpoint.latest)") from e


def _read_meta(path: Path, metadata) -> dict:
    if "meta/json" not in metadata.state_dict_metadata:
        raise ConfigError(f"{path} was not written by paratrain.checkpoint.save")
    blob = torch.empty(metadata.state_dict_metadata["meta/json"].size, dtype=torch.uint8)
    _read(lambda: dcp.load({"meta/json": blob}, storage_reader=SafeReader(path)), path)
    meta = _json_of(blob)
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{path} has checkpoint format {meta.get('format')}; this paratrain reads {FORMAT}")
    return meta


def _check_same_model(meta: dict, shapes: dict, path: Path) -> None:
    saved = {n: tuple(s) for n, s in meta["shapes"].items()}
    mine = {n: tuple(s) for n, s in shapes.items()}
    if saved != mine:
        missing, extra = sorted(mine.keys() - saved.keys()), sorted(saved.keys() - mine.keys())
        other = sorted(n for n in mine.keys() & saved.keys() if mine[n] != saved[n])
        raise ConfigError(f"{path} holds another model: parameters missing from it {missing[:5]}, "
                          f"unknown to this model {extra[:5]}, with other shapes "
                          f"{[(n, saved[n], mine[n]) for n in other[:5]]}; load it into the model that wrote it")


def _optimizer_keys(metadata) -> dict[str, torch.dtype]:
    keys = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith("optim/"):
            keys[key.rsplit("/", 1)[1]] = item.properties.dtype
    return keys


def _hyperparameters(optimizer) -> list[dict]:
    if optimizer is None:
        return []
    return [{k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, bool, str))}
            for g in optimizer.param_groups]


def _apply_hyperparameters(optimizer, groups: list[dict]) -> None:
    if optimizer is None or not groups:
        return
    if len(groups) != len(optimizer.param_groups):
        raise ConfigError(f"the checkpoint's optimizer has {len(groups)} param groups, this one "
                          f"{len(optimizer.param_groups)}; build the optimizer as the run that saved it")
    for mine, saved in zip(optimizer.param_groups, groups):
        mine.update(saved)  # e.g. the learning rate a scheduler had reached


def _json_tensor(obj: Any) -> torch.Tensor:
    """A JSON-able object as a uint8 tensor: what a checkpoint holds instead of a pickle."""
    return torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8)


def _json_of(blob: torch.Tensor) -> Any:
    return json.loads(bytes(blob.tolist()).decode())


def _replace(partial: Path, path: Path) -> None:
    """Make `partial` the checkpoint at `path`: renames are atomic on one file system."""
    old = path.with_name(path.name + ".old")
    if path.exists():
        os.replace(path, old)
    os.replace(partial, path)
    shutil.rmtree(old, ignore_errors=True)


def _is_main() -> bool:
    return _rank() == 0


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
