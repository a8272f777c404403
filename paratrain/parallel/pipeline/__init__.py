"""Pipeline parallelism across ranks: partition (cut an nn.Sequential), cut (cut any model at
named blocks) and adapters (known models), plan (which stage holds what), tied (weights shared
by stages), microbatches, p2p (activations and gradients between neighbours), stage (one rank's
stage and its step), actions (a schedule as data), schedules (GPipe, 1F1B, interleaved 1F1B,
ZB-H1), check (lists proved before they run), timeline (what ran when), strategy (`Pipeline`)."""

from paratrain.parallel.pipeline.actions import Action, Op, with_comm
from paratrain.parallel.pipeline.check import ScheduleError
from paratrain.parallel.pipeline.cut import Cut
from paratrain.parallel.pipeline.partition import boundaries, layer_costs, split_model
from paratrain.parallel.pipeline.schedules import SCHEDULES, gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from paratrain.parallel.pipeline.stage import PipelineStage
from paratrain.parallel.pipeline.strategy import Pipeline, stage_optimizer
from paratrain.parallel.pipeline.timeline import Event, Kind, draw, idle_fraction, peak_in_flight, replay

__all__ = ["Pipeline", "PipelineStage", "Cut", "SCHEDULES", "gpipe", "one_f_one_b", "interleaved_1f1b", "zb_h1",
           "Action", "Op", "with_comm", "ScheduleError", "split_model",
           "layer_costs", "boundaries", "stage_optimizer", "Event", "Kind", "idle_fraction",
           "peak_in_flight", "replay", "draw"]
