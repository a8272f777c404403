"""Communication: thin helpers over `torch.distributed`, and the pieces torch lacks.

Conventions shared by every function here:

- `group=None` means the default group. Groups are always arguments, never stored here.
- Peer ranks (`src`, `dst`) are ranks *inside* `group` (the same as global ranks for the default
  group). They are mapped with `dist.get_global_rank`, which every supported torch (>= 2.4) has;
  the `group_src=`/`group_dst=` keywords arrived later.
- Tensors are changed in place where torch changes them, and returned so calls can be chained.
- `counter=` takes a `ByteCounter` and adds the bytes this rank sends when the collective runs as
  the bandwidth-optimal ring (Patarasuk & Yuan 2009; Thakur, Rabenseifner & Gropp 2005,
  "Optimization of collective communication operations in MPICH"). Strategies compare their cost
  with it (hierarchical against flat) without instrumenting the backend; `ring.ring_all_reduce` counts
  what it really sends, and the tests check the two agree.
- Every wait is the backend's own and gives up after the group's timeout (set by
  `Topology.init`), so nothing here sleeps or polls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from paratrain.distributed.grid import new_group  # noqa: F401  (the one place groups are made)
from paratrain.errors import UsageError

SUM = dist.ReduceOp.SUM

# One flat tensor in, one out: torch 2.13 deprecates `all_gather_into_tensor`/`reduce_scatter_tensor`
# in favour of the `_single` names; torch 2.4 has only the old ones. Same arguments as torch's.
# Looked up on `dist` at each call, as everything here is, so the flight recorder's wrappers
# (debug/flight_hooks.py) see them.
_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
_REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """torch's all_gather_single (all_gather_into_tensor before torch 2.13)."""
    return getattr(dist, _ALL_GATHER)(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op=SUM, group=None, async_op: bool = False):
    """torch's reduce_scatter_single (reduce_scatter_tensor before torch 2.13)."""
    return getattr(dist, _REDUCE_SCATTER)(output, input, op=op, group=group, async_op=async_op)


@dataclass
class ByteCounter:
    """Bytes this rank sent through the calls this counter was passed to."""

    sent: int = 0  # bytes, summed over calls
    calls: int = 0

    def add(self, nbytes: int) -> int:
        self.sent += nbytes
        self.calls += 1
        return nbytes


def global_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    """The global rank of `rank`-within-`group` (itself for the default group)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait until every rank of `group` arrives."""
    dist.barrier(group=group)


# ---- point to point ------------------------------------------------------------------------

def send(tensor: torch.Tensor, dst: int, group=None, *, counter: ByteCounter | None = None) -> int:
    """Send `tensor` to rank `dst` of `group`; returns the bytes sent."""
    dist.send(tensor, global_rank(group, dst), group=group)
    return count_bytes(counter, nbytes(tensor))


def recv(tensor: torch.Tensor, src: int, group=None, *, tag: int = 0) -> torch.Tensor:
    """Receive into `tensor` (shape and dtype must match the send) from rank `src`; returns it.
    A `tag` other than 0 matches only sends of that tag (gloo; NCCL ignores tags)."""
    dist.recv(tensor, global_rank(group, src), group=group, tag=tag)
    return tensor


def isend(tensor: torch.Tensor, dst: int, group=None, *, counter: ByteCounter | None = None, tag: int = 0):
    """Start sending `tensor` to rank `dst`; returns the work handle to `.wait()` on."""
    count_bytes(counter, nbytes(tensor))
    return dist.isend(tensor, global_rank(group, dst), group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int, group=None, *, tag: int = 0):
    """Start receiving into `tensor` from rank `src`; returns the work handle to `.wait()` on."""
    return dist.irecv(tensor, global_rank(group, src), group=group, tag=tag)


# ---- collectives ---------------------------------------------------------------------------

def broadcast(tensor: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """Overwrite `tensor` on every rank with rank `src`'s; returns it."""
    dist.broadcast(tensor, global_rank(group, src), group=group)
    return tensor


def all_reduce(tensor: torch.Tensor, op=SUM, group=None, *, average: bool = False,
               counter: ByteCounter | None = None) -> torch.Tensor:
    """Reduce `tensor` in place over `group` (`average=True`: the mean); returns it."""
    _check_average(tensor, op, average, "all_reduce")
    n = dist.get_world_size(group)
    dist.all_reduce(tensor, op=op, group=group)
    count_bytes(counter, ring_bytes(tensor.numel(), tensor.element_size(), n, phases=2))
    # sum then divide: gloo has no ReduceOp.AVG (only nccl does)
    return tensor.div_(n) if average else tensor


def reduce(tensor: torch.Tensor, dst: int = 0, op=SUM, group=None) -> torch.Tensor:
    """Reduce `tensor` onto rank `dst` (other ranks' copies are left undefined); returns it."""
    dist.reduce(tensor, global_rank(group, dst), op=op, group=group)
    return tensor


def all_gather(tensor: torch.Tensor, group=None, *,
               counter: ByteCounter | None = None) -> list[torch.Tensor]:
    """Every rank's `tensor` (same shape everywhere), in group-rank order."""
    return list(all_gather_cat(tensor.unsqueeze(0), group, counter=counter).unbind(0))


def all_gather_cat(tensor: torch.Tensor, group=None, dim: int = 0, *,
                   counter: ByteCounter | None = None) -> torch.Tensor:
    """Every rank's `tensor` concatenated along `dim` (a view when dim != 0), in one buffer."""
    n = dist.get_world_size(group)
    local = tensor.movedim(dim, 0).contiguous()  # (rows, ...): rank blocks stack along dim 0
    out = local.new_empty((n * local.shape[0], *local.shape[1:]))  # (n·rows, ...)
    all_gather_single(out, local, group=group)
    count_bytes(counter, ring_bytes(out.numel(), out.element_size(), n, phases=1))
    return out.movedim(0, dim)


def gather(tensor: torch.Tensor, dst: int = 0, group=None) -> list[torch.Tensor] | None:
    """Every rank's `tensor` on rank `dst`, in group-rank order; None on the other ranks."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    out = [torch.empty_like(tensor) for _ in range(n)] if me == dst else None
    dist.gather(tensor, out, dst=global_rank(group, dst), group=group)
    return out


def scatter(tensor: torch.Tensor, chunks: Sequence[torch.Tensor] | None = None, src: int = 0,
            group=None) -> torch.Tensor:
    """Rank `src` sends `chunks[i]` to rank i, which receives it into `tensor`; returns it."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    if me == src and (chunks is None or len(chunks) != n):
        raise UsageError(f"scatter from rank {src} needs one chunk per rank ({n}); "
                         f"got {None if chunks is None else len(chunks)}")
    dist.scatter(tensor, list(chunks) if me == src else None, src=global_rank(group, src), group=group)
    return tensor


def reduce_scatter(tensor: torch.Tensor, op=SUM, group=None, *, average: bool = False,
                   counter: ByteCounter | None = None) -> torch.Tensor:
    """Split dim 0 of `tensor` into one chunk per rank, reduce each chunk over `group` and
    return this rank's reduced chunk (`average=True`: the mean). `tensor` is left unchanged."""
    _check_average(tensor, op, average, "reduce_scatter")
    n = dist.get_world_size(group)
    if tensor.dim() == 0 or tensor.shape[0] % n:
        raise UsageError(f"reduce_scatter splits dim 0 of a {tuple(tensor.shape)} tensor into {n} "
                         f"equal chunks; pad dim 0 to a multiple of {n} first")
    out = tensor.new_empty((tensor.shape[0] // n, *tensor.shape[1:]))
    reduce_scatter_single(out, tensor.contiguous(), op=op, group=group)
    count_bytes(counter, ring_bytes(tensor.numel(), tensor.element_size(), n, phases=1))
    return out.div_(n) if average else out


BROADCAST_BUCKET_BYTES = 25 << 20  # a coalesced broadcast's flat copy, at most (a larger tensor goes alone)


def broadcast_coalesced(tensors: list[torch.Tensor], group=None, src: int = 0,
                        bucket_bytes: int = BROADCAST_BUCKET_BYTES) -> None:
    """Overwrite `tensors` on every rank with rank `src`'s, in one message per dtype and device
    and `bucket_bytes` (torch's DDP does the same in `_broadcast_coalesced`, to pay one latency,
    not one per tensor). The flat copy is at most a bucket: a whole model's would double the
    memory of setting it up (#48: a pipeline stage's setup peaked at the whole model). Nothing
    on a group of one rank."""
    if not tensors or dist.get_world_size(group) == 1:
        return
    buckets: dict[tuple, list[list[torch.Tensor]]] = {}
    for t in tensors:
        kind = buckets.setdefault((t.dtype, t.device), [[]])
        if kind[-1] and sum(x.numel() for x in kind[-1]) * t.element_size() + t.nbytes > bucket_bytes:
            kind.append([])
        kind[-1].append(t)
    global_src = global_rank(group, src)
    for same in (bucket for kind in buckets.values() for bucket in kind):
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        dist.broadcast(flat, src=global_src, group=group)
        offset = 0
        with torch.no_grad():
            for t in same:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        del flat


# ---- what torch lacks ----------------------------------------------------------------------

def all_gather_with_grad(tensor: torch.Tensor, group=None, dim: int = 0) -> torch.Tensor:
    """Differentiable all-gather: every rank's `tensor` concatenated along `dim`, and in backward
    this rank's `tensor` receives the SUM of the gradients every rank's loss sent to it."""
    return _AllGatherWithGrad.apply(tensor, group, dim)


class _AllGatherWithGrad(torch.autograd.Function):
    # Why SUM: rank r's loss L_r uses every rank's rows, so the DDP objective (1/N) Σ_r L_r has
    # gradient (1/N) Σ_r ∂L_r/∂x_q for rank q's rows. Summing here gives Σ_r ∂L_r/∂x_q on rank q,
    # and DDP's averaging of parameter gradients supplies the 1/N: training then equals one
    # process on the concatenated batch with the loss averaged over ranks. Averaging here as well
    # divides by N twice; not reducing drops the other ranks' terms (the sum is argued for in
    # pytorch/pytorch#58005; lightly-ai/lightly#1977 is the bug of leaving it out). Not
    # torch.distributed.nn.all_gather: it returns a tuple, and its backward lost gradients of
    # non-contiguous buffers until pytorch/pytorch#120582.
    # A reduce-scatter gives exactly the all-reduce's slice for this rank, at half the bytes.

    @staticmethod
    def forward(ctx, tensor, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather_cat(tensor, group, dim).contiguous()

    @staticmethod
    def backward(ctx, grad):
        mine = reduce_scatter(grad.movedim(ctx.dim, 0), group=ctx.group)
        return mine.movedim(0, ctx.dim), None, None


def broadcast_object(obj: Any, src: int = 0, group=None) -> Any:
    """Rank `src`'s picklable `obj`, on every rank of `group`."""
    box = [obj if dist.get_rank(group) == src else None]
    dist.broadcast_object_list(box, src=global_rank(group, src), group=group)
    return box[0]


# ---- small pieces --------------------------------------------------------------------------

def ring_bytes(numel: int, element_size: int, n: int, phases: int) -> int:
    """Bytes one rank sends in `phases` ring phases over `numel` elements padded to N chunks."""
    return phases * (n - 1) * -(-numel // n) * element_size


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def count_bytes(counter: ByteCounter | None, sent: int) -> int:
    return counter.add(sent) if counter is not None else sent


def _check_average(tensor: torch.Tensor, op, average: bool, name: str) -> None:
    if average and op != SUM:
        raise UsageError(f"{name}(average=True) averages a SUM; drop op= or set average=False")
    if average and not tensor.is_floating_point():
        raise UsageError(f"{name}(average=True) needs a floating-point tensor; got {tensor.dtype}: "
                         "convert it with .float() first")


def max_over(flag: torch.Tensor, group=None) -> torch.Tensor:
    """`flag` (this rank's 0 or 1, a float tensor) as its largest value over `group`'s ranks: one
    MAX all-reduce on the group's device (`group=None`: this rank holds everything, `flag` as is).
    Whether any rank saw a NaN or an overflow, each rank having checked what it holds."""
    if group is None:
        return flag
    flag = flag.to(group_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag


def sum_over(value: torch.Tensor, group=None) -> torch.Tensor:
    """`value` (a 0-dim float tensor) summed over `group`'s ranks: one all-reduce, on the group's
    device (`group=None`: `value` as is). Sums of per-rank sums carry a NaN or an infinity from
    any rank, so one sum says whether every rank's values are finite (session/step.py's check), in one
    collective and no elementwise test (`torch.isfinite` of a scalar is four ops). Reduced in
    place when it is already on that device: pass a tensor of the caller's own."""
    if group is None:
        return value
    value = value.to(group_device(group))
    dist.all_reduce(value, group=group)
    return value


def group_device(group=None) -> torch.device:
    """Where scratch tensors for `group` live: nccl reduces CUDA tensors only."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
