"""What the planner reads off a pipeline schedule: the idle slots of a rank (step_time.pipeline's
bubble) and the micro-batches each rank holds activations for at its peak (memory.py).

Both come from replaying the schedule's checked action lists (pipeline/check.py), which takes
seconds at p = 64 stages and m = 512 micro-batches, so a plan that weighs many pipelines (a
search) would spend its time there. GPipe and 1F1B have closed forms, equal to the replay for
every p and m (tests/plan/cost/test_schedule_figures.py): p − 1 idle slots; GPipe holds all m
micro-batches on every stage, 1F1B min(m, p − s) on stage s (Narayanan et al., SC 2021, §2.2).
Other schedules are replayed, once per shape.
"""

from __future__ import annotations

import functools

from paratrain.parallel.pipeline import Pipeline
from paratrain.parallel.pipeline.check import bubble_slots, peak_alive


def figures(pipeline: Pipeline) -> tuple[float, tuple[int, ...]]:
    """(idle slots of a rank, each rank's peak live (micro-batch, chunk) pairs) for `pipeline`."""
    return _figures(pipeline.schedule, pipeline.stages, pipeline.virtual, pipeline.microbatches)


@functools.lru_cache(maxsize=256)
def _figures(schedule: str, p: int, v: int, m: int) -> tuple[float, tuple[int, ...]]:
    if schedule == "gpipe":
        return float(p - 1), (m,) * p
    if schedule == "1f1b":
        return float(p - 1), tuple(min(m, p - s) for s in range(p))
    lists = Pipeline(stages=p, virtual=v, microbatches=m, schedule=schedule).action_lists()
    return float(bubble_slots(lists, p)), tuple(peak_alive(lists))
