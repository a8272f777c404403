"""How long one optimizer step takes under a strategy: compute, the communication compute does
not hide, and a pipeline's bubble.

Compute: the FLOPs the probe (model/probe.py) counted for the global batch (forward; backward with any
recompute), times this rank's share of the batch (1/replicas; a pipeline stage also 1/stages),
at the cluster's achievable rate for the precision (cluster.flops), or, where the cluster holds
a calibrated matmul table, each matmul at its shape's rate with a rank's share of the batch (a
micro-batch's under a pipeline; plan/model/matmuls.py) and the rest at cluster.flops. Plus the
element-wise work FlopCounterMode does not count (norms, activation functions, softmax,
residuals, the loss): where the cluster has a traffic rate, the bytes those ops read and write
over it; else the saved activation bytes over the cluster's `elementwise_rate`, a third in the
forward and two thirds in the backward. The optimizer step: the elements this rank steps over
the cluster's `optimizer_rate` (or each tensor at its size's calibrated rate), after the
backward (and before ZeRO-1/2's gather); under ZeRO's offload, on the host, with the copies over
its link exposed (`offload`). Where the cluster has a traffic rate, each backward
also copies the gradients autograd made into the buffers the strategy reduces
(`gradient_copy`), and ZeRO-3 moves its units' bytes locally besides (`zero3_local_copies`).
Ranks beyond a node's devices share them (a CPU node running more ranks than cores): each then
computes that many times slower.

Communication: each collective the strategy issues, timed by comm_model.py, on one queue per
rank (c10d runs a group's collectives in the order issued). How each overlaps with compute:

    gradient buckets (ddp, hierarchical, zero1, zero2)
        bucket i is ready once backward has produced its gradients; gradients are assumed to
        arrive in reverse registration order, evenly in parameter count over the backward:
            ready_i = backward · (elements in buckets 1..i) / elements
            end_i   = max(ready_i, end_{i-1}) + reduce_i
        exposed = end_last − backward: what the step waits after its backward
        (PyTorch DDP, Li et al., VLDB 2020, Figure 4; parallel/grad_sync.py)
    zero1, zero2: then the updated slices go back to every rank after the optimizer step
        (gather_from_owners: one all-gather per bucket on nccl, a broadcast per owner on gloo),
        exposed whole
    zero3 units (FSDP, Zhao et al., VLDB 2023): forward gathers each unit, the next one while the
        current one computes (prefetch of one); backward gathers each again in reverse order and
        reduce-scatters its gradients after its backward, on the same queue. A unit's compute is
        its share of the parameters' FLOPs; the root unit runs first and last (its parameters
        are the embedding and head). A two-resource schedule (queue and compute) gives the end.
    gradient accumulation (accumulate=k): k micro-batches of 1/k of the batch each; the first
        k − 1 run under no_sync() and only accumulate (zero3 still gathers its units in each
        forward and backward; a pipeline still sends its cuts), the last synchronises as above
        (`accumulated`). The optimizer steps once.
    pipeline (GPipe and 1F1B alike, Narayanan et al., SC 2021, §2.2): m micro-batches over p
        stages take (m + p − 1) slots of one micro-batch's forward and backward on one stage,
        plus a send and a receive of the cut's activation (forward) and its gradient (backward)
        per slot; the bubble is the (p − 1) slots. Stages that differ (a GPT's head on the last:
        each stage's share of the forward FLOPs, block_regions.stage_shares) run at the slowest
        one's pace: m of its slots and one of every other stage's. Replicas of a stage
        all-reduce its gradients after the last micro-batch's backward, which hides a slot's
        backward of it.

On a CPU cluster nothing overlaps: gloo reduces and copies on the cores that compute, so every
collective is exposed, and a node running more ranks than cores runs each collective that many
times slower, as it does the compute (`on_cores`, from recommend.predict_time). What it leaves
out: kernel launch and Python overhead, compute slowed by communication sharing memory
bandwidth, and, on shared cores, the cycles a pipeline's idle stage leaves to the others.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from paratrain.plan.cluster.cluster import Cluster
from paratrain.plan.cost import comm_model
from paratrain.plan.cost.comm_model import Group
from paratrain.plan.model.matmuls import Matmuls, Traffic
from paratrain.plan.model.matmuls import flops as matmul_flops
from paratrain.plan.model.matmuls import seconds as matmul_seconds


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step on the slowest rank, by where they go."""

    compute: float  # forward and backward (with recompute) of this rank's share
    exposed_comm: float  # communication the compute does not hide
    bubble: float = 0.0  # a pipeline's idle slots
    comm: float = 0.0  # every collective's time, hidden or not
    optimizer: float = 0.0  # the optimizer step over what this rank steps

    @property
    def total(self) -> float:
        return self.compute + self.exposed_comm + self.bubble + self.optimizer


@dataclass(frozen=True)
class Compute:
    """Seconds of forward and backward for the global batch on one device of the cluster."""

    forward: float
    backward: float

    @classmethod
    def of(cls, flops_forward: float, flops_backward: float, cluster: Cluster, dtype: str,
           *, world: int, nodes: int = 1, activation_bytes: int = 0, matmuls: Matmuls = (),
           traffic: Traffic | None = None, fraction: float = 1.0) -> "Compute":
        """At the cluster's achievable rates, slowed when a node runs more ranks than devices.
        Where the cluster has a matmul table for `dtype`, `matmuls` (probe's) are timed
        at their shapes when a rank runs `fraction` of the batch at once, and where it has a
        traffic rate, the other ops by the bytes they move (`traffic`; plan/model/matmuls.py)."""
        shared = sharing(cluster, world=world, nodes=nodes)
        rate = cluster.flops(dtype) / shared
        elementwise = activation_bytes * shared / cluster.elementwise_rate if cluster.elementwise_rate else 0.0
        split = (elementwise / 3, 2 * elementwise / 3)
        if traffic is not None and any(traffic) and cluster.traffic_rate:
            split = tuple(traffic.bytes(name, fraction) * shared / cluster.traffic_rate
                          for name in ("forward", "backward"))
        if not (matmuls and cluster.matmul_rates.get(dtype)):
            return cls(flops_forward / rate + split[0], flops_backward / rate + split[1])
        shaped = cluster.matmul_rate(dtype)

        def phase(flops: float, name: str) -> float:  # the rest (attention, convolutions) at the flat rate
            rest = max(0.0, flops - matmul_flops(matmuls, name))
            return rest / rate + shared * matmul_seconds(matmuls, name, shaped, fraction)

        return cls(phase(flops_forward, "forward") + split[0], phase(flops_backward, "backward") + split[1])

    def share(self, fraction: float) -> "Compute":
        return Compute(self.forward * fraction, self.backward * fraction)


def sharing(cluster: Cluster, *, world: int, nodes: int = 1) -> float:
    """How many ranks share one device: more than 1 when a node runs more ranks than it has."""
    return max(1.0, world / nodes / cluster.gpus_per_node)


def on_cores(seconds: StepTime, shared: float) -> StepTime:
    """`seconds` on a CPU cluster whose ranks run `shared` to a core (sharing): every collective
    exposed, and each `shared` times slower."""
    comm = seconds.comm * shared
    return replace(seconds, comm=comm, exposed_comm=max(seconds.exposed_comm * shared, comm))


def gradient_copy(grad_bytes: float, cluster: Cluster, *, world: int, nodes: int = 1) -> float:
    """Seconds a backward takes to write the gradients autograd made into the buffers the
    strategy reduces: DDP's, ZeRO-1/2's and a pipeline stage's buckets, ZeRO-3's flat gradients
    (buckets.adopt_grad, flat_shard.grad_arrived), or to add them to those of the backwards
    before it (each micro-batch of a pipeline, of gradient accumulation); a read and a write of
    `grad_bytes` at the cluster's traffic rate (0 without one: the presets')."""
    return _moving(2 * grad_bytes, cluster, world=world, nodes=nodes)


def zero3_local_copies(unit_bytes: float, cluster: Cluster, *, world: int, nodes: int = 1,
                       accumulate: int = 1) -> float:
    """Seconds of ZeRO-3's own copies per optimizer step, besides its collectives, for units of
    `unit_bytes` in all (flat_shard.py): each gather copies this rank's shard into the full
    buffer (1/N read and written; the whole unit at world 1, where no collective runs), in every
    forward and backward; each window's first backward zero-fills the full gradient (written
    once), and its reduced slice is copied into the shard's gradient (1/N read and written). At
    the cluster's traffic rate; 0 without one."""
    return _moving(unit_bytes * (accumulate * 4 / world + 1 + 2 / world), cluster, world=world, nodes=nodes)


def _moving(nbytes: float, cluster: Cluster, *, world: int, nodes: int) -> float:
    """Seconds to read and write `nbytes` in all at the cluster's traffic rate, on ranks that may
    share a device (sharing); 0 where the cluster has no traffic rate."""
    if not cluster.traffic_rate:
        return 0.0
    return nbytes * sharing(cluster, world=world, nodes=nodes) / cluster.traffic_rate


def optimizer_seconds(elements: int, cluster: Cluster, *, world: int, nodes: int = 1,
                      tensors: list[int] | None = None) -> float:
    """The optimizer step over `elements` on one rank (0 when the cluster gives no rate); with
    the sizes of the `tensors` it steps (their sum may exceed `elements`: a pipeline stage steps
    its share of them) and a calibrated table, each size at its own rate."""
    if not cluster.optimizer_rate and not cluster.optimizer_rates:
        return 0.0
    shared = sharing(cluster, world=world, nodes=nodes)
    if not (tensors and cluster.optimizer_rates):
        return elements * shared / (cluster.optimizer_rate or cluster.optimizer_rate_for(elements))
    seconds = sum(n / cluster.optimizer_rate_for(n) for n in tensors)
    return seconds * elements / sum(tensors) * shared


def offload(shards: list[int], element_bytes: int, cluster: Cluster, *, gathers: int) -> tuple[float, float]:
    """ZeRO's offload on a GPU cluster (stage12.py [Note: master shards], flat_shard.py): seconds of
    (the host's optimizer step, the copies over the host link). This rank's `shards` (elements,
    one per bucket or unit) step on the host; the reduced slices go down once per optimizer step,
    and the updated shards come up once (stages 1, 2) or at each of ZeRO-3's `gathers`. The copies are
    synchronous: exposed. (0, 0) where the cluster has no host link (a CPU's memory is the host's)."""
    if cluster.host_link is None or not cluster.host_optimizer_rate:
        return 0.0, 0.0
    link, moves = cluster.host_link, 1 + gathers
    copies = moves * (sum(shards) * element_bytes / link.bandwidth + len(shards) * link.latency)
    return sum(shards) / cluster.host_optimizer_rate, copies


def accumulated(last: StepTime, local: StepTime, k: int) -> StepTime:
    """An optimizer step of k micro-batches: k − 1 `local` ones (no gradient synchronisation)
    and the `last`, which synchronises."""
    return StepTime(last.compute + (k - 1) * local.compute, last.exposed_comm + (k - 1) * local.exposed_comm,
                    bubble=last.bubble + (k - 1) * local.bubble, comm=last.comm + (k - 1) * local.comm,
                    optimizer=last.optimizer)


def bucket_overlap(backward: float, bucket_elements: list[int], reduce_times: list[float]) -> float:
    """Seconds after the backward until the last bucket is reduced (module docstring)."""
    total, done, end = sum(bucket_elements) or 1, 0, 0.0
    for elements, seconds in zip(bucket_elements, reduce_times):
        done += elements
        end = max(backward * done / total, end) + seconds
    return max(0.0, end - backward)


def prefetch_schedule(compute: list[float], gathers: list[float], after: list[float] | None = None) -> float:
    """End time of units computed in order, each after its gather; the queue gathers unit i+1
    once unit i's gather is done and unit i−1's compute has freed its memory (one prefetched),
    and runs `after[i]` (a reduce-scatter) once unit i's compute is done."""
    queue = done = 0.0
    finished: list[float] = []
    for i, (work, gather) in enumerate(zip(compute, gathers)):
        start = max(queue, finished[i - 2] if i >= 2 else 0.0)
        queue = start + gather
        done = max(done, queue) + work
        finished.append(done)
        if after is not None and i >= 1:  # the previous unit's gradients, once it is done
            queue = max(queue, finished[i - 1]) + after[i - 1]
    if after is not None and after:
        queue = max(queue, done) + after[-1]
    return max(done, queue)


def data_parallel(compute: Compute, bucket_bytes: list[int], bucket_elements: list[int], group: Group,
                  cluster: Cluster, *, hierarchical: bool = False) -> StepTime:
    """ddp (and hierarchical): every bucket all-reduced during the backward."""
    reduce = comm_model.hierarchical_all_reduce if hierarchical and group.nodes > 1 else comm_model.all_reduce
    times = [reduce(b, group, cluster) if group.ranks > 1 else 0.0 for b in bucket_bytes]
    exposed = bucket_overlap(compute.backward, bucket_elements, times)
    return StepTime(compute.forward + compute.backward, exposed, comm=sum(times))


def zero12(compute: Compute, bucket_bytes: list[int], bucket_elements: list[int], param_bucket_bytes: list[int],
           group: Group, cluster: Cluster, *, scatter: bool) -> StepTime:
    """zero1/zero2: buckets reduced to their owners in the backward (a reduce-scatter, or an
    all-reduce keeping a slice: collectives.OwnerCollectives), slices gathered back after the step."""
    if group.ranks == 1:
        return StepTime(compute.forward + compute.backward, 0.0)
    reduce = comm_model.reduce_scatter if scatter else comm_model.all_reduce
    times = [reduce(b, group, cluster) for b in bucket_bytes]
    gather = [gather_from_owners(b, group, cluster, all_gather=scatter) for b in param_bucket_bytes]
    exposed = bucket_overlap(compute.backward, bucket_elements, times) + sum(gather)
    return StepTime(compute.forward + compute.backward, exposed, comm=sum(times) + sum(gather))


def gather_from_owners(nbytes: float, group: Group, cluster: Cluster, *, all_gather: bool) -> float:
    """Seconds to give every rank of `group` the owners' updated slices of `nbytes` (zero/collectives.py)."""
    if all_gather:
        return comm_model.all_gather(nbytes, group, cluster)
    return group.ranks * comm_model.broadcast(nbytes / group.ranks, group, cluster)


def zero3(compute: Compute, unit_elements: list[int], unit_bytes: list[int], grad_bytes: list[int],
          group: Group, cluster: Cluster, *, scatter: bool, reshard_after_forward: bool = True,
          sync: bool = True) -> StepTime:
    """zero3: units in forward order, the root first (module docstring); `sync` False: a
    backward under no_sync(), which gathers but reduces nothing."""
    total = sum(unit_elements) or 1
    forward = [compute.forward * e / total for e in unit_elements]
    backward = [compute.backward * e / total for e in reversed(unit_elements)]
    if group.ranks == 1:
        return StepTime(compute.forward + compute.backward, 0.0)
    gather = [comm_model.all_gather(b, group, cluster) for b in unit_bytes]
    reduce = comm_model.reduce_scatter if scatter else comm_model.all_reduce
    scatter_times = [reduce(b, group, cluster) for b in reversed(grad_bytes)] if sync else None
    regather = list(reversed(gather))
    if not reshard_after_forward:
        regather = [0.0] * len(gather)
    elif regather:
        regather[-1] = 0.0  # the root (first of forward, last of backward) stays gathered: stage3.py
    end = prefetch_schedule(forward, gather) + prefetch_schedule(backward, regather, scatter_times)
    busy = compute.forward + compute.backward
    comm = sum(gather) + sum(regather) + sum(scatter_times or [])
    return StepTime(busy, max(0.0, end - busy), comm=comm)


def pipeline(compute: Compute, *, stages: int, microbatches: int, cut_bytes: int, replicas_group: Group,
             stage_bucket_bytes: list[int], stage_bucket_elements: list[int], cluster: Cluster,
             same_node: bool = True, shares: list[float] | None = None, bubble_slots: float | None = None,
             virtual: int = 1) -> StepTime:
    """A pipeline of `stages` stages, `microbatches` each; `compute` is one replica's batch over
    the whole model, `cut_bytes` the activation one cut sends for that batch, `shares` each
    stage's part of the compute (block_regions.stage_shares; None: equal). The slowest stage
    sets the pace: one micro-batch passes every stage once, then the other m − 1 follow at the
    slowest stage's slot, m·slowest + Σ(other stages' slots), of which the others are bubble
    (equal stages: (m + p − 1) slots, p − 1 of them bubble). Another schedule idles for
    `bubble_slots` slots of a stage instead of p − 1 (check.bubble_slots: interleaved (p − 1)/v,
    ZB-H1 (p − 1)/3), and with `virtual` chunks each micro-batch crosses v times as many cuts."""
    slots = [compute.share(share / microbatches) for share in shares or [1.0 / stages] * stages]
    message = comm_model.send_recv(cut_bytes / microbatches, cluster, same_node=same_node) if stages > 1 else 0.0
    message *= virtual
    per_slot = [slot.forward + slot.backward + 2 * message for slot in slots]
    slowest = max(range(stages), key=lambda s: per_slot[s])
    busy = microbatches * (slots[slowest].forward + slots[slowest].backward)
    if replicas_group.ranks > 1:
        times = [comm_model.all_reduce(b, replicas_group, cluster) for b in stage_bucket_bytes]
        reduced = bucket_overlap(slots[slowest].backward, stage_bucket_elements, times)
    else:
        times, reduced = [], 0.0
    bubble = sum(per_slot) - per_slot[slowest]
    if bubble_slots is not None and stages > 1:
        bubble *= bubble_slots / (stages - 1)
    return StepTime(busy, microbatches * 2 * message + reduced, bubble=bubble,
                    comm=microbatches * 2 * message + sum(times))
