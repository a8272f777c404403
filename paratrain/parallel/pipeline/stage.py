"""One rank of a pipeline: its chunks (one virtual stage each, actions.py), the micro-batches in
flight, and the executor of its schedule's action list.

A step is a lifecycle pair around that list:

    start_step(inputs, targets, loss_fn, scale)   cut the batch into micro-batches
    run the actions                               F / B / I / W, sends and receives, in list order
    finish_step() -> loss                         wait for sends, average gradients over replicas

The list was proved before the first step (check.py), so the executor only does what each action
says ([Note: what an action does when it runs], actions.py). A forward runs the chunk's layers on
micro-batch i (the first stage takes its own slice of the batch; the last applies the loss) and
keeps what backward needs; B back-propagates the output's gradient (on the last stage, the
scaled loss) through inputs and weights; I only to the inputs, keeping the graph for W, which
then back-propagates to the chunk's weights (Qi et al. 2023: the weight gradients are the same
sums, taken later; W walks the graph from the outputs again). Each records an `Event`
(timeline.py).

Gradients: micro-batch losses are scaled by 1/m, so m micro-batches of the mean loss sum to the
mean over the whole batch, exactly as one device computes it. With data parallelism, replicas of
the same stage average their gradients once per step (as GPipe does, Huang et al. 2019, section
2.2) through DDP's bucketed path (grad_sync.py), one per chunk: during the chunk's last action
that makes weight gradients (its last B or W), each full bucket's all-reduce starts while that
backward goes on; only at the end of the step `finish_step` waits for them. So a sync never
starts before the last weight gradient of its chunk is made (picotron's PR #5 was that bug).
Skipped inside `no_sync()`, so gradient accumulation communicates only on the last micro-step.
Buffers (BatchNorm statistics) go the other way, as in torch's DDP: replicas take replica 0's
before the forward of each optimizer step and before inference.

Inference is the module's own `forward(x)` under torch.no_grad(): every stage, forward only, the
output broadcast to the whole pipeline.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from paratrain.components.optim import clip_grad_norm_over
from paratrain.distributed import comm
from paratrain.errors import ConfigError, UsageError
from paratrain.parallel.base import CheckpointLayout, LossFn, ParallelModule, backward_no_autocast, check_loss, user_key
from paratrain.parallel.buckets import AllReduce, default_caps
from paratrain.parallel.grad_sync import GradSync
from paratrain.parallel.pipeline.actions import Action, Op, rank_of, with_comm
from paratrain.parallel.pipeline.check import check
from paratrain.parallel.pipeline.microbatches import chunks, shape_key
from paratrain.parallel.pipeline.p2p import Pending, StageLinks, broadcast_output, floating
from paratrain.parallel.pipeline.schedules import Order, Schedule
from paratrain.parallel.pipeline.sharded import ShardedReplicas
from paratrain.parallel.pipeline.tied import TiedWeights
from paratrain.parallel.pipeline.timeline import Event, Kind


class PipelineStage(ParallelModule):
    """Rank `stage` of a pipeline of `stages` ranks: `module` (its chunks' parts) runs here;
    `schedule` orders the micro-batches.

    schedule: a `Schedule` of schedules.py, or an order function `(p, v, m) -> lists`.
    pipe_group: the ranks of this pipeline (one per stage), in stage order.
    dp_group: the ranks holding this same stage in other replicas (None or size 1: no replicas).
    device: where this stage's layers, activations and gradients live.
    run: what the stage computes (default `module` itself; a cut model's `StageRun`, cut.py).
    runs: with `virtual` > 1, what each chunk computes, chunk c being virtual stage c·stages + stage.
    chunk_params: each chunk's parameters (default: the module's, one chunk).
    tied: the weights this stage shares with other stages (tied.py).
    names: each parameter's name in the whole model (a tied weight's first name there).
    ordered_pairs: check the schedule for a backend that ignores p2p tags (NCCL; check.py).
    sharded: the replicas under ZeRO stage 1 or 2 (sharded.py), whose gradient syncs replace
        DDP's; `holders` then names every rank of this pipeline and its replicas, which between
        them hold the whole gradient.
    """

    supports_token_weights = False  # micro-batches are cut inside the schedule (Session refuses weight=)

    def __init__(self, module: nn.Module, *, stage: int, stages: int, schedule: Schedule | Order,
                 microbatches: int, pipe_group: dist.ProcessGroup | None,
                 dp_group: dist.ProcessGroup | None, device: torch.device,
                 run: Callable[[Any], Any] | None = None, tied: TiedWeights | None = None,
                 names: dict[nn.Parameter, str] | None = None, loss: LossFn | None = None,
                 virtual: int = 1, runs: list[Callable[[Any], Any]] | None = None,
                 chunk_params: list[list[nn.Parameter]] | None = None, ordered_pairs: bool = False,
                 sharded: ShardedReplicas | None = None, holders: dist.ProcessGroup | None = None):
        super().__init__()
        self.module = module
        self.runs = runs or [run or module]
        self.tied = tied or TiedWeights()
        self._names = names or {}
        self._loss = loss  # the model's own loss on the head's outputs (a cut's), if it has one
        self.stage, self.stages, self.microbatches, self.virtual = stage, stages, microbatches, virtual
        # a bare order (a test's hand-made one): no theory of its bubble, nothing to refuse ahead of check()
        self.schedule = schedule if isinstance(schedule, Schedule) else \
            Schedule(schedule, lambda p, v, m: None, lambda p, v, m: None)
        self.lists = with_comm(self.schedule.order(stages, virtual, microbatches), stages, virtual)
        check(self.lists, stages, virtual, microbatches, name=getattr(self.schedule.order, "__name__", "the schedule"),
              ordered_pairs=ordered_pairs)  # before any step: refused by rank and action, not hung
        self.actions = self.lists[stage]
        self.pipe_group, self.dp_group, self.device = pipe_group, dp_group, device
        self.last = stages * virtual - 1  # the last virtual stage
        self.links = {k: StageLinks(pipe_group, k, self.last + 1, device, prev=rank_of(k - 1, stages),
                                    next=rank_of(k + 1, stages)) for k in self._stages()}
        self.replicas = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.replica_index = dist.get_rank(dp_group) if dp_group is not None else 0
        self._chunk_params = chunk_params or [[p for p in module.parameters()]]
        self.sharded, self.holders = sharded, holders
        self._grad_syncs = sharded.syncs if sharded is not None else \
            [self._replica_sync(params) for params in self._chunk_params] if self.replicas > 1 else None
        self._last_weights = {a.stage: a for a in self.actions if a.op in (Op.B, Op.W)}  # each chunk's last
        self._model_shapes: dict[str, torch.Size] | None = None  # gathered on first use
        self._buffers_stale = True  # broadcast replica 0's buffers at the next forward (as DDP)
        self.events: list[Event] = []  # what this stage ran in the last step
        self._stash: dict[tuple[int, int], tuple[Any, Any]] = {}  # (i, stage) → (input, output)
        self._inbox: dict[tuple[Op, int, int], Pending] = {}  # posted receives, by (F or B, i, stage)
        self._outbox: dict[tuple[Op, int, int], Any] = {}  # outputs and input gradients to send
        self._weights_due: dict[tuple[int, int], tuple[Any, Any]] = {}  # I done, W not: (outputs, grads)
        self._inputs: list[Any] = []  # the step's micro-batches (tensors, or trees of them)
        self._targets: list[Any] = []
        self._losses: list[torch.Tensor] = []
        self._run_op = {Op.F: self._forward, Op.B: self._backward, Op.I: self._backward_input,
                        Op.W: self._backward_weight, Op.SEND_F: self._send_forward, Op.RECV_F: self._recv_forward,
                        Op.SEND_B: self._send_backward, Op.RECV_B: self._recv_backward}

    def _stages(self) -> list[int]:
        """The virtual stages this rank holds, chunk by chunk."""
        return [c * self.stages + self.stage for c in range(self.virtual)]

    def _run(self, k: int) -> Callable[[Any], Any]:
        return self.runs[k // self.stages]

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Inference: `inputs` through every stage, micro-batch by micro-batch, forward only;
        returns the whole model's output on every rank of the pipeline (broadcast from the last
        stage), so an evaluation loop runs unchanged on every rank. Every stage passes the same
        inputs, as in training. Call it under torch.no_grad(): training runs forward and backward
        together (session.train_step). Micro-batches need not divide the batch here."""
        if torch.is_grad_enabled():
            raise UsageError("a pipeline stage's forward is for inference: call it under "
                             "torch.no_grad(); to train, call session.train_step(batch, loss_fn), "
                             "which runs forward and backward together, micro-batch by micro-batch")
        self._sync_buffers()
        outputs = []
        for x in chunks(inputs, self.microbatches, exact=False):  # the last may be shorter
            for k in self._stages():  # chunk by chunk: the activation goes round the ranks v times
                links = self.links[k]
                links.begin(shape_key(x))
                y = self._run(k)(x if links.is_first else links.recv_forward())
                self._check_output(y)
                links.send_forward(y)
            outputs.append(y)
        for links in self.links.values():
            links.wait_sends()
        is_last = self.stage == rank_of(self.last, self.stages)
        return broadcast_output(torch.cat(outputs) if is_last else None, rank_of(self.last, self.stages),
                                self.pipe_group, self.device)

    # -- one step --------------------------------------------------------------------------------

    def forward_backward(self, inputs: Any, targets: Any, loss_fn: LossFn, scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of one batch through the whole pipeline, by the schedule.
        Every stage passes the same batch. Returns the batch's mean loss on every stage."""
        self.start_step(inputs, targets, loss_fn, scale)
        for action in self.actions:
            self._run_op[action.op](action)
        return self.finish_step()

    def start_step(self, inputs: Any, targets: Any, loss_fn: LossFn, scale: float) -> None:
        """Cut the batch (tensors, or tuples / dicts of them) into `microbatches` equal
        micro-batches along dim 0; the loss of each is scaled by scale / microbatches."""
        m = self.microbatches
        self._inputs, self._targets = chunks(inputs, m), chunks(targets, m)
        self._loss_fn, self._scale = loss_fn, scale / m
        self._losses, self.events = [], []
        for left in (self._stash, self._inbox, self._outbox, self._weights_due):
            left.clear()  # a step that raised may have left activations behind
        self._sync_buffers()
        self._buffers_stale = self.require_backward_grad_sync  # the step after a no_sync() one skips it
        for links in self.links.values():
            links.begin(shape_key(self._inputs[0]))

    def finish_step(self) -> torch.Tensor:
        """Wait for this step's sends and for the replicas' gradient all-reduces, and return the
        mean loss of the batch, broadcast from the last stage to every stage."""
        for links in self.links.values():
            links.wait_sends()
        if self._stash:
            raise UsageError(f"the schedule left micro-batches {sorted(self._stash)} without backward")
        for sync in self._grad_syncs or []:
            sync.finish()
        if self.require_backward_grad_sync and self.tied.params:
            self.tied.sum_grads()  # after the replicas' average: both are linear
        # float32 everywhere: a broadcast needs the same dtype on every rank
        is_last = self.stage == rank_of(self.last, self.stages)
        loss = torch.stack(self._losses).float().mean() if is_last else \
            torch.zeros((), device=self.device)
        return comm.broadcast(loss, rank_of(self.last, self.stages), self.pipe_group)

    # -- the actions (actions.py) ------------------------------------------------------------------

    def _recv_forward(self, a: Action) -> None:
        self._inbox[(Op.F, a.microbatch, a.stage)] = self.links[a.stage].post_recv_forward()

    def _send_forward(self, a: Action) -> None:
        self.links[a.stage - 1].send_forward(self._outbox.pop((Op.F, a.microbatch, a.stage - 1)))

    def _recv_backward(self, a: Action) -> None:
        self._inbox[(Op.B, a.microbatch, a.stage - 1)] = self.links[a.stage - 1].post_recv_backward()

    def _send_backward(self, a: Action) -> None:
        self.links[a.stage].send_backward(self._outbox.pop((Op.B, a.microbatch, a.stage)))

    def _forward(self, a: Action) -> None:
        """Run micro-batch i through stage k: its input received (or its own slice of the batch on
        the first stage); on the last stage the micro-batch's loss."""
        i, k = a.microbatch, a.stage
        x = self._inputs[i] if k == 0 else self._inbox.pop((Op.F, i, k)).wait()
        start = time.perf_counter()
        if k > 0:  # their gradients are what backward sends to the previous stage
            for leaf in floating(tree_flatten(x)[0]):
                leaf.requires_grad_()
        y = self._run(k)(x)
        if k == self.last:
            y = check_loss(self._loss_fn(y, self._targets[i]))
            self._losses.append(y.detach())
        else:
            self._check_output(y)
            self._outbox[(Op.F, i, k)] = y
        self._stash[(i, k)] = (x, y)
        self._record(Kind.FORWARD, a, start)

    def _backward(self, a: Action) -> None:
        """Back-propagate micro-batch i of stage k through its inputs and weights."""
        outputs, grads = self._output_grads(a)
        start = time.perf_counter()
        self._prepare_sync(a)
        backward_no_autocast(outputs, grads)
        self._input_grads(a, self._stash.pop((a.microbatch, a.stage))[0])
        self._record(Kind.BACKWARD, a, start)

    def _backward_input(self, a: Action) -> None:
        """The input's gradient only (the previous stage waits for it); the graph is kept for W."""
        outputs, grads = self._output_grads(a)
        start = time.perf_counter()
        x = self._stash[(a.microbatch, a.stage)][0]
        leaves = [t for t in floating(tree_flatten(x)[0]) if t.requires_grad] if a.stage > 0 else []
        if leaves:
            backward_no_autocast(outputs, grads, inputs=leaves, retain_graph=True)
        self._input_grads(a, x)
        self._weights_due[(a.microbatch, a.stage)] = (outputs, grads)
        self._record(Kind.INPUT, a, start)

    def _backward_weight(self, a: Action) -> None:
        """The weight gradients of micro-batch i of stage k, from the graph its I kept."""
        outputs, grads = self._weights_due.pop((a.microbatch, a.stage))
        start = time.perf_counter()
        params = [p for p in self._chunk_params[a.stage // self.stages] if p.requires_grad]
        self._prepare_sync(a)
        backward_no_autocast(outputs, grads, inputs=params)
        del self._stash[(a.microbatch, a.stage)]
        self._record(Kind.WEIGHT, a, start)

    def _output_grads(self, a: Action) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """What backward starts from: the scaled loss on the last stage, else the output's
        floating leaves that require a gradient, with the gradients received for them."""
        i, k = a.microbatch, a.stage
        y = self._stash[(i, k)][1]
        if k == self.last:
            return [y * self._scale], None
        g = self._inbox.pop((Op.B, i, k)).wait()
        outputs = floating(tree_flatten(y)[0])
        return [o for o in outputs if o.requires_grad], [d for o, d in zip(outputs, g) if o.requires_grad]

    def _input_grads(self, a: Action, x: Any) -> None:
        if a.stage > 0:
            self._outbox[(Op.B, a.microbatch, a.stage)] = [
                leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in floating(tree_flatten(x)[0])]

    def _prepare_sync(self, a: Action) -> None:
        """Before an action that makes weight gradients: the chunk's last one averages them over
        the replicas (and only it: a sync never starts before its chunk's last W)."""
        if self._grad_syncs is not None:
            last = self._last_weights[a.stage] == a
            # under ZeRO a parameter must take part (sharded.py); under DDP it may not
            unused = () if self.sharded is not None else None
            self._grad_syncs[a.stage // self.stages].prepare(self.require_backward_grad_sync and last, unused=unused)

    def _check_output(self, y: Any) -> None:
        if not all(torch.is_tensor(t) for t in tree_flatten(y)[0]):
            raise UsageError(f"stage {self.stage} returned {type(y).__name__}; a stage must return a tensor, or "
                             "a tuple / dict of tensors (before the last: the activation for the next stage)")

    def _record(self, kind: Kind, a: Action, start: float) -> None:
        self.events.append(Event(self.stage, kind, a.microbatch, start, time.perf_counter(), len(self._stash),
                                 chunk=a.stage // self.stages))

    # -- replicas ----------------------------------------------------------------------------------

    def _sync_buffers(self) -> None:
        """Replicas of a stage take replica 0's buffers (BatchNorm statistics) before a forward,
        as torch's DDP does with rank 0's: once per optimizer step, and before inference."""
        if self._buffers_stale:
            self.sync_buffers()

    def sync_buffers(self) -> None:
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            comm.broadcast_coalesced(list(self.module.buffers()), self.dp_group)

    def _replica_sync(self, params: list[nn.Parameter]) -> GradSync:
        """DDP's bucketed gradient averaging of one chunk's parameters over this stage's replicas.
        Which parameters take part in the last micro-batch is not known before its backward: those
        that do not count as zero where another replica has a gradient, and keep None where none
        has one."""
        params = [p for p in params if p.requires_grad]
        names = {p: n for n, p in self.module.named_parameters()}
        return GradSync(params, names, self.dp_group, reduction=AllReduce(self.dp_group),
                        caps=default_caps(), find_unused=True,
                        finish_in_backward=False)

    # -- the protocol (parallel/base.py) ---------------------------------------------------------

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm over all stages' gradients: squares summed over the pipeline group
        (replicas hold equal gradients after their all-reduce, and a tied weight's copies equal
        ones after theirs: each is counted once); under ZeRO, over this replica's slices, summed
        over every stage and replica."""
        grads, group = self.local_grads()
        if self.sharded is not None:
            return clip_grad_norm_over(grads, max_norm, group)
        skip = self.tied.not_counted()
        counted = [p.grad for p in self.module.parameters() if p.grad is not None and id(p) not in skip]
        return clip_grad_norm_over(counted, max_norm, group, scale_also=grads)

    def local_grads(self) -> tuple[list[torch.Tensor], Any]:
        """This stage's gradients; the other stages' are on the other ranks of the pipeline
        (replicas of a stage hold equal ones after their all-reduce, so every pipeline reaches
        the same verdict); under ZeRO this replica's slices, the others on every rank of `holders`."""
        if self.sharded is not None:
            return self.sharded.grads(), self.holders
        return [p.grad for p in self.module.parameters() if p.grad is not None], self.pipe_group

    def check_loader(self, loader: Any) -> None:
        """Fail at setup, not at the end of the first epoch: every batch a replica reads (the
        epoch's last one too, unless the loader drops it) must cut into equal micro-batches."""
        batch, m = loader.batch_size, self.microbatches
        if batch % m:
            raise ConfigError(f"Pipeline(microbatches={m}) cuts each replica's batch into {m} equal "
                              f"micro-batches, but each replica reads batches of {batch}: make the "
                              f"loader's batch size a multiple of {m} × the replicas, or change microbatches")
        samples = len(loader.sampler) if hasattr(loader.sampler, "__len__") else None
        last = samples % batch if samples is not None and not loader.drop_last else 0
        if last % m:
            raise ConfigError(f"the last batch of each epoch holds {last} samples per replica, which "
                              f"Pipeline(microbatches={m}) cannot cut into {m} equal micro-batches: "
                              "pass DataLoader(..., drop_last=True), or a batch size that divides "
                              "the dataset")

    def checkpoint_layout(self) -> CheckpointLayout:
        """This stage's parameters, whole, under their names in the whole model (a tied weight
        under its first one: its copies write one entry); the shapes of the whole model's. Under
        ZeRO, the optimizer steps this replica's flat slices of them."""
        flat = self.sharded.flat_layouts({p: self._name(p, user_key(n)) for n, p in self.module.named_parameters()}) \
            if self.sharded is not None else None
        whole = CheckpointLayout.whole(self.module, flat, shapes=self.model_shapes())
        params = {self._name(p, n): p for n, p in whole.params.items()}
        first = {n: self._name(p, n) for n, p in whole.params.items()}
        aliases = {**{n: f for n, f in first.items() if n != f},
                   **{a: first[n] for a, n in whole.aliases.items()}}
        return CheckpointLayout(params, whole.flat, False, whole.buffers, whole.shapes, aliases, whole.persistent)

    def default_loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        """The last stage's head returns outputs, not the model's loss: the cut's loss, if it has one."""
        if self._loss is None:
            raise UsageError("a pipeline's last stage returns the head's outputs, not the model's loss: pass "
                             "train_step(batch, loss_fn), or give the Cut a loss= (transformers' GPT-2 has one)")
        return self._loss(outputs, targets)

    def _name(self, p: nn.Parameter, local: str) -> str:
        return self._names.get(p, local)

    def gather_events(self) -> list[Event]:
        """Every stage's events of the last step, on every rank of the pipeline (collective)."""
        return [e for events in self._from_every_stage(self.events) for e in events]

    # -- the whole model, seen from one stage --------------------------------------------------

    def state_pieces(self) -> Iterator[dict[str, torch.Tensor]]:
        """Stage by stage, each stage's state dict sent to the others of its pipeline (on CPU),
        so no rank holds more than its own stage and one other at a time."""
        for stage in range(self.stages):
            box = [{user_key(k): v.detach().cpu() for k, v in self.module.state_dict().items()}
                   if stage == self.stage else None]
            dist.broadcast_object_list(box, src=comm.global_rank(self.pipe_group, stage), group=self.pipe_group)
            yield box[0]

    def model_shapes(self) -> dict[str, torch.Size]:
        """Name → shape of every parameter of the whole model, in stage order (collective over
        the pipeline the first time): what a checkpoint records to recognise its model."""
        if self._model_shapes is None:
            mine = {self._name(p, user_key(n)): p.shape for n, p in self.module.named_parameters()}
            self._model_shapes = {n: s for part in self._from_every_stage(mine) for n, s in part.items()}
        return self._model_shapes

    def _from_every_stage(self, obj: Any) -> list[Any]:
        everyone: list[Any] = [None] * self.stages
        dist.all_gather_object(everyone, obj, group=self.pipe_group)
        return everyone
