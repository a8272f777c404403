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
the same stage average their gradients once per step, after the schedule has flushed (as
GPipe does, Huang et al. 2019, section 2.2): one all-reduce over the data-parallel group, skipped
inside `no_sync()` so gradient accumulation communicates only on the last micro-step. Buffers
(BatchNorm statistics) go the other way, as in torch's DDP: replicas take replica 0's before the
forward of each optimizer step and before inference.

Inference is the module's own `forward(x)` under torch.no_grad(): every stage, forward only, the
output broadcast to the whole pipeline.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from paratrain import comm
from paratrain.errors import ConfigError, UsageError
from paratrain.parallel.pipeline.p2p import StageLinks, broadcast_output
from paratrain.parallel.pipeline.timeline import Event, Kind

Schedule = Callable[["PipelineStage", int], None]


class PipelineStage(nn.Module):
    """Stage `stage` of `stages`: `module` runs here; `schedule` orders its micro-batches.

    pipe_group: the ranks of this pipeline (one per stage), in stage order.
    dp_group: the ranks holding this same stage in other replicas (None or size 1: no replicas).
    device: where this stage's layers, activations and gradients live.
    """

    is_pipeline = True  # holds one stage, not the model (Session refuses weight= for now)

    def __init__(self, module: nn.Module, *, stage: int, stages: int, schedule: Schedule,
                 microbatches: int, pipe_group: dist.ProcessGroup | None,
                 dp_group: dist.ProcessGroup | None, device: torch.device):
        super().__init__()
        self.module = module
        self.stage, self.stages, self.microbatches = stage, stages, microbatches
        self.schedule = schedule
        self.pipe_group, self.dp_group = pipe_group, dp_group
        self.links = StageLinks(pipe_group, stage, stages, device)
        self.require_grad_sync = True  # False inside no_sync()
        self._buffers_stale = True  # broadcast replica 0's buffers at the next forward (as DDP)
        self.events: list[Event] = []  # what this stage ran in the last step
        self._stash: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}  # i → (input, output)
        self._inputs: tuple[torch.Tensor, ...] = ()
        self._targets: tuple[torch.Tensor, ...] = ()
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
        if not torch.is_tensor(inputs):
            raise UsageError(f"a pipeline forward takes one tensor of inputs; got {type(inputs).__name__}")
        self._sync_buffers()
        links, outputs = self.links, []
        for x in inputs.chunk(self.microbatches):  # the last may be shorter: its own shape key
            links.begin(tuple(x.shape), 0)  # no gradients to receive
            y = self.module(x if links.is_first else links.recv_forward())
            self._check_output(y)
            links.send_forward(y)
            outputs.append(y)
        links.wait_sends()
        return broadcast_output(torch.cat(outputs) if links.is_last else None, self.stages - 1,
                                self.pipe_group, links.device)

    # -- one step --------------------------------------------------------------------------------

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor,
                         loss_fn: Callable[[Any, Any], torch.Tensor], scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of one batch through the whole pipeline, by the schedule.
        Every stage passes the same batch. Returns the batch's mean loss on every stage."""
        self.start_step(inputs, targets, loss_fn, scale)
        self.schedule(self, self.microbatches)
        return self.finish_step()

    def start_step(self, inputs: torch.Tensor, targets: torch.Tensor,
                   loss_fn: Callable[[Any, Any], torch.Tensor], scale: float) -> None:
        """Cut the batch into `microbatches` equal micro-batches; the loss of each is scaled by
        scale / microbatches."""
        if not (torch.is_tensor(inputs) and torch.is_tensor(targets)):
            raise UsageError("a pipeline step takes a batch (inputs, targets) of two tensors, cut "
                             f"into micro-batches along dim 0; got {type(inputs).__name__}, "
                             f"{type(targets).__name__}")
        m, batch = self.microbatches, inputs.shape[0]
        if batch % m:
            raise ConfigError(f"{m} micro-batches do not divide this stage's batch of {batch} "
                              f"samples: use a per-replica batch that is a multiple of {m}, "
                              "or change Pipeline(microbatches=...)")
        self._inputs = inputs.chunk(m)
        self._targets = targets.chunk(m)
        self._loss_fn, self._scale = loss_fn, scale / m
        self._losses, self.events = [], []
        self._stash.clear()  # a step that raised may have left activations behind
        self._sync_buffers()
        self._buffers_stale = self.require_grad_sync  # the step after a no_sync() one skips it
        self.links.begin(tuple(self._inputs[0].shape), m)

    def finish_step(self) -> torch.Tensor:
        """Wait for this step's sends, average gradients over replicas (unless in no_sync), and
        return the mean loss of the batch, broadcast from the last stage to every stage."""
        self.links.wait_sends()
        if self._stash:
            raise UsageError(f"the schedule left micro-batches {sorted(self._stash)} without backward")
        if self.require_grad_sync:
            self.sync_grads()
        # float32 everywhere: a broadcast needs the same dtype on every rank
        loss = torch.stack(self._losses).float().mean() if self.links.is_last else \
            torch.zeros((), device=self.links.device)
        return comm.broadcast(loss, self.stages - 1, self.pipe_group)

    # -- what schedules call -------------------------------------------------------------------

    def forward_one(self, i: int, x: torch.Tensor | None) -> torch.Tensor:
        """Run micro-batch i (x: the activation received, None on the first stage); return the
        output to send on, or on the last stage the micro-batch's loss."""
        start = time.perf_counter()
        if x is None:
            x = self._inputs[i]
        else:
            x.requires_grad_()  # its gradient is what backward sends to the previous stage
        y = self.module(x)
        if self.links.is_last:
            y = self._loss_fn(y, self._targets[i])
            self._losses.append(y.detach())
        else:
            self._check_output(y)
        self._stash[i] = (x, y)
        self._record(Kind.FORWARD, i, start)
        return y

    def backward_one(self, i: int, g: torch.Tensor | None) -> torch.Tensor | None:
        """Back-propagate micro-batch i (g: gradient of its output, None on the last stage, which
        starts from its scaled loss); return the gradient of its input (None on the first)."""
        start = time.perf_counter()
        x, y = self._stash.pop(i)
        if g is None:
            (y * self._scale).backward()
        else:
            torch.autograd.backward(y, g)
        dx = None if self.links.is_first else x.grad
        self._record(Kind.BACKWARD, i, start)
        return dx

    def _check_output(self, y: Any) -> None:
        if not torch.is_tensor(y):
            raise UsageError(f"stage {self.stage} returned {type(y).__name__}; a stage must return one "
                             "tensor (before the last: the activation for the next stage)")

    def _record(self, kind: Kind, i: int, start: float) -> None:
        self.events.append(Event(self.stage, kind, i, start, time.perf_counter(), len(self._stash)))

    # -- replicas ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Steps inside accumulate gradients locally; the first step after averages them all."""
        previous, self.require_grad_sync = self.require_grad_sync, False
        try:
            yield
        finally:
            self.require_grad_sync = previous

    def _sync_buffers(self) -> None:
        """Replicas of a stage take replica 0's buffers (BatchNorm statistics) before a forward,
        as torch's DDP does with rank 0's: once per optimizer step, and before inference."""
        if self._buffers_stale and self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            comm.broadcast_coalesced(list(self.module.buffers()), self.dp_group)

    def sync_grads(self) -> None:
        """Average this stage's gradients over its replicas: one all-reduce per dtype. A
        parameter without a gradient counts as zero where another replica has one, and keeps
        None where no replica has one (so the optimizer skips it, as one process would)."""
        if self.dp_group is None or dist.get_world_size(self.dp_group) == 1:
            return
        params = [p for p in self.module.parameters() if p.requires_grad]
        has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.int32,
                                device=self.links.device)
        comm.all_reduce(has_grad, op=dist.ReduceOp.MAX, group=self.dp_group)
        params = [p for p, anywhere in zip(params, has_grad.tolist()) if anywhere]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            comm.all_reduce(flat, group=self.dp_group, average=True)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def gather_events(self) -> list[Event]:
        """Every stage's events of the last step, on every rank of the pipeline (collective)."""
        return [e for events in self._from_every_stage(self.events) for e in events]

    # -- the whole model, seen from one stage --------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict with its own keys (a stage's keys are the model's), on
        every rank of the pipeline, on CPU (collective over the pipeline)."""
        mine = {k: v.detach().cpu() for k, v in self.module.state_dict().items()}
        return {k: v for part in self._from_every_stage(mine) for k, v in part.items()}

    def model_shapes(self) -> dict[str, torch.Size]:
        """Name → shape of every parameter of the whole model, in stage order (collective over
        the pipeline the first time): what a checkpoint records to recognise its model."""
        if not hasattr(self, "_model_shapes"):
            mine = {n: p.shape for n, p in self.module.named_parameters()}
            self._model_shapes = {n: s for part in self._from_every_stage(mine) for n, s in part.items()}
        return self._model_shapes

    def _from_every_stage(self, obj: Any) -> list[Any]:
        everyone: list[Any] = [None] * self.stages
        dist.all_gather_object(everyone, obj, group=self.pipe_group)
        return everyone
