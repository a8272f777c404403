"""`paratrain plan MODEL`: what one training step of MODEL costs (model/probe.py), and
`paratrain plan --calibrate OUT.json`: measure this machine into a cluster file (calibrate.py).

    paratrain plan gpt2-xl --batch 8 --seq 1024 --precision bf16 [--cluster h100-8x] [--gpus 8] [--json]
    paratrain plan gpt2-xl --gpus 8 --cluster h100-8x --batch 8 --seq 1024 --png scaling.png
    paratrain plan gpt2-xl --gpus 8 --nodes 2 --cluster h100-8x --batch 8 --seq 1024
    paratrain plan gpt2-xl --gpus 8 --cluster h100-8x --batch 64 --accumulate 4 --seq 1024
    paratrain plan llama-2-70b --gpus 1024 --cluster h100-8x --batch 1024 --seq 4096 --precision bf16 --search
    paratrain plan mypackage.models:build --batch 32
    paratrain plan --calibrate cpu.json

It prints the model's facts and, with `--gpus N`, each strategy's memory per rank on N devices
(memory_table.py, memory.py; `--batch` is the global batch); with `--cluster` too, each one's
step time, throughput and MFU, and the plan to use (recommend.py, step_time.py, traffic.py).
A model that no strategy fits is exit status 2, with what would make it fit. `--png FILE` draws
the leading strategies' throughput and memory per device from 1 to 1,024 devices (scaling.py).
`--nodes M` spreads the N devices evenly over M nodes (N/M each, at most the cluster's
gpus_per_node; default: the fewest whole nodes of the cluster's size): which collectives leave a
node (comm_model.py), hierarchical's node groups, and the node size --png scales with. The
pt.Session(...) line does not change: a session reads the node layout from its launcher.
`--search [TOP]` (with --gpus and --cluster) also searches every layout of the step over the N
devices: tp × cp × pp × virtual × the data-parallel strategy × micro-batches × checkpointing
(plan/search.py), and prints the TOP (default 5) fastest that fit, each with its Session line.
`--accumulate K` plans gradient accumulation (Session(accumulate=K)): `--batch` stays the
optimizer step's, run as K micro-batches of batch/K (recommend.py).
Bad input (an unknown model, preset or file, a factory that raises) is one line on stderr and
exit status 2, as everywhere in the CLI.

`--json` prints one object (schema "paratrain.plan/0"; sizes in bytes, times in seconds):

    schema            "paratrain.plan/0"
    model             null when only calibrating; else:
      name, batch, seq (null: no sequence), tokens (batch × seq, or batch), precision
      params, trainable_params, param_bytes, buffer_bytes
      step            one forward and backward of the batch, without checkpointing:
        flops_forward, flops_backward     2 FLOPs per multiply-add, matmuls and attention only
        activation_bytes                  saved for backward (distinct storages, no parameters)
        transient_bytes                   the most the forward and backward hold at once beyond the
                                          parameters, buffers and their gradients (activations, their
                                          gradients, temporaries)
        block_activation_bytes            {block name: the part saved while it ran}
        block_output_bytes                {block name: its output, what a pipeline cut after it sends}
        block_flops                       {block name: the forward FLOPs while it ran}
        lead_flops, lead_activation_bytes forward FLOPs and saved bytes before the first block
                                          (the rest, after the last: a pipeline's last stage)
        extended                          counted from copies cut to 1 and 2 blocks (see notes)
        matmuls                           [[[phase, b, m, k, n, [which of b, m, k, n follow the
                                          batch]], count], ...]: b products of (m × k) @ (k × n)
                                          (plan/model/matmuls.py)
        traffic                           [forward_fixed, forward_per_batch, backward_fixed,
                                          backward_per_batch]: bytes the other ops read and write
        attention_kv_bytes                the keys and values of every attention call in forward
                                          (what context parallelism passes around its ring)
        attention_calls                   F.scaled_dot_product_attention calls in forward
        weight_copy_bytes                 autocast's low-precision copies of the weights, one
                                          each (fp32 parameters under bf16 or fp16; not in the
                                          activations: each rank holds those of its weights)
        checkpointed                      [] here
      checkpointed    the same with --activation-checkpointing's modules checkpointed
                      (`checkpointed` names them; flops_backward includes the recompute), or null
      flops_per_token {forward, backward}: the step's, divided by tokens
      notes           [how the counts were made, e.g. a stack of blocks counted from 1 and 2]
    cluster           null without --cluster; else the cluster file's fields (cluster.py)
    compute_seconds   null without --cluster; else {step, step_checkpointed}: the step's FLOPs on
                      one device at the cluster's achievable rate for the precision (no
                      communication, no overlap: a lower bound)
    calibrated        the file --calibrate wrote, or null
    accumulate        micro-batches per optimizer step (--accumulate; 1 without)
    nodes             null without --gpus; else how many nodes the devices are spread over, evenly
                      (--nodes, or the fewest of the cluster's size; 1 without --cluster)
    strategies        null without --gpus; else one row per strategy (its default settings, the
                      --optimizer's state, --batch split over the ranks and --accumulate's
                      micro-batches), for its fullest rank:
      strategy, label, rank  the strategy's name; as the table shows it (a pipeline: "pipeline
                      SxM", stages × micro-batches; ZeRO with offload: "zero3+offload", rows
                      left out on a cluster without a host link); the rank whose device_peak
                      is largest
      params, grads, optimizer   exact bytes at rest (after a step, before zero_grad)
      comm_buffers, gathered     upper bounds of what backward / ZeRO-3's gathers add
      activations                approximate: the step's transient_bytes (at least its
                                 activation_bytes), this rank's share
      weight_copies              approximate: autocast's low-precision copies of the weights
                                 this rank computes with (fp32 parameters under --precision
                                 bf16 or fp16), held through the backward (plan/cost/memory.py)
      workspace                  approximate: the optimizer step's temporaries on the device
                                 (optimizer_state.OptimizerState.workspace; foreach on a cuda cluster)
      host                       of params + grads + optimizer: in CPU memory (offload)
      fresh_grads                of grads on the device: freed by zero_grad and made again as
                                 the backward frees the activations (zero2's slices, zero3's shards)
      comm_at_start              of comm_buffers, what the backward holds at its start (zero2: the
                                 bucket it fills first); null: all of them
      at_rest, device_peak       params + grads + optimizer; on the device at the peak: at_rest
                                 - host - fresh_grads + max(weight_copies + gathered +
                                 max(activations + comm_at_start, comm_buffers + fresh_grads),
                                 fresh_grads + workspace)
      with --cluster too:
      activation_checkpointing   whether this row checkpoints (tried when it does not fit without)
      session         the pt.Session(...) line that runs it
      fits            device_peak is within the cluster's device memory, and host times the
                      devices per node within its host memory
      step_seconds    compute_seconds + exposed_comm_seconds + bubble_seconds + optimizer_seconds
                      (step_time.py; compute includes the element-wise work; with offload the
                      optimizer is the host's and the copies over its link are exposed comm)
      comm_seconds    every collective's time, hidden by compute or not
      per_device_per_second      tokens (or samples, without a sequence) per second per device
      mfu             the model's FLOPs per step / (step_seconds × devices × peak FLOP/s)
      or strategy, label, error  a strategy that cannot run the model on N ranks, and why
    recommended       null, or the fitting row with the most per_device_per_second: its `session`
    fit_advice        null, or when nothing fits (with --cluster): what would (recommend.smallest_fit)
    search            null without --search; else the fastest layouts that fit, fastest first, each
                      a row as in strategies (plan/search.py); the search ignores --accumulate
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from paratrain.errors import ConfigError
from paratrain.plan.cluster.calibrate import Settings, calibrate
from paratrain.plan.cluster.cluster import Cluster, save_cluster
from paratrain.plan.cluster.presets import PRESETS as CLUSTERS
from paratrain.plan.cluster.presets import load_cluster
from paratrain.plan.cost.layouts import reused
from paratrain.plan.cost.optimizer_state import OPTIMIZERS
from paratrain.plan.memory_table import describe_memory, memory_rows, strategies
from paratrain.plan.model.probe import ModelFacts, StepCount, model_facts
from paratrain.plan.model.source import PRESETS as MODELS
from paratrain.plan.model.source import resolve
from paratrain.plan.recommend import FLOPS_DTYPE, describe_plan, nodes_for, plan_rows, recommend, smallest_fit
from paratrain.plan.scaling import draw, leaders, scaling
from paratrain.plan.search import describe_search, search

SCHEMA = "paratrain.plan/0"
QUICK = Settings(sizes=(2**12, 2**18, 2**20), repeats=2, trials=2, matmul_size=256, matmul_seconds=0.2,
                 matmul_grid=(64, 512, 4096), shape_seconds=0.03)


def add_plan_parser(commands) -> None:
    plan = commands.add_parser(
        "plan", help="what a training step of a model costs; --calibrate: measure this machine",
        description="Count a model's parameters, FLOPs and saved activations per step on fake tensors "
        "(no memory, nothing downloaded), with and without activation checkpointing.")
    plan.add_argument("model", nargs="?", metavar="MODEL",
                      help=f"package.module:factory, a transformers config.json, or one of {', '.join(MODELS)}")
    plan.add_argument("--batch", type=int, default=1, help="samples per optimizer step, over every rank (default: 1)")
    plan.add_argument("--accumulate", type=int, default=1, metavar="K",
                      help="micro-batches per optimizer step, each --batch / K samples (default: 1)")
    plan.add_argument("--seq", type=int, help="tokens per sample (default: the config's context length)")
    plan.add_argument("--precision", choices=("32", "bf16", "fp16"), default="32",
                      help="autocast, as Session(precision=...) (default: 32)")
    plan.add_argument("--activation-checkpointing", choices=("auto", "none"), default="auto",
                      help="which modules the second count checkpoints: the repeated blocks, or none")
    plan.add_argument("--cluster", metavar="PRESET|FILE",
                      help=f"a cluster ({', '.join(CLUSTERS)}, or a JSON file) to time the compute on")
    plan.add_argument("--exact", action="store_true",
                      help="run every block, not the first one and two of a stack of identical ones")
    plan.add_argument("--gpus", type=int, metavar="N", help="also predict each strategy's memory per rank on N devices")
    plan.add_argument("--nodes", type=int, metavar="M", help="spread the N devices evenly over M nodes "
                      "(default: whole nodes of the cluster's size)")
    plan.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adam",
                      help="whose state the memory table counts (default: adam)")
    plan.add_argument("--png", metavar="FILE", help="with --gpus and --cluster: draw predicted throughput and "
                      "memory per device against 1 to 1,024 devices for the leading strategies (plan/scaling.py)")
    plan.add_argument("--search", type=int, nargs="?", const=5, metavar="TOP",
                      help="with --gpus and --cluster: search tp, cp, pp, virtual, the dp strategy, micro-batches "
                      "and checkpointing for the TOP (default 5) fastest layouts that fit (plan/search.py)")
    plan.add_argument("--json", action="store_true", help="one JSON object (schema: paratrain/cli/plan.py)")
    plan.add_argument("--calibrate", metavar="OUT.json", help="measure this machine and write a cluster file")
    plan.add_argument("--quick", action="store_true", help="with --calibrate: fewer, smaller measurements")


def plan(args: argparse.Namespace) -> None:
    with reused():  # nothing changes a model while the command plans it (plan/cost/layouts.py)
        _plan(args)


def _plan(args: argparse.Namespace) -> None:
    if not args.model and not args.calibrate:
        raise ConfigError("name a MODEL to plan, or --calibrate OUT.json to measure this machine")
    if args.gpus is not None and args.gpus < 1:
        raise ConfigError(f"--gpus must be at least 1; got {args.gpus}")
    if args.accumulate < 1 or args.batch % args.accumulate:
        raise ConfigError(f"--accumulate {args.accumulate} splits --batch {args.batch} into micro-batches: give a "
                          f"--batch that is a multiple of it (or --accumulate 1)")
    if args.search is not None and (args.gpus is None or not args.cluster or not args.model or args.search < 1):
        raise ConfigError("--search ranks layouts over the devices of a cluster: give MODEL, --gpus N and --cluster, "
                          "and a TOP of at least 1")
    if args.nodes is not None and args.gpus is None:
        raise ConfigError(f"--nodes {args.nodes} spreads the devices of --gpus over nodes: give --gpus N too")
    calibrated = None
    if args.calibrate:
        calibrated = calibrate(QUICK if args.quick else Settings(), name=Path(args.calibrate).stem)
        save_cluster(calibrated, args.calibrate)
    cluster = load_cluster(args.cluster) if args.cluster else None
    nodes = nodes_for(args.gpus, cluster, args.nodes) if args.gpus is not None else None
    facts = None
    if args.model:
        which = None if args.activation_checkpointing == "none" else "auto"
        facts = model_facts(resolve(args.model), args.batch, args.seq, precision=args.precision,
                            activation_checkpointing=which, exact=args.exact)
    rows = _memory(args, facts, cluster, nodes) if args.gpus is not None and facts is not None else None
    timed = rows is not None and cluster is not None
    best = recommend(rows) if timed else None
    advice = None if best is not None or not timed else \
        smallest_fit(resolve(args.model), facts, cluster, gpus=args.gpus, optimizer=args.optimizer,
                     accumulate=args.accumulate)
    if args.png:
        _draw_scaling(args, facts, cluster, rows, nodes)
    searched = search(resolve(args.model), facts, cluster, gpus=args.gpus, optimizer=args.optimizer, nodes=nodes,
                      top=args.search) if args.search else None
    if args.json:
        print(json.dumps({**to_json(facts, cluster, args.calibrate), "accumulate": args.accumulate,
                          "nodes": nodes, "strategies": rows,
                          "recommended": best["session"] if best else None, "fit_advice": advice,
                          "search": searched}, indent=2))
        return
    if calibrated is not None:
        print(describe_cluster(calibrated, f"wrote {args.calibrate}, cluster"))
    if cluster is not None:
        print(describe_cluster(cluster, "cluster"))
    if facts is not None:
        print(describe_facts(facts, cluster))
    if rows is not None:
        print(describe_memory(rows, gpus=args.gpus, optimizer=args.optimizer, size=_bytes))
    if timed:
        print(describe_plan(rows, gpus=args.gpus, cluster=cluster, per="token" if facts.seq else "sample", size=_bytes,
                            nodes=nodes))
    if searched is not None:
        print(describe_search(searched, gpus=args.gpus, cluster=cluster, per="token" if facts.seq else "sample"))
    if advice is not None:
        raise ConfigError(f"no strategy fits {facts.name} in {_bytes(cluster.device_memory)} per device on "
                          f"{args.gpus} {cluster.name} device(s); {advice}")


def _draw_scaling(args: argparse.Namespace, facts: ModelFacts, cluster: Cluster | None, rows: list[dict] | None,
                  nodes: int | None) -> None:
    if rows is None or cluster is None:
        raise ConfigError("--png draws the strategies' predictions: give --gpus N and --cluster too")
    per_device = max(1, facts.batch // args.gpus)
    per_node = args.gpus // nodes if args.nodes else cluster.gpus_per_node
    points = scaling(resolve(args.model), facts, cluster, optimizer=args.optimizer, per_device=per_device,
                     per_node=per_node, accumulate=args.accumulate)
    where = f"{cluster.name}, {per_node} per node" if args.nodes else cluster.name
    draw(points, leaders(rows), args.png, per="token" if facts.seq else "sample", device_memory=cluster.device_memory,
         title=f"{facts.name} on {where}, {per_device} sample(s) per device, precision {facts.precision}")


def _memory(args: argparse.Namespace, facts: ModelFacts, cluster: Cluster | None, nodes: int) -> list[dict]:
    """The table's rows: the model built again on the meta device, the step's activations split
    over the ranks, the ranks spread evenly over `nodes`; with a cluster, each row timed too (recommend.py)."""
    if cluster is not None:
        return plan_rows(resolve(args.model), facts, cluster, gpus=args.gpus, optimizer=args.optimizer, nodes=nodes,
                         accumulate=args.accumulate)
    chosen = strategies(args.gpus, attention=facts.step.attention_calls > 0)
    return memory_rows(resolve(args.model), gpus=args.gpus, optimizer=args.optimizer, gpus_per_node=args.gpus // nodes,
                       activation_bytes=facts.step.activation_peak_bytes, accumulate=args.accumulate, step=facts.step,
                       chosen=chosen)


def to_json(facts: ModelFacts | None, cluster: Cluster | None, calibrated: str | None) -> dict:
    """The --json object (module docstring)."""
    model = None
    if facts is not None:
        model = dataclasses.asdict(facts)
        model["tokens"] = facts.tokens
        model["flops_per_token"] = {"forward": facts.step.flops_forward / facts.tokens,
                                    "backward": facts.step.flops_backward / facts.tokens}
    seconds = None
    if facts is not None and cluster is not None:
        rate = cluster.flops(FLOPS_DTYPE[facts.precision])
        seconds = {"step": _flops(facts.step) / rate,
                   "step_checkpointed": _flops(facts.checkpointed) / rate if facts.checkpointed else None}
    return {"schema": SCHEMA, "model": model, "cluster": dataclasses.asdict(cluster) if cluster else None,
            "compute_seconds": seconds, "calibrated": calibrated}


def _flops(step: StepCount) -> int:
    return step.flops_forward + step.flops_backward


def describe_facts(facts: ModelFacts, cluster: Cluster | None) -> str:
    step, ckpt = facts.step, facts.checkpointed
    shape = f"{facts.batch} × {facts.seq} tokens" if facts.seq else f"{facts.batch} samples"
    lines = [f"model {facts.name}: {facts.params:,} parameters ({_bytes(facts.param_bytes)}), "
             f"{facts.trainable_params:,} trainable; buffers {_bytes(facts.buffer_bytes)}",
             f"one step of {shape}, precision {facts.precision}:",
             f"  FLOPs       forward {_flop(step.flops_forward)}, backward {_flop(step.flops_backward)}; "
             f"per {'token' if facts.seq else 'sample'} {_flop(_flops(step) / facts.tokens)} "
             f"({_flops(step) / facts.tokens / max(facts.params, 1):.2f} × parameters)",
             f"  activations {_bytes(step.activation_bytes)} saved for backward; "
             f"{_bytes(step.activation_peak_bytes)} at the backward's peak, with their gradients and temporaries"]
    if step.weight_copy_bytes:
        lines.append(f"  autocast's copies of the weights {_bytes(step.weight_copy_bytes)} "
                     f"({facts.precision} casts of the fp32 parameters, held through the backward)")
    if ckpt is not None:
        lines.append(f"  checkpointing {len(ckpt.checkpointed)} modules ({_span(ckpt.checkpointed)}): "
                     f"activations {_bytes(ckpt.activation_bytes)} ({_bytes(ckpt.activation_peak_bytes)} at the peak), "
                     f"backward {_flop(ckpt.flops_backward)} "
                     f"(+{_flop(ckpt.flops_backward - step.flops_backward)} recomputed)")
    if cluster is not None:
        rate = cluster.flops(FLOPS_DTYPE[facts.precision])
        lines.append(f"  compute on one {cluster.name} device at {_flop(rate)}/s: {_flops(step) / rate:.3g} s "
                     "per step (no communication: a lower bound)")
    lines += [f"  ({note})" for note in facts.notes]
    return "\n".join(lines)


def describe_cluster(cluster: Cluster, head: str) -> str:
    rates = ", ".join(f"{dtype} {_flop(rate)}/s" for dtype, rate in cluster.peak_flops.items())
    return (f"{head} {cluster.name}: {cluster.gpus_per_node} {cluster.device} device(s) per node, "
            f"{_bytes(cluster.device_memory)} each; peak {rates} (× {cluster.matmul_efficiency:g} achievable)\n"
            f"  intra-node α {cluster.intra.latency * 1e6:.3g} µs, β {cluster.intra.bandwidth / 1e9:.3g} GB/s; "
            f"inter-node α {cluster.inter.latency * 1e6:.3g} µs, β {cluster.inter.bandwidth / 1e9:.3g} GB/s")


def _span(names: tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} … {names[-1]}"


def _flop(value: float) -> str:
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if value >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.3g} FLOP"


def _bytes(value: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.3g} {unit}" if value < 1000 * size else f"{value / size:.0f} {unit}"
    return f"{int(value)} B"
