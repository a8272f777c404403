"""What the planner knows about the machines: a `Cluster` of identical nodes, each holding
`gpus_per_node` devices, linked by a fast fabric inside a node and a slower one between nodes.

Each figure of a preset says where it comes from (`sources`): a vendor datasheet, a measurement
by `paratrain plan --calibrate`, or an assumption. Peak FLOP/s are dense (no 2:4 sparsity) per
device; no large training job reaches them, so the cost model multiplies them by
`matmul_efficiency`, which is always an assumption for a preset and a measurement (1.0: the
measured rate is already the achieved one) for a calibrated file.

Bandwidths are per device and per direction (bytes/s one rank sends while it also receives), the
β of the alpha-beta model (comm_model.py); latencies are the α of one step of a collective.

    cluster = load_cluster("h100-8x")  # cluster/presets.py: a preset, or a JSON file written by save_cluster
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from paratrain.errors import ConfigError

GB = 10**9  # link and memory figures in datasheets are decimal (GB/s, Gb/s); device memory is GiB
GiB = 2**30
TERA = 10**12


@dataclass(frozen=True)
class Link:
    """One kind of connection as one device sees it."""

    bandwidth: float  # β: bytes/s a device sends over it while receiving as much (one direction)
    latency: float  # α: seconds of fixed cost per step of a collective over it


@dataclass(frozen=True)
class Cluster:
    """Identical nodes of `gpus_per_node` devices (for a CPU machine: processes, one per core)."""

    name: str
    gpus_per_node: int  # devices per node
    peak_flops: dict[str, float]  # dtype name ("fp32", "tf32", "bf16", "fp16") -> dense FLOP/s per device
    matmul_efficiency: float  # achievable fraction of peak for large matmuls (an assumption for presets)
    device_memory: int  # bytes per device
    host_memory: int  # bytes per node (CPU offload lands here)
    intra: Link  # between devices of one node (NVLink; loopback for a CPU machine)
    inter: Link  # between nodes (InfiniBand per GPU)
    device: str = "cuda"  # "cuda" or "cpu": what the ranks compute on
    backend: str = "nccl"  # the process group backend the figures were taken for
    sources: dict[str, str] = field(default_factory=dict)  # figure -> where it comes from
    # intra-node links fitted per collective ("all_reduce", "reduce_scatter", "all_gather",
    # "broadcast") by calibration; each replaces `intra` for its collective (comm_model.py)
    collective_links: dict[str, Link] = field(default_factory=dict)
    measured: dict = field(default_factory=dict)  # calibration's raw fits (calibrate.py), if any
    # what matmuls leave out (step_time.py); 0: not timed
    optimizer_rate: float = 0.0  # elements per second an element-wise optimizer (Adam) steps per device
    elementwise_rate: float = 0.0  # saved-activation bytes per second the non-matmul work of a
    # forward and backward gets through (norms, activations, softmax, residuals, the loss)
    # dtype -> [m, k, n, achieved FLOP/s] over a grid of shapes (calibrate.py matmul_table); a
    # dtype without one times every matmul at flops(dtype) (plan/model/matmuls.py)
    matmul_rates: dict[str, list[list[float]]] = field(default_factory=dict)
    # [elements per tensor, elements/s] the optimizer steps tensors of that size at (calibrate.py
    # optimizer_table): a tensor that fits in cache steps faster; none: optimizer_rate for all
    optimizer_rates: list[list[float]] = field(default_factory=list)
    # bytes/s the non-matmul ops read and write, counted as plan/matmuls.Recorder counts them
    # (calibrate.py traffic_rate); 0: elementwise_rate over the saved activations instead
    traffic_rate: float = 0.0
    # ZeRO's offload (step_time.offload): the copies between a device and its host's memory (PCIe),
    # and the elements/s the host's cores step the optimizer at for one device's rank. None and 0
    # on a CPU cluster, whose "device" memory is the host's: there offload moves nothing
    host_link: Link | None = None
    host_optimizer_rate: float = 0.0

    def __post_init__(self):
        if self.gpus_per_node < 1 or not 0 < self.matmul_efficiency <= 1:
            raise ConfigError(f"cluster {self.name!r}: gpus_per_node must be at least 1 and "
                              f"matmul_efficiency in (0, 1]; got {self.gpus_per_node}, {self.matmul_efficiency}")
        links = [("intra", self.intra), ("inter", self.inter), *self.collective_links.items()]
        bad = [k for k, link in links if link.bandwidth <= 0 or link.latency < 0]
        if bad or not self.peak_flops:
            raise ConfigError(f"cluster {self.name!r}: needs peak_flops and links with positive bandwidth "
                              f"and non-negative latency (check {', '.join(bad) or 'peak_flops'})")

    def flops(self, dtype: str) -> float:
        """Achievable matmul FLOP/s per device in `dtype`: peak × matmul_efficiency."""
        if dtype not in self.peak_flops:
            raise ConfigError(f"cluster {self.name!r} gives no peak FLOP/s for {dtype}; "
                              f"it has {', '.join(sorted(self.peak_flops))}")
        return self.peak_flops[dtype] * self.matmul_efficiency

    def matmul_rate(self, dtype: str) -> Callable[[int, int, int], float]:
        """FLOP/s of an (m × k) @ (k × n) product in `dtype`: interpolated in the calibrated
        table (log-rate, trilinear in log-dimensions, clamped to the grid), else flops(dtype)."""
        rows = self.matmul_rates.get(dtype)
        if not rows:
            flat = self.flops(dtype)
            return lambda m, k, n: flat
        axes = [sorted({int(row[i]) for row in rows}) for i in range(3)]
        rates = {(int(m), int(k), int(n)): rate for m, k, n, rate in rows}
        if len(rates) != len(axes[0]) * len(axes[1]) * len(axes[2]) or min(rates.values()) <= 0:
            raise ConfigError(f"cluster {self.name!r}: matmul_rates[{dtype!r}] must hold a positive rate "
                              "for every (m, k, n) of a grid; calibrate again")

        def rate(*dims: int) -> float:
            corners = [_bracket(axis, d) for axis, d in zip(axes, dims)]  # (low, high, weight of high)
            weighted = []
            for pick in itertools.product((0, 1), repeat=3):
                weight, corner = 1.0, []
                for (low, high, w), p in zip(corners, pick):
                    weight *= w if p else 1 - w
                    corner.append(high if p else low)
                if weight:
                    weighted.append((weight, rates[tuple(corner)]))
            if len(weighted) == 1:  # a grid point: its own figure
                return weighted[0][1]
            return math.exp(sum(weight * math.log(r) for weight, r in weighted))
        return rate

    def optimizer_rate_for(self, elements: int) -> float:
        """Elements/s the optimizer steps a tensor of `elements` at: log-interpolated in the
        calibrated sizes (clamped), else optimizer_rate."""
        if not self.optimizer_rates:
            return self.optimizer_rate
        sizes = sorted(int(size) for size, _ in self.optimizer_rates)
        rates = {int(size): rate for size, rate in self.optimizer_rates}
        low, high, w = _bracket(sizes, max(1, elements))
        return rates[low] if not w else math.exp((1 - w) * math.log(rates[low]) + w * math.log(rates[high]))


def _bracket(axis: list[int], d: int) -> tuple[int, int, float]:
    """The grid values around `d` and the weight of the upper one, in log2 (clamped at the ends)."""
    if d <= axis[0] or len(axis) == 1:
        return axis[0], axis[0], 0.0
    if d >= axis[-1]:
        return axis[-1], axis[-1], 0.0
    high = next(i for i, v in enumerate(axis) if v >= d)
    low = axis[high - 1]
    return low, axis[high], math.log2(d / low) / math.log2(axis[high] / low)


def from_dict(raw: dict, where: str = "cluster") -> Cluster:
    names = {f.name for f in dataclasses.fields(Cluster)}
    unknown = sorted(set(raw) - names)
    missing = sorted(f.name for f in dataclasses.fields(Cluster) if f.name not in raw
                     and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    if unknown or missing:
        raise ConfigError(f"{where}: unknown fields {unknown} and missing fields {missing}; "
                          f"a cluster file has {sorted(names)}")
    try:
        links = {op: Link(**link) for op, link in raw.get("collective_links", {}).items()}
        host = raw.get("host_link")
        return Cluster(**{**raw, "intra": Link(**raw["intra"]), "inter": Link(**raw["inter"]),
                          "collective_links": links, "host_link": Link(**host) if host else None})
    except TypeError as e:  # a link with other fields than bandwidth and latency
        raise ConfigError(f"{where}: each link has bandwidth (bytes/s) and latency (s): {e}") from None


def save_cluster(cluster: Cluster, path: str | Path) -> None:
    """Write `cluster` as JSON (what `load_cluster` reads back)."""
    Path(path).write_text(json.dumps(dataclasses.asdict(cluster), indent=2) + "\n")
