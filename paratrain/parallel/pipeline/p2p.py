"""Pipeline communication: activations forward to the next stage, their gradients back.

A stage exchanges tensors only with its two neighbours in the pipeline group (peers are ranks
inside that group, as everywhere in paratrain.distributed.comm). Four moves, named after picotron's
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
A receiver must allocate its buffers before the data arrives, so it must know their shapes and
dtypes. An activation is a tensor, or a tuple / dict of tensors (a hidden state and an attention
mask): its leaves travel as separate tensors. The first time an input shape is seen, each stage
sends the next a header — the activation's tree structure and each leaf's shape and dtype, as
JSON in a uint8 tensor, after its length — ahead of the first activation; the receiver caches it
under that input shape, which every stage of a replica knows because every stage is given the
same batch. Later steps with that input shape send no header. Gradients travel back for the
floating-point leaves only (an integer mask has none), each with its leaf's shape, so backward
needs no header. Micro-batches of one step are equal (the batch must divide evenly), so one
header serves the whole step.

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

import json
from typing import Any, Hashable

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_dumps, treespec_loads

from paratrain.distributed import comm
from paratrain.errors import UsageError

Meta = tuple[torch.Size, torch.dtype]  # one leaf's shape and dtype


def floating(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """The leaves that carry a gradient back: the floating-point ones."""
    return [t for t in leaves if t.is_floating_point()]


class StageLinks:
    """The p2p moves of stage `stage` of `stages`, whose ranks form the pipeline `group`."""

    def __init__(self, group: dist.ProcessGroup | None, stage: int, stages: int, device: torch.device):
        self.group, self.stage, self.stages, self.device = group, stage, stages, device
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        self._in: dict[Hashable, tuple[Any, list[Meta]]] = {}  # input shape → (tree spec, leaf metas) in
        self._announced: set[Hashable] = set()  # input shapes whose header went to the next stage
        self._key: Hashable = None  # this step's input micro-batch shape
        self._out: list[Meta] | None = None  # this step's output floating leaves
        self._sends: dict[int, list[dist.Work]] = {}  # peer → its last message's sends, not waited on
        self._grads_left = 0  # gradient receives of this step not posted yet
        self._next_grad: tuple[list[torch.Tensor], list[dist.Work]] | None = None  # posted ahead

    def begin(self, key: Hashable, microbatches: int) -> None:
        """Start a step of `microbatches` micro-batches whose input micro-batches have shape `key`
        (the same on every stage)."""
        self._key, self._out = key, None
        self._grads_left = 0 if self.is_last else microbatches
        self._next_grad = None  # left over only by a step that raised

    # -- forward direction ---------------------------------------------------------------------

    def recv_forward(self) -> Any:
        """The next activation from the previous stage; None on the first stage."""
        if self.is_first:
            return None
        if self._key not in self._in:  # see [Note: shapes agreed once]
            length = comm.recv(torch.zeros(1, dtype=torch.int64, device=self.device), self.stage - 1, self.group)
            header = comm.recv(torch.empty(int(length), dtype=torch.uint8, device=self.device),
                               self.stage - 1, self.group)
            self._in[self._key] = _decode(header)
        spec, metas = self._in[self._key]
        leaves = [comm.recv(torch.empty(shape, dtype=dtype, device=self.device), self.stage - 1, self.group)
                  for shape, dtype in metas]
        return tree_unflatten(leaves, spec)

    def send_forward(self, y: Any) -> None:
        """Send this stage's output to the next stage (nothing on the last stage)."""
        if self.is_last:
            return
        leaves, spec = tree_flatten(y)
        _check_leaves(leaves)
        self._out = [(t.shape, t.dtype) for t in floating(leaves)]
        message = [t.detach().contiguous() for t in leaves]
        if self._key not in self._announced:
            header = _encode(spec, leaves, self.device)
            message = [torch.tensor([header.numel()], dtype=torch.int64, device=self.device), header] + message
            self._announced.add(self._key)
        self._isend(message, self.stage + 1)
        if self._next_grad is None and self._grads_left:
            self._post_grad()  # the first gradient's shape is now known

    # -- backward direction --------------------------------------------------------------------

    def recv_backward(self) -> list[torch.Tensor] | None:
        """The gradients of this stage's output's floating leaves from the next stage; None on
        the last stage."""
        if self.is_last:
            return None
        if self._next_grad is None:
            self._post_grad()
        (grads, handles), self._next_grad = self._next_grad, None
        for handle in handles:
            handle.wait()
        if self._grads_left:
            self._post_grad()
        return grads

    def send_backward(self, dx: list[torch.Tensor] | None) -> None:
        """Send the gradients of this stage's input's floating leaves back (nothing on the first)."""
        if not self.is_first:
            self._isend([g.contiguous() for g in dx], self.stage - 1)
    # -- fused moves of 1F1B's steady state ---------------------------------------------------

    def send_forward_recv_backward(self, y: Any) -> list[torch.Tensor] | None:
        """Send output `y` on, and receive the gradient of this stage's oldest waiting output."""
        self.send_forward(y)
        return self.recv_backward()

    def send_backward_recv_forward(self, dx: list[torch.Tensor] | None) -> Any:
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
        grads = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in self._out]
        self._next_grad = (grads, [comm.irecv(g, self.stage + 1, self.group) for g in grads])
        self._grads_left -= 1


def broadcast_output(y: torch.Tensor | None, src: int, group: dist.ProcessGroup | None,
                     device: torch.device) -> torch.Tensor:
    """Stage `src`'s tensor `y` (None on the other stages) on every rank of the pipeline
    `group`: its header first, so the others can allocate, then its data."""
    if dist.get_rank(group) == src:
        _check_leaves([y])
        header = _encode(tree_flatten(y)[1], [y], device)
        comm.broadcast(torch.tensor([header.numel()], dtype=torch.int64, device=device), src, group)
        comm.broadcast(header, src, group)
        return comm.broadcast(y.contiguous(), src, group)
    length = comm.broadcast(torch.zeros(1, dtype=torch.int64, device=device), src, group)
    _, [(shape, dtype)] = _decode(comm.broadcast(torch.empty(int(length), dtype=torch.uint8, device=device),
                                                 src, group))
    return comm.broadcast(torch.empty(shape, dtype=dtype, device=device), src, group)


def _encode(spec: Any, leaves: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tree structure and each leaf's shape and dtype, as JSON bytes in a uint8 tensor."""
    text = json.dumps({"spec": treespec_dumps(spec),
                       "leaves": [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in leaves]})
    return torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)


def _decode(header: torch.Tensor) -> tuple[Any, list[Meta]]:
    data = json.loads(bytes(header.cpu().tolist()).decode())
    return treespec_loads(data["spec"]), [(torch.Size(shape), getattr(torch, dtype)) for shape, dtype in data["leaves"]]


def _check_leaves(leaves: list[Any]) -> None:
    bad = [type(t).__name__ for t in leaves if not torch.is_tensor(t)]
    if bad or not leaves:
        raise UsageError(f"a stage's output must be a tensor, or a tuple / dict of tensors, to travel to the "
                         f"next stage; got leaves of type {bad or 'none'}")
