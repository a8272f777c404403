"""Benchmark: what the flight recorder costs per collective, and so per DDP step.

    python bench/flight_recorder.py [--calls 400] [--rounds 20] [--out bench/results/flight_recorder.json]

bench/ddp.py times our DDP with the recorder on and off, but its step times vary by ±3-4 % from
round to round on this machine (two runs gave the recorder +14 % and +0.2 % on the same MLP), so
a 1 % target cannot be read from them. This measures the cost where it is paid instead: on the
calling thread, per call. World 2 on gloo, one thread per rank: `--rounds` rounds of `--calls`
all-reduces of one float each, with the recorder on and off in turn (`flight_hooks.off()`, the
order swapped every round); per call, the median over rounds of the CPU time of the calling
thread (time.thread_time: the wrapper's Python work, without the wait for the peer) and of the
wall time. The cost per call is the difference (on − off). Then, for the two models of
bench/ddp.py under our DDP, the collectives one training step issues (counted by the recorder),
and the step time bench/ddp.py measured (bench/results/ddp.json, "ours_ms"): the recorder's share
of a step is calls × cost per call / step time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_write_options, load_at_start, make_batches, make_model, train_step, write_results  # noqa: E402

import paratrain as pt  # noqa: E402
from paratrain.debug import flight_hooks  # noqa: E402
from paratrain.debug.flight_recorder import RECORDER  # noqa: E402
from paratrain.testing import run_on_ranks  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _per_call(topo, calls: int, rounds: int) -> dict:
    x = torch.zeros(1)
    for _ in range(50):  # warm up the connection
        dist.all_reduce(x)
    samples: dict[str, dict[str, list[float]]] = {m: {"cpu": [], "wall": []} for m in ("on", "off")}
    for r in range(rounds):
        for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
            with flight_hooks.off() if mode == "off" else _nothing():
                dist.barrier()
                cpu, wall = time.thread_time(), time.perf_counter()
                for _ in range(calls):
                    dist.all_reduce(x)
                samples[mode]["cpu"].append((time.thread_time() - cpu) / calls)
                samples[mode]["wall"].append((time.perf_counter() - wall) / calls)
    return {m: {k: statistics.median(v) * 1e6 for k, v in s.items()} for m, s in samples.items()}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _calls_per_step(topo, name: str) -> int:
    model = pt.DistributedDataParallel(make_model(name))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    batches = make_batches(name, 128, 3, seed=topo.rank)  # bench/ddp.py's --batch: rows, or tokens
    for x, y in batches[:2]:
        train_step(model, opt, x, y)
    before = sum(RECORDER.issued.values())
    train_step(model, opt, *batches[2])
    return sum(RECORDER.issued.values()) - before


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=400, help="all-reduces per round and setting")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default=os.path.join(RESULTS, "flight_recorder.json"))
    parser.add_argument("--quick", action="store_true", help="a smoke check: few calls and rounds")
    add_write_options(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.calls, args.rounds = 20, 2
    if not flight_hooks.installed():
        raise SystemExit("the flight recorder is off (PARATRAIN_FLIGHT_RECORDER=0): nothing to measure")
    load_before = load_at_start(args)
    per_rank = run_on_ranks(_per_call, 2, args.calls, args.rounds, timeout=1800)
    worst = max(per_rank, key=lambda r: r["on"]["cpu"] - r["off"]["cpu"])
    cost_cpu, cost_wall = worst["on"]["cpu"] - worst["off"]["cpu"], worst["on"]["wall"] - worst["off"]["wall"]
    print(f"per all-reduce: {worst['off']['cpu']:.1f} µs CPU, {worst['off']['wall']:.1f} µs wall without the "
          f"recorder; it adds {cost_cpu:.2f} µs CPU ({cost_wall:+.2f} µs wall)")
    ddp = json.load(open(os.path.join(RESULTS, "ddp.json")))["models"]
    models = {}
    for name in ("mlp", "transformer"):
        calls = max(run_on_ranks(_calls_per_step, 2, name))
        step_ms = ddp[name]["ours_ms"]
        share = calls * max(cost_cpu, cost_wall, 0.0) / (step_ms * 1e3)
        models[name] = dict(collectives_per_step=calls, step_ms=step_ms, share_of_step=share)
        print(f"{name}: {calls} collectives per DDP step of {step_ms:.1f} ms: the recorder costs {share:.4%} of it")
    write_results(args, dict(calls=args.calls, rounds=args.rounds, world=2), load_before, ranks=2,
                  per_call_us=dict(cpu=cost_cpu, wall=cost_wall, off=worst["off"], on=worst["on"]), models=models)


if __name__ == "__main__":
    main()
