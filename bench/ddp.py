"""Benchmark: paratrain.DistributedDataParallel against torch.nn.parallel.DistributedDataParallel.

    python bench/ddp.py [--rounds 5] [--steps 20] [--batch 128] [--out bench/results/ddp.json] [--quick]

World 2 on gloo, one thread per rank (2 ranks on 2 cores), ranks started by
`paratrain.testing.run_on_ranks`. Two models (bench/common.py): an MLP of 18,905,098 parameters
and a small GPT of 9,739,520. `--batch` is samples per rank: MLP rows, or transformer tokens
(sequences of 64). Both wrappers take default arguments (torch's: bucket_cap_mb 25,
gradient_as_bucket_view False, as a user gets it); both train with SGD(lr 1e-3, momentum 0.9) and
`opt.zero_grad()` (set_to_none=True, the default).

A third row, "mlp+bf16": the MLP again, both wrappers given torch's bf16 gradient compression,
`register_comm_hook(None, bf16_compress_hook)` (each bucket cast to bfloat16, divided, all-reduced
in bfloat16, cast back: half the bytes on the wire). Torch's CPU build refuses that hook by its
name (it asks for CUDA and NCCL, though gloo reduces bfloat16), so torch's DDP gets the same
function under another name; ours takes it as it is.

Phase 1, peak memory: one fresh job per (model, implementation), so the other implementation is
never allocated and neither inherits the other's heap. Each rank fixes glibc's mmap threshold at
64 KiB with mallopt and checks that freed blocks leave RSS (see common.py; done in the rank rather
than by MALLOC_MMAP_THRESHOLD_, which would have to reach the forkserver shared by all jobs and
would then add page faults to every step of the timing jobs too), builds the
model, runs one unwrapped forward/backward so one-time allocations (oneDNN, autograd) land in the
baseline, drops the gradients, resets the kernel's high-water mark (clear_refs), reads VmRSS,
then wraps the model, makes the optimizer and runs 3 steps, and reads VmHWM. Reported:
VmHWM - VmRSS before wrapping, the larger of the two ranks: everything the wrapper and training
add (buckets, gradients, momentum, activations, collective buffers).

Phase 2, speed and agreement: one job per model. Each rank wraps deep copies of one seeded
model, one per implementation, with an optimizer each; all see the same per-rank batches in the
same order. A third implementation, "ours_no_recorder", is ours again with the flight recorder
switched off for its steps (`flight_hooks.off()`: torch.distributed's own functions, as under
PARATRAIN_FLIGHT_RECORDER=0); recorder_overhead_blocks is ours_ms / ours_no_recorder_ms - 1.
After warm-up steps, `--rounds` rounds in
which each implementation runs `--steps` timed steps, the order rotated by one each round (ranks
meet at a barrier before each block). A step
(forward, loss, backward, optimizer step, zero_grad) takes as long as its slowest rank; reported:
the median over all timed steps (and each round's median, to show the noise). Also reported, as
*_cpu_ms: the median CPU time of the training thread per step (time.thread_time, larger rank),
which leaves out waiting for the all-reduces and for other processes, so it shows what each
wrapper adds on the critical thread even on a busy machine. All have then done the same steps
from the same start, and max_param_diff is the largest |ours - torch| over all parameters.

Phase 3, the flight recorder's cost (its target: at most 1% of a step): the block medians above
differ by the machine's drift between blocks (±3% here), which hides a cost of 0.1%. So ours then
runs rounds × steps pairs of steps, the recorder on for one step of each pair and off for the
other (which first alternates), the ranks meeting at a barrier before each step; recorder_overhead
is the median over pairs of the slowest rank's (on − off), over the median step with it off.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, for the ranks too
from common import (  # noqa: E402
    MODELS,
    SEQ,
    bench_parser,
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
    slowest_rank,
    summarize_times,
    time_interleaved,
    train_step,
    write_results,
)

import paratrain as pt  # noqa: E402
from paratrain.debug import flight_hooks  # noqa: E402
from paratrain.testing import max_param_diff, run_on_ranks  # noqa: E402

WORLD, THREADS, LR, MEMORY_STEPS, DATA_BATCHES = 2, 1, 1e-3, 3, 4
WRAPPERS = {"ours": pt.DistributedDataParallel, "torch": torch.nn.parallel.DistributedDataParallel}
CASES = {name: (name, None) for name in MODELS} | {"mlp+bf16": ("mlp", "bf16")}  # row: (model, comm hook)
TIMED = [*WRAPPERS, "ours_no_recorder"]  # ours once more, with the flight recorder off


def _torch_bf16(state, bucket):
    """bf16_compress_hook under another name, which torch's CPU build accepts (module docstring)."""
    return bf16_compress_hook(state, bucket)


def _wrap(impl: str, model: torch.nn.Module, hook: str | None) -> torch.nn.Module:
    ddp = WRAPPERS[impl.removesuffix("_no_recorder")](model)
    if hook == "bf16":
        ddp.register_comm_hook(None, _torch_bf16 if impl == "torch" else bf16_compress_hook)
    return ddp


def _step(impl: str, ddp: torch.nn.Module, opt: torch.optim.Optimizer, x, y) -> torch.Tensor:
    if impl == "ours_no_recorder":
        with flight_hooks.off():
            return train_step(ddp, opt, x, y)
    return train_step(ddp, opt, x, y)


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def peak_memory(topo, name: str, hook: str | None, impl: str, batch: int) -> float:
    """MiB this rank's RSS rose above its level just before wrapping (phase 1)."""
    return_freed_memory_to_os()
    model = make_model(name)
    (x, y), = make_batches(name, batch, 1, seed=100 + topo.rank)
    loss_of(model, x, y).backward()  # warm-up, unwrapped: one-time allocations join the baseline
    model.zero_grad()
    reset_peak_rss()
    baseline = rss_mb()
    ddp = _wrap(impl, model, hook)
    opt = _optimizer(ddp)
    for _ in range(MEMORY_STEPS):
        train_step(ddp, opt, x, y)
    return peak_rss_mb() - baseline


def speed(topo, name: str, hook: str | None, batch: int, warmup: int, rounds: int, steps: int) -> dict:
    """Per-step seconds of each implementation and the parameter difference after (phase 2)."""
    model = make_model(name)
    ddps = {impl: _wrap(impl, copy.deepcopy(model), hook) for impl in TIMED}
    opts = {impl: _optimizer(ddp) for impl, ddp in ddps.items()}
    batches = make_batches(name, batch, DATA_BATCHES, seed=100 + topo.rank)
    step_of = {impl: (lambda x, y, impl=impl: _step(impl, ddps[impl], opts[impl], x, y)) for impl in ddps}
    timed = time_interleaved(step_of, batches, warmup=warmup, rounds=rounds, steps=steps)
    diffs = dict(diff=max_param_diff(ddps["ours"].module, ddps["torch"].module),
                 recorder_diff=max_param_diff(ddps["ours"].module, ddps["ours_no_recorder"].module))
    return dict(**timed, **diffs, paired=_paired(ddps["ours"], opts["ours"], batches, rounds * steps))


def _paired(ddp: torch.nn.Module, opt: torch.optim.Optimizer, batches, pairs: int) -> dict[str, list[float]]:
    """Phase 3: the recorder on and off on alternate steps of one model (which goes first swapped
    each pair), so each pair's two steps share the machine's state: their difference is the
    recorder's cost, where the difference of two blocks' medians is mostly the blocks' drift."""
    times: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(pairs):
        for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
            x, y = batches[i % len(batches)]
            dist.barrier()
            start = time.perf_counter()
            _step("ours" if mode == "on" else "ours_no_recorder", ddp, opt, x, y)
            times[mode].append(time.perf_counter() - start)
    return times


def paired_overhead(per_rank: list[dict]) -> float:
    """The median over pairs of (on − off), the slowest rank's steps, over the median off step."""
    on = slowest_rank([r["paired"]["on"] for r in per_rank])
    off = slowest_rank([r["paired"]["off"] for r in per_rank])
    return statistics.median(a - b for a, b in zip(on, off)) / statistics.median(off)


def bench_model(case: str, args) -> dict:
    name, hook = CASES[case]
    memory = {impl: max(run_on_ranks(peak_memory, WORLD, name, hook, impl, args.batch,
                                     threads=THREADS, timeout=600))
              for impl in WRAPPERS}
    results = run_on_ranks(speed, WORLD, name, hook, args.batch, args.warmup, args.rounds, args.steps,
                           threads=THREADS, timeout=900, collective_timeout=300)
    times = summarize_times(results, TIMED, args.steps)
    if max(r["recorder_diff"] for r in results):
        raise RuntimeError("the flight recorder changed what training computed")
    return dict(params=sum(p.numel() for p in make_model(name).parameters()),
                ratio=times["ours_ms"] / times["torch_ms"], max_param_diff=max(r["diff"] for r in results),
                recorder_overhead=paired_overhead(results),
                recorder_overhead_blocks=times["ours_ms"] / times["ours_no_recorder_ms"] - 1,
                ours_peak_mb=memory["ours"], torch_peak_mb=memory["torch"], **times)


def _parse_args(argv) -> argparse.Namespace:
    parser = bench_parser(__doc__, out_name="ddp.json", rounds=5, steps=20, warmup=3, batch=128)
    return parse_bench_args(parser, argv, quick=dict(rounds=2, steps=2, warmup=1, batch=SEQ))


def _report(models: dict) -> None:
    print_table([dict(model=name, **row) for name, row in models.items()],
                [("model", "model", ""), ("params", "params", ","), ("ours_ms", "ours ms", ".1f"),
                 ("torch_ms", "torch ms", ".1f"), ("ratio", "ratio", ".3f"),
                 ("ours_cpu_ms", "ours cpu", ".1f"), ("torch_cpu_ms", "torch cpu", ".1f"),
                 ("max_param_diff", "max diff", ".1e"), ("ours_peak_mb", "ours MiB", ".1f"),
                 ("torch_peak_mb", "torch MiB", ".1f"), ("ours_no_recorder_ms", "no rec ms", ".1f"),
                 ("recorder_overhead", "recorder", "+.2%")])
    missed = [f"{name}: {what}" for name, m in models.items() for what, ok in
              [("ratio > 1.05", m["ratio"] <= 1.05), ("max_param_diff > 1e-6", m["max_param_diff"] <= 1e-6),
               ("more peak memory than torch", m["ours_peak_mb"] <= m["torch_peak_mb"]),
               ("flight recorder overhead > 1%", m["recorder_overhead"] <= 0.01)] if not ok]
    print("targets missed: " + "; ".join(missed) if missed else "all targets met")


def main(argv=None) -> None:
    args = _parse_args(argv)
    load_before = load_at_start(args)
    models = {}
    for case in CASES:
        print(f"benchmarking {case} ...", flush=True)
        models[case] = bench_model(case, args)
    settings = dict(world=WORLD, backend="gloo", rounds=args.rounds, steps=args.steps,
                    warmup=args.warmup, batch_per_rank=args.batch, threads_per_rank=THREADS,
                    optimizer=f"SGD(lr={LR}, momentum=0.9)", memory_steps=MEMORY_STEPS)
    _report(models)
    write_results(args, settings, load_before, ranks=WORLD, models=models)


if __name__ == "__main__":
    main()
