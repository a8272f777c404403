"""Benchmark: paratrain's ring attention, pt.Mesh(cp=2), against all-gathering K and V, and its memory against one process.

    python bench/context_parallel.py [--rounds 5] [--steps 5] [--batch 4096] [--out ...] [--quick]

World 2 on gloo, one thread per rank (2 ranks on 2 cores), ranks started by
`paratrain.testing.run_on_ranks`. The model: tests/support/llama.py's Llama-style decoder
(RMSNorm, SwiGLU, rotary positions, grouped-query attention), LAYERS blocks of width WIDTH,
fp32, trained with Adam, on one sequence of `--batch` tokens per step, which cp cuts over the two
ranks (each holds half of its tokens).

Baseline: torch's own `context_parallel` (torch.distributed.tensor.experimental) dispatches only
to the CUDA flash, efficient and cuDNN attention kernels, so it cannot run on gloo/CPU. The
baseline is therefore the other way to attend over a cut sequence: `cp_mode="all-gather"`
(each rank gathers the whole sequence's K and V and attends its queries to them: Llama 3's).

Speed: each rank builds both from one seeded model and trains them on the same sequences; after
warm-up steps, `--rounds` rounds in which each runs `--steps` timed steps, the order alternating
(bench/common.py, time_interleaved). A step (forward, loss, backward, Adam step, zero_grad) takes
as long as its slower rank; reported: the medians, ratio = ring / all-gather, and max_param_diff
between the two after the same steps.

Memory: on each rank, for one step of the ring, of the all-gather and of one process training
the same model on the whole sequence alone (in the same process, after the others): the peak
resident memory above the step's start (VmHWM, freed blocks returned to the OS), and the bytes
autograd keeps from the forward for the backward (activations: a tensor once, by its storage;
parameters left out). Reported: the larger rank's, and each over one process's.
"""

from __future__ import annotations

import copy
import gc
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), ROOT]  # common.py and tests.support, for the ranks too
from common import (  # noqa: E402
    bench_parser,
    load_at_start,
    parse_bench_args,
    peak_rss_mb,
    print_table,
    reset_peak_rss,
    return_freed_memory_to_os,
    rss_mb,
    summarize_times,
    time_interleaved,
    write_results,
)

import paratrain as pt  # noqa: E402
from paratrain.testing import max_param_diff, run_on_ranks  # noqa: E402
from tests.support.llama import Llama, lm_loss  # noqa: E402

WORLD, CP, THREADS, LR, DATA_BATCHES = 2, 2, 1, 1e-4, 3
LAYERS, WIDTH, HEADS, KV_HEADS, HIDDEN, VOCAB = 2, 256, 8, 4, 688, 512
MODES = {"ring": "ring", "all_gather": "all-gather"}  # result name → Mesh(cp_mode=...)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Llama(vocab=VOCAB, width=WIDTH, layers=LAYERS, heads=HEADS, kv_heads=KV_HEADS, hidden=HIDDEN)


def _batches(tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100)
    ids = torch.randint(0, VOCAB, (DATA_BATCHES, 1, tokens + 1), generator=g)
    return [(x[:, :-1], x[:, 1:]) for x in ids]


def _cp(model, topo, mode: str):
    strategy = pt.Mesh(cp=CP, cp_mode=mode)
    return strategy.setup(model, torch.optim.Adam(model.parameters(), lr=LR), strategy.grid(topo))


def _cp_step(model, opt, x, y) -> torch.Tensor:
    loss = model.forward_backward(x, y, lm_loss, 1.0)  # this rank's cut of the sequence
    opt.step()
    opt.zero_grad()
    return loss


def _one_step(model, opt, x, y) -> torch.Tensor:
    loss = lm_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _memory(step, params, x, y) -> dict:
    """The peak resident MiB above the start of one `step(x, y)`, and the bytes autograd saved
    for backward in it (parameters left out)."""
    mine = {p.untyped_storage().data_ptr() for p in params}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in mine:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    gc.collect()
    reset_peak_rss()
    start = rss_mb()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(x, y)
    return dict(peak_mb=peak_rss_mb() - start, saved_bytes=sum(saved.values()))


def run(topo, tokens: int, warmup: int, rounds: int, steps: int) -> dict:
    topo = topo.init()
    return_freed_memory_to_os()
    base = _model()
    models = {name: _cp(copy.deepcopy(base), topo, mode) for name, mode in MODES.items()}
    batches = _batches(tokens)
    step_of = {name: (lambda x, y, name=name: _cp_step(*models[name], x, y)) for name in models}
    timed = time_interleaved(step_of, batches, warmup=warmup, rounds=rounds, steps=steps)
    diff = max_param_diff(models["ring"][0].full_state_dict(), models["all_gather"][0].full_state_dict())
    x, y = batches[0]
    memory = {name: _memory(step_of[name], models[name][0].parameters(), x, y) for name in models}
    pt.destroy()
    models.clear()  # free both before one process is measured
    alone = copy.deepcopy(base)
    opt = torch.optim.Adam(alone.parameters(), lr=LR)
    _one_step(alone, opt, x, y)  # its Adam state exists before the measured step, as the others' does
    memory["one_process"] = _memory(lambda x, y: _one_step(alone, opt, x, y), alone.parameters(), x, y)
    return dict(**timed, diff=diff, memory=memory)


def _parse_args(argv=None):
    parser = bench_parser(__doc__, out_name="context_parallel.json", rounds=5, steps=5, warmup=2, batch=4096)
    return parse_bench_args(parser, argv, quick=dict(rounds=1, steps=1, warmup=1, batch=256))


def main(argv=None) -> None:
    args = _parse_args(argv)
    load_before = load_at_start(args)
    per_rank = run_on_ranks(run, WORLD, args.batch, args.warmup, args.rounds, args.steps, threads=THREADS,
                            timeout=1800)
    times = summarize_times(per_rank, list(MODES), args.steps)
    memory = {name: {k: max(r["memory"][name][k] for r in per_rank) for k in ("peak_mb", "saved_bytes")}
              for name in [*MODES, "one_process"]}
    one = memory["one_process"]
    for name in MODES:
        memory[name]["peak_over_one_process"] = memory[name]["peak_mb"] / max(one["peak_mb"], 1e-9)
        memory[name]["saved_over_one_process"] = memory[name]["saved_bytes"] / max(one["saved_bytes"], 1)
    result = dict(**times, ratio=times["ring_ms"] / times["all_gather_ms"],
                  max_param_diff=max(r["diff"] for r in per_rank), memory=memory)
    print_table([dict(model="llama", **result, ring_peak=memory["ring"]["peak_mb"],
                      gather_peak=memory["all_gather"]["peak_mb"], one_peak=one["peak_mb"],
                      saved=memory["ring"]["saved_over_one_process"])], [
        ("model", "model", "s"), ("ring_ms", "ring ms", ".1f"), ("all_gather_ms", "all-gather ms", ".1f"),
        ("ratio", "ring/all-gather", ".3f"), ("ring_peak", "ring peak MiB", ".1f"),
        ("gather_peak", "all-gather peak MiB", ".1f"), ("one_peak", "one process peak MiB", ".1f"),
        ("saved", "ring saved/one", ".3f")])
    settings = dict(world=WORLD, cp=CP, threads=THREADS, layers=LAYERS, width=WIDTH, heads=HEADS, kv_heads=KV_HEADS,
                    hidden=HIDDEN, vocab=VOCAB, sequence=args.batch, rounds=args.rounds, steps=args.steps,
                    warmup=args.warmup, optimizer=f"Adam(lr={LR})",
                    baseline="cp_mode='all-gather'", baseline_reason=(
                        "torch's context_parallel dispatches only to the CUDA flash, efficient and cuDNN attention "
                        "kernels, so it cannot run on gloo/CPU"))
    write_results(args, settings, load_before, ranks=WORLD, llama=result)


if __name__ == "__main__":
    main()
