"""`paratrain plan --gpus N --cluster C`: each strategy's step time beside its memory, the plan to
use, and what would make a model fit that fits nowhere.

Each strategy's row joins its memory (memory_table.py) and its step time (step_time.py over the
messages traffic.py reads from its layout). A strategy fits when its fullest rank's device peak
is within the cluster's device memory; one that does not fit is tried again with activation
checkpointing (probe's second count: fewer activations, the recompute's FLOPs). The
recommendation is the fitting row with the most tokens (or samples) per second per device,
written as the `pt.Session(...)` line that runs it. MFU is the model's FLOPs per step (the
forward and backward, not the recompute) over the step time times the devices' peak rate. With
gradient accumulation (`accumulate` k) the batch is still the optimizer step's: each of its k
micro-batches is 1/k of it, which is what the activations, the matmul shapes and a pipeline's
micro-batches follow; the gradients are synchronised once (step_time.accumulated).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from paratrain.errors import ConfigError
from paratrain.parallel.base import Strategy
from paratrain.parallel.ddp import DDP
from paratrain.parallel.hierarchical import Hierarchical
from paratrain.parallel.pipeline import Pipeline
from paratrain.parallel.tensor.mesh import Mesh
from paratrain.parallel.zero import ZeRO
from paratrain.plan.cluster.cluster import Cluster
from paratrain.plan.cost import context_parallel, schedule_figures, step_time, tensor_parallel
from paratrain.plan.cost.comm_model import Group
from paratrain.plan.cost.layouts import trainable
from paratrain.plan.cost.traffic import traffic
from paratrain.plan.memory_table import memory_rows, strategies
from paratrain.plan.model.block_regions import stage_shares
from paratrain.plan.model.probe import ModelFacts, StepCount
from paratrain.plan.model.source import ModelSource

FLOPS_DTYPE = {"32": "fp32", "bf16": "bf16", "fp16": "fp16"}  # the cluster's rate for each precision


def plan_rows(source: ModelSource, facts: ModelFacts, cluster: Cluster, *, gpus: int, optimizer: str,
              nodes: int | None = None, accumulate: int = 1) -> list[dict]:
    """One row per strategy (checkpointed where it fits only so): memory, time, throughput, fit;
    the devices spread evenly over `nodes` (default: nodes_for's); `accumulate` micro-batches
    per optimizer step."""
    nodes = nodes_for(gpus, cluster, nodes)
    chosen = strategies(gpus, facts.batch // accumulate, offload=cluster.host_link is not None, per_node=gpus // nodes,
                        attention=facts.step.attention_calls > 0)
    how = {"gpus": gpus, "nodes": nodes, "optimizer": optimizer, "accumulate": accumulate}
    plain = timed_rows(source, facts, facts.step, cluster, chosen, **how)
    if facts.checkpointed is None:
        return plain
    again = [s for s, row in zip(chosen, plain) if "error" not in row and not row["fits"]]
    if not again:
        return plain
    checkpointed = iter(timed_rows(source, facts, facts.checkpointed, cluster, again, **how))
    return [next(checkpointed) if s in again else row for s, row in zip(chosen, plain)]


def nodes_for(gpus: int, cluster: Cluster | None, nodes: int | None = None) -> int:
    """How many nodes hold `gpus` devices, spread evenly: `nodes` when given (checked: it divides
    `gpus`, and no node holds more than the cluster's gpus_per_node), else the fewest that do
    (whole nodes of the cluster's size; one node when fewer devices than a node holds, or no cluster)."""
    most = cluster.gpus_per_node if cluster is not None else gpus
    if nodes is None:
        return spread(gpus, most)
    if nodes < 1 or gpus % nodes:
        raise ConfigError(f"--nodes {nodes} cannot hold {gpus} devices evenly: give a number of nodes that "
                          f"divides --gpus {gpus} ({', '.join(str(m) for m in range(1, gpus + 1) if gpus % m == 0)})")
    if gpus // nodes > most:
        raise ConfigError(f"{gpus} devices on {nodes} node(s) is {gpus // nodes} per node, but a node of "
                          f"{cluster.name} holds {most}: give --nodes {spread(gpus, most)} or more")
    return nodes


def spread(gpus: int, per_node: int) -> int:
    """The fewest nodes that hold `gpus` devices evenly, at most `per_node` on each."""
    return next(m for m in range(-(-gpus // per_node), gpus + 1) if gpus % m == 0)


def timed_rows(source: ModelSource, facts: ModelFacts, step: StepCount, cluster: Cluster, chosen: list[Strategy],
               *, gpus: int, nodes: int, optimizer: str, accumulate: int) -> list[dict]:
    memory = memory_rows(source, gpus=gpus, gpus_per_node=gpus // nodes, optimizer=optimizer,
                         activation_bytes=step.activation_peak_bytes, chosen=chosen,
                         foreach=cluster.device == "cuda", accumulate=accumulate, step=step)
    out = []
    for strategy, row in zip(chosen, memory):
        if "error" in row:
            out.append(row)
            continue
        replicas, batch = data_replicas(strategy, gpus), facts.batch // accumulate
        if batch < replicas:  # the session's loader would give some replicas no sample
            out.append({"strategy": row["strategy"], "label": row["label"],
                        "error": f"a batch of {batch} per micro-step cannot give each of its {replicas} data-parallel "
                                 f"replicas a sample; raise --batch to {replicas} or more, or cut the model over more "
                                 "ranks (tp, pp, cp) so that fewer replicas read it"})
            continue
        seconds = predict_time(source, strategy, step, cluster, gpus=gpus, nodes=nodes, facts=facts,
                               accumulate=accumulate)
        out.append({**row, "activation_checkpointing": bool(step.checkpointed),
                    "session": session_line(strategy, step, facts.precision, accumulate),
                    "fits": row["device_peak"] <= cluster.device_memory and _host_holds(row, cluster, gpus // nodes),
                    **_speed(seconds, facts, cluster, gpus)})
    return out


def data_replicas(strategy: Strategy, gpus: int) -> int:
    """The data-parallel replicas `strategy` makes of `gpus` devices: each reads its own part of
    the batch (the ranks of a tp, cp or pipeline group read the same one)."""
    if isinstance(strategy, Mesh):
        return gpus // (strategy.tp * strategy.cp * (strategy.pp.stages if strategy.pp is not None else 1))
    if isinstance(strategy, Pipeline):
        return gpus // strategy.stages
    return 1 if strategy.name == "single" else gpus


def _host_holds(row: dict, cluster: Cluster, per_node: int) -> bool:
    """Whether a node's host memory holds what its `per_node` ranks offload (row["host"] each)."""
    return row["host"] * per_node <= cluster.host_memory


def predict_time(source: ModelSource, strategy: Strategy, step: StepCount, cluster: Cluster, *, gpus: int, nodes: int,
                 facts: ModelFacts, accumulate: int = 1) -> step_time.StepTime:
    """`strategy`'s step on `gpus` devices spread evenly over `nodes` nodes of `cluster` (step_time.py),
    the optimizer step included; `accumulate` micro-batches of the batch per step."""
    if isinstance(strategy, Mesh):
        return _mesh_time(source, strategy, step, cluster, gpus=gpus, nodes=nodes, facts=facts, accumulate=accumulate)
    at_once = 1 / gpus if not isinstance(strategy, Pipeline) else strategy.stages / gpus / strategy.microbatches
    at_once /= accumulate
    compute = step_time.Compute.of(step.flops_forward, step.flops_backward, cluster, FLOPS_DTYPE[facts.precision],
                                   world=gpus, nodes=nodes, activation_bytes=step.activation_bytes,
                                   matmuls=step.matmuls, traffic=step.traffic, fraction=at_once)
    model = source.shared
    sent = traffic(model, strategy, world=gpus, local_world=gpus // nodes)
    how = {"sent": sent, "cluster": cluster, "gpus": gpus, "nodes": nodes, "step": step, "model": model}
    micro = compute.share(1 / accumulate)  # one micro-batch of the batch on one device
    seconds = _collectives(strategy, micro, sync=True, accumulate=accumulate, **how)
    if accumulate > 1:
        local = _collectives(strategy, micro, sync=False, accumulate=accumulate, **how)
        seconds = step_time.accumulated(seconds, local, accumulate)
    stepped = sum(n for n, _ in sent.buckets) if sent.buckets else facts.trainable_params
    tensors = [p.numel() for p in trainable(model)]
    if isinstance(strategy, ZeRO):
        stepped //= gpus  # each rank steps its slice: one flat shard per bucket (unit)
        tensors = [max(1, n // gpus) for n, _ in sent.buckets] or tensors
    optimizer = step_time.optimizer_seconds(stepped, cluster, world=gpus, nodes=nodes, tensors=tensors)
    held = sum(b for _, b in sent.buckets)  # the gradient buffers (zero3: its units, whole)
    backwards = accumulate * (strategy.microbatches if isinstance(strategy, Pipeline) else 1)
    copied = backwards * step_time.gradient_copy(held, cluster, world=gpus, nodes=nodes)  # each adds its gradients
    if isinstance(strategy, ZeRO) and strategy.stage == 3:
        copied += step_time.zero3_local_copies(held, cluster, world=gpus, nodes=nodes, accumulate=accumulate)
    seconds = dataclasses.replace(seconds, compute=seconds.compute + copied)
    if cluster.device == "cpu":  # gloo reduces on the cores that compute (step_time.py)
        seconds = step_time.on_cores(seconds, step_time.sharing(cluster, world=gpus, nodes=nodes))
    if isinstance(strategy, ZeRO) and strategy.offload:  # the masters' dtype: the parameters' own
        size = trainable(model)[0].element_size()
        gathers = 2 * accumulate if strategy.stage == 3 else 1
        host_step, copies = step_time.offload(tensors, size, cluster, gathers=gathers)
        if host_step:  # the host steps, and the copies to and from it are exposed (0: no host link)
            optimizer = host_step
            seconds = dataclasses.replace(seconds, comm=seconds.comm + copies,
                                          exposed_comm=seconds.exposed_comm + copies)
    return dataclasses.replace(seconds, optimizer=optimizer)


def _mesh_time(source: ModelSource, strategy: Mesh, step: StepCount, cluster: Cluster, *, gpus: int, nodes: int,
               facts: ModelFacts, accumulate: int) -> step_time.StepTime:
    """Tensor and context parallelism (plan/cost/tensor_parallel.py, plan/cost/context_parallel.py): the
    data-parallel strategy's step on the cut model over gpus / tp ranks (dp × cp), or with `pp`
    the pipeline's over them (pp × dp), its compute the cut share, plus the tp all-reduces and
    the cp ring's passes, all exposed. In a pipeline a rank all-reduces for its stage's blocks
    only, in every slot: its bubble, slots of the stage's work, grows by the same factor."""
    tp, cp = strategy.tp, strategy.cp
    if gpus % (tp * cp):
        raise ConfigError(f"tp={tp} × cp={cp} does not divide {gpus} devices")
    if strategy.pp is not None and strategy.data_parallel().name != "ddp":  # sharded replicas: tp is 1
        return _sharded_pipeline_time(source, strategy.pp, step, cluster, gpus=gpus, nodes=nodes, facts=facts,
                                      accumulate=accumulate)
    stages = strategy.pp.stages if strategy.pp is not None else 1
    cut = source if tp == 1 else ModelSource(source.name, lambda: tensor_parallel.cut_copy(source.shared, strategy),
                                             source.default_seq)
    inner = predict_time(cut, tensor_parallel.inner_strategy(strategy), step, cluster, gpus=gpus // tp,
                         nodes=min(nodes, gpus // tp), facts=facts, accumulate=accumulate)
    share = tensor_parallel.compute_fraction(tp, step.block_flops, step.flops_forward)
    comm = tensor_parallel.tp_seconds(step.block_output_bytes, tp=tp, dp=gpus // (tp * stages), accumulate=accumulate,
                                      recompute=bool(step.checkpointed), cluster=cluster) / stages
    comm += context_parallel.ring_seconds(step.attention_kv_bytes, step.attention_calls, cp=cp, gpus=gpus,
                                          accumulate=accumulate, recompute=bool(step.checkpointed),
                                          same_node=tp * cp <= (cluster.gpus_per_node or gpus), cluster=cluster)
    compute = inner.compute * share
    bubble = inner.bubble * share * (1 + comm / compute) if compute else inner.bubble
    return dataclasses.replace(inner, compute=compute, bubble=bubble, exposed_comm=inner.exposed_comm + comm,
                               comm=inner.comm + comm)


def _sharded_pipeline_time(source: ModelSource, pipe: Pipeline, step: StepCount, cluster: Cluster, *, gpus: int,
                           nodes: int, facts: ModelFacts, accumulate: int) -> step_time.StepTime:
    """A pipeline whose replicas run ZeRO-1 or 2 (pipeline/sharded.py): the DDP pipeline's step,
    its reductions costed as all-reduces (what gloo runs; a reduce-scatter elsewhere is no
    slower), then each replica steps its slices of the fullest stage's buckets and gathers the
    stage's parameters back, exposed."""
    seconds = predict_time(source, pipe, step, cluster, gpus=gpus, nodes=nodes, facts=facts, accumulate=accumulate)
    replicas = gpus // pipe.stages
    if replicas == 1:
        return seconds
    buckets = traffic(source.shared, pipe, world=gpus, local_world=gpus // nodes).buckets  # the fullest stage's
    group = _stage_replicas(replicas, gpus, nodes)
    gather = sum(step_time.gather_from_owners(b, group, cluster, all_gather=cluster.backend != "gloo")
                 for _, b in buckets)
    optimizer = step_time.optimizer_seconds(sum(n for n, _ in buckets) // replicas, cluster, world=gpus, nodes=nodes,
                                            tensors=[max(1, n // replicas) for n, _ in buckets])
    return dataclasses.replace(seconds, exposed_comm=seconds.exposed_comm + gather, comm=seconds.comm + gather,
                               optimizer=optimizer)


def _collectives(strategy: Strategy, compute: step_time.Compute, *, sent, cluster: Cluster, gpus: int, nodes: int,
                 step: StepCount, sync: bool, accumulate: int, model: nn.Module) -> step_time.StepTime:
    """One backward's (micro-batch's) time: `compute` is its work on one device, `sync` False
    under no_sync() (the first accumulate − 1 micro-batches)."""
    elements, sizes = [n for n, _ in sent.buckets], [b for _, b in sent.buckets]
    group = Group(gpus, nodes)
    if isinstance(strategy, Pipeline):
        replicas = gpus // strategy.stages
        cut = max(step.block_output_bytes.values(), default=0) // (replicas * accumulate)
        shares = stage_shares(step, model, strategy.holdings(model))
        return step_time.pipeline(compute.share(1 / replicas), stages=strategy.stages,
                                  microbatches=strategy.microbatches, cut_bytes=cut,
                                  replicas_group=_stage_replicas(replicas if sync else 1, gpus, nodes),
                                  stage_bucket_bytes=sizes,
                                  stage_bucket_elements=elements, cluster=cluster, same_node=nodes == 1,
                                  shares=shares[0] if shares is not None else None,
                                  bubble_slots=schedule_figures.figures(strategy)[0],
                                  virtual=strategy.virtual)
    share = compute.share(1 / gpus)
    scatter = cluster.backend != "gloo"  # zero/collectives.py: what measured faster on each backend
    if isinstance(strategy, ZeRO) and strategy.stage == 3:
        return step_time.zero3(share, elements, sizes, sizes, group, cluster, scatter=scatter, sync=sync)
    if not sync:  # the buckets only accumulate
        return step_time.StepTime(share.forward + share.backward, 0.0)
    if isinstance(strategy, ZeRO):
        return step_time.zero12(share, sizes, elements, sent.gathers, group, cluster, scatter=scatter)
    if isinstance(strategy, DDP):
        return step_time.data_parallel(share, sizes, elements, group, cluster,
                                       hierarchical=isinstance(strategy, Hierarchical))
    return step_time.StepTime(share.forward + share.backward, 0.0)


def _stage_replicas(replicas: int, gpus: int, nodes: int) -> Group:
    """The group of a pipeline stage's replicas: adjacent ranks (the grid's pp is outermost), so
    on as few nodes as hold them."""
    return Group(replicas, spread(replicas, max(1, gpus // nodes)))


def _speed(seconds: step_time.StepTime, facts: ModelFacts, cluster: Cluster, gpus: int) -> dict:
    model_flops = facts.step.flops_forward + facts.step.flops_backward
    peak = cluster.peak_flops[FLOPS_DTYPE[facts.precision]]
    return {"step_seconds": seconds.total, "compute_seconds": seconds.compute, "optimizer_seconds": seconds.optimizer,
            "exposed_comm_seconds": seconds.exposed_comm, "bubble_seconds": seconds.bubble,
            "comm_seconds": seconds.comm, "per_device_per_second": facts.tokens / seconds.total / gpus,
            "mfu": model_flops / (seconds.total * gpus * peak)}


def session_line(strategy: Strategy, step: StepCount, precision: str = "32", accumulate: int = 1) -> str:
    """The `pt.Session(...)` that runs `strategy` as planned."""
    if isinstance(strategy, Pipeline):
        name = _pipeline_call(strategy)
    elif isinstance(strategy, Mesh):
        dims = "".join(f"{d}={n}, " for d, n in (("tp", strategy.tp), ("cp", strategy.cp)) if n > 1)
        pp = f", pp={_pipeline_call(strategy.pp)}" if strategy.pp is not None else ""
        name = f"pt.Mesh({dims}dp={_call(strategy.data_parallel())}{pp})"
    else:
        name = _call(strategy)
    ac = ", activation_checkpointing=\"auto\"" if step.checkpointed else ""
    precision = f", precision={precision!r}" if precision != "32" else ""
    accumulated = f", accumulate={accumulate}" if accumulate > 1 else ""
    return f"pt.Session({name}{precision}{accumulated}{ac})"


def _call(strategy: Strategy) -> str:
    """A data-parallel strategy as the Session line names it: its name, or ZeRO's settings."""
    if isinstance(strategy, ZeRO) and (strategy.offload or strategy.param_dtype is not None):
        dtype = f", param_dtype=torch.{str(strategy.param_dtype).removeprefix('torch.')}" if strategy.param_dtype else ""
        return f"pt.ZeRO(stage={strategy.stage}{', offload=True' if strategy.offload else ''}{dtype})"
    return repr(strategy.name)


def _pipeline_call(strategy: Pipeline) -> str:
    virtual = f", virtual={strategy.virtual}" if strategy.virtual > 1 else ""
    return (f"pt.Pipeline(stages={strategy.stages}, schedule={strategy.schedule!r}{virtual}, "
            f"microbatches={strategy.microbatches})")


def recommend(rows: list[dict]) -> dict | None:
    """The fitting row with the most throughput per device, or None when none fits."""
    fitting = [row for row in rows if "error" not in row and row["fits"]]
    return max(fitting, key=lambda row: row["per_device_per_second"], default=None)


def describe_plan(rows: list[dict], *, gpus: int, cluster: Cluster, per: str, size, nodes: int | None = None) -> str:
    """The text table of times and the recommendation; `per` names the unit (token or sample),
    `size` formats bytes."""
    lines = [f"step time per strategy on {gpus} {cluster.name} device(s) ({nodes_for(gpus, cluster, nodes)} node(s)); "
             f"fits: device peak within {size(cluster.device_memory)}, and offload's CPU memory within a node's "
             f"{size(cluster.host_memory)}:",
             f"  {'strategy':<22}{'device peak':>12}{'fits':>6}{'step s':>10}{'compute':>10}{'exposed':>10}"
             f"{'bubble':>10}{'optimizer':>10}{per + 's/s/dev':>14}{'MFU':>7}"]
    for row in rows:
        if "error" in row:
            continue
        name = _label(row)
        lines.append(f"  {name:<22}{size(row['device_peak']):>12}{'yes' if row['fits'] else 'no':>6}"
                     f"{row['step_seconds']:>10.3g}{row['compute_seconds']:>10.3g}{row['exposed_comm_seconds']:>10.3g}"
                     f"{row['bubble_seconds']:>10.3g}{row['optimizer_seconds']:>10.3g}"
                     f"{row['per_device_per_second']:>14.4g}{row['mfu']:>7.1%}")
    best = recommend(rows)
    if best is not None:
        lines.append(f"recommended: {best['session']}  ({_label(best)}: {best['step_seconds']:.3g} s per step, "
                     f"{best['per_device_per_second']:.4g} {per}s/s per device, MFU {best['mfu']:.1%})")
    return "\n".join(lines)


def _label(row: dict) -> str:
    return row["label"] + (" +ckpt" if row["activation_checkpointing"] else "")


def smallest_fit(source: ModelSource, facts: ModelFacts, cluster: Cluster, *, gpus: int, optimizer: str,
                 accumulate: int = 1) -> str:
    """What would make the model fit when no strategy does: more devices, offload, a smaller batch."""
    step = facts.checkpointed or facts.step
    ac = " with activation checkpointing" if facts.checkpointed else ""
    zero3 = ZeRO(stage=3)

    def peak(n: int, strategy: Strategy, activations: int) -> int:
        """The device peak; past any device where the node's host memory cannot hold the ranks' offload."""
        per_node = min(n, cluster.gpus_per_node)
        row = memory_rows(source, gpus=n, gpus_per_node=per_node, optimizer=optimizer,
                          activation_bytes=activations, chosen=[strategy], foreach=cluster.device == "cuda",
                          accumulate=accumulate, step=step)[0]
        return row["device_peak"] if "error" not in row and _host_holds(row, cluster, per_node) else 1 << 62

    ways, batch = [], facts.batch // accumulate
    # on more devices than the batch has samples, the batch must grow to give each one (data_replicas)
    more = next((n for n in (2 ** k for k in range(11)) if n > gpus and
                 peak(n, zero3, step.activation_peak_bytes * max(1, n // batch)) <= cluster.device_memory), None)
    if more:
        ways.append(f"{more} devices under zero3{ac}" + (f" and a batch of {more * accumulate}" if more > batch else ""))
    if cluster.host_link is not None and \
            peak(gpus, ZeRO(stage=3, offload=True), step.activation_peak_bytes) <= cluster.device_memory:
        ways.append(f"zero3 with offload{ac} on {gpus}")
    fixed = peak(gpus, zero3, 0)
    per_sample = step.activation_peak_bytes / facts.batch
    if fixed < cluster.device_memory and per_sample and (
            smaller := int((cluster.device_memory - fixed) / per_sample * gpus * accumulate)):
        ways.append(f"a batch of at most {min(smaller, facts.batch - 1)} under zero3{ac} on {gpus}")
    if not ways:
        return "nothing up to 1,024 devices fits it"
    return "it would fit with " + "; or ".join(ways)
