"""`paratrain verify`: a user's own job on N processes, checked step by step against one process.

    paratrain verify -n 2 [--steps 3] [--strategy zero3] [--rtol R] [--atol A] script.py [args]

The script runs unchanged, twice, through `paratrain run`: once as one process under strategy
"single" (the reference), once as N processes under `--strategy` or the script's own. The
`PARATRAIN_VERIFY*` variables tell each rank's Session to record, at every optimizer step:

    loss     the mean of the step's micro-batch losses (over the ranks: the mean of theirs); with
             token weights (`weight=`), the mean weighted by them, and their sum (`weight`), so
             the ranks' losses combine into the mean over every token, as one process's is
    grads    every gradient this rank holds, as the optimizer is about to read it: after the
             reduction over the ranks, token normalisation, fp16 unscaling and clipping
    params   every parameter this rank holds, after the step

and to stop the script (exit 0) once `--steps` optimizer steps are recorded. Both runs see the
same global batches: the loader's batch_size is the global batch (Session.setup), so one process
reads in one step what N read together; accumulation stays as the script sets it.

What a rank holds is read through the layout checkpoints use (checkpoint/layout.py): whole tensors, or
the pieces of each flattened parameter a shard holds (ZeRO) — so every strategy is checked the
same way, and a replicated parameter is checked on every rank that holds it (a bug on one rank
shows there). Parameters of up to FULL_LIMIT elements are recorded whole; larger ones as the
sum of squares and PROJECTIONS fixed random projections of each piece (generated per chunk of
CHUNK elements from the parameter's name, so any piece's share can be computed alone): a step's
records of a 300M-parameter model would otherwise be 2.4 GB per run. Pieces of one parameter
held by different ranks add up (both figures are sums), so a sharded parameter is compared whole.

The report names the first optimizer step, and in it the first parameter in backward order (the
reverse of the model's order, where gradients are produced first), whose gradient — then whose
value after the step — differs from the reference by more than atol + rtol × the reference's
norm, with the relative error and the rank(s) holding it. Default tolerances follow the
candidate's precision (TOLERANCES). Randomness: every nn.Dropout is turned off (p = 0) in both
runs, since one process cannot draw the masks N processes draw; randomness elsewhere (F.dropout
called with a fixed p, augmentation drawn in loader workers) must be off or seeded per sample for
the runs to agree.

`PARATRAIN_VERIFY_INJECT=kind:param:step[:rank]` is a test-only hook that breaks the candidate on
purpose, just before the step is recorded: `unaveraged` multiplies `param`'s gradient by the
world size on `rank` (summed, not averaged), `scaled-twice` divides it by the world size again on
every rank, `dropped-bucket` zeroes the whole DDP gradient bucket holding it on `rank`.
"""

from __future__ import annotations

import functools
import os
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.checkpoint.layout import layout_of
from paratrain.errors import ConfigError

DIR, STEPS, STRATEGY, INJECT = ("PARATRAIN_VERIFY", "PARATRAIN_VERIFY_STEPS", "PARATRAIN_VERIFY_STRATEGY",
                                "PARATRAIN_VERIFY_INJECT")
FULL_LIMIT = 1 << 20  # elements: recorded whole up to this size
CHUNK, PROJECTIONS = 1 << 16, 4
TOLERANCES = {"32": (1e-4, 1e-7), "bf16": (3e-2, 1e-5), "fp16": (3e-2, 1e-5)}  # (rtol, atol)


class StepRecorder:
    """What a Session records under `paratrain verify` (module docstring); None outside it."""

    def __init__(self, directory: str, steps: int, rank: int, inject: str | None):
        self.directory, self.steps, self.rank = Path(directory), steps, rank
        self.inject = inject.split(":") if inject else None
        self.records: list[dict] = []
        self._losses: list[tuple[float, float | None]] = []  # (loss, its token weight or None)
        self._grads: dict = {}

    @classmethod
    def from_env(cls, rank: int, env=os.environ) -> "StepRecorder | None":
        if not env.get(DIR):
            return None
        return cls(env[DIR], int(env.get(STEPS, "3")), rank, env.get(INJECT))

    @staticmethod
    def strategy(given: Any, env=os.environ) -> Any:
        """The strategy this run uses: the one `paratrain verify` names, else the script's."""
        return (env.get(STRATEGY) if env.get(DIR) else None) or given

    # a step hook (session/hooks.py): the first of a session's
    @staticmethod
    def on_setup(model: nn.Module) -> None:
        """Dropout off: one process cannot draw the masks N processes draw."""
        for module in model.modules():
            if isinstance(module, nn.modules.dropout._DropoutNd):
                module.p = 0.0

    def on_loss(self, loss: torch.Tensor, weight: float | torch.Tensor | None = None) -> None:
        self._losses.append((float(loss.float().mean()), None if weight is None else float(weight)))

    @torch.no_grad()
    def before_step(self, model: nn.Module) -> None:
        model.local_grads()  # ZeRO-1/2 attach each shard's slice of the reduced gradient here
        if self.inject and int(self.inject[2]) == len(self.records) + 1:
            _inject(model, self.inject)
        self._grads = _pieces(model, grads=True)

    def after_step(self, session: Any, result: Any) -> None:
        """Record the step; once the last is written, end the run: the steps asked for are here."""
        model = session.model
        with torch.no_grad():
            self.records.append(dict(**_step_loss(self._losses), grads=self._grads, params=_pieces(model, grads=False)))
        self._losses, self._grads = [], {}
        if len(self.records) < self.steps:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        order = list(reversed(layout_of(model).shapes))  # backward order
        torch.save(dict(rank=self.rank, precision=session.precision, order=order, steps=self.records),
                   self.directory / f"rank{self.rank}.pt")
        session.close()
        raise SystemExit(0)


def _step_loss(losses: list[tuple[float, float | None]]) -> dict:
    """The step's loss: the plain mean of its micro-batches', or with token weights the mean
    weighted by them and their sum (`weight`; train_step refuses a step that mixes the two)."""
    weights = [w for _, w in losses if w is not None]
    if not weights or len(weights) < len(losses):
        return dict(loss=sum(value for value, _ in losses) / max(len(losses), 1), weight=None)
    total = sum(weights)
    return dict(loss=sum(value * w for value, w in losses) / total if total else 0.0, weight=total)


def combined_loss(records: list[dict]) -> float:
    """One optimizer step's loss over ranks (or one rank's record): the mean over every token
    when each weighed its losses, else the mean of the ranks' losses."""
    if all(r.get("weight") is not None for r in records):
        total = sum(r["weight"] for r in records)
        return sum(r["loss"] * r["weight"] for r in records) / total if total else 0.0
    return sum(r["loss"] for r in records) / len(records)


def _holdings(model: nn.Module, grads: bool) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """name → [(offset in the flattened parameter, this rank's tensor there)]: its gradient or
    its value, whole or the pieces its shards hold."""
    layout = layout_of(model)
    out: dict[str, list] = {}
    # a gradient an optimizer steps in flat shards is read there: ZeRO-1 keeps the whole reduced
    # bucket too, but clipping scales only this rank's slice of it, the slice the step reads
    stepped_flat = {n for flat in layout.flat.values() for n, _, _ in flat.slots} if grads else set()
    for name, p in layout.params.items():
        t = p.grad if grads else p
        if t is not None and name not in stepped_flat:
            out.setdefault(name, []).extend(_runs(layout, name, p.shape, t.detach().reshape(-1), 0))
    if layout.params_in_flat or grads:
        for shard, flat in layout.flat.items():
            t = shard.grad if grads else shard
            if t is None:
                continue
            shapes = {name: shape for name, _, shape in flat.slots}
            for name, offset, local, length in flat.pieces(flat.rank):
                values = t.detach().reshape(-1)[local:local + length]
                out.setdefault(name, []).extend(_runs(layout, name, shapes[name], values, offset))
    return out


def _runs(layout, name: str, held: torch.Size, values: torch.Tensor, start: int) -> list[tuple[int, torch.Tensor]]:
    """(offset in the whole flattened parameter, values there) for `values`, elements from
    `start` of what this rank holds of `name` (of shape `held`): one run, or under tensor
    parallelism a run per row of its slice (views: an injected bug writes through them)."""
    cut = layout.slices.get(name)
    if cut is None:
        return [(start, values)]
    return [(whole, values[at - start:at - start + n]) for whole, at, n in cut.runs(held, start, values.numel())]


def _pieces(model: nn.Module, grads: bool) -> dict[str, list[tuple[int, int, Any]]]:
    """name → [(offset, length, the values on CPU, or their summary)] for this rank."""
    shapes = layout_of(model).shapes
    out = {}
    for name, held in _holdings(model, grads).items():
        if shapes[name].numel() <= FULL_LIMIT:
            out[name] = [(offset, t.numel(), t.float().cpu().clone()) for offset, t in held]
        else:  # one summary of everything this rank holds of it (its runs add up)
            out[name] = [(held[0][0], sum(t.numel() for _, t in held), sum(summary(name, o, t) for o, t in held))]
    return out


def summary(name: str, offset: int, values: torch.Tensor) -> torch.Tensor:
    """(Σ x², Σ x·r_1, …, Σ x·r_k) over elements [offset, offset + len) of the flattened
    parameter `name`, r_j fixed random vectors drawn chunk by chunk from the name."""
    values = values.double().cpu()
    out = torch.zeros(1 + PROJECTIONS, dtype=torch.float64)
    out[0] = values.square().sum()
    start = offset
    while start < offset + values.numel():
        chunk = start // CHUNK
        stop = min((chunk + 1) * CHUNK, offset + values.numel())
        r = _projections(name, chunk)[start - chunk * CHUNK:stop - chunk * CHUNK]
        out[1:] += values[start - offset:stop - offset] @ r
        start = stop
    return out


@functools.lru_cache(maxsize=2)
def _projections(name: str, chunk: int) -> torch.Tensor:
    """The random vectors of one chunk of `name`, kept while the next pieces read it (a
    tensor-parallel slice is a run per row, many to a chunk)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 1_000_003 + chunk)
    return torch.randn(CHUNK, PROJECTIONS, generator=g, dtype=torch.float64)


def _inject(model: nn.Module, how: list[str]) -> None:
    kind, name = how[0], how[1]
    rank = int(how[3]) if len(how) > 3 else None
    me, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if name not in layout_of(model).shapes:
        raise ConfigError(f"{INJECT} names {name!r}, which is not a parameter of the model")
    if rank is not None and rank != me:
        return
    held = _holdings(model, grads=True).get(name, [])
    if kind == "unaveraged":
        for _, t in held:
            t.mul_(world)
    elif kind == "scaled-twice":
        for _, t in held:
            t.div_(world)
    elif kind == "dropped-bucket":
        buckets = getattr(model, "_buckets", None)
        target = dict(model.module.named_parameters()).get(name)
        for bucket in (buckets.buckets if buckets is not None else []):
            if any(p is target for p in bucket.params):
                bucket.buffer.zero_()
    else:
        raise ConfigError(f"unknown {INJECT} kind {kind!r}: unaveraged, scaled-twice or dropped-bucket")
