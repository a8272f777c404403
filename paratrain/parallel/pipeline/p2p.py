"""Pipeline communication: activations forward to the next stage, their gradients back.

A stage exchanges tensors only with its two neighbours in the pipeline group (peers are ranks
inside that group, as everywhere in paratrain.comm). Four moves, named after picotron's
pp_communications and Megatron-LM's p2p_communication:

    recv_forward / send_forward     activation of a micro-batch from stage s-1 / to stage s+1
    recv_backward / send_backward   gradient of that activation from stage s+1 / to stage s-1

and the two fused moves of 1F1B's steady state (a send, then a receive).

[Note: gradient receives posted ahead]
Over gloo a send's bytes leave only once the receiver has posted its receive; a send to a receive
already posted is written at once, by the sending thread. A stage's next gradient is its tightest
dependency (it has gone through every later stage and back), so a stage keeps one gradient
receive posted ahead: the first once its first output went on (its shape is then known), the next
as soon as one arrives. Each stage but the last receives exactly m gradients per step, so nothing
is posted past the step's end; the cost is one buffer. Activations are received when needed: the
earlier stage sent them ahead, and its own background thread writes them when the receive comes.
Posting activations ahead as well, or neither, was slower in bench/pipeline.py (1F1B, m=4 and 8:
ratios 0.98-1.03 against 0.95-0.98). At the ends of the pipeline the moves do nothing and receives
return None, so schedules never test for first/last.

[Note: shapes agreed once]
A receiver must allocate its buffer before the data arrives, so it must know the shape and dtype.
The first time an input shape is seen, each stage sends the next a small header (number of
dimensions, dtype, shape) ahead of the first activation; the receiver caches it under that input
shape, which every stage of a replica knows because every stage is given the same batch. Later
steps with that input shape send no header. A gradient has its activation's shape, so backward
needs no header. Micro-batches of one step are equal (the batch must divide evenly), so one shape
serves the whole step.

Sends are asynchronous (`isend`): a stage computes while its outputs travel. A send holds its
tensor until it is waited on, and gloo reports a send complete only once waited on, so before a
new send to a neighbour the stage waits for its previous send to that neighbour (as torch's
schedules do). In 1F1B that send has already left: the gradient this stage took before its
forward was sent by the next stage just before it posted the receive for that activation. So at
most one message per direction is held, not all m of a step; `wait_sends()` waits for the last
ones at the end of the step. Every wait runs on the backend's own timeout for the group (no
sleeping, no polling).
"""

from __future__ import annotations

from typing import Hashable

import torch
import torch.distributed as dist

from paratrain import comm
from paratrain.errors import UsageError

# floating only: every activation carries a gradient back
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
_MAX_DIMS = 8
_HEADER = 2 + _MAX_DIMS  # (ndim, dtype index, shape padded with zeros)


class StageLinks:
    """The p2p moves of stage `stage` of `stages`, whose ranks form the pipeline `group`."""

    def __init__(self, group: dist.ProcessGroup | None, stage: int, stages: int, device: torch.device):
        self.group, self.stage, self.stages, self.device = group, stage, stages, device
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        self._in_shapes: dict[Hashable, tuple[torch.Size, torch.dtype]] = {}  # input shape → activation in
        self._announced: set[Hashable] = set()  # input shapes whose header went to the next stage
        self._key: Hashable = None  # this step's input micro-batch shape
        self._out: tuple[torch.Size, torch.dtype] | None = None  # this step's output shape
        self._sends: dict[int, list[dist.Work]] = {}  # peer → its last message's sends, not waited on
        self._grads_left = 0  # gradient receives of this step not posted yet
        self._next_grad: tuple[torch.Tensor, dist.Work] | None = None  # the one posted ahead

    def begin(self, key: Hashable, microbatches: int) -> None:
        """Start a step of `microbatches` micro-batches whose input micro-batches have shape `key`
        (the same on every stage)."""
        self._key, self._out = key, None
        self._grads_left = 0 if self.is_last else microbatches
        self._next_grad = None  # left over only by a step that raised

    # -- forward direction ---------------------------------------------------------------------

    def recv_forward(self) -> torch.Tensor | None:
        """The next activation from the previous stage; None on the first stage."""
        if self.is_first:
            return None
        if self._key not in self._in_shapes:  # see [Note: shapes agreed once]
            header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
            self._in_shapes[self._key] = _shape_of(comm.recv(header, self.stage - 1, self.group))
        shape, dtype = self._in_shapes[self._key]
        return comm.recv(torch.empty(shape, dtype=dtype, device=self.device), self.stage - 1, self.group)

    def send_forward(self, y: torch.Tensor) -> None:
        """Send this stage's output to the next stage (nothing on the last stage)."""
        if self.is_last:
            return
        self._out = (y.shape, y.dtype)
        message = [y.detach().contiguous()]
        if self._key not in self._announced:
            message.insert(0, _header(y, self.device))
            self._announced.add(self._key)
        self._isend(message, self.stage + 1)
        if self._next_grad is None and self._grads_left:
            self._post_grad()  # the first gradient's shape is now known

    # -- backward direction --------------------------------------------------------------------

    def recv_backward(self) -> torch.Tensor | None:
        """The gradient of this stage's output from the next stage; None on the last stage."""
        if self.is_last:
            return None
        if self._next_grad is None:
            self._post_grad()
        (g, handle), self._next_grad = self._next_grad, None
        handle.wait()
        if self._grads_left:
            self._post_grad()
        return g

    def send_backward(self, dx: torch.Tensor | None) -> None:
        """Send the gradient of this stage's input back (nothing on the first stage)."""
        if not self.is_first:
            self._isend([dx.contiguous()], self.stage - 1)

    # -- fused moves of 1F1B's steady state ---------------------------------------------------

    def send_forward_recv_backward(self, y: torch.Tensor) -> torch.Tensor | None:
        """Send output `y` on, and receive the gradient of this stage's oldest waiting output."""
        self.send_forward(y)
        return self.recv_backward()

    def send_backward_recv_forward(self, dx: torch.Tensor | None) -> torch.Tensor | None:
        """Send input gradient `dx` back, and receive the next activation from the previous stage."""
        self.send_backward(dx)
        return self.recv_forward()

    def wait_sends(self) -> None:
        """Wait until every send of this step has left (end of step)."""
        for handles in self._sends.values():
            for handle in handles:
                handle.wait()
        self._sends.clear()

    # -- buffers -------------------------------------------------------------------------------

    def _isend(self, message: list[torch.Tensor], peer: int) -> None:
        for handle in self._sends.pop(peer, []):  # the previous message to this peer
            handle.wait()
        self._sends[peer] = [comm.isend(t, peer, self.group) for t in message]

    def _post_grad(self) -> None:
        if self._out is None:
            raise UsageError("a schedule asked for a gradient before this stage sent any output")
        g = torch.empty(self._out[0], dtype=self._out[1], device=self.device)
        self._next_grad = (g, comm.irecv(g, self.stage + 1, self.group))
        self._grads_left -= 1


def broadcast_output(y: torch.Tensor | None, src: int, group: dist.ProcessGroup | None,
                     device: torch.device) -> torch.Tensor:
    """Stage `src`'s tensor `y` (None on the other stages) on every rank of the pipeline
    `group`: its header first, so the others can allocate, then its data."""
    if dist.get_rank(group) == src:
        comm.broadcast(_header(y, device), src, group)
        return comm.broadcast(y.contiguous(), src, group)
    shape, dtype = _shape_of(comm.broadcast(torch.zeros(_HEADER, dtype=torch.int64, device=device), src, group))
    return comm.broadcast(torch.empty(shape, dtype=dtype, device=device), src, group)


def _shape_of(header: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    ndim, code = int(header[0]), int(header[1])
    return torch.Size(header[2:2 + ndim].tolist()), _DTYPES[code]


def _header(y: torch.Tensor, device: torch.device) -> torch.Tensor:
    if y.dim() > _MAX_DIMS or y.dtype not in _DTYPES:
        raise UsageError(f"a stage's output must be one floating-point tensor of at most {_MAX_DIMS} "
                         f"dimensions to travel to the next stage; got {tuple(y.shape)} {y.dtype}")
    return torch.tensor([y.dim(), _DTYPES.index(y.dtype), *y.shape] + [0] * (_MAX_DIMS - y.dim()),
                        dtype=torch.int64, device=device)
