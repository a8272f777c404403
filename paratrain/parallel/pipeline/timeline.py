"""What a pipeline schedule did: one event per compute action (F, B, I or W, actions.py) of one
micro-batch on one chunk of one pipeline rank.

Every `PipelineStage` records, for each micro-batch it computes, when the computation started and
ended (`time.perf_counter`, the same CLOCK_MONOTONIC in every process of one machine; across
machines the clocks are only as close as their synchronisation) and how many micro-batches' worth
of activations the stage held afterwards. From these events:

- `idle_fraction(events)`: the bubble, 1 - busy / (stages × makespan), from the recorded times;
- `replay(events)`: the same per-rank order of actions, re-timed as if every forward took 1 unit
  and every backward 2 (I and W 1 each) on every stage, each action starting when its rank is free
  and its input has arrived (check.replay); with v chunks per rank each costs 1/v. This gives the bubble of the *schedule* on uniform
  stages, free of the noise of a shared machine, and it fails if the recorded order could
  deadlock. `replay(events, measured=True)` keeps each
  action's recorded duration: the fastest run of the recorded order with those durations, so its
  bubble is a lower bound of the recorded one;
- `peak_in_flight(events)`: per stage, the most micro-batches whose activations were alive;
- `draw(events, path)`: a timeline picture (PNG), one row per stage, as in the GPipe paper's
  Figure 2 (Huang et al. 2019) and PipeDream-flush's (Narayanan et al. 2021, Figure 4).

The theory these are checked against (Narayanan et al. 2021, "Efficient Large-Scale Language
Model Training on GPU Clusters", section 2.2.1): with p uniform stages and m micro-batches, GPipe
and 1F1B both leave each stage idle for (p-1) forward+backward slots out of m+p-1, an idle fraction
of (p-1)/(m+p-1); GPipe holds the activations of all m micro-batches at once, 1F1B at most p.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from paratrain.parallel.pipeline.actions import Action, Op
from paratrain.parallel.pipeline.check import replay as replay_lists


class Kind(str, enum.Enum):
    """Which half of a micro-batch's work an event is."""

    FORWARD = "F"
    BACKWARD = "B"
    INPUT = "I"  # the input-gradient half of a split backward
    WEIGHT = "W"  # the weight-gradient half


@dataclass(frozen=True)
class Event:
    """One stage computing one micro-batch's forward or backward."""

    stage: int  # pipeline rank, 0 … stages-1
    kind: Kind  # forward, backward, or one half of a split backward
    microbatch: int  # index of the micro-batch inside the step
    start: float  # seconds (perf_counter) when the computation began (after its input arrived)
    end: float  # seconds when it finished (before its output was sent)
    in_flight: int  # micro-batches (of one chunk each) whose activations this rank holds after it
    chunk: int = 0  # which of the rank's chunks: virtual stage chunk · stages + stage


COLOURS = {Kind.FORWARD: "#9ecae1", Kind.BACKWARD: "#3182bd", Kind.INPUT: "#6baed6", Kind.WEIGHT: "#08519c"}


def by_stage(events: Sequence[Event]) -> dict[int, list[Event]]:
    """Events grouped per stage, each list in the order the stage ran them."""
    out: dict[int, list[Event]] = {}
    for e in sorted(events, key=lambda e: (e.stage, e.start)):
        out.setdefault(e.stage, []).append(e)
    return out


def idle_fraction(events: Sequence[Event]) -> float:
    """Share of stage-time spent not computing, between the first start and the last end."""
    stages = by_stage(events)
    start, end = min(e.start for e in events), max(e.end for e in events)
    busy = sum(e.end - e.start for e in events)
    return 1.0 - busy / (len(stages) * (end - start))


def peak_in_flight(events: Sequence[Event]) -> dict[int, int]:
    """Per stage, the most micro-batches whose activations it held at once."""
    return {s: max(e.in_flight for e in evs) for s, evs in by_stage(events).items()}


def replay(events: Sequence[Event], forward_cost: float = 1.0, backward_cost: float = 2.0, *,
           measured: bool = False) -> list[Event]:
    """The recorded per-rank order, re-timed on uniform stages, or with `measured` each action
    taking its recorded duration (see the module docstring). Raises if no action can run, which
    means the recorded orders deadlock."""
    ranks = by_stage(events)
    p = len(ranks)
    lists = [[Action(Op(e.kind.value), e.microbatch, e.chunk * p + e.stage) for e in ranks[s]] for s in sorted(ranks)]
    v = len({e.chunk for e in events})  # a chunk is 1/v of a rank's stage: its work costs 1/v
    costs = {Op.F: forward_cost / v, Op.B: backward_cost / v, Op.I: backward_cost / 2 / v, Op.W: backward_cost / 2 / v}
    duration = (lambda r, j: ranks[r][j].end - ranks[r][j].start) if measured else None
    timed = replay_lists(lists, p, costs, duration=duration)
    return [replace(ranks[t.rank][t.index], start=float(t.start), end=float(t.end)) for t in timed]


def draw(panels: Mapping[str, Sequence[Event]], path: str, *, unit: str = "seconds") -> None:
    """Save a timeline picture (PNG): one panel per entry of `panels` (title → events), one row
    per stage, a box per forward (light) and backward (dark) labelled with its micro-batch; the
    white gaps are the bubble. `unit` labels the time axis ("seconds" for recorded events)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: training machines have no display
    import matplotlib.pyplot as plt

    rows = max(len(by_stage(evs)) for evs in panels.values())
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, len(panels) * (0.45 * rows + 1.1)),
                             squeeze=False)
    for ax, (title, evs) in zip(axes[:, 0], panels.items()):
        _draw_panel(ax, evs, f"{title}: idle fraction {idle_fraction(evs):.2f}")
    axes[-1, 0].set_xlabel(unit)
    from matplotlib.patches import Patch

    names = {Kind.FORWARD: "forward", Kind.BACKWARD: "backward", Kind.INPUT: "input grad", Kind.WEIGHT: "weight grad"}
    shown = {e.kind for evs in panels.values() for e in evs}
    axes[0, 0].legend(handles=[Patch(color=COLOURS[k], label=n) for k, n in names.items() if k in shown],
                      loc="upper left", bbox_to_anchor=(0.3, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw_panel(ax, events: Sequence[Event], title: str) -> None:
    stages = by_stage(events)
    origin = min(e.start for e in events)
    for s, evs in stages.items():
        for e in evs:
            light = e.kind is Kind.FORWARD
            ax.barh(s, e.end - e.start, left=e.start - origin, color=COLOURS[e.kind], edgecolor="black", lw=0.5,
                    hatch="//" if e.chunk % 2 else None)
            ax.text((e.start + e.end) / 2 - origin, s, str(e.microbatch), ha="center", va="center",
                    fontsize=7, color="black" if light else "white")
    ax.set_yticks(list(stages), [f"rank {s}" for s in stages])
    ax.invert_yaxis()
    ax.set_title(title, fontsize=10)
