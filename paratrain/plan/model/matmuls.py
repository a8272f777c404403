"""The matmuls of one training step, by shape, and how long they take at shape-dependent rates.

A matmul's achieved rate depends on its shape: on this CPU (one thread, fp32) a 1024³ product
ran at ~190 GFLOP/s while the bench GPT's head, 2048 × 256 × 8192, ran at ~112; small or thin
products fall further. So a single FLOP/s figure times every model's matmuls as if they were
square and large, and the planner's compute came out 20-35 % short on the bench models.

Recording: probe runs the step on fake tensors under `Recorder`, a dispatch mode that notes
each aten.mm / addmm / bmm / baddbmm as (b, m, k, n): b products of (m × k) @ (k × n), 2·b·m·k·n
FLOPs as FlopCounterMode counts them. It runs again at twice the batch: a dimension that doubled
is proportional to the batch (`scaling`), so the shapes a rank multiplies with its share of the
batch (1/N of it under data parallelism, a micro-batch's under a pipeline) follow without probing
each world size again.

Timing: Σ b·2mkn / rate(m, k, n) over the shapes at the rank's share, the rate interpolated in a
table the calibration measured (cluster.py `matmul_rate`, calibrate.py `matmul_table`); FLOPs the
recorder did not see (attention, convolutions) keep the cluster's flat rate. Every other op is
timed by the bytes it reads and writes (`Traffic`) over the rate the calibration measured for
element-wise work counted the same way (cluster.traffic_rate).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten


class Matmul(NamedTuple):
    """`b` products of (m × k) @ (k × n) in `phase` ("forward" or "backward"), at the probed
    batch; `scales`: which of b, m, k, n are proportional to the batch."""

    phase: str
    b: int
    m: int
    k: int
    n: int
    scales: tuple[bool, bool, bool, bool]

    @property
    def flops(self) -> int:
        return 2 * self.b * self.m * self.k * self.n

    def at(self, fraction: float) -> tuple[int, int, int, int]:
        """(b, m, k, n) when the batch is `fraction` of the probed one."""
        return tuple(max(1, round(d * fraction)) if s else d  # type: ignore[return-value]
                     for d, s in zip((self.b, self.m, self.k, self.n), self.scales))


Matmuls = tuple[tuple[Matmul, int], ...]  # each shape and how many times the step runs it


MATMULS = (aten.mm, aten.addmm, aten.bmm, aten.baddbmm)
GATHERS = (aten.embedding, aten.index_select)  # a table's rows by index
# ops that move no data (a view, a fresh allocation) or whose time their FLOPs give (attention)
NO_TRAFFIC = ("_unsafe_view", "empty", "detach", "alias", "lift_fresh", "attention")  # parts of op names


class Recorder(TorchDispatchMode):
    """Notes the (b, m, k, n) of every matmul run while it is active, in order, and the bytes
    every other op reads and writes (`traffic`: the sizes of its tensor inputs and outputs;
    views, allocations and attention move none): the work of norms, activations, softmax,
    residuals, copies and the loss, which takes memory bandwidth rather than FLOPs."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, int, int, int]] = []
        self.traffic = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        packet = getattr(func, "overloadpacket", None)
        if packet in MATMULS:
            a, b = args[-2], args[-1]  # addmm/baddbmm take the added term first
            if a.dim() == 2:
                self.shapes.append((1, a.shape[0], a.shape[1], b.shape[1]))
            else:
                self.shapes.append((a.shape[0], a.shape[1], a.shape[2], b.shape[2]))
        elif packet in GATHERS:  # reads the rows it gathers, not the whole table
            index = next(a for a in args[1:] if isinstance(a, torch.Tensor))
            self.traffic += 2 * out.numel() * out.element_size() + index.numel() * index.element_size()
        elif getattr(func, "namespace", None) == "aten" and not (
                func.is_view or any(word in str(packet) for word in NO_TRAFFIC)):  # not prim.device &c.
            tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            self.traffic += sum(t.numel() * t.element_size() for t in tensors)
        return out


class Traffic(NamedTuple):
    """Bytes the non-matmul ops move (Recorder), per phase, at the probed batch: a part that does
    not change with the batch (gradients of parameters, zeroed buffers) and one proportional to
    it, told apart by the runs at the batch and at twice it."""

    forward_fixed: int = 0
    forward_per_batch: int = 0
    backward_fixed: int = 0
    backward_per_batch: int = 0

    @classmethod
    def of(cls, at_batch: dict[str, int], at_double: dict[str, int]) -> "Traffic":
        """From each phase's bytes at the batch and at twice it (none at twice: all per batch)."""
        parts = []
        for phase in ("forward", "backward"):
            one, two = at_batch.get(phase, 0), at_double.get(phase)
            fixed = min(one, max(0, 2 * one - two)) if two is not None else 0
            parts += [fixed, one - fixed]
        return cls(*parts)

    def bytes(self, phase: str, fraction: float = 1.0) -> float:
        """Bytes of `phase` over the whole probed batch, run in pieces of `fraction` of it."""
        fixed, per_batch = (self[0], self[1]) if phase == "forward" else (self[2], self[3])
        return fixed / fraction + per_batch


def scaling(at_batch: dict[str, list], at_double: dict[str, list]) -> Matmuls:
    """The shapes of a run at the batch (by phase, in order), each dimension marked as scaling
    where the run at twice the batch doubled it; runs that differ in their matmuls (a model
    whose ops depend on the batch) mark none."""
    found: Counter = Counter()
    for phase, shapes in at_batch.items():
        double = at_double.get(phase, [])
        same = len(double) == len(shapes)
        for i, shape in enumerate(shapes):
            scales = tuple(same and 2 * d == e and d != e for d, e in zip(shape, double[i])) if same \
                else (False,) * 4
            found[Matmul(phase, *shape, scales)] += 1  # type: ignore[arg-type]
    return tuple(sorted(found.items()))


def extend_matmuls(one: Matmuls, two: Matmuls, length: int) -> Matmuls:
    """The whole stack's matmuls from runs with one block and with two (repeated_blocks.extend)."""
    a, b = Counter(dict(one)), Counter(dict(two))
    counts = {shape: a[shape] + (length - 1) * (b[shape] - a[shape]) for shape in a.keys() | b.keys()}
    return tuple(sorted((shape, n) for shape, n in counts.items() if n > 0))


def flops(matmuls: Matmuls, phase: str) -> int:
    """FLOPs of the recorded matmuls of `phase`, at the probed batch."""
    return sum(shape.flops * n for shape, n in matmuls if shape.phase == phase)


def seconds(matmuls: Matmuls, phase: str, rate: Callable[[int, int, int], float], fraction: float = 1.0) -> float:
    """Seconds for the matmuls of `phase` over the whole probed batch, run in pieces of
    `fraction` of it, each at rate(m, k, n) FLOP/s."""
    total = 0.0
    for shape, n in matmuls:
        if shape.phase == phase:
            b, m, k, n_ = shape.at(fraction)
            total += n * 2 * b * m * k * n_ / rate(m, k, n_)
    return total / fraction
