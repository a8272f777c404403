"""Checkpoints through torch.distributed.checkpoint (DCP): sharded, reshardable, atomic, safe.

- Each rank writes its own shard of the canonical layout (checkpoint/layout.py), so a checkpoint
  loads under another world size and another strategy (DDP at 4 → ZeRO-3 at 2 → one process).
- A save writes into `<path>.partial`, and only when every rank has finished does rank 0 write
  `paratrain.json` and rename the directory to `<path>`: a crash mid-save leaves `<path>.partial`
  (ignored, removed by the next save) and every earlier checkpoint untouched. A save to the name of
  an existing checkpoint replaces it.
- The newest checkpoint is the one written last: `paratrain.json` records a sequence per root,
  which orders `latest`, `resume` and `prune` (checkpoint/files.py, [Note: the marker]).
- Every file's sha256 is recorded at save and checked at load: a damaged checkpoint is a
  DamagedCheckpoint naming the file, and `resume` falls back past it to the previous one.
- A root of `step-*` checkpoints is pruned to the newest K and resumed from with a fallback past
  damaged ones (checkpoint/root.py), and locked for one writing job (checkpoint/lock.py).
- Loading never unpickles arbitrary objects: our own state is JSON in a uint8 tensor, and DCP's
  metadata file is read with an unpickler that admits only DCP's metadata classes.
- Paths must be on a file system every node sees (as DCP's FileSystemWriter requires).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain.checkpoint.files import (
    ADVICE,
    MARKER,
    CheckpointWarning,
    DamagedCheckpoint,
    agree,
    all_gather,
    describe_failure,
    digest,
    file_problem,
    listed_files,
    next_sequence,
    os_cause,
    rank,
    world,
    write_marker,
)
from paratrain.checkpoint.layout import layout_of, loaded, state_entries
from paratrain.checkpoint.lock import check_not_locked, lock_root, unlock_roots
from paratrain.checkpoint.random_state import json_of, json_tensor
from paratrain.checkpoint.root import latest, prune, resume
from paratrain.errors import CheckpointError, ConfigError

__all__ = ["save", "load", "resume", "latest", "prune", "verify", "describe", "lock_root", "unlock_roots",
           "DamagedCheckpoint", "CheckpointWarning"]

FORMAT = 2  # 1: parameters stored flattened (checkpoint/layout.py)
READS = (1, 2)


def save(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         state: dict | None = None, rng: dict[str, torch.Tensor] | None = None) -> Path:
    """Write `model`, `optimizer`, the JSON-able `state` (step, sampler, …) and this rank's `rng`
    tensors to `path` atomically. A collective: every rank calls it."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    agree(lambda: _prepare(partial))
    entries, shapes = state_entries(model, optimizer, flat=FORMAT == 1)
    meta = {"format": FORMAT, "world_size": world(), "shapes": {n: list(s) for n, s in shapes.items()},
            **_state_dict_names(model), "param_groups": _hyperparameters(optimizer), "state": state or {}}
    entries["meta/json"] = json_tensor(meta)
    entries.update({f"rng/{rank()}/{k}": v for k, v in (rng or {}).items()})
    dcp = _io().dcp
    writer = _io().Writer(partial)
    try:
        # a tensor several ranks hold is written by the lowest of them: buffers may differ
        # between replicas (BatchNorm statistics under zero3), and rank 0's are the ones
        # full_state_dict() and export give
        with _io().quiet_dcp():
            dcp.save(entries, storage_writer=writer, planner=dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    except dcp.CheckpointException as e:  # a BaseException: turn it into an ordinary error
        raise CheckpointError(f"saving {path} failed: {describe_failure(e)}; it was left as "
                              f"{partial.name}, and every checkpoint saved before is intact") from e
    files = _hash_written(path, partial, writer.fs.written)
    agree(lambda: _commit(path, partial, meta, files))
    return path


def _io():
    """checkpoint_dcp (DCP's reader and writer), imported when a checkpoint is first read or
    written: importing DCP takes a second, which every process paid at `import paratrain`."""
    from paratrain.checkpoint import dcp_io as checkpoint_dcp

    return checkpoint_dcp


def _state_dict_names(model: nn.Module) -> dict:
    """What the plain model's state dict holds beyond the stored parameters, from every rank (a
    pipeline stage knows its own): each tied parameter's other names, and the buffers it saves
    (not the non-persistent ones). `paratrain ckpt export` writes these names."""
    layout = layout_of(model)
    everyone = all_gather((layout.aliases, sorted(layout.saved_buffers())))
    return {"aliases": {a: n for aliases, _ in everyone for a, n in aliases.items()},
            "buffers": sorted({b for _, buffers in everyone for b in buffers})}


def _prepare(partial: Path) -> None:
    """Rank 0, before a save: clear what a crashed save left, and respect another job's lock."""
    shutil.rmtree(partial, ignore_errors=True)
    check_not_locked(partial.parent)


def _hash_written(path: Path, partial: Path, names: set[str]) -> dict[str, dict]:
    """Every rank's digests of the files it wrote, on every rank (see [Note: the marker])."""
    try:
        mine: tuple[dict, str | None] = ({n: digest(partial / n) for n in sorted(names)}, None)
    except OSError as e:  # reported by every rank, not left to a rank that raised alone
        mine = ({}, f"{os_cause(e)} reading back the files rank {rank()} wrote")
    gathered = all_gather(mine)
    failed = [error for _, error in gathered if error]
    if failed:
        raise CheckpointError(f"saving {path} failed: {failed[0]}; it was left as {partial.name}, "
                              "and every checkpoint saved before is intact")
    return {name: d for files, _ in gathered for name, d in files.items()}


def _commit(path: Path, partial: Path, meta: dict, files: dict) -> None:
    """Rank 0, once every rank's files are written and hashed: the marker, then the rename."""
    marker = {k: v for k, v in meta.items() if k not in ("shapes", "aliases", "buffers")}
    marker.update(sequence=next_sequence(path.parent), saved_at=time.time(), files=files)
    try:
        write_marker(partial, marker)
        _replace(partial, path)
    except OSError as e:
        raise CheckpointError(f"saving {path} failed: {os_cause(e)} writing {MARKER} or renaming "
                              f"{partial.name}; every checkpoint saved before is intact") from e


def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         hyperparameters: bool = True) -> dict:
    """Load `path` into `model` and `optimizer` (in place, whatever strategy and world size wrote
    it), after checking its files against their checksums; `hyperparameters`: also the optimizer's
    (learning rates, …). Returns {"state": …, "rng": this rank's rng tensors or {}}. A collective.
    Raises DamagedCheckpoint when a file is missing or changed."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"there is no checkpoint at {path}: nothing exists there; pass the path save() "
                          "returned, or session.resume(root) to load the newest one if there is one")
    if not (path / MARKER).is_file():
        raise ConfigError(f"{path} is not a complete paratrain checkpoint (no {MARKER}): it may be a "
                          "save that was interrupted; use paratrain.checkpoint.latest(root)")
    verify(path)
    io = _io()
    reader = io.SafeReader(path)
    metadata = io.read_or_damaged(reader.read_metadata, path)
    meta = _read_meta(path, metadata)
    optim_keys = _optimizer_keys(metadata) if optimizer is not None else None
    entries, shapes = state_entries(model, optimizer, optim_keys, flat=meta["format"] == 1)
    _check_same_model(meta, shapes, path)
    _check_same_entries(entries, metadata, path)
    rng = {k.split("/", 2)[2]: torch.empty(metadata.state_dict_metadata[k].size, dtype=torch.uint8)
           for k in metadata.state_dict_metadata if k.startswith(f"rng/{rank()}/")}
    entries.update({f"rng/{rank()}/{k}": v for k, v in rng.items()})
    io.read_entries(entries, reader, path)
    loaded(model)
    if hyperparameters:
        _apply_hyperparameters(optimizer, meta["param_groups"])
    return {"state": meta["state"], "rng": rng if meta["world_size"] == world() else {}}


def verify(path: str | os.PathLike) -> None:
    """Check every file of checkpoint `path` against the sizes and sha256 its save recorded, each
    rank reading a share of the files. A collective: every rank raises the same DamagedCheckpoint."""
    path = Path(path)
    files = agree(lambda: listed_files(path))  # {}: saved before checksums
    names = sorted(files)[rank()::world()]
    found = all_gather([p for p in (file_problem(path, n, files[n]) for n in names) if p])
    found = sorted(p for mine in found for p in mine)
    if found:
        more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
        raise DamagedCheckpoint(f"checkpoint {path} is damaged: {'; '.join(found[:3])}{more}{ADVICE}")


def describe(path: str | os.PathLike) -> tuple[dict, list[tuple[str, torch.dtype, tuple[int, ...]]]]:
    """What checkpoint `path` holds, read offline (no process group, no model): its metadata
    (world size, the whole model's shapes, the session's state) and every stored tensor as
    (key, dtype, shape), a parameter's entries under its own shape rather than flattened. Checks
    the files' checksums first: a damaged checkpoint raises DamagedCheckpoint."""
    path = Path(path)
    if not (path / MARKER).is_file():
        raise ConfigError(f"{path} is not a complete paratrain checkpoint (" + (f"no {MARKER}" if path.exists()
                          else "nothing exists there") + "): pass a checkpoint directory (root/step-…), not its root")
    verify(path)
    metadata = _io().read_or_damaged(_io().SafeReader(path).read_metadata, path)
    meta = _read_meta(path, metadata)
    tensors = []
    for key, item in sorted(metadata.state_dict_metadata.items()):
        if hasattr(item, "size") and not key.startswith(("meta/", "rng/")):
            # model/<name> and optim/<name>/<state key> are stored at the parameter's shape (in
            # format 1 flattened; a 0-d parameter as one element): show the parameter's shape
            # where the sizes agree (not for scalar state such as Adam's step); buffers as they are
            own = meta["shapes"].get(key.split("/")[1])
            flat = own is not None and torch.Size(own).numel() == torch.Size(item.size).numel()
            tensors.append((key, item.properties.dtype, tuple(own if flat else item.size)))
    return meta, tensors


def _read_meta(path: Path, metadata) -> dict:
    if "meta/json" not in metadata.state_dict_metadata:
        raise ConfigError(f"{path} was not written by paratrain.checkpoint.save")
    blob = torch.empty(metadata.state_dict_metadata["meta/json"].size, dtype=torch.uint8)
    _io().read_entries({"meta/json": blob}, _io().SafeReader(path), path)
    meta = json_of(blob)
    if meta.get("format") not in READS:
        raise ConfigError(f"{path} has checkpoint format {meta.get('format')}; this paratrain reads formats "
                          f"{', '.join(map(str, READS))}: load it with the paratrain that wrote it")
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


def _check_same_entries(entries: dict, metadata, path: Path) -> None:
    """Every tensor the model and optimizer ask for is in the checkpoint, at its size: a buffer
    or optimizer state the writer did not have is another model (or optimizer), not damage."""
    stored = metadata.state_dict_metadata
    missing = sorted(k for k in entries if k not in stored)
    with _io().quiet_dcp():
        other = sorted(k for k in entries if k in stored and tuple(entries[k].size()) != tuple(stored[k].size))
    if missing or other:
        found = ([f"it has no {missing[:5]}"] if missing else []) + ([f"other sizes for {other[:5]}"] if other else [])
        raise ConfigError(f"{path} holds another model or optimizer state: {', and '.join(found)}; load it into "
                          "the model and optimizer that wrote it, or load the weights alone (paratrain.load_weights)")


def _optimizer_keys(metadata) -> dict[str, torch.dtype]:
    """The optimizer state entries stored ("optim/<name>/<key>" → dtype)."""
    return {key: item.properties.dtype for key, item in metadata.state_dict_metadata.items()
            if key.startswith("optim/")}


def hyperparameter(value: Any) -> Any:
    """A param group's value as JSON keeps it: numbers, strings, and tuples of numbers (Adam's
    betas) as lists; None for what a checkpoint does not carry (tensors, callables)."""
    if isinstance(value, (int, float, bool, str)):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, (int, float, bool)) for v in value):
        return list(value)
    return None


def _hyperparameters(optimizer) -> list[dict]:
    if optimizer is None:
        return []
    return [{k: kept for k, v in g.items() if k != "params" and (kept := hyperparameter(v)) is not None}
            for g in optimizer.param_groups]


def _apply_hyperparameters(optimizer, groups: list[dict]) -> None:
    if optimizer is None or not groups:
        return
    if len(groups) != len(optimizer.param_groups):
        raise ConfigError(f"the checkpoint's optimizer has {len(groups)} param groups, this one "
                          f"{len(optimizer.param_groups)}; build the optimizer as the run that saved it")
    for mine, saved in zip(optimizer.param_groups, groups):
        # e.g. the learning rate a scheduler had reached; betas back as the tuple they were
        mine.update({k: tuple(v) if isinstance(v, list) and isinstance(mine.get(k), tuple) else v
                     for k, v in saved.items()})


def _replace(partial: Path, path: Path) -> None:
    """Make `partial` the checkpoint at `path`: renames are atomic on one file system."""
    old = path.with_name(path.name + ".old")
    if path.exists():
        os.replace(path, old)
    os.replace(partial, path)
    shutil.rmtree(old, ignore_errors=True)
