"""What the planner knows about the machines: a `Cluster` of identical nodes, each holding
`gpus_per_node` devices, linked by a fast fabric inside a node and a slower one between nodes.

Each figure of a preset says where it comes from (`sources`): a vendor datasheet, a measurement
by `paratrain plan --calibrate`, or an assumption. Peak FLOP/s are dense (no 2:4 sparsity) per
device; no large training job reaches them, so the cost model multiplies them by
`matmul_efficiency`, which is always an assumption for a preset and a measurement (1.0: the
measured rate is already the achieved one) for a calibrated file.

Bandwidths are per device and per direction (bytes/s one rank sends while it also receives), the
β of the alpha-beta model (comm_model.py); latencies are the α of one step of a collective.

    cluster = load_cluster("h100-8x")          # a preset, or a JSON file written by save_cluster
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
    # dtype without one times every matmul at flops(dtype) (plan/matmuls.py)
    matmul_rates: dict[str, list[list[float]]] = field(default_factory=dict)
    # [elements per tensor, elements/s] the optimizer steps tensors of that size at (calibrate.py
    # optimizer_table): a tensor that fits in cache steps faster; none: optimizer_rate for all
    optimizer_rates: list[list[float]] = field(default_factory=list)
    # bytes/s the non-matmul ops read and write, counted as plan/matmuls.Recorder counts them
    # (calibrate.py traffic_rate); 0: elementwise_rate over the saved activations instead
    traffic_rate: float = 0.0

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


# Adam reads and writes the parameter and both moments and reads the gradient: 28 bytes per fp32
# element, memory-bound on a GPU; and each saved activation byte is read and written by about
# this many element-wise kernels over a forward and backward (an assumption)
ADAM_BYTES, ELEMENTWISE_PASSES = 28, 10
HBM_NOTE = "assumption: Adam's step is memory-bound, 28 bytes moved per fp32 element at the HBM bandwidth, {bw}"
PASSES_NOTE = ("assumption: each saved activation byte passes through memory about 10 times in the element-wise "
               "kernels of a forward and backward, at the HBM bandwidth, {bw}")


def _h100_8x() -> Cluster:
    datasheet = "NVIDIA H100 Tensor Core GPU datasheet, SXM5 column (sparsity figures halved)"
    return Cluster(
        name="h100-8x", gpus_per_node=8,
        peak_flops={"fp32": 67 * TERA, "tf32": 494.7 * TERA, "bf16": 989.4 * TERA, "fp16": 989.4 * TERA},
        matmul_efficiency=0.6, device_memory=80 * GiB, host_memory=2 * 1024 * GB,
        intra=Link(bandwidth=450 * GB, latency=3.4e-6), inter=Link(bandwidth=50 * GB, latency=14e-6),
        optimizer_rate=3350 * GB / ADAM_BYTES, elementwise_rate=3350 * GB / ELEMENTWISE_PASSES,
        sources={
            "peak_flops": datasheet,
            "optimizer_rate": HBM_NOTE.format(bw="3.35 TB/s (H100 SXM5 datasheet)"),
            "elementwise_rate": PASSES_NOTE.format(bw="3.35 TB/s"),
            "matmul_efficiency": "assumption: large bf16 GEMMs reach 60-75% of peak on H100 and whole "
                                 "training steps less; 0.6 is the planner's default, not a measurement",
            "device_memory": "H100 SXM5 datasheet: 80 GB HBM3",
            "host_memory": "NVIDIA DGX H100 datasheet: 2 TB system memory",
            "intra.bandwidth": "NVLink 4: 900 GB/s per GPU both directions together (datasheet), so 450 GB/s "
                               "each way through NVSwitch; NCCL reaches less (assumption: 80-90%)",
            "inter.bandwidth": "400 Gb/s InfiniBand NDR per GPU (DGX H100: 8 ConnectX-7), 50 GB/s each way",
            "latency": "assumption: NCCL's own tuning model (src/graph/tuning.cc, ring/Simple) charges "
                       "about 3.4 us per step over NVLink and 14 us over the network",
        })


def _a100_8x() -> Cluster:
    datasheet = "NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column (sparsity figures halved)"
    return Cluster(
        name="a100-8x", gpus_per_node=8,
        peak_flops={"fp32": 19.5 * TERA, "tf32": 156 * TERA, "bf16": 312 * TERA, "fp16": 312 * TERA},
        matmul_efficiency=0.6, device_memory=80 * GiB, host_memory=2 * 1024 * GB,
        intra=Link(bandwidth=300 * GB, latency=3.4e-6), inter=Link(bandwidth=25 * GB, latency=14e-6),
        optimizer_rate=2039 * GB / ADAM_BYTES, elementwise_rate=2039 * GB / ELEMENTWISE_PASSES,
        sources={
            "peak_flops": datasheet,
            "optimizer_rate": HBM_NOTE.format(bw="2.04 TB/s (A100 80GB SXM datasheet)"),
            "elementwise_rate": PASSES_NOTE.format(bw="2.04 TB/s"),
            "matmul_efficiency": "assumption: as for h100-8x; Megatron-LM reports 40-52% MFU of whole steps "
                                 "on A100 (Narayanan et al., SC 2021), GEMMs alone reach more",
            "device_memory": "A100 80GB SXM datasheet: 80 GB HBM2e",
            "host_memory": "NVIDIA DGX A100 640GB datasheet: 2 TB system memory",
            "intra.bandwidth": "NVLink 3: 600 GB/s per GPU both directions together (datasheet), 300 GB/s "
                               "each way through NVSwitch",
            "inter.bandwidth": "200 Gb/s InfiniBand HDR per GPU (a DGX A100 has 8 ConnectX-6; Selene's nodes "
                               "'eight NVIDIA Mellanox 200Gbps HDR Infiniband HCAs for application communication', "
                               "Narayanan et al., SC 2021, §5), 25 GB/s each way",
            "latency": "assumption: as for h100-8x (NCCL's tuning model)",
        })


def _v100_dgx2h() -> Cluster:
    megatron = ("Shoeybi et al., Megatron-LM (arXiv:1909.08053) §5, of the DGX-2H servers it ran on: "
                "'300 GB/sec bandwidth between GPUs inside a server via NVSwitch and 100 GB/sec of interconnect "
                "bandwidth between servers using 8 InfiniBand adapters per server'")
    return Cluster(
        name="v100-dgx2h", gpus_per_node=16,
        peak_flops={"fp32": 15.7 * TERA, "fp16": 130 * TERA},
        matmul_efficiency=0.6, device_memory=32 * GiB, host_memory=1536 * GB,
        intra=Link(bandwidth=150 * GB, latency=3.4e-6), inter=Link(bandwidth=6.25 * GB, latency=14e-6),
        optimizer_rate=900 * GB / ADAM_BYTES, elementwise_rate=900 * GB / ELEMENTWISE_PASSES,
        sources={
            "peak_flops": "fp16: NVIDIA DGX-2H, 2.1 PFLOPS of tensor cores over 16 V100 SXM3 (higher clocks than "
                          "the V100 SXM2 datasheet's 125), 130 TFLOP/s each, as Megatron-LM §5.1.1 implies "
                          "(39 TFLOP/s = 30% of a DGX-2H GPU's peak); fp32: V100 SXM2 datasheet",
            "optimizer_rate": HBM_NOTE.format(bw="900 GB/s (V100 datasheet, HBM2)"),
            "elementwise_rate": PASSES_NOTE.format(bw="900 GB/s"),
            "matmul_efficiency": "assumption: the planner's default, as for h100-8x, not fitted to any run",
            "device_memory": "Tesla V100 SXM3 32GB (Megatron-LM §5)",
            "host_memory": "NVIDIA DGX-2 datasheet: 1.5 TB system memory",
            "intra.bandwidth": "NVLink 2 through NVSwitch: 300 GB/s per GPU both directions together (V100 datasheet; "
                               + megatron + "), 150 GB/s each way",
            "inter.bandwidth": megatron + ": 100 GB/s each way per node over 16 GPUs, 6.25 GB/s per GPU "
                               "(8 EDR adapters of 12.5 GB/s, each shared by 2 GPUs; the ZeRO paper, §10.2, "
                               "says the same of its DGX-2 cluster: 800 Gbps, 12.5 GB/s per EDR link)",
            "latency": "assumption: as for h100-8x (NCCL's tuning model)",
        })


def _cpu_here() -> Cluster:
    # Measured on the development machine (2-core AMD EPYC under KVM, 23.5 GiB) by
    # `paratrain plan --calibrate` on 2026-11-25, rounded, while another job kept the machine busy
    # (load average about 2.3): approximate. A fresh calibration on a quiet machine replaces them.
    return Cluster(
        name="cpu-here", gpus_per_node=2, device="cpu", backend="gloo",
        peak_flops={"fp32": 90e9, "bf16": 200e9}, matmul_efficiency=1.0,
        device_memory=23 * GiB, host_memory=23 * GiB,
        intra=Link(bandwidth=3.5 * GB, latency=190e-6), inter=Link(bandwidth=3.5 * GB, latency=190e-6),
        collective_links={"all_reduce": Link(2.0 * GB, 170e-6), "reduce_scatter": Link(0.6 * GB, 400e-6),
                          "all_gather": Link(1.2 * GB, 270e-6), "broadcast": Link(4.5 * GB, 140e-6)},
        optimizer_rate=340e6, elementwise_rate=3.7 * GB,
        sources={
            "all": "paratrain plan --calibrate on the 2-core development machine, 2026-11-25, under load; "
                   "run `paratrain plan --calibrate cpu.json` on a quiet machine and pass --cluster cpu.json",
            "peak_flops": "achieved 1024x1024 matmul rate on one thread (a device is one core)",
            "collective_links": "gloo at world 2 over loopback, least-squares alpha and beta per collective",
            "inter": "assumption: one node only; the same loopback as intra",
            "optimizer_rate, elementwise_rate": "calibrate.optimizer_rate / elementwise_rate on one thread, "
                                                "2026-11-26, quiet machine",
        })


PRESETS = {"cpu-here": _cpu_here, "h100-8x": _h100_8x, "a100-8x": _a100_8x, "v100-dgx2h": _v100_dgx2h}


def preset(name: str) -> Cluster:
    """The built-in cluster `name`; a ConfigError listing the presets when there is none."""
    if name not in PRESETS:
        raise ConfigError(f"no cluster preset {name!r}: choose one of {', '.join(PRESETS)}, "
                          "or give a cluster JSON file (paratrain plan --calibrate OUT.json writes one)")
    return PRESETS[name]()


def load_cluster(name_or_path: str | Path) -> Cluster:
    """A preset by name, or a cluster JSON file (the form `save_cluster` writes)."""
    path = Path(name_or_path)
    if str(name_or_path) in PRESETS:
        return preset(str(name_or_path))
    if not path.is_file():
        raise ConfigError(f"no cluster preset or file {str(name_or_path)!r}: choose one of "
                          f"{', '.join(PRESETS)}, or give a cluster JSON file (paratrain plan "
                          "--calibrate OUT.json writes one)")
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read cluster file {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"cluster file {path} is not JSON: {e}") from None
    return from_dict(raw, where=str(path))


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
        return Cluster(**{**raw, "intra": Link(**raw["intra"]), "inter": Link(**raw["inter"]),
                          "collective_links": links})
    except TypeError as e:  # a link with other fields than bandwidth and latency
        raise ConfigError(f"{where}: each link has bandwidth (bytes/s) and latency (s): {e}") from None


def save_cluster(cluster: Cluster, path: str | Path) -> None:
    """Write `cluster` as JSON (what `load_cluster` reads back)."""
    Path(path).write_text(json.dumps(dataclasses.asdict(cluster), indent=2) + "\n")
