"""Benchmark: ZeRO stages 1, 2 and 3 (`paratrain.shard`) against torch's own, side by side.

    python bench/zero.py [--rounds 5] [--steps 8] [--warmup 2] [--batch 128] [--stages 1,2,3]
                         [--models mlp,transformer] [--out bench/results/zero.json] [--quick]

World 2 on gloo, one thread per rank (2 ranks on 2 cores), ranks started by
`paratrain.testing.run_on_ranks`; the two models of bench/common.py (an MLP of 18,905,098
parameters, a small GPT of 9,739,520); `--batch` samples per rank as in bench/ddp.py. Everything
trains with Adam(lr 1e-3) and `opt.zero_grad()` (to None). The pairs:

    stage 1  pt.shard(stage=1)  vs  torch DDP (defaults) + ZeroRedundancyOptimizer(optimizer_class=Adam)
    stage 2  pt.shard(stage=2)  vs  FSDP2: fully_shard(unit, reshard_after_forward=False) for each
                                    unit, then fully_shard(root, reshard_after_forward=False)
    stage 3  pt.shard(stage=3, wrap_policy=WrapPolicy(module_classes=(unit class,)))
                                vs  FSDP2: fully_shard(unit) for each unit, then fully_shard(root)
                                    (defaults: units reshard after forward, the root does not)

Units, the same for both: every nn.Linear of the MLP (its root holds nothing), every
nn.TransformerEncoderLayer of the GPT (its root keeps the embeddings, final norm and head).
FSDP2 runs on CPU/gloo with a 1-D mesh, init_device_mesh("cpu", (2,)), as torchtitan applies it.

Phase 1, memory: one fresh job per (stage, model, implementation). As in bench/ddp.py each rank
fixes glibc's mmap threshold, builds the model, runs one unwrapped forward/backward, drops the
gradients, resets the kernel's high-water mark and reads VmRSS; then wraps, runs MEMORY_STEPS
steps and reads VmHWM. peak MiB = VmHWM - that baseline (the larger rank); the unwrapped model
(4Ψ bytes) is in the baseline, so stage 3, which frees it, can add less than its shards.
The last step stops after optimizer.step(), before zero_grad, and the bytes the implementation
holds are counted from its tensors, each distinct storage once (views, tied weights and gradients
that view a bucket share one; a storage freed by resize_(0) counts 0; padding counts):

    params     ours: flat parameter buffers (1, 2), or shards + any gathered unit buffer (3)
               torch: DDP's module parameters (1); FSDP2's local shards + any all-gather output
               or unsharded parameter still allocated (2, 3)
    grads      ours: gradient buckets, .grad of parameters and shards, stage 2's reduced slices,
               stage 3's gathered .grad; torch: .grad (the local shard of a DTensor's)
    optimizer  every tensor in the (inner, local) optimizer's state, DTensors by local shard

DDP's reducer keeps its own gradient buckets (gradient_as_bucket_view=False by default) where no
tensor count reaches; their size, from DDP's logging data, is reported beside (ddp_bucket_bytes)
and not in the total. live_tensor_bytes is every storage the garbage collector sees (batch and
buffers included), a cross-check. Formulas, fp32 Adam, N = 2 (ZeRO paper §5): stage 1
4Ψ + 4Ψ + 8Ψ/N, stage 2 4Ψ + 12Ψ/N, stage 3 16Ψ/N. Reported: the larger rank (they differ
only for ZeroRedundancyOptimizer, which gives each rank whole tensors). FSDP2 reshards after
backward even with reshard_after_forward=False, so after a step it holds 16Ψ/N, below the
stage-2 formula: its full parameters exist only from the first forward gather to the end of
backward (they show in its peak RSS).

Phase 2, agreement and speed: one job per (stage, model). Each rank wraps two deep copies of one
seeded model; both see the same per-rank batches. After PARITY_STEPS steps each,
max_param_diff is the largest |ours - torch| over the full parameters (gathered where sharded).
Then `--warmup` untimed steps each and `--rounds` interleaved rounds of `--steps` timed steps,
alternating which goes first (bench/common.py `time_interleaved`); reported as in bench/ddp.py:
median step over the slowest rank, per-round medians, and the median thread CPU time per step.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import subprocess
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, for the ranks too
from common import (  # noqa: E402
    MODELS,
    SEQ,
    bench_parser,
    distinct_storage_bytes,
    live_tensor_bytes,
    load_at_start,
    loss_of,
    make_batches,
    make_model,
    parse_bench_args,
    peak_rss_mb,
    print_table,
    reset_peak_rss,
    return_freed_memory_to_os,
    rss_mb,
    summarize_times,
    time_interleaved,
    train_step,
    write_results,
)

import paratrain as pt  # noqa: E402
from paratrain.testing import max_param_diff, run_on_ranks  # noqa: E402

WORLD, THREADS, LR, MEMORY_STEPS, PARITY_STEPS, DATA_BATCHES = 2, 1, 1e-3, 3, 3, 4
IMPLS = ("ours", "reference")
REFERENCE = {1: "torch DDP + ZeroRedundancyOptimizer(Adam)",
             2: "FSDP2 fully_shard(reshard_after_forward=False)",
             3: "FSDP2 fully_shard"}
UNIT = {"mlp": nn.Linear, "transformer": nn.TransformerEncoderLayer}
TARGET_RATIO, TARGET_BYTES, TARGET_DIFF = 1.00, 1.05, 1e-5


def formula_bytes(stage: int, params: int, n: int = WORLD) -> float:
    """fp32 Adam, bytes per rank (Rajbhandari et al. 2020, §5.1–5.3)."""
    return {1: 4 * params + 4 * params + 8 * params / n, 2: 4 * params + 12 * params / n,
            3: 16 * params / n}[stage]


# -- in the ranks: building each implementation -------------------------------------------------

def _adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LR)


def _mesh(stage: int, impl: str):
    """FSDP2's 1-D device mesh over the default group (None where it is not used)."""
    if impl == "ours" or stage == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (WORLD,))


def build(stage: int, impl: str, name: str, model: nn.Module,
          mesh) -> tuple[nn.Module, torch.optim.Optimizer]:
    """(the module to call, its optimizer) for one implementation of `stage` around `model`."""
    if impl == "ours":
        policy = pt.WrapPolicy(module_classes=(UNIT[name],))
        return pt.shard(model, _adam(model.parameters()), stage=stage, wrap_policy=policy)
    if stage == 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
    from torch.distributed.fsdp import fully_shard
    # stage 2: nothing resharded after forward; stage 3: FSDP2's defaults (units reshard, the root not)
    reshard = {"reshard_after_forward": False} if stage == 2 else {}
    for unit in [m for m in model.modules() if isinstance(m, UNIT[name])]:
        fully_shard(unit, mesh=mesh, **reshard)
    fully_shard(model, mesh=mesh, **reshard)
    return model, _adam(model.parameters())


def full_params(stage: int, impl: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict, gathered where sharded (a collective for stage 3 and FSDP2)."""
    if impl == "ours":
        return pt.full_state_dict(model)
    if stage == 1:
        return model.module.state_dict()
    from torch.distributed.tensor import DTensor
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}


# -- in the ranks: what each implementation holds ------------------------------------------------

def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer's local optimizer
    return [_local(v) for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]


def _fsdp_params(model: nn.Module) -> list:
    """FSDP2's per-parameter records (private: torch/distributed/fsdp/_fully_shard/_fsdp_state.py;
    torch 2.13 keeps a list `_fsdp_param_groups`, older versions one `_fsdp_param_group`)."""
    from torch.distributed.fsdp import FSDPModule
    states = [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]
    groups = [g for s in states for g in getattr(s, "_fsdp_param_groups", None) or [s._fsdp_param_group]]
    return [fp for g in groups if g is not None for fp in g.fsdp_params]


def held_tensors(stage: int, impl: str, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, list]:
    """Parameters, gradients and optimizer state this rank holds (see the docstring's table)."""
    if impl == "ours" and stage < 3:
        module_params = list(model.module.parameters())
        grads = [b.buffer for b in model._buckets.buckets] + [p.grad for p in module_params]
        grads += [s.grad for s in model.shards] + list(getattr(model._reduction, "shard_grads", {}).values())
        return dict(params=model.param_buffers + module_params + list(model.shards), grads=grads,
                    optimizer=_state_tensors(opt))
    if impl == "ours":
        flats = [f for u in model.units for f in u.flats]
        return dict(params=[f.shard for f in flats] + [f.full for f in flats],
                    grads=[f.shard.grad for f in flats] + [f.grad for f in flats],
                    optimizer=_state_tensors(opt))
    if stage == 1:
        params = list(model.module.parameters())
        return dict(params=params, grads=[p.grad for p in params], optimizer=_state_tensors(opt))
    fsdp = _fsdp_params(model)
    gathered = [t for fp in fsdp for t in fp.all_gather_outputs]
    gathered += [getattr(fp, "_unsharded_param", None) for fp in fsdp]
    return dict(params=[_local(p) for p in model.parameters()] + gathered,
                grads=[_local(p.grad) for p in model.parameters()], optimizer=_state_tensors(opt))


def _ddp_bucket_bytes(model: nn.Module) -> int:
    """Bytes of torch DDP's reducer buckets, from its logging data (no tensor reaches them)."""
    sizes = model._get_ddp_logging_data().get("bucket_sizes", "")
    return sum(int(s) for s in str(sizes).split(",") if s.strip())


# -- in the ranks: the two phases ---------------------------------------------------------------

def memory(topo, stage: int, name: str, impl: str, batch: int) -> dict:
    """Peak RSS added by wrapping and training, and the bytes held after a step (phase 1)."""
    return_freed_memory_to_os()
    mesh = _mesh(stage, impl)  # one-time setup, in the baseline
    model = make_model(name)
    (x, y), = make_batches(name, batch, 1, seed=100 + topo.rank)
    loss_of(model, x, y).backward()  # warm-up, unwrapped: one-time allocations join the baseline
    model.zero_grad()
    reset_peak_rss()
    baseline = rss_mb()
    wrapped, opt = build(stage, impl, name, model, mesh)
    for _ in range(MEMORY_STEPS - 1):
        train_step(wrapped, opt, x, y)
    loss_of(wrapped, x, y).backward()
    opt.step()  # the last step keeps its gradients: counted after step(), before zero_grad()
    peak = peak_rss_mb() - baseline
    held = distinct_storage_bytes(held_tensors(stage, impl, wrapped, opt))
    extra = dict(ddp_bucket_bytes=_ddp_bucket_bytes(wrapped)) if impl == "reference" and stage == 1 else {}
    return dict(peak_mb=peak, bytes=sum(held.values()), **held, **extra,
                live_tensor_bytes=live_tensor_bytes())


def speed(topo, stage: int, name: str, batch: int, warmup: int, rounds: int, steps: int) -> dict:
    """Parameter agreement after PARITY_STEPS, then per-step times of both (phase 2)."""
    mesh = _mesh(stage, "reference")
    base = make_model(name)
    runs = {impl: build(stage, impl, name, copy.deepcopy(base), mesh) for impl in IMPLS}
    batches = make_batches(name, batch, DATA_BATCHES, seed=100 + topo.rank)
    for i in range(PARITY_STEPS):
        for model, opt in runs.values():
            train_step(model, opt, *batches[i % len(batches)])
    diff = max_param_diff(*(full_params(stage, impl, runs[impl][0]) for impl in IMPLS))
    step_of = {impl: functools.partial(train_step, *runs[impl]) for impl in IMPLS}
    return dict(**time_interleaved(step_of, batches, warmup=warmup, rounds=rounds, steps=steps), diff=diff)


# -- in the launching process -------------------------------------------------------------------

def bench_pair(stage: int, name: str, args) -> dict:
    mem = {impl: run_on_ranks(memory, WORLD, stage, name, impl, args.batch, threads=THREADS, timeout=600)
           for impl in IMPLS}
    results = run_on_ranks(speed, WORLD, stage, name, args.batch, args.warmup, args.rounds, args.steps,
                           threads=THREADS, timeout=1200, collective_timeout=300)
    params = sum(p.numel() for p in make_model(name).parameters())
    times = summarize_times(results, list(IMPLS), args.steps)
    row = dict(params=params, reference=REFERENCE[stage], ours_ms=times["ours_ms"],
               reference_ms=times["reference_ms"], ratio=times["ours_ms"] / times["reference_ms"],
               max_param_diff=max(r["diff"] for r in results), formula_bytes=formula_bytes(stage, params))
    for impl in IMPLS:
        worst = max(mem[impl], key=lambda r: r["bytes"])
        row.update({f"{impl}_bytes": worst["bytes"],
                    f"{impl}_bytes_over_formula": worst["bytes"] / row["formula_bytes"],
                    f"{impl}_peak_mb": max(r["peak_mb"] for r in mem[impl]),
                    f"{impl}_bytes_per_rank": [{k: v for k, v in r.items() if k != "peak_mb"}
                                               for r in mem[impl]]})
    return dict(row, **{k: v for k, v in times.items() if k not in row})


def _parse_args(argv) -> argparse.Namespace:
    parser = bench_parser(__doc__, out_name="zero.json", rounds=5, steps=8, warmup=2, batch=128)
    parser.add_argument("--stages", default="1,2,3", help="comma-separated ZeRO stages to run")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated models to run")
    args = parse_bench_args(parser, argv, quick=dict(rounds=2, steps=2, warmup=1, batch=SEQ))
    args.stages = [int(s) for s in args.stages.split(",")]
    args.models = args.models.split(",")
    if not set(args.stages) <= {1, 2, 3} or not set(args.models) <= set(MODELS):
        parser.error(f"--stages takes some of 1,2,3 and --models some of {','.join(MODELS)}")
    return args


def _report(results: dict) -> None:
    mib = 2.0**20
    rows = [dict(stage=stage, model=name, **r, ours_mib=r["ours_bytes"] / mib,
                 reference_mib=r["reference_bytes"] / mib, formula_mib=r["formula_bytes"] / mib)
            for stage, models in results.items() for name, r in models.items()]
    print_table(rows, [("stage", "stage", ""), ("model", "model", ""), ("ours_ms", "ours ms", ".1f"),
                       ("reference_ms", "ref ms", ".1f"), ("ratio", "ratio", ".3f"),
                       ("ours_cpu_ms", "ours cpu", ".1f"), ("reference_cpu_ms", "ref cpu", ".1f"),
                       ("max_param_diff", "max diff", ".1e"), ("ours_mib", "ours MiB", ".1f"),
                       ("reference_mib", "ref MiB", ".1f"), ("formula_mib", "formula MiB", ".1f"),
                       ("ours_bytes_over_formula", "ours/formula", ".3f"),
                       ("ours_peak_mb", "ours peak", ".1f"), ("reference_peak_mb", "ref peak", ".1f")])
    for stage, models in results.items():
        print(f"{stage} reference: {next(iter(models.values()))['reference']}")
    missed = [f"{stage} {name}: {what}" for stage, models in results.items() for name, r in models.items()
              for what, ok in [(f"ratio > {TARGET_RATIO:.2f}", r["ratio"] <= TARGET_RATIO),
                               (f"bytes > {TARGET_BYTES} x formula",
                                r["ours_bytes_over_formula"] <= TARGET_BYTES),
                               (f"max_param_diff > {TARGET_DIFF:.0e}", r["max_param_diff"] <= TARGET_DIFF)]
              if not ok]
    print("targets missed: " + "; ".join(missed) if missed else "all targets met")


def _source_version() -> str:
    """The commit measured, and whether paratrain/ differed from it (others share this tree)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        git = ["git", "-C", root]
        head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(git + ["status", "--porcelain", "--", "paratrain"], capture_output=True,
                               text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    changed = [line[3:] for line in dirty.splitlines() if line.strip()]  # "XY path"
    return head + (f" + uncommitted changes to {', '.join(changed)}" if changed else "")


def main(argv=None) -> None:
    args = _parse_args(argv)
    load_before = load_at_start(args)
    results: dict[str, dict] = {}
    for stage in args.stages:
        for name in args.models:
            print(f"benchmarking stage {stage}, {name} ...", flush=True)
            results.setdefault(f"stage{stage}", {})[name] = bench_pair(stage, name, args)
    settings = dict(world=WORLD, backend="gloo", rounds=args.rounds, steps=args.steps,
                    warmup=args.warmup, batch_per_rank=args.batch, threads_per_rank=THREADS,
                    optimizer=f"Adam(lr={LR})", memory_steps=MEMORY_STEPS, parity_steps=PARITY_STEPS,
                    units={name: UNIT[name].__name__ for name in args.models},
                    references={f"stage{s}": REFERENCE[s] for s in args.stages},
                    source=_source_version())
    _report(results)
    write_results(args, settings, load_before, ranks=WORLD, results=results)


if __name__ == "__main__":
    main()
