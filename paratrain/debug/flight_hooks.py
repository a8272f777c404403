"""What feeds the flight recorder (debug/flight_recorder.py): torch.distributed's functions, wrapped.

torch has no Python hook that fires on every collective (its NCCL flight recorder lives in C++,
for NCCL only), so `install()` replaces the module-level functions of `torch.distributed` —
all_reduce, broadcast, all_gather*, reduce_scatter*, barrier, send/recv/isend/irecv,
batch_isend_irecv and the object collectives (OPS) — with wrappers that record the call and then
call torch's own function, keeping the originals (`uninstall()` puts them back). Importing
paratrain does not: they are installed where a job starts, once, unless
PARATRAIN_FLIGHT_RECORDER=0: by each rank `paratrain run` starts (launch/rank.py, before the
script runs), by `Session()`, by testing.run_on_ranks' ranks, and by a user's own
`pt.install_flight_recorder()`. Whoever looks a function up
on `torch.distributed` when calling it goes through the wrapper: paratrain's strategies and
distributed/comm.py, the plain `pt.DistributedDataParallel` (its bucket all-reduces, from autograd hooks),
and the user's own `dist.all_reduce(...)` between Session calls.

Not covered (these never pass through the wrappers):
- functions taken before the hooks were installed (`from torch.distributed import all_reduce` at
  the top of a script run outside `paratrain run`, which installs them before the script starts),
  or called through `torch.distributed.distributed_c10d` directly: torch's helpers call each
  other that way, so `all_gather_object` is recorded once, not with the gathers inside it;
- collectives issued from C++: torch's own `torch.nn.parallel.DistributedDataParallel` reducer,
  `ProcessGroup` methods called directly, functional collectives (DTensor, FSDP2,
  `torch.distributed._functional_collectives`) and code compiled by torch.compile (the
  wrapper hands dynamo torch's own function, which it traces as it would without paratrain);
- the call site of a collective issued from a thread with no Python caller (autograd's CUDA
  device threads run DDP's hooks): recorded without one.

[Note: P2POp and the wrappers]
`dist.P2POp(op, ...)` checks that `op` *is* torch's isend or irecv, and batch_isend_irecv asks
`op.op is isend`. So P2POp's constructor is patched too (in place, so that references to the class
taken earlier see it) to swap a wrapper for the original it wraps; batch_isend_irecv itself is
recorded as one operation.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import weakref
from typing import Any, Iterator

import torch
import torch.distributed as dist

from paratrain.debug import flight_recorder
from paratrain.debug.flight_recorder import RECORDER, call_site

COLLECTIVES = ("broadcast", "all_reduce", "all_reduce_coalesced", "reduce", "all_gather", "all_gather_single",
               "all_gather_into_tensor", "all_gather_coalesced", "all_gather_object", "gather", "gather_object",
               "scatter", "scatter_object_list", "reduce_scatter", "reduce_scatter_single",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
               "broadcast_object_list")
P2P = ("send", "recv", "isend", "irecv", "send_object_list", "recv_object_list")
OPS = COLLECTIVES + P2P + ("batch_isend_irecv",)
_originals: dict[str, Any] = {}  # name -> torch's function, while installed
_unwrapped: dict[Any, Any] = {}  # wrapper -> torch's function
_groups: dict[Any, tuple] = {}  # process group (None: the default) -> its global ranks
_me: list[int] = []  # this process's global rank, once known

flight_recorder.skip_paths(os.path.dirname(torch.__file__))


def installed() -> bool:
    return bool(_originals)


def install() -> None:
    """Record every torch.distributed collective and p2p operation this process issues from now on
    in the flight recorder, which `paratrain run` prints when a job fails or hangs (wraps
    torch.distributed's functions; once, and again after uninstall). A Session and the ranks of
    `paratrain run` call it themselves."""
    if installed() or not dist.is_available() or RECORDER.capacity == 0:
        return
    for name in OPS:
        if callable(getattr(dist, name, None)):
            _originals[name] = getattr(dist, name)
            wrapper = _wrap(name, _originals[name])
            _unwrapped[wrapper] = _originals[name]
            setattr(dist, name, wrapper)
    for name in ("init_process_group", "destroy_process_group"):  # new groups: number afresh
        _originals[name] = getattr(dist, name)
        setattr(dist, name, _forgetting(_originals[name]))
    _originals["P2POp.__new__"], _originals["P2POp.__init__"] = dist.P2POp.__new__, dist.P2POp.__init__
    dist.P2POp.__new__ = _unwrapping(dist.P2POp.__new__, 1)  # [Note: P2POp and the wrappers]
    dist.P2POp.__init__ = _unwrapping(dist.P2POp.__init__, 1)


def uninstall() -> None:
    """Put torch's own functions back."""
    if not installed():
        return
    dist.P2POp.__new__ = _originals.pop("P2POp.__new__")
    dist.P2POp.__init__ = _originals.pop("P2POp.__init__")
    for name, original in _originals.items():
        setattr(dist, name, original)
    _originals.clear()
    _unwrapped.clear()


@contextlib.contextmanager
def off() -> Iterator[None]:
    """torch's own functions inside the block (bench/ddp.py times a step with and without)."""
    was = installed()
    uninstall()
    try:
        yield
    finally:
        if was:
            install()


def _wrap(name: str, original):
    params = list(inspect.signature(original).parameters)
    group_at = params.index("group") if "group" in params else None
    p2p = name in P2P  # dst / src: the second argument of every p2p function

    @functools.wraps(original)
    def recorded(*args, **kwargs):
        if torch.compiler.is_compiling():  # dynamo traces torch's own function, as without us
            return original(*args, **kwargs)
        group = kwargs.get("group", args[group_at] if group_at is not None and len(args) > group_at else None)
        if name == "batch_isend_irecv":
            ops = args[0] if args else kwargs["p2p_op_list"]
            (tensors, nbytes), (key, detail) = _describe([op.tensor for op in ops], {}), _batch(ops)
        else:
            tensors, nbytes = _describe(args, kwargs)
            key, detail = (_ranks(group), None) if not p2p else _p2p(name, args, kwargs, group)
        entry = RECORDER.start(name, key, tensors, nbytes, detail, call_site())
        try:
            out = original(*args, **kwargs)
        except BaseException as e:
            RECORDER.failed(entry, e)
            raise
        _finish(entry, out)
        return out

    return recorded


def _finish(entry, out) -> None:
    """Synchronous: done now. Async (a Work, or batch_isend_irecv's list of them): done when
    every work's future has completed, failed when one completed with an error."""
    works = [w for w in (out if isinstance(out, list) else [out]) if isinstance(w, dist.Work)]
    if not works:
        entry.done()
        return
    left = [len(works)]

    def one_done(future) -> None:  # on the thread that completes the work (gloo's, NCCL's watchdog)
        left[0] -= 1
        if entry.settled(future) and not left[0] and entry.state == "started":
            entry.done()

    try:
        for work in works:
            work.get_future().add_done_callback(one_done)
    except RuntimeError:  # "getFuture not implemented" (gloo's send/recv): asked when dumped
        entry.works = [weakref.ref(w) for w in works]  # weakly: a work holds its tensors


def _describe(args, kwargs) -> tuple[list, int]:
    """(shape, dtype, count) of each tensor argument (a list: its first tensor's, and its length;
    a single tensor's count is None), and the bytes
    of the largest (a list: the sum): the message the operation moves."""
    tensors, nbytes = [], 0
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            tensors.append((tuple(value.shape), value.dtype, None))
            nbytes = max(nbytes, value.numel() * value.element_size())
        elif isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            tensors.append((tuple(value[0].shape), value[0].dtype, len(value)))
            nbytes = max(nbytes, sum(t.numel() * t.element_size() for t in value))
    return tensors, nbytes


def _p2p(name: str, args, kwargs, group) -> tuple[tuple, str]:
    """('p2p', lower rank, higher rank), and 'to 1' or 'from 0'."""
    peer = kwargs.get("dst", kwargs.get("src", args[1] if len(args) > 1 else None))
    if peer is None:  # given as group_dst / group_src, a rank inside `group`
        inner = kwargs.get("group_dst", kwargs.get("group_src"))
        peer = dist.get_global_rank(group, inner) if group is not None and inner is not None else inner
    toward = "to" if "send" in name else "from"
    return ("p2p", *sorted((_my_rank(), peer))), f"{toward} {peer}"


def _batch(ops) -> tuple[tuple, str]:
    """('p2p', every rank the batch involves), and 'send to 1, recv from 3'."""
    peers = [(op.op is dist.distributed_c10d.isend, op.peer) for op in ops]  # torch's own isend: P2POp note
    detail = ", ".join(f"{'send to' if send else 'recv from'} {peer}" for send, peer in peers)
    return ("p2p", *sorted({_my_rank(), *(p for _, p in peers)})), detail


def _ranks(group) -> tuple:
    """The global ranks of `group` (None: the default group), looked up once per group."""
    ranks = _groups.get(group)
    if ranks is None:
        try:
            ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
        except (RuntimeError, ValueError, AttributeError):  # no default group yet: torch raises itself
            ranks = ("?",)
        _groups[group] = ranks
    return ranks


def _my_rank() -> int:
    if not _me:
        _me.append(dist.get_rank() if dist.is_initialized() else 0)
    return _me[0]


def _forgetting(original):
    """init/destroy_process_group: groups (and this rank) are no longer what was looked up."""
    @functools.wraps(original)
    def forgetting(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            _groups.clear()
            _me.clear()
            if original.__name__ == "init_process_group":
                RECORDER.reset()

    return forgetting


def _unwrapping(method, position: int):
    """P2POp's constructor, given torch's isend/irecv where the caller passed a wrapper."""
    @functools.wraps(method)
    def unwrapping(*args, **kwargs):
        if len(args) > position and args[position] in _unwrapped:
            args = (*args[:position], _unwrapped[args[position]], *args[position + 1:])
        elif kwargs.get("op") in _unwrapped:
            kwargs["op"] = _unwrapped[kwargs["op"]]
        return method(*args, **kwargs)

    return unwrapping

