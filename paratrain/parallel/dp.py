"""DataParallel: one process drives several devices (torch.nn.DataParallel's algorithm).

Every forward (torch/nn/parallel/data_parallel.py, and the files it calls):

1. scatter: cut the batch along dim 0 into one chunk per device (sizes differ by at most one,
   so an uneven last batch is fine; a batch smaller than the device count uses fewer devices);
2. replicate: one shallow copy of the module per device whose parameters are differentiable
   copies of the original's (`p.to(device)`: on the original's own device the parameter itself),
   so backward sums every replica's gradient into the one model (torch: replicate.py);
3. parallel_apply: run each replica on its chunk in its own thread (the GIL is released inside
   kernels; torch: parallel_apply.py);
4. gather: concatenate the outputs on the output device.

Balanced mode (`DataParallel.loss`): the loss is computed on each replica and only the scalars
travel to the output device, weighted by chunk size so their sum is the full batch's mean. The
plain mode gathers every output on device 0 and computes the loss there, which is why device 0
of nn.DataParallel runs out of memory first (pytorch/pytorch#8571; the "balanced" fix of
Zhang's PyTorch-Encoding `DataParallelCriterion`).

Replicas are rebuilt at every forward, as torch does, because the parameters change between
steps. Buffers (BatchNorm statistics): replica 0 shares the module's own, so its updates are
kept; other replicas update copies that are dropped (torch keeps replica 0's updates too).
Works on a list of CPU devices (all the same device; the replicas are still separate modules
run in separate threads), which is how the tests prove it on a machine without GPUs.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from paratrain.components.materialize import MetaInit, whole
from paratrain.distributed.grid import ProcessGrid
from paratrain.errors import ConfigError
from paratrain.parallel.base import LossFn, ParallelModule, Strategy, backward_no_autocast, owned, scaled

Device = torch.device | str | int


class DataParallel(ParallelModule):
    """`module` run on `devices` at once, from one process.

    module: the model, on `devices[0]` (its parameters live there; gradients arrive there).
    devices: the devices to use, e.g. ["cuda:0", "cuda:1"] or ["cpu", "cpu"]; an int is a
        CUDA index. Default: every visible CUDA device.
    output_device: where outputs (plain mode) or losses (balanced mode) are gathered; devices[0].
    balanced: a Session's train_step computes the loss on each replica (`loss`), not on the
        gathered outputs.
    """

    def __init__(self, module: nn.Module, devices: Sequence[Device] | None = None,
                 output_device: Device | None = None, *, balanced: bool = False):
        super().__init__()
        self.module, self.balanced = module, balanced
        # balanced: each chunk's loss is weighted by its rows, which a batch's token weight cannot reach
        self.supports_token_weights = not balanced
        self.devices = [_device(d) for d in (devices if devices is not None else _all_cuda())]
        if not self.devices:
            raise ConfigError("DataParallel needs at least one device: pass devices=['cuda:0', "
                              "'cuda:1'] (or ['cpu', 'cpu'] to try it without GPUs)")
        self.output_device = _device(output_device) if output_device is not None else self.devices[0]
        held = {p.device for p in module.parameters()}
        if held and held != {self.devices[0]}:
            raise ConfigError(f"the module's parameters are on {sorted(map(str, held))}, but "
                              f"DataParallel's first device is {self.devices[0]}: call "
                              f"module.to('{self.devices[0]}') first")

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Plain mode: every replica's output, concatenated along dim 0 on the output device."""
        chunks = scatter((inputs, kwargs), self.devices)
        outputs = parallel_apply(replicate(self.module, self.devices[: len(chunks)]), chunks)
        return gather(outputs, self.output_device)

    def forward_backward(self, inputs: Any, targets: Any, loss_fn: LossFn, scale: float) -> torch.Tensor:
        if not self.balanced:
            return super().forward_backward(inputs, targets, loss_fn, scale)
        loss = self.loss(inputs, targets, loss_fn)
        backward_no_autocast(scaled(loss, scale))
        return loss.detach()

    def loss(self, inputs: Any, targets: Any, loss_fn: LossFn) -> torch.Tensor:
        """Balanced mode: `loss_fn(outputs, targets)` on each replica; returns the mean over the
        batch as a scalar on the output device. `loss_fn` must return a mean over its samples
        (as cross_entropy and mse_loss do by default), so chunk means weighted by chunk sizes
        are the full batch's mean."""
        chunks = scatter((inputs, targets), self.devices)
        replicas = replicate(self.module, self.devices[: len(chunks)])
        losses = parallel_apply(replicas, chunks, lambda replica, x, y: loss_fn(replica(x), y))
        sizes = [_rows(chunk) for chunk in chunks]
        total = sum(sizes)
        return sum(loss.to(self.output_device) * (n / total) for loss, n in zip(losses, sizes))


def replicate(module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
    """One shallow copy of `module` per device; parameters are `p.to(device)` (differentiable,
    shared between tied uses), buffers are shared on replica 0 and copied elsewhere."""
    params = {id(p): p for p in module.parameters()}
    replicas = []
    for index, device in enumerate(devices):
        copies = {key: p.to(device) for key, p in params.items()}  # autograd: grads flow to p
        clone = {}  # original module → its copy, so shared submodules stay shared
        for m in module.modules():
            clone[m] = m._replicate_for_data_parallel()  # torch's own shallow copy (module.py)
        for m, r in clone.items():
            for name, child in m._modules.items():
                r._modules[name] = None if child is None else clone[child]
            for name, p in m._parameters.items():
                setattr(r, name, None if p is None else copies[id(p)])  # a plain attribute now
            for name, b in m._buffers.items():
                r._buffers[name] = None if b is None else _buffer_for(b, device, index)
        replicas.append(clone[module])
    return replicas


def _buffer_for(buffer: torch.Tensor, device: torch.device, index: int) -> torch.Tensor:
    moved = buffer.to(device)
    return moved.clone() if index > 0 and moved is buffer else moved  # no two threads share one


def scatter(batch: Any, devices: Sequence[torch.device]) -> list[Any]:
    """`batch` (any nesting of tensors) cut along dim 0 into at most len(devices) chunks, chunk i
    moved to devices[i]; non-tensors are repeated. Empty chunks are left out."""
    leaves, spec = tree_flatten(batch)
    rows = {t.shape[0] for t in leaves if torch.is_tensor(t) and t.dim() > 0}
    if len(rows) != 1:
        raise ConfigError(f"DataParallel cuts every input tensor along dim 0, so they must share "
                          f"its size; got sizes {sorted(rows) or 'none'}")
    n = min(len(devices), rows.pop())
    pieces = [t.tensor_split(n) if torch.is_tensor(t) and t.dim() > 0 else [t] * n for t in leaves]
    return [tree_unflatten([_to(piece[i], devices[i]) for piece in pieces], spec) for i in range(n)]


def parallel_apply(replicas: Sequence[nn.Module], chunks: Sequence[Any],
                   call: Callable[..., Any] | None = None) -> list[Any]:
    """`call(replica, *chunk)` (default: `replica(*args, **kwargs)` of an (args, kwargs) chunk)
    for every pair, each in its own thread, with this thread's grad and autocast modes."""
    call = call or (lambda replica, args, kwargs: replica(*args, **kwargs))
    grad_enabled = torch.is_grad_enabled()
    autocast = _caller_autocast()
    results: list[Any] = [None] * len(replicas)
    errors: list[BaseException | None] = [None] * len(replicas)

    def work(i: int) -> None:
        try:  # grad mode is per thread: a new thread starts with autograd on
            with torch.set_grad_enabled(grad_enabled), _on(chunks[i]), contextlib.ExitStack() as stack:
                for kind, dtype, enabled in autocast:  # one context object per thread
                    stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
                results[i] = call(replicas[i], *chunks[i])
        except BaseException as error:  # re-raised in the caller's thread, below
            errors[i] = error

    threads = [threading.Thread(target=work, args=(i,)) for i in range(1, len(replicas))]
    for t in threads:
        t.start()
    work(0)  # the calling thread takes the first replica
    for t in threads:
        t.join()
    for i, error in enumerate(errors):
        if error is not None:
            raise RuntimeError(f"DataParallel replica {i} failed: {error!r}") from error
    return results


def gather(outputs: Sequence[Any], device: torch.device) -> Any:
    """Every replica's output concatenated along dim 0 on `device` (0-dim tensors stacked),
    keeping the outputs' nesting (tuples, dicts)."""
    flat = [tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    joined = []
    for parts in zip(*(leaves for leaves, _ in flat)):
        if not torch.is_tensor(parts[0]):
            joined.append(parts[0])
            continue
        moved = [t.to(device) for t in parts]  # differentiable: gradients go back to each device
        joined.append(torch.stack(moved) if moved[0].dim() == 0 else torch.cat(moved))
    return tree_unflatten(joined, spec)


@dataclass(frozen=True)
class DP(Strategy):
    """One process, several devices: nn.DataParallel's algorithm, optionally balanced."""

    name = "dp"
    devices: tuple[str, ...] | None = None  # e.g. ("cuda:0", "cuda:1"); None: all CUDA devices, else one CPU
    output_device: str | None = None  # where outputs or losses are gathered; None: devices[0]
    balanced: bool = False  # compute the loss on each replica, gather only scalars

    def setup(self, model: nn.Module, optimizer, grid: ProcessGrid, *, init: MetaInit | None = None):
        if grid.topology.world_size > 1:
            raise ConfigError(f"strategy 'dp' drives several devices from one process, but this job "
                              f"has {grid.topology.world_size}; start one process, or use strategy='ddp'")
        devices = list(self.devices) if self.devices else (_all_cuda() or ["cpu"])
        wrapped = DataParallel(whole(model, init).to(_device(devices[0])), devices, self.output_device,
                               balanced=self.balanced)
        return wrapped, owned(optimizer, model)


def _rows(chunk: Any) -> int:
    return next(t.shape[0] for t in tree_flatten(chunk)[0] if torch.is_tensor(t) and t.dim() > 0)


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device, non_blocking=True) if torch.is_tensor(value) else value


def _on(chunk: Any) -> ContextManager:
    """Make the chunk's CUDA device current in this thread (kernels launch on it)."""
    tensors = [t for t in tree_flatten(chunk)[0] if torch.is_tensor(t)]
    if tensors and tensors[0].device.type == "cuda":
        return torch.cuda.device(tensors[0].device)
    return contextlib.nullcontext()


def _caller_autocast() -> list[tuple[str, torch.dtype, bool]]:
    """Autocast is per thread: the caller's settings, for the replicas' threads (as torch does)."""
    kinds = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return [(k, torch.get_autocast_dtype(k), torch.is_autocast_enabled(k)) for k in kinds]


def _device(d: Device) -> torch.device:
    return torch.device("cuda", d) if isinstance(d, int) else torch.device(d)


def _all_cuda() -> list[torch.device]:
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
