"""`paratrain verify`: a user's own job on N processes, checked step by step against one process.

    paratrain verify -n 2 [--steps 3] [--strategy zero3] [--rtol R] [--atol A] script.py [args]

The script runs unchanged, twice, through `paratrain run`: once as one process under strategy
"single" (the reference), once as N processes under `--strategy` or the script's own. The
`PARATRAIN_VERIFY*` variables tell each rank's Session to record, at every optimizer step:

    loss     the mean of the step's micro-batch losses (over the ranks: the mean of theirs)
    grads    every gradient this rank holds, as the optimizer is about to read it: after the
             reduction over the ranks, token normalisation, fp16 unscaling and clipping
    params   every parameter this rank holds, after the step

and to stop the script (exit 0) once `--steps` optimizer steps are recorded. Both runs see the
same global batches: the loader's batch_size is the global batch (Session.setup), so one process
reads in one step what N read together; accumulation stays as the script sets it.

What a rank holds is read through the layout checkpoints use (state_layout.py): whole tensors, or
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

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain.errors import ConfigError
from paratrain.state_layout import layout_of

DIR, STEPS, STRATEGY, INJECT = ("PARATRAIN_VERIFY", "PARATRAIN_VERIFY_STEPS", "PARATRAIN_VERIFY_STRATEGY",
                                "PARATRAIN_VERIFY_INJECT")
FULL_LIMIT = 1 << 20  # elements: recorded whole up to this size
CHUNK, PROJECTIONS = 1 << 16, 4
TOLERANCES = {"32": (1e-4, 1e-7), "bf16": (3e-2, 1e-5), "fp16": (3e-2, 1e-5)}  # (rtol, atol)

# -- in every rank: recording --------------------------------------------------------------------


class StepRecorder:
    """What a Session records under `paratrain verify` (module docstring); None outside it."""

    def __init__(self, directory: str, steps: int, rank: int, inject: str | None):
        self.directory, self.steps, self.rank = Path(directory), steps, rank
        self.inject = inject.split(":") if inject else None
        self.records: list[dict] = []
        self._losses: list[float] = []
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

    @staticmethod
    def prepare(model: nn.Module) -> None:
        """Dropout off: one process cannot draw the masks N processes draw."""
        for module in model.modules():
            if isinstance(module, nn.modules.dropout._DropoutNd):
                module.p = 0.0

    def loss(self, loss: torch.Tensor) -> None:
        self._losses.append(float(loss.float().mean()))

    @torch.no_grad()
    def before_step(self, model: nn.Module) -> None:
        model.local_grads()  # ZeRO-1/2 attach each shard's slice of the reduced gradient here
        if self.inject and int(self.inject[2]) == len(self.records) + 1:
            _inject(model, self.inject)
        self._grads = _pieces(model, grads=True)

    @torch.no_grad()
    def after_step(self, model: nn.Module, precision: str) -> bool:
        """Record the step; True once the last one is written (the run should stop)."""
        self.records.append(dict(loss=sum(self._losses) / max(len(self._losses), 1), grads=self._grads,
                                 params=_pieces(model, grads=False)))
        self._losses, self._grads = [], {}
        if len(self.records) < self.steps:
            return False
        self.directory.mkdir(parents=True, exist_ok=True)
        order = list(reversed(layout_of(model).shapes))  # backward order
        torch.save(dict(rank=self.rank, precision=precision, order=order, steps=self.records),
                   self.directory / f"rank{self.rank}.pt")
        return True


def _holdings(model: nn.Module, grads: bool) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """name → [(offset in the flattened parameter, this rank's tensor there)]: its gradient or
    its value, whole or the pieces its shards hold."""
    layout = layout_of(model)
    out: dict[str, list] = {}
    for name, p in layout.params.items():
        t = p.grad if grads else p
        if t is not None:
            out.setdefault(name, []).append((0, t.detach().reshape(-1)))
    if layout.params_in_flat or grads:
        for shard, flat in layout.flat.items():
            t = shard.grad if grads else shard
            if t is None:
                continue
            for name, offset, local, length in flat.pieces(flat.rank):
                out.setdefault(name, []).append((offset, t.detach().reshape(-1)[local:local + length]))
    return out


def _pieces(model: nn.Module, grads: bool) -> dict[str, list[tuple[int, int, Any]]]:
    """name → [(offset, length, the values on CPU, or their summary)] for this rank."""
    shapes = layout_of(model).shapes
    out = {}
    for name, held in _holdings(model, grads).items():
        whole = shapes[name].numel()
        out[name] = [(offset, t.numel(), t.float().cpu().clone() if whole <= FULL_LIMIT else summary(name, offset, t))
                     for offset, t in held]
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
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 1_000_003 + chunk)
        r = torch.randn(CHUNK, PROJECTIONS, generator=g, dtype=torch.float64)[start - chunk * CHUNK:stop - chunk * CHUNK]
        out[1:] += values[start - offset:stop - offset] @ r
        start = stop
    return out


def _inject(model: nn.Module, how: list[str]) -> None:
    kind, name = how[0], how[1]
    rank = int(how[3]) if len(how) > 3 else None
    import torch.distributed as dist
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


# -- in `paratrain verify`: running and comparing --------------------------------------------------


@dataclass
class Difference:
    step: int
    what: str  # "loss", "gradient", "value"
    name: str
    error: float  # ‖candidate − reference‖ / ‖reference‖
    ranks: list[int]
    agreeing: list[int] = field(default_factory=list)


def read_run(directory: Path) -> dict[int, dict]:
    runs = {int(p.stem[4:]): torch.load(p, weights_only=False) for p in sorted(directory.glob("rank*.pt"))}
    if not runs:
        raise ConfigError(f"the run left no records in {directory}: did it reach an optimizer step through "
                          "paratrain.Session (train_step or step())?")
    return runs


def compare(reference: dict[int, dict], candidate: dict[int, dict], rtol: float, atol: float
            ) -> tuple[Difference | None, dict]:
    """The first difference beyond tolerance, and the largest relative error of each kind."""
    ref = reference[min(reference)]
    order = ref["order"]
    steps = min(len(ref["steps"]), *(len(c["steps"]) for c in candidate.values()))
    worst = {"loss": 0.0, "gradient": 0.0, "value": 0.0}
    for step in range(steps):
        mine = sum(c["steps"][step]["loss"] for c in candidate.values()) / len(candidate)
        theirs = ref["steps"][step]["loss"]
        error = abs(mine - theirs) / max(abs(theirs), 1e-30)
        worst["loss"] = max(worst["loss"], error)
        if abs(mine - theirs) > atol + rtol * abs(theirs):
            return Difference(step + 1, "loss", "loss", error, sorted(candidate)), worst
        for what, key in (("gradient", "grads"), ("value", "params")):
            for name in order:
                found = _check(name, ref["steps"][step][key].get(name), {r: c["steps"][step][key].get(name)
                                                                          for r, c in candidate.items()}, rtol, atol)
                if found is None:
                    continue
                error, bad, good = found
                worst[what] = max(worst[what], error)
                if bad:
                    return Difference(step + 1, what, name, error, bad, good), worst
    return None, worst


def _check(name, reference, candidate, rtol, atol):
    """(largest relative error, ranks beyond tolerance, ranks within) for one parameter."""
    if reference is None:
        return None
    (_, length, ref), = reference
    held = {r: pieces for r, pieces in candidate.items() if pieces}
    if not held:
        return None
    if torch.is_tensor(ref) and ref.dim() == 1 and ref.numel() == length:  # whole values
        return _check_values(ref, held, rtol, atol)
    return _check_summaries(ref, held, length, rtol, atol)


def _check_values(ref, held, rtol, atol):
    errors = {}
    for rank, pieces in held.items():
        diff = sum(float((v - ref[o:o + n]).double().square().sum()) for o, n, v in pieces)
        norm = sum(float(ref[o:o + n].double().square().sum()) for o, n, _ in pieces)
        errors[rank] = (math.sqrt(diff), math.sqrt(norm))
    return _verdict(errors, rtol, atol)


def _check_summaries(ref, held, length, rtol, atol):
    whole = {r: s for r, pieces in held.items() for _, n, s in pieces if n == length}
    if whole:  # replicated: every holder compared
        parts = whole
    else:  # sharded: the pieces of every rank add up to the parameter's
        parts = {min(held): sum(s for pieces in held.values() for _, _, s in pieces)}
    errors = {}
    for rank, s in parts.items():
        diff = float((s[1:] - ref[1:]).norm()) / math.sqrt(PROJECTIONS)
        errors[rank] = (diff, math.sqrt(float(ref[0])))
    verdict = _verdict(errors, rtol, atol)
    if not whole:  # name every rank that holds a piece
        error, bad, _ = verdict
        verdict = (error, sorted(held) if bad else [], [] if bad else sorted(held))
    return verdict


def _verdict(errors: dict[int, tuple[float, float]], rtol, atol):
    bad = sorted(r for r, (d, n) in errors.items() if d > atol + rtol * n)
    good = sorted(r for r in errors if r not in bad)
    worst = max(d / max(n, 1e-30) for d, n in errors.values())
    return worst, bad, good


def report(difference: Difference | None, worst: dict, *, ranks: int, strategy: str, steps: int,
           rtol: float, atol: float, params: int) -> str:
    head = f"paratrain verify: {ranks} processes ({strategy}) against 1 (single), {steps} optimizer step(s)"
    if difference is None:
        return (f"{head}: they agree.\n  losses, the gradients and the values after each step of all {params} "
                f"parameters are within rtol {rtol:g}, atol {atol:g}; largest relative errors: loss "
                f"{worst['loss']:.1e}, gradients {worst['gradient']:.1e}, values {worst['value']:.1e}")
    d = difference
    where = "the loss" if d.what == "loss" else f"the {d.what} of {d.name}" + \
        (" (its gradient agreed)" if d.what == "value" else "")
    ranks_line = f"on rank{'s' if len(d.ranks) > 1 else ''} {', '.join(map(str, d.ranks))}"
    if d.agreeing:
        ranks_line += f"; {'ranks' if len(d.agreeing) > 1 else 'rank'} {', '.join(map(str, d.agreeing))} " + \
            ("agree" if len(d.agreeing) > 1 else "agrees")
    return (f"{head}: they DIFFER.\n  first difference: optimizer step {d.step}, {where}\n"
            f"  relative error {d.error:.2e} (tolerance: rtol {rtol:g}, atol {atol:g}) {ranks_line}\n"
            "  (parameters are checked in backward order, gradients before values: the first one named "
            "is the earliest the error reached)")


def add_verify_parser(commands) -> None:
    verify = commands.add_parser(
        "verify", help="check a job on N processes against one process, step by step",
        description="Run the script as one process and as N, record every optimizer step's loss, "
        "gradients and parameters in both, and report the first that differ (exit 1), or exit 0.")
    verify.add_argument("-n", "--nproc-per-node", type=int, default=2, metavar="N",
                        help="processes of the checked run (default: 2)")
    verify.add_argument("--steps", type=int, default=3, help="optimizer steps to check (default: 3)")
    verify.add_argument("--strategy", help="the checked run's strategy (default: the script's own)")
    verify.add_argument("--rtol", type=float, help="relative tolerance (default by precision: 1e-4 for "
                        "fp32, 3e-2 for bf16/fp16)")
    verify.add_argument("--atol", type=float, help="absolute tolerance (default by precision)")
    verify.add_argument("--timeout", type=float, default=600, help="seconds each run may take (default: 600)")
    verify.add_argument("target", metavar="script.py", help="the training script, unchanged")
    rest = verify.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    rest.required = False


def verify(args: argparse.Namespace) -> int:
    if args.nproc_per_node < 1 or args.steps < 1:
        raise ConfigError("-n and --steps must be at least 1")
    work = Path(tempfile.mkdtemp(prefix="paratrain-verify-"))
    try:
        runs = {}
        for role, n, strategy in (("reference", 1, "single"), ("candidate", args.nproc_per_node, args.strategy)):
            env = {k: v for k, v in os.environ.items() if k != INJECT or role == "candidate"}
            env.update({DIR: str(work / role), STEPS: str(args.steps)})
            env.pop(STRATEGY, None)
            if strategy:
                env[STRATEGY] = strategy
            cmd = [sys.executable, "-m", "paratrain", "run", "-n", str(n), args.target, *args.args]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            if done.returncode != 0:
                sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
                raise ConfigError(f"the {role} run ({n} process(es)) failed with exit status {done.returncode}; "
                                  "its output is above")
            runs[role] = read_run(work / role)
        first = next(iter(runs["candidate"].values()))
        rtol, atol = TOLERANCES.get(first["precision"], TOLERANCES["32"])
        rtol, atol = args.rtol if args.rtol is not None else rtol, args.atol if args.atol is not None else atol
        difference, worst = compare(runs["reference"], runs["candidate"], rtol, atol)
        print(report(difference, worst, ranks=args.nproc_per_node, strategy=args.strategy or "the script's",
                     steps=args.steps, rtol=rtol, atol=atol, params=len(first["order"])))
        return 0 if difference is None else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
