"""What a Session adds to a checkpoint, so that a loaded run goes on exactly where it stopped.

checkpoint/save_load.py stores model and optimizer in the canonical layout; a session also needs its place
in the data and its randomness:

    epoch, micro_step      where the loop is (micro-batches seen; a step every `accumulate`)
    sampler                the position inside the epoch: the batches whose optimizer step
                           completed (data.ShardedLoader), not those workers fetched ahead
    scaler                 fp16's loss scale and its growth counter
    objects                the state_dict() of each object passed to `session.register(name=obj)`
                           (LR schedulers, counters of your own), JSON, under its name
    rng                    every rank's torch/CUDA/Python/NumPy states and the loader's generator
                           (as the pass in progress began: ShardedLoader.generator_state)

All but `rng` are JSON in the checkpoint's metadata, the same on every rank. RNG states are
restored only under the world size that saved them (another world draws other streams anyway).

[Note: a checkpoint is taken at an optimizer step]
Gradients accumulated between optimizer steps are not saved (under no_sync each rank holds its
own, unreduced). So a checkpoint taken in the middle of an accumulation window records the loop
as it was at the window's start — epoch, micro-step, data position and RNG states, snapshotted at
every optimizer step when accumulate > 1 — and a resumed run trains that window again from its
first micro-batch, exactly as the uninterrupted run did.

The Session's checkpoint methods (session.py) call the functions here.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from paratrain import checkpoint
from paratrain.checkpoint.layout import layout_of
from paratrain.checkpoint.random_state import rng_state, rng_tensors, set_rng_state
from paratrain.data.loader import ShardedLoader
from paratrain.distributed.comm import group_device
from paratrain.errors import CheckpointError, ConfigError, UsageError
from paratrain.parallel.base import ParallelModule

if TYPE_CHECKING:
    from paratrain.session.session import Session


def check_registrable(name: str, obj: Any) -> None:
    """Refuse an object whose state a checkpoint could not save or load back."""
    if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
        raise UsageError(f"session.register({name}=...) takes objects with state_dict() and "
                         f"load_state_dict(), such as an LR scheduler; got {type(obj).__name__}")


def position(session: "Session") -> dict:
    """Where the loop stands now: epoch, micro-step, data position, this rank's RNG states."""
    rng = rng_state()
    loader = session.loader if isinstance(session.loader, ShardedLoader) else None
    if loader is not None:
        rng["loader"] = loader.generator_state()
    return dict(epoch=session.epoch, micro_step=session.micro_step,
                sampler=loader.position() if loader is not None else None, rng=rng)


def refuse_non_finite(model: ParallelModule, path: Any) -> None:
    """Never write NaN or infinite parameters over a good checkpoint: every rank checks what it
    holds, and one small all-reduce makes every rank refuse together (a collective, as save is)."""
    layout = layout_of(model)
    held = {**layout.params, **{f"flat shard {i}": t for i, t in enumerate(layout.flat)}}
    bad = [name for name, t in held.items() if not bool(torch.isfinite(t.detach()).all())]
    flag = torch.tensor([float(bool(bad))])
    if dist.is_initialized():
        flag = flag.to(group_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        raise CheckpointError(f"not saving {path}: the parameters hold NaN or infinite values "
                              f"({', '.join(bad[:5]) or 'on another rank'}); the checkpoints saved "
                              "before are intact, and the newest of them is the newest good state")


def check_same_optimizer(session: "Session", path: Path, marker: dict, keep_current: bool) -> None:
    """Refuse optimizer state of another class (SGD given Adam's exp_avg and eps), and name the
    hyperparameters the checkpoint's values replace. `marker`: the checkpoint's paratrain.json."""
    saved = marker.get("state", {}).get("optimizer")
    if saved and session.given.optimizer and saved != session.given.optimizer:
        raise ConfigError(f"checkpoint {path} holds the state of a {saved}, but this session's optimizer "
                          f"is a {session.given.optimizer}: its state and settings would load into the "
                          "wrong optimizer. Build the optimizer the saving run used, or load the model "
                          "alone: session.load(path, weights_only=True) / session.resume(root, weights_only=True)")
    changed = sorted({f"{k} {mine[k]!r} → {theirs[k]!r}" for mine, theirs in
                      zip(session.optimizer.param_groups, marker.get("param_groups", []))
                      for k in theirs if k in mine and checkpoint.hyperparameter(mine[k]) != theirs[k]
                      and not _scheduled(k, mine, theirs)})
    if changed and not keep_current and session.is_main:
        warnings.warn(f"resuming from {path} replaces this optimizer's {', '.join(changed)} with the "
                      "checkpoint's; pass hyperparameters='current' to keep yours", stacklevel=4)


def check_whole_window(session: "Session", path: Path, marker: dict) -> None:
    """Refuse to resume at a micro-batch that this session's `accumulate` does not divide: its
    first optimizer step would take fewer micro-batches, each scaled by 1/accumulate."""
    micro_step = marker.get("state", {}).get("micro_step", 0)
    if micro_step % session.accumulate:
        divisors = [k for k in range(1, micro_step + 1) if micro_step % k == 0][:8]
        raise ConfigError(f"checkpoint {path} was saved after micro-batch {micro_step} (accumulate="
                          f"{marker['state'].get('accumulate')}); with accumulate={session.accumulate} the first "
                          f"optimizer step would take {session.accumulate - micro_step % session.accumulate} "
                          f"micro-batch(es), not {session.accumulate}, each scaled by 1/{session.accumulate}: "
                          f"resume with an accumulate that divides {micro_step} (such as "
                          f"{', '.join(map(str, divisors))}), or load the weights alone (weights_only=True)")


def _scheduled(key: str, mine: dict, theirs: dict) -> bool:
    """A learning rate a scheduler moves (both groups record its start): compare the starts."""
    return key == "lr" and "initial_lr" in mine and "initial_lr" in theirs


def note_micro_step(session: "Session", optimizer_step: bool) -> None:
    """A micro-batch's step() finished: the loader counts it as trained (and stepped, at an
    optimizer step), and with accumulate > 1 an optimizer step snapshots the loop's position."""
    if isinstance(session.loader, ShardedLoader):
        session.loader.count_trained(optimizer_stepped=optimizer_step)
    if optimizer_step and session.accumulate > 1:
        session.step_boundary = position(session)


def session_state(session: "Session") -> tuple[dict, dict]:
    """(JSON state, this rank's RNG tensors) of `session` for checkpoint.save, as at the last
    optimizer step (see [Note: a checkpoint is taken at an optimizer step])."""
    mid_window = session.micro_step % session.accumulate != 0
    where = session.step_boundary if mid_window and session.step_boundary is not None else position(session)
    objects = dict(session.unclaimed)  # carried on until an object claims them (register)
    for name, obj in session.registered.items():
        objects[name] = obj.state_dict()
        try:
            json.dumps(objects[name])
        except (TypeError, ValueError) as e:
            raise ConfigError(f"the state_dict() of registered object {name!r} is not JSON ({e}); "
                              "checkpoints store JSON, never pickles: register only objects whose "
                              "state is numbers, strings, lists and dicts") from None
    state = {"epoch": where["epoch"], "micro_step": where["micro_step"], "accumulate": session.accumulate,
             "strategy": session.strategy.name,
             "optimizer": session.given.optimizer,
             "sampler": where["sampler"], "scaler": session.scaler.state_dict() if session.scaler is not None else None,
             "objects": objects}
    return state, rng_tensors(where["rng"])


def _check_same_dataset(session: "Session", sampler: dict | None, path: Any) -> None:
    """Refuse, before anything is restored, a checkpoint whose data position counts another
    dataset's samples (the raw sampler's own error would advise its own calls, not a Session's)."""
    if not sampler or not isinstance(session.loader, ShardedLoader):
        return
    saved, here = sampler.get("dataset_len"), session.loader.dataset_len()
    if saved is not None and here is not None and int(saved) != here:
        raise ConfigError(f"checkpoint {path} was saved while training on a dataset of {saved} samples, but the "
                          f"loader given to setup() reads {here}: resume with the same dataset, or take the "
                          "model alone with session.resume(root, weights_only=True) and train this dataset "
                          "from its first epoch")


def restore_session(session: "Session", loaded: dict, path: Any) -> None:
    """Put the state checkpoint.load returned back into `session` and its registered objects."""
    state = loaded["state"]
    missing = sorted(session.registered.keys() - state.get("objects", {}).keys())
    if missing:
        raise ConfigError(f"checkpoint {path} holds no state for registered object(s) {missing}: it was "
                          "saved before they were registered; load it first, then register them")
    _check_same_dataset(session, state.get("sampler"), path)
    session.epoch, session.micro_step = state.get("epoch", 0), state.get("micro_step", 0)
    if session.scaler is not None and state.get("scaler"):
        session.scaler.load_state_dict(state["scaler"])
    if state.get("sampler") and isinstance(session.loader, ShardedLoader):
        session.loader.load_position(state["sampler"])
    for name, obj in session.registered.items():
        obj.load_state_dict(state["objects"][name])
    # what no object has claimed yet: register() hands it over (a scheduler made after resume)
    session.unclaimed = {k: v for k, v in state.get("objects", {}).items() if k not in session.registered}
    if loaded["rng"]:
        set_rng_state(loaded["rng"])
        if "loader" in loaded["rng"] and session.loader is not None:
            session.loader.generator.set_state(loaded["rng"]["loader"])
    # the loaded state is at an optimizer step: a save before the next one records it
    session.step_boundary = position(session) if session.accumulate > 1 else None
