"""A pipeline schedule as data: for each rank of the pipeline, the list of actions it runs in one
step (torch.distributed.pipelining's `_Action` lists, Megatron's schedule tables).

The model is cut into p·v *virtual stages* (v = 1 unless the schedule interleaves); rank r of
the pipeline holds the chunks r, r+p, r+2p, … (Narayanan et al. 2021, section 2.2: chunk c of
rank r is virtual stage c·p + r). An activation leaves virtual stage k for k+1 on rank
(r+1) mod p, so the last rank sends back round to the first between chunks.

Compute actions, each on one micro-batch of one virtual stage:

    F   forward; keeps what backward needs
    B   backward, input and weight gradients at once
    I   backward for the input gradient only (zero-bubble: Qi et al. 2023, "Zero Bubble Pipeline
        Parallelism", section 2: B split into B and W)
    W   backward for the weight gradients, deferred to fill the bubble

Communication actions, each carrying one micro-batch across one boundary:

    SEND_F / RECV_F   the output of stage k-1 to stage k (named by the receiving stage k)
    SEND_B / RECV_B   the gradient of that output back (named by the sending stage k)

[Note: what an action does when it runs]
The executor (stage.py) and the checker (check.py) read the lists the same way:
- SEND starts an asynchronous send. First it waits until the previous message on its link has
  been received (its receive was posted): a rank holds one message per link.
- RECV posts a receive and goes on. Only the first RECV_F of a new input shape waits, for the
  shape header that travels ahead of the activation (p2p.py).
- F, B and I wait for the receive of their input (F: the activation; B, I: the gradient), which
  completes once the matching send has started. W waits for nothing.
Each link (one boundary, one direction) carries its messages in order, under a tag of its own,
so two links between the same two ranks (p = 2, or the wrap-around) never take each other's.

`with_comm` turns a schedule's compute order into the full lists by one rule, the same for every
schedule: each send right after the compute that produced it; each activation received right
before the forward that needs it; each gradient receive posted one ahead (the first once its
activation has gone, each next one when the previous gradient is about to be used). A schedule is
therefore only its compute order (schedules.py), and hand-written lists go through the same check.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Op(str, enum.Enum):
    F = "F"
    B = "B"
    I = "I"  # noqa: E741 (the zero-bubble paper's name)
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"


COMPUTE = (Op.F, Op.B, Op.I, Op.W)


@dataclass(frozen=True)
class Action:
    """One thing one rank does: `op` on micro-batch `microbatch` of virtual stage `stage`."""

    op: Op
    microbatch: int
    stage: int  # virtual stage, 0 … p·v-1 (for a send or receive: the stage named in Op's note)

    def __str__(self) -> str:
        return f"{self.op.value}(micro-batch {self.microbatch}, stage {self.stage})"


def rank_of(stage: int, p: int) -> int:
    """The pipeline rank that holds virtual stage `stage`."""
    return stage % p


def link(action: Action, p: int) -> tuple[int, int, str, int]:
    """(sending rank, receiving rank, direction, boundary) of a send or receive: the boundary is
    the stage whose input it is (forward) or whose input's gradient it is (backward)."""
    k = action.stage
    if action.op in (Op.SEND_F, Op.RECV_F):
        return rank_of(k - 1, p), rank_of(k, p), "F", k
    return rank_of(k, p), rank_of(k - 1, p), "B", k


def tag(action: Action) -> int:
    """The p2p tag of the link a send or receive travels on (see [Note: what an action does])."""
    return 2 * action.stage + (action.op in (Op.SEND_B, Op.RECV_B))


def with_comm(orders: list[list[Action]], p: int, v: int) -> list[list[Action]]:
    """Each rank's compute order with its sends and receives put in (the rule in the module
    docstring). `orders[r]` holds only F, B, I and W actions."""
    return [_rank_with_comm(order, p * v - 1) for order in orders]


def _rank_with_comm(order: list[Action], last: int) -> list[Action]:
    actions: list[Action] = []
    queue: dict[int, list[int]] = {}  # stage → micro-batches whose gradient is not posted, in need order
    for a in order:
        if a.op in (Op.B, Op.I) and a.stage != last:
            queue.setdefault(a.stage, []).append(a.microbatch)
    sent: set[tuple[int, int]] = set()  # (micro-batch, stage) whose activation has gone
    ahead: dict[int, int] = {}  # stage → gradient receives posted and not used yet

    def post(k: int, i: int) -> None:
        queue[k].remove(i)
        ahead[k] = ahead.get(k, 0) + 1
        actions.append(Action(Op.RECV_B, i, k + 1))

    for a in order:
        k, i = a.stage, a.microbatch
        if a.op is Op.F:
            if k > 0:
                actions.append(Action(Op.RECV_F, i, k))
            actions.append(a)
            if k < last:
                actions.append(Action(Op.SEND_F, i, k + 1))
                sent.add((i, k))
                if not ahead.get(k) and queue.get(k) and queue[k][0] == i:
                    post(k, i)  # the first gradient, once its activation has gone
        elif a.op in (Op.B, Op.I):
            if k < last:
                if i in queue[k]:
                    post(k, i)
                ahead[k] -= 1
                if queue[k] and (queue[k][0], k) in sent and not ahead[k]:
                    post(k, queue[k][0])  # the next, ahead, while this one is used
            actions.append(a)
            if k > 0:
                actions.append(Action(Op.SEND_B, i, k))
        else:
            actions.append(a)
    return actions
