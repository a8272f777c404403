"""The one surface every parallel wrapper offers, and the strategy objects that build them.

[Note: the parallel protocol]
Session, checkpoints and `shard` talk to a wrapped model only through `ParallelModule`; they
never ask which strategy built it, nor probe it for attributes:

    module                              the user's model (a pipeline stage: this rank's part of it)
    no_sync()                           backward accumulates locally; the flag is
                                        `require_backward_grad_sync`, torch DDP's name, everywhere
    forward_backward(x, y, loss_fn, s)  one micro-batch: forward, loss, backward of loss·s; returns
                                        the loss, detached (a pipeline runs its schedule here)
    clip_grad_norm_(max_norm)           clip by the global norm, whatever part each rank holds
    local_grads()                       (the gradients this rank holds after backward, the group
                                        whose ranks hold the rest: None when every rank has all)
    replicas, replica_index             data-parallel replicas, and which one this rank is
    check_loader(loader)                refuse at setup a sharded loader it cannot take
    checkpoint_layout()                 what this rank holds, in the checkpoint's terms
    full_state_dict()                   the whole model's state dict, keys the user's (collective)
    sync_buffers()                      replicas take replica 0's buffers now, as the next forward
                                        would (collective): what full_state_dict reports first
    state_pieces()                      the same, a piece at a time: a ZeRO-3 unit, a pipeline stage
                                        (collective; how session.export streams the model to rank 0)
    supports_token_weights              whether train_step(weight=...) works
    default_loss(outputs, targets)      the loss when train_step is given none (the model's own)

The defaults below are those of a model every rank holds whole, with gradients that are equal on
every rank after backward. A `Strategy` is a frozen dataclass of settings whose `setup` builds
the wrapper and the optimizer that steps it; it sits in the wrapper's own file, and the registry
(parallel/registry.py) names it.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator

import torch
from torch import nn

from paratrain.components.materialize import MetaInit
from paratrain.components.optim import check_optimizer_owns
from paratrain.distributed.grid import ProcessGrid
from paratrain.distributed.topology import Topology
from paratrain.errors import UsageError

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class FlatLayout:
    """Which parameters a flat, sharded buffer holds, and which slice of it this rank owns."""

    slots: tuple[tuple[str, int, torch.Size], ...]  # (name, offset in the flat buffer, shape)
    shard_size: int  # elements per rank (the padded buffer / world)
    rank: int
    world: int

    def pieces(self, rank: int) -> list[tuple[str, int, int, int]]:
        """(name, offset in the flattened parameter, offset in the shard, length) of each
        parameter piece rank `rank`'s shard holds."""
        lo, hi = rank * self.shard_size, (rank + 1) * self.shard_size
        out = []
        for name, offset, shape in self.slots:
            a, b = max(lo, offset), min(hi, offset + shape.numel())
            if a < b:
                out.append((name, a - offset, a - lo, b - a))
        return out


@dataclass(frozen=True)
class Slice:
    """Which part of a whole parameter a rank holds, when tensor parallelism cuts it: part
    `index` of `parts` equal parts along dimension `dim`."""

    dim: int
    index: int
    parts: int

    def offsets(self, local: torch.Size, index: int | None = None) -> list[int]:
        """Where part `index` (this rank's by default) of local shape `local` starts in the whole."""
        at = [0] * len(local)
        at[self.dim] = (self.index if index is None else index) * local[self.dim]
        return at

    def runs(self, local: torch.Size, start: int, length: int) -> list[tuple[int, int, int]]:
        """Elements [start, start + length) of this rank's part (shape `local`), flattened, as
        runs contiguous in the whole flattened parameter: (offset in the whole, offset in the
        part, length). The part's elements of one index of the dimensions before `dim` are
        contiguous, and sit `index` such blocks into the whole's."""
        block = math.prod(local[self.dim:])
        out, at = [], start
        while at < start + length:
            outer, inner = divmod(at, block)
            n = min(block - inner, start + length - at)
            out.append((outer * block * self.parts + self.index * block + inner, at, n))
            at += n
        return out


@dataclass(frozen=True)
class CheckpointLayout:
    """What one rank holds of a model, in the terms of the canonical layout (checkpoint/layout.py)."""

    params: dict[str, torch.Tensor]  # parameters held whole, by their names in the user's model
    flat: dict[torch.Tensor, FlatLayout]  # flat shards (what a sharded optimizer steps) → contents
    params_in_flat: bool  # the parameters' values live in the flat shards (ZeRO-3), not `params`
    buffers: dict[str, torch.Tensor]
    shapes: dict[str, torch.Size]  # every parameter of the whole model, on every rank
    aliases: dict[str, str] = field(default_factory=dict)  # a tied parameter's other names → its first
    persistent: frozenset[str] | None = None  # the buffers a state dict holds (None: all of them)
    after_load: Callable[[], None] | None = None  # a collective run once values were loaded in
    # parameters held in part (tensor parallelism): `params` and the flat slots hold the part, of
    # the part's shape; `shapes` gives the whole one
    slices: dict[str, Slice] = field(default_factory=dict)

    @classmethod
    def whole(cls, module: nn.Module, flat: dict | None = None,
              shapes: dict[str, torch.Size] | None = None) -> "CheckpointLayout":
        """A rank holding `module`'s parameters whole (and maybe flat optimizer shards)."""
        params = {user_key(n): p for n, p in module.named_parameters()}
        first = {p: n for n, p in params.items()}
        aliases = {user_key(n): first[p] for n, p in module.named_parameters(remove_duplicate=False)
                   if user_key(n) != first[p]}
        return cls(params, flat or {}, False, {user_key(n): b for n, b in module.named_buffers()},
                   shapes if shapes is not None else {n: p.shape for n, p in params.items()},
                   aliases, persistent_buffers(module))

    def saved_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers a state dict holds: not the non-persistent ones."""
        return {n: b for n, b in self.buffers.items() if self.persistent is None or n in self.persistent}


def names_by_first(aliases: dict[str, str]) -> dict[str, list[str]]:
    """A tied parameter's first name → all its names, the first first (from a layout's
    `aliases`); a parameter with one name is not listed."""
    out: dict[str, list[str]] = {}
    for alias, first in aliases.items():
        out.setdefault(first, [first]).append(alias)
    return out


class ParallelModule(nn.Module):
    """Base of every parallel wrapper; see [Note: the parallel protocol]."""

    module: nn.Module
    require_backward_grad_sync: bool = True  # False inside no_sync()
    supports_token_weights: ClassVar[bool] = True
    replicas: int = 1
    replica_index: int = 0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate gradients locally, with no communication; the first
        synchronised backward after it averages everything accumulated."""
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def forward_backward(self, inputs: Any, targets: Any, loss_fn: LossFn, scale: float) -> torch.Tensor:
        outputs = self(**inputs) if isinstance(inputs, Mapping) else self(inputs)  # a dict: keyword arguments
        loss = check_loss(loss_fn(outputs, targets))
        # backward needs only what autograd saved: a language model's logits (batch × tokens ×
        # vocabulary, 64 MiB for bench/session.py's GPT) go now, as in a plain loop, not after it
        del outputs
        backward_no_autocast(scaled(loss, scale))
        return loss.detach()

    @staticmethod
    def default_loss(outputs: Any, targets: Any) -> torch.Tensor:
        """The loss when train_step is given none: the one the model computed (transformers'
        `outputs.loss`, present when the batch holds labels=)."""
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
        if loss is None:
            raise UsageError(f"the model returned {type(outputs).__name__} without a loss, and train_step was "
                             "given no loss_fn: put labels in the batch (transformers computes the loss from "
                             "labels=), or pass loss_fn(outputs, targets)")
        return loss

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm)

    def local_grads(self) -> tuple[list[torch.Tensor], Any]:
        return [p.grad for p in self.parameters() if p.grad is not None], None

    def reduced_finite(self) -> torch.Tensor | None:
        """A 0-dim tensor, the same on every rank, that is finite exactly when every gradient
        reduced since the last call is (a sum of them all), or None when this rank cannot tell
        alone; called once per optimizer step, on every rank. Strategies that see each reduction
        whole may say once watch_reductions() was called (buckets.py, ReducedSums): DDP, and ZeRO
        on gloo; with no collective up to ReducedSums.LIMIT elements, above it after one
        all-reduce of the ranks' partial sums. Unwatched: None, and nothing was summed."""
        return None

    def watch_reductions(self) -> None:
        """The finite check is on (Session(nan_check=True)): sum each gradient reduction as it
        completes if that is how this strategy answers reduced_finite() cheapest (DDP: the check
        reads every gradient anyway, and reading each bucket while the later ones are in flight
        hides part of it). Plain users of the wrapper never call it and pay nothing."""

    def check_loader(self, loader: Any) -> None:
        pass

    def checkpoint_layout(self) -> CheckpointLayout:
        return CheckpointLayout.whole(self.module)

    def sync_buffers(self) -> None:
        """Every data-parallel replica takes replica 0's buffers (BatchNorm statistics), the
        broadcast torch's DDP runs before each forward, run now: so the state dict every rank
        reports is one model's, and the next forward starts where it would have anyway. A
        collective over the replicas; nothing where every rank computes the same buffers."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        self.sync_buffers()
        return {k: v for piece in self.state_pieces() for k, v in piece.items()}

    def state_pieces(self) -> Iterator[dict[str, torch.Tensor]]:
        yield {user_key(k): v for k, v in self.module.state_dict().items()}


class Wrapping(ParallelModule):
    """A wrapper over another ParallelModule, `inner` (a data-parallel strategy over the ranks
    that read different data): the protocol passes through to it, and a subclass overrides what
    its own dimension changes (parallel/tensor/mesh.py: tp slices made whole; parallel/context/
    model.py: the sequence cut). `reduced_finite` and `watch_reductions` keep the defaults: a
    reduction the inner wrapper saw whole need not be the whole model's gradient."""

    def __init__(self, inner: ParallelModule, *, replicas: int, replica_index: int):
        super().__init__()
        self.inner, self.module = inner, inner.module
        self.replicas, self.replica_index = replicas, replica_index
        self.supports_token_weights = inner.supports_token_weights

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.inner.no_sync():
            yield

    @property
    def require_backward_grad_sync(self) -> bool:
        return self.inner.require_backward_grad_sync

    def forward_backward(self, inputs: Any, targets: Any, loss_fn: LossFn, scale: float) -> torch.Tensor:
        return self.inner.forward_backward(inputs, targets, loss_fn, scale)

    def default_loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        return self.inner.default_loss(outputs, targets)

    def check_loader(self, loader: Any) -> None:
        self.inner.check_loader(loader)

    def local_grads(self) -> tuple[list[torch.Tensor], Any]:
        return self.inner.local_grads()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return self.inner.clip_grad_norm_(max_norm)

    def checkpoint_layout(self) -> CheckpointLayout:
        return self.inner.checkpoint_layout()

    def sync_buffers(self) -> None:
        self.inner.sync_buffers()

    def state_pieces(self) -> Iterator[dict[str, torch.Tensor]]:
        return self.inner.state_pieces()


def persistent_buffers(module: nn.Module) -> frozenset[str]:
    """The names of `module`'s buffers its state dict holds (a causal mask registered with
    persistent=False is rebuilt by the model, not saved)."""
    return frozenset(user_key(f"{prefix}.{name}" if prefix else name)
                     for prefix, m in module.named_modules() for name, b in m._buffers.items()
                     if b is not None and name not in m._non_persistent_buffers_set)


def user_key(name: str) -> str:
    """A parameter's name as the user's own model has it: `torch.compile` wraps a module in an
    OptimizedModule whose names gain `_orig_mod.`, which a checkpoint or an export must not
    keep (the plain model would not load them)."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod") if "_orig_mod" in name else name


def uncompiled(module: nn.Module) -> nn.Module:
    """The module `torch.compile` wrapped, or `module` itself (dynamo is imported only by code
    that compiled something, so it is looked up, not imported)."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    return module._orig_mod if dynamo is not None and isinstance(module, dynamo.OptimizedModule) else module


class Strategy:
    """Base of the strategy objects (frozen dataclasses): settings, and `setup` to apply them."""

    name: ClassVar[str] = "base"

    def grid(self, topology: Topology) -> ProcessGrid:
        """The rank grid this strategy slices its groups from (a pipeline sets its "pp")."""
        return ProcessGrid(topology)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, grid: ProcessGrid, *,
              init: MetaInit | None = None) -> tuple[ParallelModule, torch.optim.Optimizer | None]:
        """The wrapped model (on this rank's device) and the optimizer that steps it. Collective:
        every rank calls it at the same point. A model built on the meta device gets its values
        by `init`'s rule (components/materialize.py): whole where every rank holds all of it, only this
        rank's part under ZeRO-3 and the pipeline."""
        raise NotImplementedError


def owned(optimizer: torch.optim.Optimizer | None, model: nn.Module) -> torch.optim.Optimizer | None:
    """`optimizer`, checked to step `model`'s parameters (strategies that keep the user's own)."""
    if optimizer is not None:
        check_optimizer_owns(optimizer, model.parameters())
    return optimizer


def state_pieces(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """The whole model's state dict in pieces whose union is `full_state_dict(model)`, each on
    every rank of the group that gathers it (a collective, piece by piece)."""
    if not isinstance(model, ParallelModule):
        return iter([model.state_dict()])
    model.sync_buffers()
    return model.state_pieces()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict with the user's keys, whatever wraps it (a collective under
    sharded strategies); a plain module's own state dict."""
    return model.full_state_dict() if isinstance(model, ParallelModule) else model.state_dict()


def scaled(loss: torch.Tensor, factor: float) -> torch.Tensor:
    """`loss * factor`, or `loss` itself for 1.0: no op in forward, none in backward."""
    return loss if factor == 1.0 else loss * factor


def backward_no_autocast(tensors: torch.Tensor | list[torch.Tensor], grads: list[torch.Tensor] | None = None,
                         **kwargs: Any) -> None:
    """`torch.autograd.backward` with autocast off, as torch's AMP recipe runs it. The session's
    autocast spans forward_backward (a pipeline interleaves forward and backward), and the
    autograd engine hands it on to its CUDA threads, where it adds cast kernels to every block's
    backward (torch.profiler shows them on a bf16 GPT step). `kwargs`: torch's (inputs=,
    retain_graph=), for a backward split in two (pipeline/stage.py)."""
    first = tensors if torch.is_tensor(tensors) else next(iter(tensors), None)
    if first is None or not torch.is_autocast_enabled(first.device.type):
        torch.autograd.backward(tensors, grads, **kwargs)
        return
    with torch.autocast(first.device.type, enabled=False):
        torch.autograd.backward(tensors, grads, **kwargs)


def check_loss(loss: Any) -> torch.Tensor:
    """The loss a loss function returned, refused when it cannot be backpropagated."""
    if loss is None:
        raise UsageError("the loss function returned None: a model called without labels returns no "
                         "loss (transformers models compute it only when given labels=); return a scalar "
                         "tensor such as F.cross_entropy(outputs, targets)")
    if not torch.is_tensor(loss) or loss.numel() != 1:
        shape = tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__
        raise UsageError(f"the loss function returned {shape}, not a scalar: reduce it to one number "
                         "(a mean over the batch, e.g. reduction='mean') before backward")
    return loss
