"""Draw what GPipe, 1F1B, interleaved 1F1B and ZB-H1 did: a pipeline on 4 real ranks, 8 micro-batches.

    python examples/pipeline_timeline.py [--out docs/pipeline_timeline.png] [--measured]

Each rank trains a step of an 8-block MLP with each schedule and records an event per forward,
backward, input-gradient and weight-gradient action it ran (paratrain/parallel/pipeline/
timeline.py). The picture shows those recorded per-rank orders re-timed on uniform stages
(forward 1, backward 2, each half of a split backward 1: `replay`), where each bubble is the
schedule's own: (p-1)/(m+p-1) = 3/11 for GPipe and 1F1B, (p-1)/(v·m+p-1) = 3/19 for interleaved
1F1B with 2 chunks per rank (hatched: the second chunk), (p-1)/(3m+p-1) = 3/27 for ZB-H1, whose
deferred weight gradients fill the cool-down. 1F1B's early backwards keep at most 4 micro-batches
alive instead of GPipe's 8. `--measured` draws the recorded wall-clock times instead (on a
machine with fewer cores than ranks they mostly show the operating system's scheduling).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.parallel.pipeline import Pipeline, draw, idle_fraction, peak_in_flight, replay
from paratrain.parallel.pipeline.schedules import SCHEDULES
from paratrain.testing import run_on_ranks

STAGES, MICROBATCHES, BATCH = 4, 8, 64


SHOWN = (("GPipe", "gpipe", 1), ("1F1B", "1f1b", 1), ("interleaved 1F1B", "interleaved-1f1b", 2), ("ZB-H1", "zb-h1", 1))


def _events(topo, schedule: str, virtual: int):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(2 * STAGES)])
    strategy = Pipeline(stages=STAGES, schedule=schedule, microbatches=MICROBATCHES, virtual=virtual)
    stage, _ = strategy.setup(model, None, strategy.grid(topo))
    x, y = torch.randn(BATCH, 256), torch.randn(BATCH, 256)
    for _ in range(2):  # the second step is the one drawn: no first-call costs in it
        stage.forward_backward(x, y, F.mse_loss, 1.0)
    return stage.gather_events()


def _all(topo):
    return {name: (_events(topo, schedule, virtual), schedule, virtual) for name, schedule, virtual in SHOWN}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs",
                                                      "pipeline_timeline.png"))
    parser.add_argument("--measured", action="store_true", help="draw wall-clock times, not replayed")
    args = parser.parse_args(argv)
    recorded = run_on_ranks(_all, STAGES, timeout=300)[0]
    panels = {}
    for name, (events, schedule, virtual) in recorded.items():
        shown = events if args.measured else replay(events)
        peak = max(peak_in_flight(events).values()) / virtual
        panels[f"{name}, {STAGES} ranks, {MICROBATCHES} micro-batches, at most {peak:g} stages' activations"] = shown
        theory = float(SCHEDULES[schedule].bubble(STAGES, virtual, MICROBATCHES))
        print(f"{name}: idle fraction {idle_fraction(shown):.3f} (theory {theory:.3f}), measured "
              f"{idle_fraction(events):.3f}; micro-batches alive per rank {peak_in_flight(events)}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    draw(panels, args.out, unit="seconds" if args.measured else "time (forward = 1, backward = 2, I = W = 1)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
