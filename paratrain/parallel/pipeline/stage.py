"""One rank's stage of a pipeline: its layers, the micro-batches in flight, the events it ran.

A step is a lifecycle pair around a schedule (schedules.py):

    start_step(inputs, targets, loss_fn, scale)   cut the batch into micro-batches
    schedule(stage, microbatches)                 stage.forward_one(i, x) / backward_one(i, g) + p2p
    finish_step() -> loss                         wait for sends, average gradients over replicas

`forward_one(i, x)` runs the stage's layers on micro-batch i (the first stage takes its own slice
of the batch; the last stage applies the loss) and keeps what backward needs; `backward_one(i, g)`
back-propagates `g` (on the last stage, the scaled loss) and returns the gradient of the stage's
input for the previous stage. Each records an `Event` (timeline.py).

Gradients: micro-batch losses are scaled by 1/m, so m micro-batches of the mean loss sum to the
mean over the whole batch, exactly as one device computes it. With data parallelism, replicas of
the same stage average their gradients once per step (as GPipe does, Huang et al. 2019, section
2.2) through DDP's bucketed path (grad_sync.py): during the backward of the step's last
micro-batch, each full bucket's all-reduce starts while that backward goes on; the stage sends its
input's gradient on, and only then `finish_step` waits for them. Skipped inside `no_sync()`, so
gradient accumulation communicates only on the last micro-step. Buffers (BatchNorm statistics) go
the other way, as in torch's DDP: replicas take replica 0's before the forward of each optimizer
step and before inference.

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
from paratrain.parallel.pipeline.microbatches import chunks, shape_key
from paratrain.parallel.pipeline.p2p import StageLinks, broadcast_output, floating
from paratrain.parallel.pipeline.tied import TiedWeights
from paratrain.parallel.pipeline.timeline import Event, Kind

Schedule = Callable[["PipelineStage", int], None]


class PipelineStage(ParallelModule):
    """Stage `stage` of `stages`: `module` runs here; `schedule` orders its micro-batches.

    pipe_group: the ranks of this pipeline (one per stage), in stage order.
    dp_group: the ranks holding this same stage in other replicas (None or size 1: no replicas).
    device: where this stage's layers, activations and gradients live.
    run: what the stage computes (default `module` itself; a cut model's `StageRun`, cut.py).
    tied: the weights this stage shares with other stages (tied.py).
    names: each parameter's name in the whole model (a tied weight's first name there).
    """

    supports_token_weights = False  # micro-batches are cut inside the schedule (Session refuses weight=)

    def __init__(self, module: nn.Module, *, stage: int, stages: int, schedule: Schedule,
                 microbatches: int, pipe_group: dist.ProcessGroup | None,
                 dp_group: dist.ProcessGroup | None, device: torch.device,
                 run: Callable[[Any], Any] | None = None, tied: TiedWeights | None = None,
                 names: dict[nn.Parameter, str] | None = None, loss: LossFn | None = None):
        super().__init__()
        self.module = module
        self.run = run or module
        self.tied = tied or TiedWeights()
        self._names = names or {}
        self._loss = loss  # the model's own loss on the head's outputs (a cut's), if it has one
        self.stage, self.stages, self.microbatches = stage, stages, microbatches
        self.schedule = schedule
        self.pipe_group, self.dp_group = pipe_group, dp_group
        self.links = StageLinks(pipe_group, stage, stages, device)
        self.replicas = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.replica_index = dist.get_rank(dp_group) if dp_group is not None else 0
        self._grad_sync = self._replica_sync() if self.replicas > 1 else None
        self._model_shapes: dict[str, torch.Size] | None = None  # gathered on first use
        self._buffers_stale = True  # broadcast replica 0's buffers at the next forward (as DDP)
        self.events: list[Event] = []  # what this stage ran in the last step
        self._stash: dict[int, tuple[Any, Any]] = {}  # i → (input, output) of micro-batch i
        self._inputs: list[Any] = []  # the step's micro-batches (tensors, or trees of them)
        self._targets: list[Any] = []
        self._losses: list[torch.Tensor] = []

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
        links, outputs = self.links, []
        for x in chunks(inputs, self.microbatches, exact=False):  # the last may be shorter
            links.begin(shape_key(x), 0)  # no gradients to receive
            y = self.run(x if links.is_first else links.recv_forward())
            self._check_output(y)
            links.send_forward(y)
            outputs.append(y)
        links.wait_sends()
        return broadcast_output(torch.cat(outputs) if links.is_last else None, self.stages - 1,
                                self.pipe_group, links.device)

    # -- one step --------------------------------------------------------------------------------

    def forward_backward(self, inputs: Any, targets: Any, loss_fn: LossFn, scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of one batch through the whole pipeline, by the schedule.
        Every stage passes the same batch. Returns the batch's mean loss on every stage."""
        self.start_step(inputs, targets, loss_fn, scale)
        self.schedule(self, self.microbatches)
        return self.finish_step()

    def start_step(self, inputs: Any, targets: Any, loss_fn: LossFn, scale: float) -> None:
        """Cut the batch (tensors, or tuples / dicts of them) into `microbatches` equal
        micro-batches along dim 0; the loss of each is scaled by scale / microbatches."""
        m = self.microbatches
        self._inputs, self._targets = chunks(inputs, m), chunks(targets, m)
        self._loss_fn, self._scale = loss_fn, scale / m
        self._losses, self.events = [], []
        self._stash.clear()  # a step that raised may have left activations behind
        self._sync_buffers()
        self._buffers_stale = self.require_backward_grad_sync  # the step after a no_sync() one skips it
        self.links.begin(shape_key(self._inputs[0]), m)

    def finish_step(self) -> torch.Tensor:
        """Wait for this step's sends and for the replicas' gradient all-reduces, and return the
        mean loss of the batch, broadcast from the last stage to every stage."""
        self.links.wait_sends()
        if self._stash:
            raise UsageError(f"the schedule left micro-batches {sorted(self._stash)} without backward")
        if self._grad_sync is not None:
            self._grad_sync.finish()
        if self.require_backward_grad_sync and self.tied.params:
            self.tied.sum_grads()  # after the replicas' average: both are linear
        # float32 everywhere: a broadcast needs the same dtype on every rank
        loss = torch.stack(self._losses).float().mean() if self.links.is_last else \
            torch.zeros((), device=self.links.device)
        return comm.broadcast(loss, self.stages - 1, self.pipe_group)

    # -- what schedules call -------------------------------------------------------------------

    def forward_one(self, i: int, x: Any) -> Any:
        """Run micro-batch i (x: the activation received, None on the first stage); return the
        output to send on, or on the last stage the micro-batch's loss."""
        start = time.perf_counter()
        if x is None:
            x = self._inputs[i]
        else:  # their gradients are what backward sends to the previous stage
            for leaf in floating(tree_flatten(x)[0]):
                leaf.requires_grad_()
        y = self.run(x)
        if self.links.is_last:
            y = check_loss(self._loss_fn(y, self._targets[i]))
            self._losses.append(y.detach())
        else:
            self._check_output(y)
        self._stash[i] = (x, y)
        self._record(Kind.FORWARD, i, start)
        return y

    def backward_one(self, i: int, g: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        """Back-propagate micro-batch i (g: gradients of its output's floating leaves, None on the
        last stage, which starts from its scaled loss); return those of its input (None on the
        first stage)."""
        start = time.perf_counter()
        x, y = self._stash.pop(i)
        if self._grad_sync is not None:  # the step's last backward averages over the replicas
            last = i == self.microbatches - 1
            self._grad_sync.prepare(self.require_backward_grad_sync and last, unused=None)
        if g is None:
            backward_no_autocast(y * self._scale)
        else:
            outputs = floating(tree_flatten(y)[0])
            backward_no_autocast([o for o, _ in zip(outputs, g) if o.requires_grad],
                                 [d for o, d in zip(outputs, g) if o.requires_grad])
        dx = None if self.links.is_first else [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                                                for leaf in floating(tree_flatten(x)[0])]
        self._record(Kind.BACKWARD, i, start)
        return dx

    def _check_output(self, y: Any) -> None:
        if not all(torch.is_tensor(t) for t in tree_flatten(y)[0]):
            raise UsageError(f"stage {self.stage} returned {type(y).__name__}; a stage must return a tensor, or "
                             "a tuple / dict of tensors (before the last: the activation for the next stage)")

    def _record(self, kind: Kind, i: int, start: float) -> None:
        self.events.append(Event(self.stage, kind, i, start, time.perf_counter(), len(self._stash)))

    # -- replicas ----------------------------------------------------------------------------------

    def _sync_buffers(self) -> None:
        """Replicas of a stage take replica 0's buffers (BatchNorm statistics) before a forward,
        as torch's DDP does with rank 0's: once per optimizer step, and before inference."""
        if self._buffers_stale:
            self.sync_buffers()

    def sync_buffers(self) -> None:
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            comm.broadcast_coalesced(list(self.module.buffers()), self.dp_group)

    def _replica_sync(self) -> GradSync:
        """DDP's bucketed gradient averaging over this stage's replicas. Which parameters take
        part in the last micro-batch is not known before its backward: those that do not count
        as zero where another replica has a gradient, and keep None where none has one."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        names = {p: n for n, p in self.module.named_parameters()}
        return GradSync(params, names, self.dp_group, reduction=AllReduce(self.dp_group),
                        caps=default_caps(), find_unused=True,
                        finish_in_backward=False)

    # -- the protocol (parallel/base.py) ---------------------------------------------------------

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm over all stages' gradients: squares summed over the pipeline group
        (replicas hold equal gradients after their all-reduce, and a tied weight's copies equal
        ones after theirs: each is counted once)."""
        grads, group = self.local_grads()
        skip = self.tied.not_counted()
        counted = [p.grad for p in self.module.parameters() if p.grad is not None and id(p) not in skip]
        return clip_grad_norm_over(counted, max_norm, group, scale_also=grads)

    def local_grads(self) -> tuple[list[torch.Tensor], Any]:
        """This stage's gradients; the other stages' are on the other ranks of the pipeline
        (replicas of a stage hold equal ones after their all-reduce, so every pipeline reaches
        the same verdict)."""
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
        under its first one: its copies write one entry); the shapes of the whole model's."""
        whole = CheckpointLayout.whole(self.module, shapes=self.model_shapes())
        params = {self._name(p, n): p for n, p in whole.params.items()}
        first = {n: self._name(p, n) for n, p in whole.params.items()}
        aliases = {**{n: f for n, f in first.items() if n != f},
                   **{a: first[n] for a, n in whole.aliases.items()}}
        return CheckpointLayout(params, {}, False, whole.buffers, whole.shapes, aliases, whole.persistent)

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
