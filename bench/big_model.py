"""Benchmark: a GPT whose training state does not fit whole on a rank, built on the meta device and
trained under ZeRO-3 at world 4: setup and training peak memory per rank against the formulas.

    python bench/big_model.py [--layers 24] [--width 1024] [--heads 16] [--vocab 32000] [--seq 128]
                              [--batch 1] [--world 4] [--steps 3] [--configs zero3,bf16,offload,ac,all]
                              [--out bench/results/big_model.json] [--quick] [--force]

The model is examples/gpt.py's GPT (token and position embeddings, pre-norm blocks, the head tied
to the token embedding). At the defaults it has 335,210,496 parameters: 16Ψ = 5.4 GB of fp32
parameters, gradients and Adam state, which no rank holds (each holds 1/4). Each configuration is
a fresh job of `--world` ranks on gloo (one thread each), started by paratrain.testing.run_on_ranks:

    zero3    pt.ZeRO(stage=3, wrap_policy=pt.WrapPolicy(module_classes=(Block,)))
    bf16     … param_dtype=torch.bfloat16 (units gathered, computed and reduced in bf16; fp32 masters)
    offload  … offload=True (masters and Adam state in CPU memory; on this CPU-only machine the
             same memory as the device, so only the code path differs)
    ac       … and Session(activation_checkpointing=Block): every block recomputed in backward
    all      bf16 + offload + ac

Each rank fixes glibc's mmap threshold (bench/common.py: freed blocks return to the OS, so RSS
follows the live tensors), reads VmRSS after the process group is up (the baseline), resets the
kernel's high-water mark (VmHWM), builds the GPT under `torch.device("meta")` and calls
`session.setup(..., init_fn=GPT.init_weights)`; setup peak = VmHWM - baseline. Then the mark is
reset again and `--steps` train_steps run (AdamW, `--batch` sequences of `--seq` tokens per
rank); training peak = VmHWM - baseline. Both are compared with:

    setup    this rank's shards + the largest unit, in fp32 (each unit is materialised whole, on the
             CPU, then sharded and freed before the next)
    training 16 bytes per shard element (fp32 master, its gradient, Adam's two moments: 16Ψ/N with
             padding) + the two largest gathered units (in the compute dtype) + the activations
             of that batch, measured: the distinct storages autograd saves for backward during the
             first step's forward (torch.autograd.graph.saved_tensors_hooks), parameters excluded.
             Under activation checkpointing that is what the checkpoints keep (each block's input).

Beside them, what one rank would hold with the whole model: an eager build (4Ψ, measured in one
process: VmHWM of `GPT(...)` on the CPU) and DDP's 16Ψ + activations (a formula: four ranks of
5.4 GB do not fit this machine's 24 GiB).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    add_write_options,
    load_at_start,
    peak_rss_mb,
    print_table,
    reset_peak_rss,
    return_freed_memory_to_os,
    rss_mb,
    write_results,
)

import paratrain as pt  # noqa: E402
from paratrain.testing import run_on_ranks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20
CONFIGS = {
    "zero3": dict(param_dtype=None, offload=False, ac=False),
    "bf16": dict(param_dtype="bfloat16", offload=False, ac=False),
    "offload": dict(param_dtype=None, offload=True, ac=False),
    "ac": dict(param_dtype=None, offload=False, ac=True),
    "all": dict(param_dtype="bfloat16", offload=True, ac=True),
}


def gpt_example():
    spec = importlib.util.spec_from_file_location("gpt_example", os.path.join(ROOT, "examples", "gpt.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(gpt, dims: dict):
    return gpt.GPT(dims["vocab"], dims["seq"], dims["layers"], dims["width"], dims["heads"])


class SavedForBackward:
    """Bytes of the distinct storages autograd saves while this is active, skipping `skip` (the
    gathered parameter buffers, by storage identity: their data pointer moves as they are freed
    and gathered again)."""

    def __init__(self, skip: set[int]):
        self.skip, self.seen, self.bytes = skip, set(), 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.skip and key not in self.seen:
            self.seen.add(key)
            self.bytes += storage.nbytes()
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def _rank(topo, config: dict, dims: dict, steps: int) -> dict:
    return_freed_memory_to_os()
    gpt = gpt_example()
    g = torch.Generator().manual_seed(1 + topo.rank)
    batches = [torch.randint(0, dims["vocab"], (dims["batch"], dims["seq"] + 1), generator=g) for _ in range(steps)]
    param_dtype = getattr(torch, config["param_dtype"]) if config["param_dtype"] else None
    strategy = pt.ZeRO(stage=3, wrap_policy=pt.WrapPolicy(module_classes=(gpt.Block,)),
                       param_dtype=param_dtype, offload=config["offload"])
    session = pt.Session(strategy, topology=topo, progress_bar=False,
                         activation_checkpointing=gpt.Block if config["ac"] else None)
    baseline = rss_mb()
    reset_peak_rss()
    tick = time.perf_counter()
    with torch.device("meta"):
        model = build(gpt, dims)
    model, optimizer = session.setup(model, gpt.adamw(model, 3e-4), init_fn=model.init_weights)
    setup_s = time.perf_counter() - tick
    setup_peak = peak_rss_mb() - baseline
    flats = [f for u in model.units for f in u.flats]
    shard_elements = sum(f.shard.numel() for f in flats)
    unit_fp32 = max(sum(f.padded for f in u.flats) for u in model.units) * 4
    gathered = sorted(sum(f.full_bytes for f in u.flats) for u in model.units)[-2:]
    after_setup = rss_mb() - baseline
    reset_peak_rss()
    times, activations = [], 0
    for i, tokens in enumerate(batches):
        tick = time.perf_counter()
        if i == 0:
            with SavedForBackward({f.full.untyped_storage()._cdata for f in flats}) as saved:
                session.train_step((tokens[:, :-1], tokens[:, 1:]), gpt.next_token_loss).item()
            activations = saved.bytes
        else:
            session.train_step((tokens[:, :-1], tokens[:, 1:]), gpt.next_token_loss).item()
        times.append(time.perf_counter() - tick)
    train_peak = peak_rss_mb() - baseline
    state = 16 * shard_elements
    session.close()
    return dict(rank=topo.rank, setup_peak_mib=setup_peak, setup_formula_mib=(4 * shard_elements + unit_fp32) / MiB,
                after_setup_mib=after_setup, train_peak_mib=train_peak,
                train_formula_mib=(state + sum(gathered) + activations) / MiB,
                state_mib=state / MiB, gathered_units_mib=sum(gathered) / MiB, activations_mib=activations / MiB,
                setup_s=setup_s, step_s=times)


def _eager_build(topo, dims: dict) -> dict:
    """One process: the whole model built on the CPU, as without meta-device construction."""
    return_freed_memory_to_os()
    gpt = gpt_example()
    baseline = rss_mb()
    reset_peak_rss()
    model = build(gpt, dims)
    params = sum(p.numel() for p in model.parameters())
    return dict(peak_mib=peak_rss_mb() - baseline, params=params)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"some of {','.join(CONFIGS)}")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "big_model.json"))
    parser.add_argument("--quick", action="store_true", help="a small GPT, for a smoke check")
    add_write_options(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.width, args.heads, args.vocab, args.seq = 2, 128, 4, 1000, 32
    configs = args.configs.split(",")
    unknown = set(configs) - CONFIGS.keys()
    if unknown:
        parser.error(f"unknown --configs {sorted(unknown)}; choose from {list(CONFIGS)}")
    dims = dict(layers=args.layers, width=args.width, heads=args.heads, vocab=args.vocab, seq=args.seq,
                batch=args.batch)
    load_before = load_at_start(args)
    eager = run_on_ranks(_eager_build, 1, dims, timeout=1800)[0]
    psi = eager["params"]
    print(f"GPT: {psi:,} parameters; 16 bytes each = {16 * psi / MiB:,.0f} MiB of training state; "
          f"an eager build peaks at {eager['peak_mib']:,.0f} MiB (4Ψ = {4 * psi / MiB:,.0f} MiB)")
    rows, results = [], {}
    for name in configs:
        per_rank = run_on_ranks(_rank, args.world, CONFIGS[name], dims, args.steps, timeout=3600,
                                collective_timeout=1200)
        results[name] = per_rank
        worst = max(per_rank, key=lambda r: r["train_peak_mib"] / r["train_formula_mib"])
        rows.append(dict(config=name,
                         setup=max(r["setup_peak_mib"] for r in per_rank),
                         setup_ratio=max(r["setup_peak_mib"] / r["setup_formula_mib"] for r in per_rank),
                         train=worst["train_peak_mib"], formula=worst["train_formula_mib"],
                         train_ratio=worst["train_peak_mib"] / worst["train_formula_mib"],
                         activations=max(r["activations_mib"] for r in per_rank),
                         step=sorted(t for r in per_rank for t in r["step_s"][1:] or r["step_s"])[-1]))
        print(f"{name}: done")
    print_table(rows, [("config", "config", "s"), ("setup", "setup MiB", ".0f"), ("setup_ratio", "/ formula", ".3f"),
                       ("train", "train MiB", ".0f"), ("formula", "formula MiB", ".0f"),
                       ("train_ratio", "/ formula", ".3f"), ("activations", "activ. MiB", ".1f"),
                       ("step", "step s", ".1f")])
    whole = dict(eager_build_mib=eager["peak_mib"], ddp_state_mib=16 * psi / MiB, params=psi)
    ac_cut = None
    if "zero3" in results and "ac" in results:
        ac_cut = max(r["activations_mib"] for r in results["zero3"]) / max(r["activations_mib"] for r in results["ac"])
        print(f"activation checkpointing keeps {ac_cut:.1f}x fewer activation bytes")
    write_results(args, dict(dims, world=args.world, steps=args.steps, configs=configs), load_before,
                  ranks=args.world, whole_model=whole, rows=rows, activation_cut=ac_cut, per_rank=results)


if __name__ == "__main__":
    main()
