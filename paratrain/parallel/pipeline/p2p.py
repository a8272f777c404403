"""Pipeline communication: activations forward to the next virtual stage, their gradients back.

One `StageLinks` per virtual stage this rank holds (actions.py): stage k receives its input from
the rank holding k-1 and sends its output to the rank holding k+1 (peers are ranks inside the
pipeline group, as everywhere in paratrain.distributed.comm). Four moves, named after picotron's
pp_communications and Megatron-LM's p2p_communication:

    post_recv_forward / send_forward     activation of a micro-batch from stage k-1 / to k+1
    post_recv_backward / send_backward   gradient of that activation from stage k+1 / to k-1

A receive is posted and returns a `Pending`, waited on by the compute that uses it; the schedule's
action lists say when each move happens (actions.py, [Note: what an action does when it runs]).
Each link, one boundary in one direction, has a p2p tag of its own (`actions.tag`), so the
links between two ranks (p = 2, or the last rank's sends back round to the first) never take
each other's messages; on a link messages arrive in the order they were sent.

[Note: shapes agreed once]
A receiver must allocate its buffers before the data arrives, so it must know their shapes and
dtypes. An activation is a tensor, or a tuple / dict of tensors (a hidden state and an attention
mask): its leaves travel as separate tensors. The first time an input shape is seen, each stage
sends the next a header — the activation's tree structure and each leaf's shape and dtype, as
JSON in a uint8 tensor, after its length — ahead of the first activation; the receiver caches it
under that input shape, which every stage of a replica knows because every stage is given the
same batch. So the first receive of a new shape waits for its header when it is posted. Later
steps with that input shape send no header. Gradients travel back for the floating-point leaves
only (an integer mask has none), each with its leaf's shape, so backward needs no header.
Micro-batches of one step are equal (the batch must divide evenly), so one header serves the step.

Sends are asynchronous (`isend`): a stage computes while its outputs travel. A send holds its
tensor until it is waited on, and gloo reports a send complete only once waited on, so before a
new send on a link the stage waits for its previous send on that link (as torch's schedules do):
at most one message per link is held, not all m of a step; `wait_sends()` waits for the last
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


class Pending:
    """A posted receive: its buffers, filled once every handle has been waited on."""

    def __init__(self, buffers: list[torch.Tensor], handles: list[dist.Work], spec: Any = None):
        self.buffers, self.handles, self.spec = buffers, handles, spec

    def wait(self) -> Any:
        for handle in self.handles:
            handle.wait()
        return self.buffers if self.spec is None else tree_unflatten(self.buffers, self.spec)


class StageLinks:
    """The p2p moves of virtual stage `stage` of `stages` on this rank of the pipeline `group`:
    `prev` and `next` are the pipeline ranks holding stages stage-1 and stage+1."""

    def __init__(self, group: dist.ProcessGroup | None, stage: int, stages: int, device: torch.device,
                 prev: int | None = None, next: int | None = None):
        self.group, self.stage, self.stages, self.device = group, stage, stages, device
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        self.prev = stage - 1 if prev is None else prev
        self.next = stage + 1 if next is None else next
        self._tag_in, self._tag_out = 2 * stage, 2 * (stage + 1)  # actions.tag of F links; +1: B links
        self._in: dict[Hashable, tuple[Any, list[Meta]]] = {}  # input shape → (tree spec, leaf metas) in
        self._announced: set[Hashable] = set()  # input shapes whose header went to the next stage
        self._key: Hashable = None  # this step's input micro-batch shape
        self._out: list[Meta] | None = None  # this step's output floating leaves
        self._sends: dict[int, list[dist.Work]] = {}  # tag → its last message's sends, not waited on

    def begin(self, key: Hashable) -> None:
        """Start a step whose input micro-batches have shape `key` (the same on every stage)."""
        self._key, self._out = key, None

    # -- forward direction ---------------------------------------------------------------------

    def post_recv_forward(self) -> Pending:
        """Post the receive of the next activation from the previous stage (not on the first)."""
        if self._key not in self._in:  # see [Note: shapes agreed once]
            length = comm.recv(torch.zeros(1, dtype=torch.int64, device=self.device), self.prev, self.group,
                               tag=self._tag_in)
            header = comm.recv(torch.empty(int(length), dtype=torch.uint8, device=self.device),
                               self.prev, self.group, tag=self._tag_in)
            spec, metas, inputs = _decode(header)
            self._check_same_batch(inputs)
            self._in[self._key] = spec, metas
        spec, metas = self._in[self._key]
        leaves = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in metas]
        return Pending(leaves, [comm.irecv(t, self.prev, self.group, tag=self._tag_in) for t in leaves], spec)

    def recv_forward(self) -> Any:
        """The next activation from the previous stage; None on the first stage."""
        return None if self.is_first else self.post_recv_forward().wait()

    def send_forward(self, y: Any) -> None:
        """Send this stage's output to the next stage (nothing on the last stage)."""
        if self.is_last:
            return
        leaves, spec = tree_flatten(y)
        _check_leaves(leaves)
        self._out = [(t.shape, t.dtype) for t in floating(leaves)]
        message = [t.detach().contiguous() for t in leaves]
        if self._key not in self._announced:
            header = _encode(spec, leaves, self.device, inputs=self._key)
            message = [torch.tensor([header.numel()], dtype=torch.int64, device=self.device), header] + message
            self._announced.add(self._key)
        self._isend(message, self.next, self._tag_out)

    # -- backward direction --------------------------------------------------------------------

    def post_recv_backward(self) -> Pending:
        """Post the receive of the gradients of this stage's output's floating leaves from the
        next stage (after this step's first send_forward: it gives their shapes)."""
        if self._out is None:
            raise UsageError("a schedule asked for a gradient before this stage sent any output")
        grads = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in self._out]
        return Pending(grads, [comm.irecv(g, self.next, self.group, tag=self._tag_out + 1) for g in grads])

    def send_backward(self, dx: list[torch.Tensor] | None) -> None:
        """Send the gradients of this stage's input's floating leaves back (nothing on the first)."""
        if not self.is_first:
            self._isend([g.contiguous() for g in dx], self.prev, self._tag_in + 1)

    def wait_sends(self) -> None:
        """Wait until every send of this step has left (end of step)."""
        for handles in self._sends.values():
            for handle in handles:
                handle.wait()
        self._sends.clear()

    def _check_same_batch(self, theirs: list | None) -> None:
        """The previous stage cut its micro-batches from a batch of the shapes this one's has: else
        each stage would train on other samples, and the last stage's loss pair outputs with
        another rank's targets (torch raises only if their sizes happen to differ)."""
        ours = [list(shape) for shape in self._key]
        if theirs is None or theirs == ours:
            return
        raise UsageError(f"every stage of a pipeline must be given the same batch, and they differ: stage "
                         f"{self.stage - 1} (pipeline rank {self.prev}) cut micro-batches of shapes {theirs} "
                         f"from its batch, stage {self.stage} (pipeline rank {dist.get_rank(self.group)}) "
                         f"micro-batches of shapes {ours}. Pass every rank of a pipeline the whole batch (inputs "
                         "and targets) of its replica: session.setup's loader does; a hand-fed batch must be "
                         "the same on every stage")

    def _isend(self, message: list[torch.Tensor], peer: int, tag: int) -> None:
        for handle in self._sends.pop(tag, []):  # the previous message on this link
            handle.wait()
        self._sends[tag] = [comm.isend(t, peer, self.group, tag=tag) for t in message]


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
    _, [(shape, dtype)], _ = _decode(comm.broadcast(torch.empty(int(length), dtype=torch.uint8, device=device),
                                                 src, group))
    return comm.broadcast(torch.empty(shape, dtype=dtype, device=device), src, group)


def _encode(spec: Any, leaves: list[torch.Tensor], device: torch.device, inputs: Hashable = None) -> torch.Tensor:
    """The tree structure and each leaf's shape and dtype, and the shapes of the input
    micro-batch they came from, as JSON bytes in a uint8 tensor."""
    text = json.dumps({"spec": treespec_dumps(spec), "inputs": inputs,
                       "leaves": [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in leaves]})
    return torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)


def _decode(header: torch.Tensor) -> tuple[Any, list[Meta], list | None]:
    data = json.loads(bytes(header.cpu().tolist()).decode())
    metas = [(torch.Size(shape), getattr(torch, dtype)) for shape, dtype in data["leaves"]]
    return treespec_loads(data["spec"]), metas, data["inputs"]


def _check_leaves(leaves: list[Any]) -> None:
    bad = [type(t).__name__ for t in leaves if not torch.is_tensor(t)]
    if bad or not leaves:
        raise UsageError(f"a stage's output must be a tensor, or a tuple / dict of tensors, to travel to the "
                         f"next stage; got leaves of type {bad or 'none'}")
