"""`paratrain verify`: running the script twice and comparing what the runs recorded (how and
why: debug/verify.py, which holds what each rank records)."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from paratrain.debug.verify import DIR, INJECT, PROJECTIONS, STEPS, STRATEGY, TOLERANCES, combined_loss
from paratrain.errors import ConfigError


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
        mine = combined_loss([c["steps"][step] for c in candidate.values()])
        theirs = combined_loss([ref["steps"][step]])
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
    else:  # sharded: the pieces of every rank add up to the parameter's, a replica's counted once
        distinct = {(o, n): s for pieces in held.values() for o, n, s in pieces}
        parts = {min(held): sum(distinct.values())}
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


SCRIPT = "script"  # in --strategy: the strategy the script itself chooses


def add_verify_parser(commands) -> None:
    verify = commands.add_parser(
        "verify", help="check a job on N processes against one process, step by step",
        description="Run the script as one process and as N, record every optimizer step's loss, "
        "gradients and parameters in both, and report the first that differ (exit 1), or exit 0.")
    verify.add_argument("-n", "--nproc-per-node", type=int, default=2, metavar="N",
                        help="processes of the checked run (default: 2)")
    verify.add_argument("--steps", type=int, default=3, help="optimizer steps to check (default: 3)")
    verify.add_argument("--strategy", help="the checked run's strategy, or several comma-separated, each "
                        "checked against the same reference; 'script' is the script's own (the default)")
    verify.add_argument("--rtol", type=float, help="relative tolerance (default by precision: 1e-4 for "
                        "fp32, 3e-2 for bf16/fp16)")
    verify.add_argument("--atol", type=float, help="absolute tolerance (default by precision)")
    verify.add_argument("--timeout", type=float, default=600, help="seconds each run may take (default: 600)")
    verify.add_argument("--reference", metavar="DIR", help="keep the one-process run in DIR and reuse it on later "
                        "calls with the same script (its bytes), arguments and --steps; else it runs each time")
    verify.add_argument("target", metavar="script.py", help="the training script, unchanged")
    rest = verify.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    rest.required = False


def verify(args: argparse.Namespace) -> int:
    """One reference run, then one checked run per strategy named (comma-separated, or the
    script's own); 0 when every one agrees with the reference, 1 otherwise."""
    if args.nproc_per_node < 1 or args.steps < 1:
        raise ConfigError("-n and --steps must be at least 1")
    strategies = [None if s == SCRIPT else s for s in args.strategy.split(",")] if args.strategy else [None]
    work = Path(tempfile.mkdtemp(prefix="paratrain-verify-"))
    try:
        reference = _reference(args, work)
        failed = False
        for strategy in strategies:
            candidate = _run(args, work / (strategy or "candidate"), args.nproc_per_node, strategy)
            first = next(iter(candidate.values()))
            rtol, atol = TOLERANCES.get(first["precision"], TOLERANCES["32"])
            rtol = args.rtol if args.rtol is not None else rtol
            atol = args.atol if args.atol is not None else atol
            difference, worst = compare(reference, candidate, rtol, atol)
            print(report(difference, worst, ranks=args.nproc_per_node, strategy=strategy or "the script's",
                         steps=args.steps, rtol=rtol, atol=atol, params=len(first["order"])), flush=True)
            failed = failed or difference is not None
        return 1 if failed else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


REFERENCE = "reference.json"  # in --reference's DIR: what the run there was of


def _reference(args: argparse.Namespace, work: Path) -> dict[int, dict]:
    """The one-process run: made in `work`, or with --reference in its DIR, reused from there when
    it was of the same script bytes, arguments and steps."""
    if args.reference is None:
        return _run(args, work / "reference", 1, "single")
    directory = Path(args.reference)
    what = {"script": str(Path(args.target).resolve()), "sha256": _sha256(args.target), "args": list(args.args),
            "steps": args.steps}
    note = directory / REFERENCE
    if note.exists():
        if json.loads(note.read_text()) == what:
            print(f"paratrain verify: the reference run (1 process, single) is the one in {directory}", flush=True)
            return read_run(directory)
        print(f"paratrain verify: {directory} holds the reference run of another script, arguments or --steps; "
              "running it again", flush=True)
        shutil.rmtree(directory)
    elif directory.exists() and any(directory.iterdir()):
        raise ConfigError(f"--reference {directory} holds files that are not a reference run (no {REFERENCE}): "
                          "name an empty or new directory")
    try:
        run = _run(args, directory, 1, "single")
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)  # what a failed run left is no reference
        raise
    note.write_text(json.dumps(what))
    return run


def _sha256(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:  # `paratrain run` will say what is wrong with it
        return ""


def _run(args: argparse.Namespace, directory: Path, n: int, strategy: str | None) -> dict[int, dict]:
    """The script under `paratrain run -n n`, recording into `directory`; its records."""
    reference = strategy == "single" and n == 1
    env = {k: v for k, v in os.environ.items() if k not in (STRATEGY, INJECT)}
    env.update({DIR: str(directory), STEPS: str(args.steps)})
    if strategy:
        env[STRATEGY] = strategy
    if INJECT in os.environ and not reference:  # the test-only fault goes into checked runs only
        env[INJECT] = os.environ[INJECT]
    cmd = [sys.executable, "-m", "paratrain", "run", "-n", str(n), args.target, *args.args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        what = "reference run (1 process, single)" if reference else f"run on {n} processes ({strategy or 'the script'})"
        raise ConfigError(f"the {what} failed with exit status {done.returncode}; its output is above")
    return read_run(directory)
