"""Pipeline schedules: in which order one stage runs the forwards and backwards of m micro-batches.

A schedule is a plain function `schedule(stage, m)` run by every stage of the pipeline at once;
the order of its calls to `stage.forward_one` / `stage.backward_one` is the schedule, and the p2p
moves between them (`stage.links`, p2p.py) carry activations forward and gradients back. At the
ends of the pipeline the moves do nothing, so the same lines serve every stage.

With p uniform stages both schedules below leave each stage idle (p-1)/(m+p-1) of the step, the
"pipeline bubble"; they differ in memory: GPipe holds all m micro-batches' activations at its
peak, 1F1B at most p (Narayanan et al. 2021, section 2.2.1). Gradients are the same: every
micro-batch's backward runs exactly once before the step ends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paratrain.parallel.pipeline.stage import PipelineStage


def gpipe(stage: "PipelineStage", m: int) -> None:
    """GPipe (Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using
    Pipeline Parallelism"), the fill-drain schedule; torch's ScheduleGPipe runs the same order.

    Phase 1, all forward: micro-batches 0 … m-1 in order; each waits for its activation from the
    previous stage, runs, and sends its output on without waiting. Stage s starts after s slots.
    Phase 2, all backward: micro-batches 0 … m-1 in order; each waits for its output's gradient
    from the next stage (the last stage starts from its loss), runs, and sends its input's
    gradient back. All m micro-batches' activations are alive at the end of phase 1.
    """
    links = stage.links
    for i in range(m):
        links.send_forward(stage.forward_one(i, links.recv_forward()))
    for i in range(m):
        links.send_backward(stage.backward_one(i, links.recv_backward()))


def one_f_one_b(stage: "PipelineStage", m: int) -> None:
    """1F1B, "one forward, one backward" (PipeDream-Flush: Narayanan et al. 2021, "Memory-Efficient
    Pipeline-Parallel DNN Training"; the order of Megatron-LM's
    forward_backward_pipelining_without_interleaving). Stage s of p, with w = min(p-1-s, m):

    Phase 1, warm-up: forwards of micro-batches 0 … w-1, as in GPipe.
    Phase 2, steady state, for i = w … m-1: forward micro-batch i, send its output while receiving
    the gradient of micro-batch i-w, backward i-w, send its input's gradient while receiving the
    activation of micro-batch i+1. At most w+1 ≤ p micro-batches are alive at any time.
    Phase 3, cool-down: backwards of the last w micro-batches, m-w … m-1.

    The last stage has no warm-up: it alternates forward and backward from the start. With
    m < p the warm-up is cut to m and the steady state is empty: GPipe's order.
    """
    links = stage.links
    warmup = min(stage.stages - 1 - stage.stage, m)
    for i in range(warmup):
        links.send_forward(stage.forward_one(i, links.recv_forward()))
    x = links.recv_forward() if warmup < m else None
    for i in range(warmup, m):
        g = links.send_forward_recv_backward(stage.forward_one(i, x))
        dx = stage.backward_one(i - warmup, g)
        if i + 1 < m:
            x = links.send_backward_recv_forward(dx)
        else:
            links.send_backward(dx)
    for i in range(m - warmup, m):
        links.send_backward(stage.backward_one(i, links.recv_backward()))


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}
