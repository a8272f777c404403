"""Bytes each rank holds under each strategy, predicted from the strategies' own layout code.

The model may be on the meta device: only shapes, dtypes and the module tree are read, and the
layouts are computed on meta stand-ins, so nothing is allocated. Each figure and where it comes
from (the functions named are the ones the strategies themselves call):

- params, grads, optimizer: EXACT at rest, i.e. after `optimizer.step()` from the second step on
  (the buckets of DDP are laid out again after the first backward), before `zero_grad()`, with
  the finite check's sum taken (Session's step takes it). tests/plan/cost/test_memory.py checks them
  against the live tensors of real runs at world 2, 3 and 4.
    single, ddp, hierarchical, pipeline: every parameter; gradients in DDP's buckets
        (buckets.assign / first_layout via grad_sync.first_grad_layout, buckets.buffer_numel:
        padded to 1, or to the node's size for hierarchical); pipeline stages from
        Pipeline.holdings (partition.py / plan.py), rank r holding stage r // replicas
        (distributed/grid.py: pp is the grid's outermost axis).
    zero1 / zero2: the same buckets, padded to N (OwnerReduction.pad_to), in param_dtype; the
        parameters live in flat buffers of that layout; the optimizer steps slice r of each
        (stage12.py): a view, or fp32 master copies under param_dtype / offload, with fp32
        gradients of their own. Stage 1 keeps the full gradient buckets; stage 2 keeps slice r.
    zero3: units from WrapPolicy.select, parameters by units.params_by_unit / flats_by_unit, one
        flat shard per unit and param group (and per big root parameter) of padded_numel(numel, N)
        / N elements (flat_shard.py), its gradient the same size; frozen parameters stay whole.
    mesh (tensor parallel): the data-parallel strategy's figures on the model as a tp rank holds
        it (each cut parameter 1/tp: plan/cost/tensor_parallel.py) over world / tp ranks.
    The optimizer keeps `OptimizerState.per_element` tensors the size of each tensor it steps,
    in its dtype, plus `scalar_bytes` per tensor (Adam's `step`).
  A caveat for hierarchical only: its buckets are laid out again in the order gradients arrived,
  assumed here to be the reverse of registration (`arrival` overrides it); another order may move
  bucket boundaries, and so the padding, by under L elements per bucket.
- comm_buffers: UPPER BOUND of transient storage during backward, beyond the at-rest figures:
  zero2's two largest full gradient buckets (one filling, one reducing; at the backward's start,
  when the activations peak, only the first is filling: `comm_at_start`); zero3's largest full
  flat gradient (one at a time, stage3.py) with, where the flat copies gradients in rather than
  adopting autograd's (a flat of several parameters), autograd's gradient of its largest
  parameter, there while it is copied; hierarchical's phase-1 chunks, every bucket's at
  once. Zero for ddp, zero1 and pipeline, whose buckets are the gradients. p2p receive buffers
  of a pipeline are activations, not counted here. With gradient accumulation (`accumulate` > 1:
  the backwards before the last run under no_sync()), zero2 keeps every full bucket and zero3
  every unit's full flat gradient from the first backward of the window to the reduction of the
  last, so there they are all of them.
- gathered: zero3 only, UPPER BOUND: the root unit's full parameters plus the two largest other
  units (the running one and the prefetched one; one without prefetch), in param_dtype.
- late_backward: zero3 only, without accumulation: the most that gathered units, gradient buffers
  and the shards' new gradients hold at once after the backward's start, from a walk over the
  flats in the order their gradients arrive (zero3_backward.py), where `gathered + comm_buffers +
  fresh_grads` would take the largest of each at once. The bench MLP's zero3 at world 4 (six
  units, each copying a 16 MiB gradient into a 16 MiB buffer): 120 MiB predicted before against
  134 measured; at world 2, 192 against 193, by two errors cancelling.
- activations: APPROXIMATE: `activation_bytes` (probe's StepCount.activation_peak_bytes for
  the global batch: the most its forward and backward hold at once beyond the model's state, the
  saved activations, their gradients and temporaries) times this rank's share of the batch, 1/N,
  and of that one accumulation micro-batch's, 1/accumulate; for a pipeline stage, of its
  replica's batch: the stage's share of the saved activations (its blocks', and the parts
  before and after them on the first and last: block_regions.stage_shares) times the
  micro-batches in flight (GPipe m, 1F1B min(m, S - s)) over m, and on the last stage, where
  backward starts from the loss, the rest of the transient peak for one micro-batch (the bench
  GPT's pipeline peaks: +20 % and +12 % over measured with an even split, -6 % and -5 % so);
  without blocks, the transient peak evenly over the stages.
- weight_copies: APPROXIMATE, under autocast with parameters in fp32: the low-precision copy of
  each weight the rank computes with (probe's StepCount.weight_copy_bytes, per parameter
  element, times the elements the rank holds whole: all of them under ddp, zero1 and zero2, its
  stage's in a pipeline, its slices under tp). Autocast caches the cast of a parameter, and the
  session's autocast spans forward and backward, so they live from the forward's first use to
  the backward's end, whatever the batch and however checkpointed. ZeRO-3's gathered parameters
  are views into the unit's flat buffer, which autocast does not cache: the copies are what the
  matmuls save for backward, all of them at the forward's end (an upper bound: the last unit's
  backward may free one before another is made), or, with checkpointing, the root unit's and
  one other unit's while it runs again. None with ZeRO's `param_dtype`: the parameters are in
  the low precision already. tests/plan/cost/test_memory.py measures them in real bf16 steps.
- host: how much of params + grads + optimizer is in CPU memory (ZeRO's offload).
- fresh_grads: how much of grads on the device zero_grad frees and the next backward makes again
  (ZeRO-2's reduced slices, ZeRO-3's shards' gradients); ddp's and zero1's buckets stay. They
  appear as backward frees the activations, so the peak holds the larger of the two (device_peak;
  bench/plan_accuracy.py: the bench GPT's zero3 peaks went from 6-7 % over to within 1 %).
- workspace: the optimizer step's temporaries (OptimizerState.workspace: Adam's, two of the
  tensor it steps and the previous one's on the CPU, one of each at once with foreach on CUDA),
  none on the device under offload. The step comes after the backward has freed the
  activations, so the peak holds the larger of the two.

Not counted: buffers (BatchNorm statistics; whole on every rank: ModelFacts.buffer_bytes), the
batch, the allocator's fragmentation and the framework's own workspace (CUDA context, kernels'
scratch), which a real device adds on top.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paratrain.errors import ConfigError
from paratrain.parallel.base import Strategy
from paratrain.parallel.buckets import buffer_numel
from paratrain.parallel.ddp import DDP
from paratrain.parallel.hierarchical import Hierarchical
from paratrain.parallel.pipeline import Pipeline
from paratrain.parallel.single import Single
from paratrain.parallel.tensor.mesh import Mesh
from paratrain.parallel.zero import ZeRO
from paratrain.plan.cost import schedule_figures
from paratrain.plan.cost.context_parallel import ring_bytes_held
from paratrain.plan.cost.layouts import data_parallel_layout, stage_layout, trainable, zero12_layout
from paratrain.plan.cost.optimizer_state import OPTIMIZERS, OptimizerState
from paratrain.plan.cost.tensor_parallel import activation_fraction, cut_copy, inner_strategy
from paratrain.plan.cost.zero3_backward import backward_peak, zero3_walk_flats
from paratrain.plan.model.block_regions import stage_shares


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds (module docstring: which figures are exact)."""

    params: int  # the parameters the model computes with, and master copies the optimizer steps
    grads: int  # their gradients, with the buckets / flat buffers they live in, padding included
    optimizer: int  # the optimizer's state
    comm_buffers: int = 0  # transient during backward, upper bound
    gathered: int = 0  # zero3: full units gathered at once, upper bound
    activations: int = 0  # the forward and backward's transient peak, approximate
    weight_copies: int = 0  # autocast's low-precision copies of the weights, through the backward
    host: int = 0  # of params + grads + optimizer: in CPU memory (offload)
    workspace: int = 0  # the optimizer step's temporaries on the device, approximate
    fresh_grads: int = 0  # of grads on the device: freed by zero_grad, made again in backward
    comm_at_start: int | None = None  # of comm_buffers, what the backward holds at its start (None: all)
    late_backward: int | None = None  # zero3: the most held after the start (None: gathered + comm + fresh)

    @property
    def at_rest(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def device_peak(self) -> int:
        """On the device at the peak of a step: everything but what lives in CPU memory, with the
        larger of what the forward and backward add and what the optimizer step adds (by then the
        activations, communication buffers and gathered units are freed). Gradients made again
        in every backward (`fresh_grads`: ZeRO-2's slices, ZeRO-3's shards) grow as the
        activations are freed: the backward holds the larger of the two, not their sum. So do
        buffers made as it goes (`comm_at_start`: zero2 fills one gradient bucket at a time), and
        zero3's units, whose walk (`late_backward`) gives what is held at once after the start."""
        fresh = self.fresh_grads
        start = self.comm_buffers if self.comm_at_start is None else self.comm_at_start
        late = self.gathered + self.comm_buffers + fresh if self.late_backward is None else self.late_backward
        backward = self.weight_copies + max(self.gathered + self.activations + start, late)
        return self.at_rest - self.host - fresh + max(backward, fresh + self.workspace)


def predict(model: nn.Module, strategy: Strategy, *, world: int, optimizer: OptimizerState | str = "adam",
            local_world: int | None = None, activation_bytes: int = 0,
            group_of: dict[nn.Parameter, int] | None = None,
            arrival: list[nn.Parameter] | None = None, foreach: bool = False, accumulate: int = 1,
            step: Any = None, weight_copy_rate: float | None = None) -> list[RankMemory]:
    """Rank r's bytes at index r, for `model` trained by `strategy` on `world` ranks.

    optimizer: an OptimizerState or a name in OPTIMIZERS.
    local_world: ranks per node (hierarchical; default: one node).
    activation_bytes: the transient peak of one forward and backward of the global batch
        (probe's StepCount.activation_peak_bytes).
    group_of: each trainable parameter's optimizer param group (default: all in one).
    arrival: the order gradients arrive in backward (default: reverse registration).
    foreach: the optimizer steps every tensor at once (torch's default for CUDA tensors).
    accumulate: micro-batches per optimizer step (Session(accumulate=...)), each 1/accumulate of
        the batch; all but the last backward run under no_sync().
    step: probe's StepCount that activation_bytes came from: a pipeline's stages get their
        share of them (block_regions.stage_shares), and each rank the copies autocast makes of
        the weights it holds; None: an even split, and no copies.
    weight_copy_rate: bytes of those copies per parameter element (default: the step's
        weight_copy_bytes over the model's parameters).
    """
    if isinstance(optimizer, str) and optimizer not in OPTIMIZERS:
        raise ConfigError(f"the planner knows the optimizers {', '.join(OPTIMIZERS)}; got {optimizer!r}")
    state = OPTIMIZERS[optimizer] if isinstance(optimizer, str) else optimizer
    if isinstance(strategy, ZeRO) and strategy.replicate > 1:
        return _hybrid(model, strategy, world, optimizer=state, local_world=local_world,
                       activation_bytes=activation_bytes, group_of=group_of, arrival=arrival, foreach=foreach,
                       accumulate=accumulate, step=step, weight_copy_rate=weight_copy_rate)
    if world < 1 or accumulate < 1:
        raise ConfigError(f"world and accumulate must be at least 1; got world {world}, accumulate {accumulate}")
    held = trainable(model)
    if weight_copy_rate is None:
        elements = sum(p.numel() for p in model.parameters())
        weight_copy_rate = step.weight_copy_bytes / elements if step is not None and elements else 0.0
    facts = _Model(model, held, group_of or {p: 0 for p in held}, state, world, activation_bytes, foreach,
                   accumulate, step, weight_copy_rate)
    if isinstance(strategy, Pipeline):
        return _pipeline(facts, strategy)
    if isinstance(strategy, Mesh):
        return _mesh(facts, strategy, local_world or world)
    if isinstance(strategy, ZeRO):
        if strategy.stage not in (1, 2, 3):
            raise ConfigError(f"ZeRO has stages 1, 2 and 3; got stage={strategy.stage!r}")
        one = _zero12(facts, strategy) if strategy.stage in (1, 2) else _zero3(facts, strategy)
    elif isinstance(strategy, DDP):  # Hierarchical too
        one = _data_parallel(facts, strategy, local_world or world, arrival)
    elif isinstance(strategy, Single):
        if world != 1:
            raise ConfigError(f"strategy 'single' runs one process; got world {world}")
        one = dataclasses.replace(_plain(state, list(model.parameters()), facts.activations, foreach),
                                  weight_copies=facts.copies(model.parameters()))
    else:
        raise ConfigError(f"no memory model for strategy {strategy.name!r}")
    return [one] * world


def _hybrid(model: nn.Module, strategy: ZeRO, world: int, *, activation_bytes: int, **rest) -> list[RankMemory]:
    """Hybrid sharding: each of the `replicate` groups holds what ZeRO over world / replicate ranks
    holds (the all-reduce across the groups works in place on the reduced slices, stage12.py and
    stage3.py), while the batch is split over every rank, so each rank's activations are
    1/world of the batch's. Rank r is shard rank r mod (world / replicate) (distributed/grid.py)."""
    if world % strategy.replicate:
        raise ConfigError(f"ZeRO(replicate={strategy.replicate}) needs groups of equal size: it does not divide "
                          f"the world size {world}")
    shard = world // strategy.replicate
    ranks = predict(model, dataclasses.replace(strategy, replicate=1), world=shard,
                    activation_bytes=activation_bytes // strategy.replicate, **rest)
    return [ranks[r % shard] for r in range(world)]


@dataclass(frozen=True)
class _Model:
    module: nn.Module
    trainable: list[nn.Parameter]
    group_of: dict[nn.Parameter, int]
    state: OptimizerState
    world: int
    activation_bytes: int
    foreach: bool = False
    accumulate: int = 1
    step: Any = None  # probe.StepCount, for a pipeline's stage shares
    copy_rate: float = 0.0  # autocast's weight copies, bytes per parameter element

    def copies(self, params) -> int:
        """The bytes of autocast's copies of `params` (the module docstring's weight_copies)."""
        return round(self.copy_rate * sum(p.numel() for p in params))

    @property
    def activations(self) -> int:
        """A rank's share of one accumulation micro-batch's transient peak."""
        return self.activation_bytes // (self.world * self.accumulate)

    @property
    def frozen_bytes(self) -> int:
        return sum(_bytes(p) for p in self.module.parameters() if not p.requires_grad)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.dtype.itemsize


def _plain(state: OptimizerState, params: list[nn.Parameter], activations: int, foreach: bool = False) -> RankMemory:
    """One process: every parameter, a gradient each, the optimizer's state on each trainable one."""
    trainable = [p for p in params if p.requires_grad]
    stepped = [(p.numel(), p.dtype) for p in trainable]
    return RankMemory(params=sum(_bytes(p) for p in params), grads=sum(_bytes(p) for p in trainable),
                      optimizer=state.bytes(stepped), activations=activations,
                      workspace=state.workspace(stepped, foreach))


def _data_parallel(m: _Model, strategy: DDP, local_world: int, arrival) -> RankMemory:
    """DDP and hierarchical: whole parameters and optimizer; gradients are bucket views."""
    if isinstance(strategy, Hierarchical) and m.world % local_world:
        raise ConfigError(f"hierarchical needs whole nodes: world {m.world}, {local_world} per node")
    reduction, layout = data_parallel_layout(m.trainable, strategy, local_world, arrival)
    sizes = [buffer_numel(b, reduction.pad_to) * b[0].dtype.itemsize for b in layout]
    plain = _plain(m.state, list(m.module.parameters()), 0, m.foreach)
    chunks = sum(s // reduction.pad_to for s in sizes) if isinstance(strategy, Hierarchical) else 0
    return RankMemory(params=plain.params, grads=sum(sizes), optimizer=plain.optimizer, comm_buffers=chunks,
                      activations=m.activations, weight_copies=m.copies(m.module.parameters()),
                      workspace=plain.workspace)


def _zero12(m: _Model, strategy: ZeRO) -> RankMemory:
    """Stages 1 and 2 (stage12.py, [Note: master shards])."""
    reduction, layout, original = zero12_layout(m.trainable, strategy, m.world, m.group_of)
    flats = [(buffer_numel(b, reduction.pad_to), b[0].dtype, original[b[0]].dtype) for b in layout]
    compute = sum(n * dt.itemsize for n, dt, _ in flats)
    masters = strategy.param_dtype is not None or strategy.offload
    stepped = sum(n // m.world * (mt if masters else dt).itemsize for n, dt, mt in flats)
    master_bytes = stepped if masters else 0
    slices = sum(n // m.world * dt.itemsize for n, dt, _ in flats)
    grads = (compute if strategy.stage == 1 else slices) + master_bytes
    mine = [(n // m.world, mt if masters else dt) for n, dt, mt in flats]
    optimizer = m.state.bytes(mine)
    full = sorted((n * dt.itemsize for n, dt, _ in flats), reverse=True)
    # one bucket filling, one reducing (the first alone at the backward's start); a window keeps them all
    held, filling = (sum(full[:2]), full[0] if full else 0) if m.accumulate == 1 else (sum(full), sum(full))
    fresh = 0 if strategy.stage == 1 else slices + (0 if strategy.offload else master_bytes)
    return RankMemory(params=m.frozen_bytes + compute + master_bytes, grads=grads, optimizer=optimizer,
                      fresh_grads=fresh,
                      comm_buffers=held if strategy.stage == 2 else 0,
                      comm_at_start=filling if strategy.stage == 2 else 0,
                      activations=m.activations,
                      weight_copies=0 if strategy.param_dtype is not None else m.copies(m.module.parameters()),
                      host=2 * master_bytes + optimizer if strategy.offload else 0,
                      workspace=0 if strategy.offload else m.state.workspace(mine, m.foreach))


def _zero3(m: _Model, strategy: ZeRO) -> RankMemory:
    """Stage 3 (stage3.py, flat_shard.py): one flat shard per unit and param group, and per big
    root parameter (units.flats_by_unit); the backward walked flat by flat (zero3_backward.py)."""
    flats = zero3_walk_flats(m.module, strategy, m.group_of, m.world)
    shards = [f.stepped for f in flats]  # each flat's shard: (elements, dtype)
    shard_bytes = sum(n * dtype.itemsize for n, dtype in shards)
    optimizer = m.state.bytes(shards)
    full = {u: sum(f.full for f in flats if f.unit == u) for u in {f.unit for f in flats}}
    others = sorted((b for u, b in full.items() if u), reverse=True)[:2 if strategy.prefetch else 1]
    window = m.accumulate > 1  # every unit's full flat gradient held from the first backward to the last
    copies = 0 if strategy.param_dtype is not None else m.copies(m.module.parameters())
    if copies and m.step is not None and m.step.checkpointed:  # the root's, and one unit's run again
        elements = {u: sum(f.stepped[0] for f in flats if f.unit == u) * m.world for u in full}
        copies = round(m.copy_rate * (elements.get("", 0) + max((n for u, n in elements.items() if u), default=0)))
    return RankMemory(params=m.frozen_bytes + shard_bytes, grads=shard_bytes, optimizer=optimizer,
                      fresh_grads=0 if strategy.offload else shard_bytes,
                      comm_buffers=sum(f.full for f in flats) if window else max((f.with_copy for f in flats),
                                                                                  default=0),
                      gathered=full.get("", 0) + sum(others),
                      late_backward=None if window else backward_peak(flats, full, strategy.prefetch),
                      activations=m.activations, weight_copies=copies,
                      host=2 * shard_bytes + optimizer if strategy.offload else 0,
                      workspace=0 if strategy.offload else m.state.workspace(shards, m.foreach))


def _mesh(m: _Model, strategy: Mesh, local_world: int) -> list[RankMemory]:
    """Tensor and context parallelism: the data-parallel strategy's memory on the cut model (what a
    tp rank holds: plan/cost/tensor_parallel.py) over world / tp ranks, which are dp × cp, or with `pp`
    the pipeline's over them (pp × dp); activations cut as the papers measure, and the ring's K, V
    blocks in flight (plan/cost/context_parallel.py)."""
    tp, cp = strategy.tp, strategy.cp
    if strategy.pp is not None and strategy.data_parallel().name != "ddp":  # sharded replicas: tp is 1
        return _pipeline(m, strategy.pp, strategy.data_parallel())
    if m.world % (tp * cp):
        raise ConfigError(f"tp={tp} × cp={cp} does not divide the world size {m.world}")
    checkpointed = m.step is not None and bool(m.step.checkpointed)  # what is kept are block inputs
    activations = int(m.activation_bytes * activation_fraction(tp, strategy.sequence_parallel, checkpointed))
    held = m.module if tp == 1 else cut_copy(m.module, strategy)
    ranks = predict(held, inner_strategy(strategy), world=m.world // tp, optimizer=m.state,
                    local_world=max(1, local_world // tp), activation_bytes=activations, foreach=m.foreach,
                    accumulate=m.accumulate, step=m.step, weight_copy_rate=m.copy_rate)
    if cp > 1 and m.step is not None:
        ring = ring_bytes_held(m.step.attention_kv_bytes, m.step.attention_calls, gpus=m.world,
                               accumulate=m.accumulate)
        ranks = [dataclasses.replace(r, activations=r.activations + ring) for r in ranks]
    return [ranks[r // tp] for r in range(m.world)]  # rank r is (pp ×) dp × cp rank r // tp (distributed/grid.py)


def _pipeline(m: _Model, strategy: Pipeline, sharded: ZeRO | None = None) -> list[RankMemory]:
    """Each stage's parameters whole (Pipeline.holdings); replicas of a stage average their
    gradients in DDP's buckets, which are the gradients (padded to 1), or under ZeRO stage 1 or 2
    (`sharded`, pipeline/sharded.py) hold what `_zero12` gives for the stage over its replicas,
    every bucket filling through the step's micro-batches as in an accumulation window. (The
    stage lays out buckets per chunk; with virtual > 1 each chunk's padding is not counted.)"""
    if m.world % strategy.stages:
        raise ConfigError(f"pipeline stages={strategy.stages} must divide the world size {m.world}")
    if strategy.balance == "time":
        raise ConfigError("balance='time' measures the layers on a device; plan with 'layers' or 'params'")
    replicas = m.world // strategy.stages
    holdings = strategy.holdings(m.module)
    shares = stage_shares(m.step, m.module, holdings) if m.step is not None else None
    # with shares: each stage keeps its part of the saved activations for each micro-batch in
    # flight, and the last (the loss's end) also the backward's gradients and temporaries beyond
    # them, for one micro-batch; without, the transient peak evenly
    if shares:
        kept = m.activation_bytes * m.step.activation_bytes / m.step.activation_peak_bytes
        saved, rest = [kept * share for share in shares[1]], m.activation_bytes - kept
    else:
        saved, rest = [m.activation_bytes / strategy.stages] * strategy.stages, 0
    stages = []
    alive = schedule_figures.figures(strategy)[1]  # per rank, in chunks of 1/virtual of its stage
    for s, held in enumerate(holdings):
        params = list({id(p): p for p in held}.values())
        trainable = [p for p in params if p.requires_grad]
        grads = sum(buffer_numel(b, 1) * b[0].dtype.itemsize for b in stage_layout(trainable))
        micro = strategy.microbatches
        in_flight = alive[s] / strategy.virtual  # GPipe m, 1F1B min(m, p - s) (schedules.py)
        extra = rest if s == strategy.stages - 1 else 0
        activations = round((saved[s] * in_flight + extra) / (replicas * micro * m.accumulate))
        if sharded is not None:
            own = dataclasses.replace(m, module=nn.ParameterList(params), trainable=trainable, world=replicas,
                                      accumulate=m.accumulate * micro)
            stages.append(dataclasses.replace(_zero12(own, sharded), activations=activations))
            continue
        plain = _plain(m.state, params, activations, m.foreach)
        stages.append(RankMemory(params=plain.params, grads=grads, optimizer=plain.optimizer,
                                 activations=activations, weight_copies=m.copies(params), workspace=plain.workspace))
    return [stages[r // replicas] for r in range(m.world)]
