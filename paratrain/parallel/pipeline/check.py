"""Prove a schedule's action lists (actions.py) before they run: a schedule that would hang, skip
a micro-batch or step with a missing weight gradient is refused, naming the rank and the action.

    check(lists, p, v, m)        raises ScheduleError, or returns the lists' timed replay
    replay(lists, p, costs)      when each compute action starts and ends on uniform stages
    idle_fraction(timed, p)      the bubble of a replay

What is checked, in order:
1. Each action sits on the rank that holds its stage; every micro-batch has one forward and one
   backward (B, or I and W) on every virtual stage, the backward after the forward, W after I:
   every weight gradient is done before the step ends, and so before the optimizer's step.
2. Every receive has its send and every send its receive, each on its link in the same order of
   micro-batches (a link's messages are matched in order), and each where the data exists (a
   send after the compute that made it, a receive before the compute that uses it).
3. No rank waits in a cycle: the lists are run as the executor runs them ([Note: what an action
   does when it runs], actions.py), once as a first step (the first activation of a new shape
   waits for its header at its RECV_F) and once as a later step. If no rank can move, every
   waiting rank is named with the action it waits at and the rank it waits for.
With `ordered_pairs` (NCCL, which ignores p2p tags), the messages between two ranks must also
be received in the order they are sent, over all their links together.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Mapping

from paratrain.errors import ConfigError
from paratrain.parallel.pipeline.actions import COMPUTE, Action, Op, link, rank_of

COSTS = {Op.F: 1, Op.B: 2, Op.I: 1, Op.W: 1}  # uniform stages: a backward is twice a forward


class ScheduleError(ConfigError):
    """A pipeline schedule's action lists would hang or compute the wrong step."""


@dataclass(frozen=True)
class Timed:
    rank: int
    index: int  # among the rank's compute actions
    action: Action
    start: Fraction
    end: Fraction


def check(lists: list[list[Action]], p: int, v: int, m: int, *, name: str = "the schedule",
          ordered_pairs: bool = False) -> list[Timed]:
    """Raise ScheduleError if `lists` (one per pipeline rank) is not a sound step of m
    micro-batches over p·v virtual stages; return their replay on uniform stages."""
    if len(lists) != p:
        raise ScheduleError(f"{name} has lists for {len(lists)} ranks; the pipeline has {p}")
    _check_work(lists, p, v, m, name)
    _check_links(lists, p, name, ordered_pairs)
    for first_step in (True, False):
        _run(lists, p, v, name, first_step)
    return replay(lists, p)


def _check_work(lists, p, v, m, name) -> None:
    last = p * v - 1
    for r, actions in enumerate(lists):
        done: dict[tuple[Op, int, int], int] = {}
        for at, a in enumerate(actions):
            where = f"{name}: rank {r}, action {at} {a}"
            if not (0 <= a.stage <= last and 0 <= a.microbatch < m):
                raise ScheduleError(f"{where}: no such micro-batch or stage (m={m}, {p * v} stages)")
            holder = _holder(a, p)
            if holder != r:
                raise ScheduleError(f"{where}: stage {a.stage} is held by rank {holder}")
            key = (a.op, a.microbatch, a.stage)
            if key in done:
                raise ScheduleError(f"{where}: runs twice (also action {done[key]})")
            done[key] = at
            needs = _needs(a, last)
            if needs and not any(n in done for n in needs):
                raise ScheduleError(f"{where}: comes before {_name(needs[0])}, which it needs")
        for k in range(r, last + 1, p):
            for i in range(m):
                split = (Op.I, i, k) in done or (Op.W, i, k) in done
                wanted = [Op.F, Op.I, Op.W] if split else [Op.F, Op.B]
                wanted += [Op.SEND_F] * (k < last) + [Op.SEND_B] * (k > 0)
                wanted += [Op.RECV_F] * (k > 0) + [Op.RECV_B] * (k < last)
                for op in wanted:
                    stage = k + 1 if op in (Op.SEND_F, Op.RECV_B) else k
                    if (op, i, stage) not in done:
                        raise ScheduleError(f"{name}: rank {r} never runs {Action(op, i, stage)}"
                                            + (": every weight gradient must be done before the step ends"
                                               if op is Op.W else ""))


def _holder(a: Action, p: int) -> int:
    if a.op in COMPUTE:
        return rank_of(a.stage, p)
    src, dst, _, _ = link(a, p)
    return src if a.op in (Op.SEND_F, Op.SEND_B) else dst


def _needs(a: Action, last: int) -> list[tuple[Op, int, int]]:
    """The actions (any one of them) that must come before `a` on its rank."""
    i, k = a.microbatch, a.stage
    if a.op is Op.F:
        return [(Op.RECV_F, i, k)] if k > 0 else []
    if a.op in (Op.B, Op.I):
        return [(Op.RECV_B, i, k + 1)] if k < last else [(Op.F, i, k)]
    if a.op is Op.W:
        return [(Op.I, i, k)]
    if a.op is Op.SEND_F:
        return [(Op.F, i, k - 1)]
    if a.op is Op.SEND_B:
        return [(Op.B, i, k), (Op.I, i, k)]
    if a.op is Op.RECV_B:
        return [(Op.SEND_F, i, k)]
    return []


def _name(key: tuple[Op, int, int]) -> str:
    return str(Action(*key))


def _check_links(lists, p, name, ordered_pairs) -> None:
    sends, recvs = defaultdict(list), defaultdict(list)
    for actions in lists:
        for a in actions:
            if a.op in (Op.SEND_F, Op.SEND_B):
                sends[link(a, p)].append(a.microbatch)
            elif a.op in (Op.RECV_F, Op.RECV_B):
                recvs[link(a, p)].append(a.microbatch)
    for key in sorted(set(sends) | set(recvs)):
        if sends[key] != recvs[key]:
            src, dst, direction, k = key
            what = "activations into" if direction == "F" else "gradients out of"
            raise ScheduleError(f"{name}: rank {src} sends the {what} stage {k} for micro-batches "
                                f"{sends[key]}, but rank {dst} receives {recvs[key]}: a link's messages "
                                "are matched in order, so each would get another's data")
    if ordered_pairs:
        _check_pair_order(lists, p, name)


def _check_pair_order(lists, p, name) -> None:
    sent, received = defaultdict(list), defaultdict(list)
    for actions in lists:
        for a in actions:
            src, dst, direction, k = link(a, p) if a.op not in COMPUTE else (None,) * 4
            if a.op in (Op.SEND_F, Op.SEND_B):
                sent[(src, dst)].append((direction, k, a.microbatch))
            elif a.op in (Op.RECV_F, Op.RECV_B):
                received[(src, dst)].append((direction, k, a.microbatch))
    for pair, order in sent.items():
        if order != received[pair]:
            raise ScheduleError(f"{name}: rank {pair[1]} receives rank {pair[0]}'s messages in another order "
                                "than they are sent, which NCCL (it ignores p2p tags) cannot match; use "
                                "gloo or another schedule")


def _run(lists, p, v, name, first_step) -> None:
    """Run the lists as the executor does (see the module docstring, 3.)."""
    last = p * v - 1
    pc = [0] * p
    issued: set[tuple[str, int, int]] = set()  # (direction, stage, micro-batch) sent
    posted: set[tuple[str, int, int]] = set()  # receives posted
    last_send: dict[tuple[str, int], tuple[str, int, int]] = {}  # link → its last message
    while any(pc[r] < len(lists[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pc[r] < len(lists[r]):
                a = lists[r][pc[r]]
                if _blocker(a, r, p, last, first_step, issued, posted, last_send) is not None:
                    break
                if a.op in (Op.SEND_F, Op.SEND_B):
                    _, _, direction, k = link(a, p)
                    issued.add((direction, k, a.microbatch))
                    last_send[(direction, k)] = (direction, k, a.microbatch)
                elif a.op in (Op.RECV_F, Op.RECV_B):
                    _, _, direction, k = link(a, p)
                    posted.add((direction, k, a.microbatch))
                pc[r] += 1
                moved = True
        if not moved:
            waits = []
            for r in range(p):
                if pc[r] < len(lists[r]):
                    a = lists[r][pc[r]]
                    peer, what = _blocker(a, r, p, last, first_step, issued, posted, last_send)
                    waits.append(f"rank {r} at action {pc[r]} {a} waits for rank {peer} to {what}")
            raise ScheduleError(f"{name} would hang{' in its first step' if first_step else ''}: "
                                + "; ".join(waits))


def _blocker(a, r, p, last, first_step, issued, posted, last_send):
    """None if action `a` of rank r can run now; else (the rank it waits for, what for)."""
    i, k = a.microbatch, a.stage
    if a.op in (Op.SEND_F, Op.SEND_B):
        _, dst, direction, k = link(a, p)
        previous = last_send.get((direction, k))
        if previous is not None and previous not in posted:
            return dst, f"receive the previous message on this link ({_message(previous)})"
        return None
    if a.op is Op.RECV_F and first_step and ("F", k, i) not in issued:
        return rank_of(k - 1, p), f"send the activation of micro-batch {i} into stage {k} (its shape header)"
    if a.op is Op.F and k > 0 and ("F", k, i) not in issued:
        return rank_of(k - 1, p), f"send the activation of micro-batch {i} into stage {k}"
    if a.op in (Op.B, Op.I) and k < last and ("B", k + 1, i) not in issued:
        return rank_of(k + 1, p), f"send the gradient of micro-batch {i} out of stage {k + 1}"
    return None


def _message(key: tuple[str, int, int]) -> str:
    direction, k, i = key
    return f"{'activation into' if direction == 'F' else 'gradient out of'} stage {k}, micro-batch {i}"


def replay(lists: list[list[Action]], p: int, costs: Mapping[Op, float] = COSTS, *,
           duration: Callable[[int, int], float] | None = None) -> list[Timed]:
    """Each rank's compute actions in its order, each starting when its rank is free and its
    input exists (the activation from the stage before, the gradient from the stage after; W its
    own I), communication taking no time; each takes its op's cost, or `duration(rank, index)`.
    The lists must have passed `check`'s first checks."""
    orders = [[a for a in actions if a.op in COMPUTE] for actions in lists]
    last = max(a.stage for order in orders for a in order)
    end: dict[tuple[Op, int, int], Fraction] = {}
    free, pc, out = [Fraction(0)] * p, [0] * p, []
    while any(pc[r] < len(orders[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pc[r] < len(orders[r]):
                a = orders[r][pc[r]]
                deps = _inputs(a, last)
                if any(d not in end for d in deps):
                    break
                start = max([free[r], *(end[d] for d in deps)])
                free[r] = start + (Fraction(costs[a.op]) if duration is None else duration(r, pc[r]))
                end[(_done(a.op), a.microbatch, a.stage)] = free[r]
                out.append(Timed(r, pc[r], a, start, free[r]))
                pc[r] += 1
                moved = True
        if not moved:
            stuck = {r: str(orders[r][pc[r]]) for r in range(p) if pc[r] < len(orders[r])}
            raise ScheduleError(f"the compute order deadlocks: ranks wait at {stuck}")
    return out


def _done(op: Op) -> Op:
    """What an action makes available: B and I both make the input's gradient."""
    return Op.I if op is Op.B else op


def _inputs(a: Action, last: int) -> list[tuple[Op, int, int]]:
    i, k = a.microbatch, a.stage
    if a.op is Op.F:
        return [(Op.F, i, k - 1)] if k > 0 else []
    if a.op is Op.W:
        return [(Op.I, i, k)]
    return [(Op.F, i, k)] + ([(Op.I, i, k + 1)] if k < last else [])


def idle_fraction(timed: list[Timed], p: int) -> Fraction:
    """Share of rank-time not computing, from the first start to the last end."""
    span = max(t.end for t in timed) - min(t.start for t in timed)
    return 1 - sum(t.end - t.start for t in timed) / (p * span)


def peak_alive(lists: list[list[Action]]) -> list[int]:
    """Per rank, the most (micro-batch, stage) pairs whose forward has run and whose weight
    gradient has not (B, or W): the activations it holds at its peak, in chunks."""
    peaks = []
    for actions in lists:
        alive: set[tuple[int, int]] = set()
        most = 0
        for a in actions:
            if a.op is Op.F:
                alive.add((a.microbatch, a.stage))
            elif a.op in (Op.B, Op.W):
                alive.discard((a.microbatch, a.stage))
            most = max(most, len(alive))
        peaks.append(most)
    return peaks


def bubble_slots(lists: list[list[Action]], p: int) -> Fraction:
    """A rank's idle time on uniform stages, in slots of one whole stage's forward and backward
    (1F1B and GPipe: p - 1; interleaved: (p - 1) / v; ZB-H1: (p - 1) / 3, for m >= p)."""
    timed = replay(lists, p)
    span = max(t.end for t in timed) - min(t.start for t in timed)
    busy = sum(t.end - t.start for t in timed) / p
    v = len({t.action.stage for t in timed}) // p  # chunks per rank: a stage's slot is v chunks' F + B
    return (span - busy) / (v * (COSTS[Op.F] + COSTS[Op.B]))
