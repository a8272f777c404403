"""Hierarchical DP training on this rank, against flat DDP on the same rank, and its references.

Used twice: `run_on_ranks(train_cases, …)` with simulated nodes, and as a script started by two
real `paratrain run --nnodes 2 --node-rank I` invocations (each rank saves its results to
OUT/rank{R}.pt):

    paratrain run --nnodes 2 --node-rank I -n 2 --master-addr 127.0.0.1 --master-port P \
        tests/support/hierarchical_worker.py OUT
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

# run as a script, this file's folder is first on sys.path: the repository's root makes `tests` importable
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import paratrain as pt  # noqa: E402
from paratrain.distributed.comm import ByteCounter  # noqa: E402
from paratrain.distributed.ring import ring_all_reduce  # noqa: E402
from paratrain.parallel.hierarchical import HierarchicalDataParallel  # noqa: E402
from tests.support.models import make_batches, make_model, make_optimizer, reference, train_on_rank  # noqa: E402

STEPS, GLOBAL_BATCH = 3, 16
TINY_BUCKETS = [0.0005]  # MiB: ~500-byte buckets, so many are in flight at once
# (model, accumulate, optimizer, bucket caps)
CASES = [("mlp", 1, "sgd", TINY_BUCKETS), ("bn", 1, "sgd", None), ("tied", 2, "adam", TINY_BUCKETS),
         ("unused", 1, "sgd", TINY_BUCKETS), ("mlp", 2, "sgd", None)]


def train(topo, wrapper, name, accumulate, optim, caps, groups=None):
    """STEPS steps on this rank's share of each global batch; returns (state, bytes sent)."""
    kwargs = dict(find_unused_parameters=name == "unused", bucket_cap_mb_list=caps)
    if wrapper == "hierarchical":
        model = HierarchicalDataParallel(make_model(name), groups=groups, **kwargs)
    else:
        model = pt.DistributedDataParallel(make_model(name), **kwargs)
    train_on_rank(topo, model, make_optimizer(optim, model.parameters()), steps=STEPS,
                  global_batch=GLOBAL_BATCH, accumulate=accumulate)
    sent = model.bytes_sent if wrapper == "hierarchical" else None
    return {k: v.clone() for k, v in model.module.state_dict().items()}, sent


def reference_for(name, world, accumulate, optim):
    return reference(name, optim, world=world, accumulate=accumulate, steps=STEPS, global_batch=GLOBAL_BATCH)


def flat_ring_cross_node_bytes(topo, numel):
    """Bytes this rank sends across a node boundary in a flat ring all-reduce of `numel` floats
    over the world in rank order: all it sends goes to rank+1, another node or not."""
    counter = ByteCounter()
    ring_all_reduce(torch.ones(numel), counter=counter)
    right = (topo.rank + 1) % topo.world_size
    return counter.sent if right // topo.local_world_size != topo.node_rank else 0


def train_cases(topo):
    """Every case with both wrappers; plus what crossing nodes cost for one MLP backward."""
    groups = pt.node_groups(topo)
    out = {}
    for name, accumulate, optim, caps in CASES:
        key = f"{name}-acc{accumulate}-{optim}"
        hier, _ = train(topo, "hierarchical", name, accumulate, optim, caps, groups)
        flat, _ = train(topo, "flat", name, accumulate, optim, caps)
        out[key] = dict(hierarchical=hier, flat=flat)
    out["bytes"] = one_backward_bytes(topo, groups)
    out["where"] = (topo.rank, topo.node_rank, topo.num_nodes, topo.local_world_size)
    return out


def one_backward_bytes(topo, groups):
    """Bytes of one MLP backward, one bucket: hierarchical (counted by the wrapper) and a flat
    ring all-reduce of the same gradient (counted by the reference ring)."""
    model = HierarchicalDataParallel(make_model("mlp"), groups=groups)
    xs, ys = make_batches(1, GLOBAL_BATCH)
    F.cross_entropy(model(xs[0]), ys[0]).backward()
    numel = sum(p.numel() for p in model.parameters())
    dist.barrier()
    return dict(numel=numel, inter=model.bytes_sent.inter_node.sent,
                intra=model.bytes_sent.intra_node.sent, flat=flat_ring_cross_node_bytes(topo, numel))


if __name__ == "__main__":
    topo = pt.Topology.from_env().init(timeout=60)
    result = train_cases(topo)
    torch.save(result, os.path.join(sys.argv[1], f"rank{topo.rank}.pt"))
    pt.destroy()
