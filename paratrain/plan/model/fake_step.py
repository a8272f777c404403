"""Running a model once on fake tensors, for model/probe.py: the model's parameters and buffers
swapped for fakes (`faked`), attention as the fused kernel a GPU runs (`fused_attention`,
`CPU_ATTENTION_FLOPS`), the FLOPs of the run (`Flops`) and the lifetime of every storage it makes
(`Lifetimes`)."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper


@contextmanager
def fused_attention(kv_bytes: list[int] | None = None):
    """Attention as a fused kernel on a GPU runs it. `F.scaled_dot_product_attention` is called with
    dropout_p = 0 while this lasts, so that the CPU takes its flash kernel: it has none with
    dropout, and its math path would save the T×T scores and the dropout mask, where flash
    attention on a GPU keeps only its dropout's RNG seed. The FLOPs are the same. (Replaced in the
    module, as models call it, because a TorchFunctionMode does not reach the recompute of a
    checkpointed block in backward.) `kv_bytes` gets the bytes of each call's keys and values,
    a recompute's in backward too (the caller reads it after forward): what context parallelism
    passes around its ring (plan/cost/context_parallel.py)."""
    original = F.scaled_dot_product_attention

    def without_dropout(query, key, value, *args, **kwargs):
        kwargs = {**dict(zip(SDPA_OPTIONS, args)), **kwargs, "dropout_p": 0.0}
        if kv_bytes is not None:
            kv_bytes.append(key.numel() * key.element_size() + value.numel() * value.element_size())
        return original(query, key, value, **kwargs)

    F.scaled_dot_product_attention = without_dropout
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


SDPA_OPTIONS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")  # after query, key, value

# FlopCounterMode knows the GPU attention kernels; the CPU's flash kernel does the same work
CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda grad, q, k, v, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(grad, q, k, v),
}
FLOP_FORMULAS = {**flop_registry, **{op: shape_wrapper(f) for op, f in CPU_ATTENTION_FLOPS.items()}}


class Flops(TorchDispatchMode):
    """The FLOPs of the ops run while this is active (`total`), counted as FlopCounterMode counts
    them: torch's formulas by op, an op without one decomposed first where it can be. Not
    FlopCounterMode itself: its module tracker hooks every module's outputs, and in backward those
    hooks kept a checkpointed block's recomputed activations alive until backward ended (the GC is
    off under Lifetimes), which made a checkpointed step's transient memory several times what
    torch holds at once."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        formula = FLOP_FORMULAS.get(func.overloadpacket)
        if formula is None and func is not torch.ops.prim.device.default:
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out


@contextmanager
def faked(model: nn.Module, mode: FakeTensorMode) -> Iterator[set[StorageWeakRef]]:
    """`model`'s parameters and buffers swapped, in place, for fake CPU tensors of the same shape
    and dtype (tied ones stay tied) while this lasts; yields the storages of the fakes."""
    made: dict[int, torch.Tensor] = {}
    swapped = []  # (table, name, the tensor put back after)
    with mode:
        for module in model.modules():
            for table, wrap in ((module._parameters, True), (module._buffers, False)):
                for name, t in table.items():
                    if t is None:
                        continue
                    if id(t) not in made:
                        fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
                        made[id(t)] = nn.Parameter(fake, t.requires_grad) if wrap else fake
                    swapped.append((table, name, t))
                    table[name] = made[id(t)]
    try:
        yield {StorageWeakRef(t.untyped_storage()) for t in made.values()}
    finally:
        for table, name, t in swapped:
            table[name] = t


class Lifetimes(TorchDispatchMode):
    """When each storage an op makes is born and dies, in ops (probe's docstring: transient bytes).
    `ignore`: storages never counted (the model's fake parameters and buffers).

    A cast of one of them to another dtype (autocast's low-precision copy of a weight) is not
    counted either, but kept apart in `copies`, by the weight it copies: how long it lives
    depends on the strategy, not on the batch (memory.py's weight copies), so the planner
    counts it per rank, and the batch's transient bytes leave it out."""

    def __init__(self, ignore: set[StorageWeakRef]):
        super().__init__()
        self._collecting = False  # the cyclic GC, off while this lasts: a cycle's storages die at
        # the same op in every run (counts from 1 and 2 blocks extend to the whole one exactly)
        self.ignore = ignore
        self.clock = 0  # ops run so far
        self.alive: dict[StorageWeakRef, int] = {}  # storage -> its index in `spans`
        self.spans: list[list] = []  # [born, bytes, died or None, storage]
        self.copies: dict[StorageWeakRef, int] = {}  # weight -> the bytes of its cast
        self.copy_storages: set[StorageWeakRef] = set()  # the casts alive

    def __enter__(self):
        # no collection first: garbage from before holds no storage this count follows, and a full
        # collection walked every object of the process (0.4 s each, 28 in bench/plan_published.py)
        self._collecting = gc.isenabled()
        gc.disable()
        return super().__enter__()

    def __exit__(self, *exc):
        if self._collecting:
            gc.enable()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.clock += 1
        for ref in [ref for ref in self.alive if ref.expired()]:  # a freed storage's address may be reused
            self.spans[self.alive.pop(ref)][2] = self.clock
        self.copy_storages = {ref for ref in self.copy_storages if not ref.expired()}
        if func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor) \
                and (weight := StorageWeakRef(args[0].untyped_storage())) in self.ignore:
            self.copies[weight] = max(self.copies.get(weight, 0), out.untyped_storage().nbytes())
            self.copy_storages.add(StorageWeakRef(out.untyped_storage()))
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref not in self.alive and ref not in self.ignore and ref not in self.copy_storages:
                    self.alive[ref] = len(self.spans)
                    self.spans.append([self.clock, t.untyped_storage().nbytes(), None, ref])
        return out

    def peak(self, leaving_out: set[StorageWeakRef] = frozenset()) -> int:
        """The most bytes alive at once, without the storages in `leaving_out` still alive at
        the end (the parameters' gradients). At one op, births count before deaths."""
        events = []
        for born, nbytes, died, ref in self.spans:
            if died is None and ref in leaving_out:
                continue
            events.append((born, 0, nbytes))
            if died is not None:
                events.append((died, 1, -nbytes))
        live = peak = 0
        for _, _, change in sorted(events):
            live += change
            peak = max(peak, live)
        return peak
