"""`paratrain env`: what a rank sees — its place in the job and the software and devices there."""

from __future__ import annotations

import sys

import torch

from paratrain.distributed.grid import ProcessGrid
from paratrain.distributed.topology import Topology, resolve_timeout


def env() -> None:
    """Print one line describing this process; under a launcher every rank prints its own."""
    topo = Topology.from_env()
    grid = ProcessGrid(topo)  # the ranks of this rank's groups; builds none (distributed/grid.py)
    intra, inter = grid.ranks("local"), grid.ranks("node")
    fields = dict(
        rank=topo.rank, local_rank=topo.local_rank, world_size=topo.world_size,
        local_world_size=topo.local_world_size, node_rank=topo.node_rank, nodes=topo.num_nodes,
        backend=topo.backend, device=topo.device, launcher=topo.launcher,
        master=f"{topo.master_addr}:{topo.master_port}", timeout=f"{resolve_timeout(None):g}s",
        intra_node_ranks=",".join(map(str, intra)), inter_node_ranks=",".join(map(str, inter)),
    )
    lines = [f"[rank {topo.rank}] " + " ".join(f"{k}={v}" for k, v in fields.items())]
    if topo.local_rank == 0:  # the node's software and devices, once per node
        lines.append(f"[rank {topo.rank}] " + " ".join(f"{k}={v}" for k, v in software().items()))
    sys.stdout.write("\n".join(lines) + "\n")  # one write, so the ranks' lines do not interleave
    sys.stdout.flush()


def software() -> dict[str, str]:
    """torch, CUDA, NCCL and the GPUs (names and memory), as `accelerate env` shows them."""
    out = {"python": sys.version.split()[0], "torch": torch.__version__,
           "cuda": torch.version.cuda or "none", "cuda_available": str(torch.cuda.is_available())}
    if torch.cuda.is_available():
        nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
        out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        out["gpus"] = ";".join(f"{torch.cuda.get_device_name(i)}:{torch.cuda.get_device_properties(i).total_memory / 2**30:.0f}GiB"
                               for i in range(torch.cuda.device_count()))
    else:
        out["gpus"] = "none"
    return out
