"""How long a collective takes: the alpha-beta model (Hockney 1994), per algorithm, as in Thakur,
Rabenseifner and Gropp, "Optimization of Collective Communication Operations in MPICH" (IJHPCA
2005) and Chan et al., "Collective communication: theory, practice, and experience" (2007).

A message of S bytes over a link costs α + S/β: α the link's latency, β its bandwidth (one
direction, per device; cluster.py). An algorithm runs in steps; in each step every rank sends
and receives at once, so a collective costs `steps · α + volume · S/β`, where `volume` is the
bytes each rank sends, as a multiple of S. Over a group of n ranks (S: the size of the whole
tensor, in bytes: the input of an all-reduce or a reduce-scatter, the output of an all-gather):

    ring all-reduce       2(n−1)·α + 2(n−1)/n · S/β    reduce-scatter, then all-gather, n−1 steps each
    ring reduce-scatter    (n−1)·α +  (n−1)/n · S/β    one chunk of S/n per step
    ring all-gather        (n−1)·α +  (n−1)/n · S/β
    tree all-reduce      2⌈log2 n⌉·α +     2 · S/β    reduce up a binary tree, broadcast down it,
                                                       pipelined: each byte crosses a rank's link
                                                       once each way (NCCL's double binary tree)
    broadcast              (n−1)·α +          S/β    a pipelined chain, as NCCL's ring broadcast:
                                                       the limit of many small chunks
    send / recv                  α +          S/β    one message between two ranks

A group of n = k·m ranks over m nodes (k per node): a ring (or tree) that leaves a node runs, in
every step, at the pace of its slowest edge, so it is charged the slowest link it crosses: the
intra-node link when m = 1, else the larger latency of the two and the smaller bandwidth of
the intra-node link and k × the inter-node one. cluster.py states the inter-node β per GPU (one
NIC each), and NCCL splits a collective over several rings (channels), each leaving the node
through its own NIC, so the k ranks of the group in a node send through k NICs at once: on
8-GPU DGX nodes, 8 × 25 GB/s (A100) or 8 × 50 GB/s (H100) leave each node, against one NIC's
worth when every rank is on a node of its own (k = 1, as in hierarchical's all-reduce across nodes
and a pipeline's send between nodes). nccl-tests measure about that: 91 GB/s all-reduce bus
bandwidth between two HGX A100 with four 200 Gb/s adapters each (NVIDIA/nccl-tests#100), 75 GB/s
with eight 100 Gb/s (NVIDIA/nccl#495, "roughly matching our expectation").
A calibrated cluster may hold an intra-node link per collective (gloo's implementations differ by
several times): it is used for that collective in place of `intra`.

`hierarchical_all_reduce` is DDP2's (parallel/hierarchical): reduce-scatter inside each node
(k ranks, S), ring all-reduce across nodes (m ranks, S/k), all-gather inside each node (k, S).

What the model leaves out: NCCL's base latency per call (~8 µs), protocol choice (LL/LL128 for
small messages), NVLink SHARP and in-network reduction, contention with other traffic, and the
reduction arithmetic itself; `paratrain plan --calibrate` folds some of it into a measured α, β.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from paratrain.errors import ConfigError
from paratrain.plan.cluster.cluster import Cluster, Link


@dataclass(frozen=True)
class Group:
    """`ranks` processes spread evenly over `nodes` nodes."""

    ranks: int
    nodes: int = 1

    def __post_init__(self):
        if self.ranks < 1 or self.nodes < 1 or self.ranks % self.nodes:
            raise ConfigError(f"a group of {self.ranks} ranks cannot be spread evenly over {self.nodes} "
                              "nodes: the ranks must be a positive multiple of the nodes")

    @property
    def per_node(self) -> int:
        return self.ranks // self.nodes


@dataclass(frozen=True)
class Terms:
    """A collective's cost as `steps · α + volume · S/β` (module docstring)."""

    steps: float  # how many latencies
    volume: float  # bytes each rank sends, as a multiple of the message size S

    def time(self, nbytes: float, link: Link) -> float:
        if nbytes < 0:
            raise ConfigError(f"a message of {nbytes} bytes: sizes are not negative")
        return self.steps * link.latency + self.volume * nbytes / link.bandwidth


def ring_all_reduce_terms(n: int) -> Terms:
    return Terms(2 * (n - 1), 2 * (n - 1) / n)


def ring_pass_terms(n: int) -> Terms:
    """Reduce-scatter or all-gather: one pass of a ring."""
    return Terms(n - 1, (n - 1) / n)


def tree_all_reduce_terms(n: int) -> Terms:
    depth = math.ceil(math.log2(n)) if n > 1 else 0
    return Terms(2 * depth, 2.0 if n > 1 else 0.0)


def broadcast_terms(n: int) -> Terms:
    return Terms(n - 1, 1.0 if n > 1 else 0.0)


def send_recv_terms() -> Terms:
    return Terms(1, 1.0)


# what calibrate.py fits, by the name it reports: the ring forms (gloo's algorithms at world 2)
TERMS = {"all_reduce": ring_all_reduce_terms, "reduce_scatter": ring_pass_terms,
         "all_gather": ring_pass_terms, "broadcast": broadcast_terms}


def group_link(cluster: Cluster, group: Group, collective: str | None = None) -> Link:
    """The link that paces a ring or tree through `group`: the slowest one it crosses. Inside a
    node, the link calibration fitted for `collective` (cluster.collective_links) where there is one."""
    intra = cluster.collective_links.get(collective, cluster.intra) if collective else cluster.intra
    if group.nodes == 1:
        return intra
    return Link(bandwidth=min(intra.bandwidth, cluster.inter.bandwidth * group.per_node),
                latency=max(intra.latency, cluster.inter.latency))


def ring_all_reduce(nbytes: float, group: Group, cluster: Cluster) -> float:
    return ring_all_reduce_terms(group.ranks).time(nbytes, group_link(cluster, group, "all_reduce"))


def tree_all_reduce(nbytes: float, group: Group, cluster: Cluster) -> float:
    return tree_all_reduce_terms(group.ranks).time(nbytes, group_link(cluster, group, "all_reduce"))


def all_reduce(nbytes: float, group: Group, cluster: Cluster) -> float:
    """The faster of ring and tree, as NCCL's tuner chooses per message size."""
    return min(ring_all_reduce(nbytes, group, cluster), tree_all_reduce(nbytes, group, cluster))


def reduce_scatter(nbytes: float, group: Group, cluster: Cluster) -> float:
    """`nbytes`: the whole input; each rank keeps nbytes/n."""
    return ring_pass_terms(group.ranks).time(nbytes, group_link(cluster, group, "reduce_scatter"))


def all_gather(nbytes: float, group: Group, cluster: Cluster) -> float:
    """`nbytes`: the whole output; each rank contributes nbytes/n."""
    return ring_pass_terms(group.ranks).time(nbytes, group_link(cluster, group, "all_gather"))


def broadcast(nbytes: float, group: Group, cluster: Cluster) -> float:
    return broadcast_terms(group.ranks).time(nbytes, group_link(cluster, group, "broadcast"))


def send_recv(nbytes: float, cluster: Cluster, *, same_node: bool) -> float:
    """One p2p message (a pipeline's activation or its gradient)."""
    return send_recv_terms().time(nbytes, cluster.intra if same_node else group_link(cluster, Group(2, 2)))


def hierarchical_all_reduce(nbytes: float, group: Group, cluster: Cluster) -> float:
    """Reduce-scatter in each node, all-reduce across nodes on 1/k of it, all-gather in each node."""
    node, across = Group(group.per_node), Group(group.nodes, group.nodes)
    return (reduce_scatter(nbytes, node, cluster) + ring_all_reduce(nbytes / group.per_node, across, cluster)
            + all_gather(nbytes, node, cluster))
