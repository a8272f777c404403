"""plan/cost/schedule_figures.py: the closed forms the planner uses for GPipe and 1F1B are what
replaying their checked action lists gives, and other schedules are replayed."""

import pytest

import paratrain as pt
from paratrain.parallel.pipeline.check import bubble_slots, peak_alive
from paratrain.plan.cost.schedule_figures import figures


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_closed_forms_equal_the_replay_for_every_small_shape(schedule):
    for p in range(1, 7):
        for m in range(1, 13):
            pipe = pt.Pipeline(stages=p, microbatches=m, schedule=schedule)
            lists = pipe.action_lists()
            assert figures(pipe) == (float(bubble_slots(lists, p)), tuple(peak_alive(lists))), (p, m)


def test_other_schedules_are_replayed():
    pipe = pt.Pipeline(stages=4, virtual=2, microbatches=8, schedule="interleaved-1f1b")
    lists = pipe.action_lists()
    assert figures(pipe) == (float(bubble_slots(lists, 4)), tuple(peak_alive(lists)))
    assert figures(pipe)[0] == pytest.approx(3 / 2)  # (p - 1) / v
