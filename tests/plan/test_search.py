"""plan/search.py: the candidates it weighs and the ranking it returns."""

import dataclasses
import itertools

import pytest
import torch

import paratrain as pt
from paratrain.errors import ParatrainError
from paratrain.plan.cluster.presets import preset
from paratrain.plan.model.probe import model_facts
from paratrain.plan.model.source import from_config
from paratrain.plan.recommend import timed_rows
from paratrain.plan.search import candidates, describe_search, search


@pytest.fixture(scope="module")
def gpt():
    config = dict(model_type="gpt2", n_layer=4, n_embd=256, n_head=4, n_positions=64, vocab_size=512)
    source = from_config("gpt", config)
    return source, model_facts(source, 32, seq=64, precision="bf16"), dataclasses.replace(preset("h100-8x"),
                                                                                           host_link=None)


def test_the_candidates_cover_every_dimension_and_only_shapes_that_divide(gpt):
    source, facts, cluster = gpt
    found = list(candidates(source, facts, cluster, gpus=16, nodes=2))
    meshes = [s for s, _ in found if isinstance(s, pt.Mesh)]
    assert {m.tp for m in meshes} == {1, 2, 4, 8} and {m.cp for m in meshes} == {1, 2, 4, 8}
    piped = [m.pp for m in meshes if m.pp is not None]
    assert {p.stages for p in piped} == {2, 4} and {p.virtual for p in piped} == {1, 2}
    assert {p.schedule for p in piped} == {"1f1b", "interleaved-1f1b", "zb-h1"}
    assert all(m.cp == 1 for m in meshes if m.pp is not None)  # Mesh refuses cp with pp
    assert {k for _, k in found} == {1, 2, 4, 8}
    for strategy, k in found:
        tp, cp = (strategy.tp, strategy.cp) if isinstance(strategy, pt.Mesh) else (1, 1)
        stages = strategy.pp.stages if isinstance(strategy, pt.Mesh) and strategy.pp is not None else 1
        replicas = 16 // (tp * cp * stages)
        assert 16 % (tp * cp * stages) == 0 and facts.batch % (replicas * k) == 0


def test_the_ranking_is_the_fastest_fitting_rows_each_as_the_planner_times_it(gpt):
    source, facts, cluster = gpt
    rows = search(source, facts, cluster, gpus=16, optimizer="adam", top=4)
    assert len(rows) == 4 and all(r["fits"] for r in rows)
    speeds = [r["per_device_per_second"] for r in rows]
    assert speeds == sorted(speeds, reverse=True)
    # nothing among the candidates that fits is faster than the first
    best = speeds[0]
    for strategy, k in list(candidates(source, facts, cluster, gpus=16, nodes=2))[::7]:
        row = timed_rows(source, facts, facts.step, cluster, [strategy], gpus=16, nodes=2, optimizer="adam",
                         accumulate=k)[0]
        if "error" not in row and row["fits"]:
            assert row["per_device_per_second"] <= best * (1 + 1e-9)
    text = describe_search(rows, gpus=16, cluster=cluster, per="token")
    assert rows[0]["session"] in text and text.count("pt.Session(") == 4


def test_a_pipeline_whose_replicas_shard_the_optimizer_fits_where_averaging_replicas_do_not(gpt):
    source, facts, cluster = gpt
    pipe = pt.Pipeline(stages=2, microbatches=4)
    assert pt.Mesh(dp="zero1", pp=pipe) in [s for s, _ in candidates(source, facts, cluster, gpus=16, nodes=2)]
    ddp, zero1 = (timed_rows(source, facts, facts.step, cluster, [pt.Mesh(dp=dp, pp=pipe)], gpus=16, nodes=2,
                             optimizer="adam", accumulate=1)[0] for dp in ("ddp", "zero1"))
    assert zero1["label"] == "pipeline 2x4 x zero1" and "dp='zero1', pp=pt.Pipeline(stages=2" in zero1["session"]
    replicas = 16 // 2
    assert zero1["optimizer"] < ddp["optimizer"] / replicas * 1.01  # each replica's slice, padded
    assert zero1["params"] >= ddp["params"] and zero1["device_peak"] < ddp["device_peak"]
    # the same step, then the stage's parameters gathered back over its replicas
    assert zero1["exposed_comm_seconds"] > ddp["exposed_comm_seconds"]
    assert zero1["compute_seconds"] == ddp["compute_seconds"]
    small = dataclasses.replace(cluster, device_memory=(zero1["device_peak"] + ddp["device_peak"]) // 2)
    fits = {r["session"]: r["fits"] for r in timed_rows(source, facts, facts.step, small, [pt.Mesh(dp=dp, pp=pipe)
                                                                                          for dp in ("ddp", "zero1")],
                                                        gpus=16, nodes=2, optimizer="adam", accumulate=1)}
    assert list(fits.values()) == [False, True]


def test_zero_bubble_is_timed_faster_than_1f1b_with_as_many_microbatches_alive(gpt):
    """ZB-H1 (Qi et al. 2023): a third of 1F1B's idle slots; at most p micro-batches alive on a
    stage, as on 1F1B's first, but on every stage (1F1B's stage s holds p − s), so the fullest
    rank's activations may grow."""
    source, facts, cluster = gpt
    rows = {schedule: timed_rows(source, facts, facts.step, cluster,
                                 [pt.Mesh(pp=pt.Pipeline(stages=4, microbatches=8, schedule=schedule))],
                                 gpus=16, nodes=2, optimizer="adam", accumulate=1)[0] for schedule in ("1f1b", "zb-h1")}
    one, zb = rows["1f1b"], rows["zb-h1"]
    assert zb["bubble_seconds"] == pytest.approx(one["bubble_seconds"] / 3)
    assert zb["step_seconds"] < one["step_seconds"] and zb["activations"] >= one["activations"]
    assert "schedule='zb-h1'" in zb["session"]


def test_a_device_too_small_for_every_candidate_finds_nothing(gpt):
    source, facts, cluster = gpt
    tiny = dataclasses.replace(cluster, device_memory=1024)
    assert search(source, facts, tiny, gpus=4, optimizer="adam") == []
    assert "no configuration fits" in describe_search([], gpus=4, cluster=tiny, per="token")


def test_the_ranking_is_every_candidate_timed_alone_with_nothing_reused(gpt):
    """The search makes each layout once (layouts.reused); its ranking is that of every candidate
    timed on its own, with nothing reused."""
    from paratrain.plan.cost import layouts

    source, facts, cluster = gpt
    rows = search(source, facts, cluster, gpus=16, optimizer="adam", top=3)
    assert layouts._reused is None  # the cache lasts only as long as the search
    alone = []
    for (strategy, k), step in itertools.product(candidates(source, facts, cluster, gpus=16, nodes=2),
                                                 (facts.step, facts.checkpointed)):
        try:
            row = timed_rows(source, facts, step, cluster, [strategy], gpus=16, nodes=2, optimizer="adam",
                             accumulate=k)[0]
        except ParatrainError:
            continue
        if "error" not in row and row["fits"]:
            alone.append(row)
    alone.sort(key=lambda row: -row["per_device_per_second"])
    assert rows == alone[:3]


def test_reused_layouts_are_made_once_per_model_strategy_and_world(gpt):
    from paratrain.plan.cost import layouts

    model = gpt[0].build()
    held = layouts.trainable(model)
    with layouts.reused():
        first = layouts.zero3_flats(model, pt.ZeRO(stage=3), {p: 0 for p in held})
        assert layouts.zero3_flats(model, pt.ZeRO(stage=3), {p: 0 for p in held}) is first
        assert layouts.zero3_flats(model, pt.ZeRO(stage=3, prefetch=False), {p: 0 for p in held}) is not first
        assert layouts.trainable(model) is layouts.trainable(model)
    assert layouts.zero3_flats(model, pt.ZeRO(stage=3), {p: 0 for p in held}) is not first  # made again
    assert layouts.zero3_flats(model, pt.ZeRO(stage=3), {p: 0 for p in held}) == first


def test_under_bf16_the_search_tries_zero_with_param_dtype_whose_weights_are_not_copied(gpt):
    """Under autocast, ZeRO at every stage also with param_dtype bf16 (with and without tp): no
    weight copies, and a Session line that builds that strategy; in fp32 no such candidate."""
    source, facts, cluster = gpt
    lowered = [(s, k) for s, k in candidates(source, facts, cluster, gpus=16, nodes=2)
               if getattr(s.data_parallel() if isinstance(s, pt.Mesh) else s, "param_dtype", None) == torch.bfloat16]
    assert {(s.data_parallel() if isinstance(s, pt.Mesh) else s).stage for s, _ in lowered} == {1, 2, 3}
    assert any(isinstance(s, pt.Mesh) and s.tp > 1 for s, _ in lowered)
    plain, low = (timed_rows(source, facts, facts.step, cluster, [s], gpus=16, nodes=2, optimizer="adam",
                             accumulate=1)[0]
                  for s in (pt.ZeRO(stage=3), pt.ZeRO(stage=3, param_dtype=torch.bfloat16)))
    assert plain["weight_copies"] > 0 and low["weight_copies"] == 0 and low["device_peak"] < plain["device_peak"]
    assert low["label"] == "zero3+bf16"
    call = low["session"].removeprefix("pt.Session(").split(", precision=")[0]
    assert call == "pt.ZeRO(stage=3, param_dtype=torch.bfloat16)"
    assert eval(call, {"pt": pt, "torch": torch}) == pt.ZeRO(stage=3, param_dtype=torch.bfloat16)
    fp32 = model_facts(source, 32, seq=64)
    assert not any(isinstance(s, pt.ZeRO) and s.param_dtype is not None
                   for s, _ in candidates(source, fp32, cluster, gpus=16, nodes=2))
