"""What context parallelism, `pt.Mesh(cp, tp, dp)`, changes in a plan (parallel/context/).

The ranks of a cp group read the same batches and each trains on 1/cp of every sequence, and the
inner data-parallel strategy runs over dp × cp ranks (parallel/tensor/mesh.py): so parameters,
gradients, optimizer state, the data-parallel traffic and the activations (a rank's share of the
tokens: the batch over dp · cp) are those of the inner strategy over world / tp ranks, which the
tensor-parallel plan (plan/cost/tensor_parallel.py) already gives. What cp adds is the attention's:

    memory   ring attention holds, beside what forward saves, the K, V block it attends with
             (stacked into one message) and the one arriving: 2 × one call's K and V on this rank
             at once, transient ("all-to-all" and "all-gather" hold the whole sequence's K, V
             of their heads instead: counted the same, a lower bound for those)
    comm     per attention call (probe counts them, with their keys' and values' bytes),
             each rank passes its neighbour cp − 1 blocks of K, V in forward (once more when the
             block is recomputed), and in backward cp − 1 blocks again and cp blocks of their
             gradient: (cp − 1)(1 + recompute) + 2cp − 1 messages of one rank's K, V, a p2p send
             each, within a node when the cp × tp ranks fit one. Counted on the critical path:
             the ring overlaps each pass with a block's attention, which the planner does not
             credit yet (so a long sequence's cp step is predicted slower than it runs)
"""

from __future__ import annotations

from paratrain.plan.cluster.cluster import Cluster
from paratrain.plan.cost import comm_model


def kv_per_rank(attention_kv_bytes: int, gpus: int, accumulate: int) -> float:
    """One micro-batch's K and V of all attention calls on one rank: the batch's, cut over the
    dp · cp · tp ranks (heads over tp, tokens over cp, sequences over dp)."""
    return attention_kv_bytes / (gpus * accumulate)


def ring_bytes_held(attention_kv_bytes: int, attention_calls: int, *, gpus: int, accumulate: int) -> int:
    """The transient bytes of the ring on one rank: two blocks of one call's K and V."""
    if not attention_calls:
        return 0
    return round(2 * kv_per_rank(attention_kv_bytes, gpus, accumulate) / attention_calls)


def messages(cp: int, recompute: bool) -> int:
    """Messages of one rank's K, V (or their gradient) per attention call, forward and backward."""
    return (cp - 1) * (2 if recompute else 1) + 2 * cp - 1


def ring_seconds(attention_kv_bytes: int, attention_calls: int, *, cp: int, gpus: int, accumulate: int,
                 recompute: bool, same_node: bool, cluster: Cluster) -> float:
    """The ring's p2p time of one optimizer step on one rank (module docstring)."""
    if cp == 1 or not attention_calls:
        return 0.0
    block = kv_per_rank(attention_kv_bytes, gpus, accumulate) / attention_calls  # one call's K, V here
    one = comm_model.send_recv(block, cluster, same_node=same_node)
    return accumulate * attention_calls * messages(cp, recompute) * one
