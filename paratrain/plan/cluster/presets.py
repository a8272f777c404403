"""The built-in clusters (`paratrain plan --cluster NAME`): an 8×H100 SXM node, an 8×A100 80GB
node, a 16×V100 DGX-2H (the Megatron-LM and ZeRO papers' machine) and this development machine;
and `load_cluster`, which reads a preset or a cluster file (cluster.py's `save_cluster` writes one).
Each figure says where it comes from (`Cluster.sources`): a datasheet, a measurement, or an
assumption (cluster.py).

Offload's figures (`host_link`, `host_optimizer_rate`) are the host's: the GPU's PCIe link, at an
assumed 80 % of its datasheet rate each way, and torch's Adam on CPU tensors, which moved about
100 bytes of memory traffic per element stepped on the development machine (72 to 138 bytes'
worth of a copy's bandwidth, at 2 and 1 threads, measured once while the machine was busy): a
node's memory bandwidth over its GPUs, / 100.
"""

from __future__ import annotations

import json
from pathlib import Path

from paratrain.errors import ConfigError
from paratrain.plan.cluster.cluster import GB, TERA, Cluster, GiB, Link, from_dict

# Adam reads and writes the parameter and both moments and reads the gradient: 28 bytes per fp32
# element, memory-bound on a GPU; and each saved activation byte is read and written by about
# this many element-wise kernels over a forward and backward (an assumption)
ADAM_BYTES, ELEMENTWISE_PASSES = 28, 10
HBM_NOTE = "assumption: Adam's step is memory-bound, 28 bytes moved per fp32 element at the HBM bandwidth, {bw}"
# offload (module docstring): torch's CPU Adam, bytes of the host's memory bandwidth per element
HOST_ADAM_BYTES = 100
PCIE_NOTE = "{link}; assumption: copies reach 80 % of it, {bw} GB/s, at 10 us each"
HOST_NOTE = ("assumption: torch's Adam on the host moves about 100 bytes per element (module docstring); "
             "{host}, shared by {gpus} GPUs")
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
        host_link=Link(bandwidth=0.8 * 64 * GB, latency=10e-6), host_optimizer_rate=614.4 * GB / 8 / HOST_ADAM_BYTES,
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
            "host_link": PCIE_NOTE.format(link="PCIe Gen5 x16: 128 GB/s per GPU both directions together (H100 SXM5 "
                                          "datasheet), 64 GB/s each way", bw="51"),
            "host_optimizer_rate": HOST_NOTE.format(host="2 Xeon Platinum 8480C (DGX H100 datasheet), 8 channels of "
                                                    "DDR5-4800 each: 614 GB/s", gpus=8),
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
        host_link=Link(bandwidth=0.8 * 32 * GB, latency=10e-6), host_optimizer_rate=409.6 * GB / 8 / HOST_ADAM_BYTES,
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
            "host_link": PCIE_NOTE.format(link="PCIe Gen4 x16: 64 GB/s per GPU both directions together (A100 "
                                          "datasheet), 32 GB/s each way", bw="25.6"),
            "host_optimizer_rate": HOST_NOTE.format(host="2 AMD EPYC 7742 (DGX A100 datasheet), 8 channels of "
                                                    "DDR4-3200 each: 410 GB/s", gpus=8),
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
        host_link=Link(bandwidth=0.8 * 16 * GB, latency=10e-6), host_optimizer_rate=256 * GB / 16 / HOST_ADAM_BYTES,
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
            "host_link": PCIE_NOTE.format(link="PCIe Gen3 x16: 32 GB/s per GPU both directions together (V100 "
                                          "datasheet), 16 GB/s each way", bw="12.8"),
            "host_optimizer_rate": HOST_NOTE.format(host="2 Xeon Platinum 8174 (DGX-2H datasheet), 6 channels of "
                                                    "DDR4-2666 each: 256 GB/s", gpus=16),
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
