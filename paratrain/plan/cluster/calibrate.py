"""`paratrain plan --calibrate OUT.json`: measure this machine and write a cluster file.

Phase 1, compute (calibrate_compute.py): square matmuls in fp32, and in bf16 where the device
has it; a table of matmul rates by shape; Adam's rate by tensor size; element-wise work per byte.
On the CPU, with one thread (a device is one core: the cluster's `gpus_per_node` is the core
count), and square matmuls with all of them too (`measured["matmul_all_threads"]`). The measured
rate is the achieved one, so the file's matmul_efficiency is 1.0. The process first keeps freed
blocks for reuse, as the ranks `paratrain run` starts do (launch/cpu_malloc.py): otherwise Adam's
temporaries are mapped afresh, page by page, a varying part of the time.

Phase 2, collectives: `Settings.world` ranks (testing.run_on_ranks: gloo on the CPU, nccl and one
GPU each on a CUDA machine) run all-reduce, all-gather, reduce-scatter and broadcast on messages
of `Settings.sizes` bytes; each point is the fastest of `Settings.trials` trials (taken in passes
over all the points), each the mean time of `Settings.repeats` back-to-back calls started together
(a barrier), on the slowest rank:
other work on the machine only ever adds time, so the fastest trial is the closest to the
machine's own figure. comm_model.py says a collective costs `steps·α + volume·S/β` with steps and
volume known for each (its `TERMS`), so α and 1/β come from a linear least-squares fit, each row
divided by its time (relative errors: the small messages, which fix α, count as much as the
large ones, which fix β). Each collective's own fit is its `collective_links` entry (with its
points in `measured["collectives"]`); the fit over all of them together is the intra-node link
of everything else (p2p). One node is all that is measured:
the inter-node link is written equal to it, an assumption the file's `sources` states.

On a CUDA machine the same code times CUDA matmuls and NCCL on min(2, GPUs) devices; it needs
two GPUs for the collectives. (Written for it, not yet run there: the development machines have
no GPU.)
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from paratrain.distributed.comm import all_gather_single, reduce_scatter_single
from paratrain.distributed.topology import Topology
from paratrain.errors import ConfigError
from paratrain.launch.cpu_malloc import keep_freed_blocks
from paratrain.plan.cluster.calibrate_compute import (
    DTYPES,
    Settings,
    elementwise_rate,
    matmul_rates,
    matmul_table,
    optimizer_rate,
    optimizer_table,
    sync_device,
    traffic_rate,
)
from paratrain.plan.cluster.cluster import Cluster, Link
from paratrain.plan.cost.comm_model import TERMS, Terms
from paratrain.testing import run_on_ranks


@dataclass
class Measured:
    flops: dict[str, float]  # dtype -> FLOP/s per device
    points: dict[str, list[tuple[int, float]]]  # collective -> (bytes, seconds)
    extra: dict = field(default_factory=dict)


def calibrate(settings: Settings = Settings(), *, name: str = "calibrated") -> Cluster:
    """Measure this machine (module docstring) and describe it as a one-node Cluster."""
    cuda = torch.cuda.is_available()
    world = min(settings.world, torch.cuda.device_count()) if cuda else settings.world
    if world < 2:
        raise ConfigError("calibrating collectives needs 2 ranks, and this machine has one GPU: "
                          "run it where two are, or set the links of a cluster file by hand")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    keep_freed_blocks()
    threads = torch.get_num_threads()
    extra: dict = {}
    try:
        if not cuda:
            extra["matmul_all_threads"] = matmul_rates(settings, device)
            torch.set_num_threads(1)  # one device: one core
        flops = matmul_rates(settings, device)
        extra["matmul_rates"] = {dtype: matmul_table(settings, device, DTYPES[dtype]) for dtype in flops}
        extra["optimizer_rates"] = optimizer_table(settings, device)
        # the flat rate is the table's 2^20 row where it has one (eight such tensors either way)
        extra["optimizer_rate"] = dict(extra["optimizer_rates"]).get(2**20) or optimizer_rate(settings, device)
        extra["elementwise_rate"] = elementwise_rate(settings, device)
        extra["traffic_rate"] = traffic_rate(settings, device)
    finally:
        torch.set_num_threads(threads)
    results = run_on_ranks(time_collectives, world, settings, backend="nccl" if cuda else "gloo",
                           threads=1, timeout=300)
    points = {op: [(size, max(r[op][i][1] for r in results)) for i, (size, _) in enumerate(results[0][op])]
              for op in results[0]}
    return describe(Measured(flops, points, extra), world, device, name)


def time_collectives(topology: Topology, settings: Settings) -> dict[str, list[tuple[int, float]]]:
    """On every rank: (bytes, seconds) of each collective at each size (module docstring), the
    trials taken in passes over every collective and size rather than back to back, so that a
    slow spell of the machine costs each point one trial, not all of them."""
    n, device = topology.world_size, topology.device
    points = []  # (op, bytes, call)
    for size in settings.gpu_sizes if device.type == "cuda" else settings.sizes:
        numel = max(n, size // 4 // n * n)  # float32, divisible by n
        whole = torch.ones(numel, device=device)
        piece = torch.ones(numel // n, device=device)
        points += [("all_reduce", numel * 4, functools.partial(dist.all_reduce, whole)),
                   ("reduce_scatter", numel * 4, functools.partial(reduce_scatter_single, piece, whole)),
                   ("all_gather", numel * 4, functools.partial(all_gather_single, whole, piece)),
                   ("broadcast", numel * 4, functools.partial(dist.broadcast, whole, src=0))]
    for _, _, call in points:
        call()  # warm-up: connections, buffers
    best = [float("inf")] * len(points)
    for _ in range(settings.trials):
        for i, (_, _, call) in enumerate(points):
            best[i] = min(best[i], _time(call, settings, device))
    out: dict[str, list[tuple[int, float]]] = {op: [] for op in TERMS}
    for (op, nbytes, _), seconds in zip(points, best):
        out[op].append((nbytes, seconds))
    return out


def _time(call, settings: Settings, device: torch.device) -> float:
    """Mean seconds of `settings.repeats` back-to-back calls, started together (a barrier)."""
    dist.barrier()
    sync_device(device)
    start = time.perf_counter()
    for _ in range(settings.repeats):
        call()
    sync_device(device)
    return (time.perf_counter() - start) / settings.repeats


def fit(points: list[tuple[int, float, Terms]]) -> Link:
    """α and β of `steps·α + volume·S/β` by least squares over relative errors; α ≥ 0."""
    rows = np.array([[terms.steps, terms.volume * size] for size, _, terms in points], dtype=float)
    times = np.array([t for _, t, _ in points], dtype=float)
    weights = 1 / times
    (alpha, inverse_beta), *_ = np.linalg.lstsq(rows * weights[:, None], np.ones_like(times), rcond=None)
    if alpha < 0:  # latency too small to see: bandwidth alone
        alpha = 0.0
        inverse_beta = float(np.sum(rows[:, 1] * weights**2 * times) / np.sum((rows[:, 1] * weights) ** 2))
    if inverse_beta <= 0:
        raise ConfigError("the collective timings do not grow with the message size beyond their noise: "
                          "calibrate again on a quieter machine (and without --quick)")
    return Link(bandwidth=float(1 / inverse_beta), latency=float(alpha))


def describe(measured: Measured, world: int, device: torch.device, name: str) -> Cluster:
    """The one-node Cluster the measurements describe."""
    rows = {op: [(size, t, TERMS[op](world)) for size, t in pts] for op, pts in measured.points.items()}
    link = fit([row for r in rows.values() for row in r])
    per_op = {op: _fit_or_why(r) | {"points": measured.points[op]} for op, r in rows.items()}
    cuda = device.type == "cuda"
    memory = torch.cuda.get_device_properties(device).total_memory if cuda else _host_memory()
    when = time.strftime("%Y-%m-%d")
    return Cluster(
        name=name, gpus_per_node=torch.cuda.device_count() if cuda else (os.cpu_count() or 1),
        peak_flops=dict(measured.flops), matmul_efficiency=1.0, device_memory=memory,
        host_memory=_host_memory(), intra=link, inter=link, device=device.type,
        collective_links={op: Link(fitted["bandwidth"], fitted["latency"]) for op, fitted in per_op.items()
                          if fitted["bandwidth"] is not None},
        backend="nccl" if cuda else "gloo",
        sources={"all": f"measured by paratrain plan --calibrate on {when} ({world} ranks)",
                 "peak_flops": "achieved matmul rate, so matmul_efficiency is 1.0"
                               + ("" if cuda else "; one thread per device (core)"),
                 "inter": "assumption: one node was measured; the inter-node link is the intra-node one"},
        optimizer_rate=measured.extra.get("optimizer_rate", 0.0),
        elementwise_rate=measured.extra.get("elementwise_rate", 0.0),
        matmul_rates=measured.extra.get("matmul_rates", {}),
        optimizer_rates=measured.extra.get("optimizer_rates", []),
        traffic_rate=measured.extra.get("traffic_rate", 0.0),
        measured={"collectives": per_op, **{k: v for k, v in measured.extra.items()
                                            if k not in ("matmul_rates", "optimizer_rates")}})


def _fit_or_why(rows: list) -> dict:
    """One collective's own fit (a noisy one may have none: the joint fit still stands)."""
    try:
        link = fit(rows)
    except ConfigError as e:
        return {"latency": None, "bandwidth": None, "why": str(e)}
    return {"latency": link.latency, "bandwidth": link.bandwidth}


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
