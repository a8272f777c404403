"""Draw what GPipe and 1F1B did: a 4-stage pipeline on 4 real ranks, 8 micro-batches.

    python examples/pipeline_timeline.py [--out docs/pipeline_timeline.png] [--measured]

Each rank trains one step of a 4-stage MLP with each schedule and records an event per forward
and backward it ran (paratrain/parallel/pipeline/timeline.py). The picture shows those recorded
per-stage orders re-timed on uniform stages (forward 1, backward 2: `replay`), where the bubble
is the schedule's own, (p-1)/(m+p-1) = 3/11 for both, and 1F1B's early backwards are what keep at
most 4 micro-batches alive instead of 8. `--measured` draws the recorded wall-clock times instead
(on a machine with fewer cores than ranks they mostly show the operating system's scheduling).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.parallel.pipeline import Pipeline, draw, idle_fraction, peak_in_flight, replay
from paratrain.testing import run_on_ranks

STAGES, MICROBATCHES, BATCH = 4, 8, 64


def _events(topo, schedule: str):
    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(STAGES) for layer in (nn.Linear(256, 256), nn.Tanh())])
    strategy = Pipeline(stages=STAGES, schedule=schedule, microbatches=MICROBATCHES)
    stage = strategy.wrap(model, topo)
    x, y = torch.randn(BATCH, 256), torch.randn(BATCH, 256)
    for _ in range(2):  # the second step is the one drawn: no first-call costs in it
        strategy.forward_backward(stage, x, y, F.mse_loss, 1.0)
    return stage.gather_events()


def _both(topo):
    return {name: _events(topo, schedule) for name, schedule in (("GPipe", "gpipe"), ("1F1B", "1f1b"))}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs",
                                                      "pipeline_timeline.png"))
    parser.add_argument("--measured", action="store_true", help="draw wall-clock times, not replayed")
    args = parser.parse_args(argv)
    recorded = run_on_ranks(_both, STAGES, timeout=300)[0]
    panels = {}
    for name, events in recorded.items():
        shown = events if args.measured else replay(events)
        peak = max(peak_in_flight(events).values())
        panels[f"{name}, {STAGES} stages, {MICROBATCHES} micro-batches, at most {peak} alive"] = shown
        print(f"{name}: idle fraction {idle_fraction(shown):.3f} "
              f"(theory {(STAGES - 1) / (MICROBATCHES + STAGES - 1):.3f}), measured "
              f"{idle_fraction(events):.3f}; micro-batches alive per stage {peak_in_flight(events)}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    draw(panels, args.out, unit="seconds" if args.measured else "time (forward = 1, backward = 2)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
