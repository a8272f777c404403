"""Pipeline schedules: the order in which each rank runs the forwards and backwards of m
micro-batches, as data (actions.py). A schedule is a pure function `order(p, v, m)` that returns
each rank's compute actions; `with_comm` adds the sends and receives by one rule, check.py proves
the lists before they run, and stage.py runs them.

With p uniform stages, a forward costing 1 and a backward 2 (its input and weight gradients 1
each), the schedules leave each rank idle for these fractions of the step:

    gpipe, 1f1b         (p-1) / (m + p - 1)         Narayanan et al. 2021, section 2.2.1
    interleaved-1f1b    (p-1) / (v·m + p - 1)        the same paper, section 2.2.2 (m a multiple of p)
    zb-h1               (p-1) / (3m + p - 1)         Qi et al. 2023, section 3.1: (p-1)(F+I-W) idle

and hold at most these micro-batches' activations on rank r: GPipe m, 1F1B min(m, p - r), zb-h1
min(m, p), and interleaved 1F1B (v-1)·p + 2(p-1-r) + 1 chunks of 1/v of a stage each (for m a
multiple of p): more than 1F1B, the price of its smaller bubble (check.peak_alive counts them).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

from paratrain.errors import ConfigError
from paratrain.parallel.pipeline.actions import Action, Op

Order = Callable[[int, int, int], list[list[Action]]]


def gpipe(p: int, v: int, m: int) -> list[list[Action]]:
    """GPipe (Huang et al. 2019), fill-drain; torch's ScheduleGPipe runs the same order.
    Phase 1: forwards of micro-batches 0 … m-1. Phase 2: their backwards, 0 … m-1. All m
    micro-batches' activations are alive at the end of phase 1."""
    _one_chunk("gpipe", v)
    return [[Action(Op.F, i, s) for i in range(m)] + [Action(Op.B, i, s) for i in range(m)] for s in range(p)]


def one_f_one_b(p: int, v: int, m: int) -> list[list[Action]]:
    """1F1B (PipeDream-Flush: Narayanan et al. 2021; Megatron-LM's
    forward_backward_pipelining_without_interleaving). Stage s, with w = min(p-1-s, m):
    Phase 1, warm-up: forwards 0 … w-1. Phase 2, steady: for i = w … m-1, forward i then
    backward i-w. Phase 3, cool-down: backwards m-w … m-1. At most w+1 ≤ p micro-batches are
    alive; the last stage alternates from the start; with m < p it is GPipe's order."""
    _one_chunk("1f1b", v)
    orders = []
    for s in range(p):
        w = min(p - 1 - s, m)
        order = [Action(Op.F, i, s) for i in range(w)]
        for i in range(w, m):
            order += [Action(Op.F, i, s), Action(Op.B, i - w, s)]
        orders.append(order + [Action(Op.B, i, s) for i in range(m - w, m)])
    return orders


def interleaved_1f1b(p: int, v: int, m: int) -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2.2; Megatron-LM's
    forward_backward_pipelining_with_interleaving, torch's ScheduleInterleaved1F1B). Rank r holds
    chunks r, r+p, … (virtual stages). Micro-batches go in rounds of n = min(m, p):
    the j-th forward of a rank is of chunk (j // n) mod v, the j-th backward of chunk
    v-1 - (j // n) mod v, each chunk taking its micro-batches in order.
    Phase 1, warm-up: w = min((v-1)·n + 2(p-1-r), v·m) forwards.
    Phase 2, steady: forward j, then backward j-w, for j = w … v·m-1.
    Phase 3, cool-down: the backwards left.
    m is a multiple of p (rounds of p), or fewer than p (one round of m)."""
    n = microbatches_per_round(p, m)
    orders = []
    for r in range(p):
        total = v * m
        w = min((v - 1) * n + 2 * (p - 1 - r), total)
        forwards = _chunked(r, p, v, n, total, reverse=False)
        backwards = _chunked(r, p, v, n, total, reverse=True)
        order = [Action(Op.F, i, k) for i, k in forwards[:w]]
        for j in range(w, total):
            order += [Action(Op.F, *forwards[j]), Action(Op.B, *backwards[j - w])]
        orders.append(order + [Action(Op.B, i, k) for i, k in backwards[total - w:]])
    return orders


def zb_h1(p: int, v: int, m: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3.1; torch's
    ScheduleInterleavedZeroBubble at one chunk per rank). 1F1B's order with each backward split
    into I (the input gradient, which the previous stage waits for) and W (the weight gradient,
    which nobody waits for): stage s defers its first s weight passes, then follows each I by the
    oldest deferred W, and runs the ones left at the end. The deferred W's fill the cool-down's
    bubble, and at most p micro-batches are alive, as in 1F1B."""
    _one_chunk("zb-h1", v)
    return [_zb_h1_stage(s, p, m) for s in range(p)]


def _zb_h1_stage(s: int, p: int, m: int) -> list[Action]:
    w = min(p - 1 - s, m)
    order = [Action(Op.F, i, s) for i in range(w)]
    deferred: list[int] = []

    def backward(i: int) -> list[Action]:
        """I of micro-batch i, then the oldest deferred W once s of them wait."""
        deferred.append(i)
        return [Action(Op.I, i, s)] + ([Action(Op.W, deferred.pop(0), s)] if len(deferred) > s else [])

    for i in range(w, m):
        order += [Action(Op.F, i, s)] + backward(i - w)
    for i in range(m - w, m):
        order += backward(i)
    return order + [Action(Op.W, i, s) for i in deferred]


def microbatches_per_round(p: int, m: int) -> int:
    """The micro-batches of one round of interleaved 1F1B (all m, or p), or a ConfigError saying
    what to pass. Rounds of more than p micro-batches (torch allows m = 10 at p = 4, in rounds of
    5) would make a rank's sends wait on each other in warm-up: check.py finds them hanging."""
    if m <= p or m % p == 0:
        return min(m, p)
    below, above = m - m % p, m + p - m % p
    raise ConfigError(f"interleaved-1f1b runs micro-batches in rounds of the {p} stages: "
                      f"microbatches={m} is neither a multiple of {p} nor fewer than {p}; pass "
                      f"microbatches={below} or {above}")


def _chunked(r: int, p: int, v: int, n: int, total: int, reverse: bool) -> list[tuple[int, int]]:
    """The (micro-batch, virtual stage) of rank r's j-th forward (or backward), j < total."""
    taken = [0] * v
    out = []
    for j in range(total):
        c = (j // n) % v
        c = v - 1 - c if reverse else c
        out.append((taken[c], c * p + r))
        taken[c] += 1
    return out


def _one_chunk(name: str, v: int) -> None:
    if v != 1:
        raise ConfigError(f"schedule {name!r} runs one chunk per rank; virtual={v} needs "
                          "schedule='interleaved-1f1b'")


@dataclass(frozen=True)
class Schedule:
    """A named schedule: its order, the idle fraction its theory gives (None: none stated), and
    what refuses settings it cannot run (p, v, m) without building the order, which is p·v·m
    actions long: the planner weighs pipelines of thousands of micro-batches."""

    order: Order
    bubble: Callable[[int, int, int], Fraction | None]
    refuse: Callable[[int, int, int], None]
    split_backward: bool = False  # runs I and W instead of B


def _classic(p: int, v: int, m: int) -> Fraction:
    return Fraction(p - 1, m + p - 1)


def _interleaved(p: int, v: int, m: int) -> Fraction | None:
    return Fraction(p - 1, v * m + p - 1) if m % p == 0 else None


def _zero_bubble(p: int, v: int, m: int) -> Fraction | None:
    return Fraction(p - 1, 3 * m + p - 1) if m >= p else None


def _one_chunk_only(name: str) -> Callable[[int, int, int], None]:
    return lambda p, v, m: _one_chunk(name, v)


SCHEDULES = {
    "gpipe": Schedule(gpipe, _classic, _one_chunk_only("gpipe")),
    "1f1b": Schedule(one_f_one_b, _classic, _one_chunk_only("1f1b")),
    "interleaved-1f1b": Schedule(interleaved_1f1b, _interleaved, lambda p, v, m: microbatches_per_round(p, m)),
    "zb-h1": Schedule(zb_h1, _zero_bubble, _one_chunk_only("zb-h1"), split_backward=True),
}
