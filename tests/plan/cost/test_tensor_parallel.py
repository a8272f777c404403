"""`paratrain plan` with tensor parallelism (plan/cost/tensor_parallel.py): its rows, its step's parts,
and its recommendation where the layers fit nowhere else. (Its per-rank bytes are checked
against real runs in cost/test_memory.py.)"""

import dataclasses

import pytest

import paratrain as pt
from paratrain.plan.cluster.presets import preset
from paratrain.plan.cost import tensor_parallel
from paratrain.plan.model.probe import model_facts
from paratrain.plan.model.source import ModelSource, resolve
from paratrain.plan.recommend import plan_rows, predict_time, recommend
from tests.support.llama import Llama

MIB = 2**20


def wide() -> Llama:
    """Four blocks whose gathered ZeRO-3 units are most of what a rank holds."""
    return Llama(vocab=64, width=2048, layers=4, heads=16, kv_heads=16, hidden=8192)


@pytest.fixture(scope="module")
def planned():
    source = resolve("tests.plan.cost.test_tensor_parallel:wide")
    return source, model_facts(source, 8, seq=16), dataclasses.replace(preset("h100-8x"), host_link=None)


def test_each_width_and_data_parallel_strategy_is_a_row_with_its_session(planned):
    source, facts, cluster = planned
    rows = {r["label"]: r for r in plan_rows(source, facts, cluster, gpus=8, optimizer="adam")}
    for tp in (2, 4, 8):
        for dp in ("ddp", "zero1", "zero3"):
            assert rows[f"tp{tp} x {dp}"]["session"] == f"pt.Session(pt.Mesh(tp={tp}, dp={dp!r}))"
    # a rank holds the replicated parameters whole and 1/tp of the cut ones (fp32: 4 bytes each)
    model = source.shared
    cut = {n for n in tensor_parallel.cut_modules(model, pt.Mesh(tp=8))}
    cut_numel = sum(p.numel() for name, m in model.named_modules() if name in cut for p in m.parameters())
    whole = sum(p.numel() for p in model.parameters())
    assert rows["tp8 x ddp"]["params"] == 4 * (whole - cut_numel + cut_numel // 8)


def test_the_step_is_the_data_parallel_step_on_the_cut_model_plus_the_tp_all_reduces(planned):
    source, facts, cluster = planned
    mesh, step = pt.Mesh(tp=2, dp="zero1"), facts.step
    got = predict_time(source, mesh, step, cluster, gpus=8, nodes=1, facts=facts)
    cut = ModelSource(source.name, lambda: tensor_parallel.cut_copy(source.shared, mesh), source.default_seq)
    inner = predict_time(cut, pt.ZeRO(stage=1), step, cluster, gpus=4, nodes=1, facts=facts)
    all_reduces = tensor_parallel.tp_seconds(step.block_output_bytes, tp=2, dp=4, accumulate=1, recompute=False,
                                             cluster=cluster)
    assert all_reduces > 0 and len(step.block_output_bytes) == 4
    assert got.exposed_comm == pytest.approx(inner.exposed_comm + all_reduces)
    share = tensor_parallel.compute_fraction(2, step.block_flops, step.flops_forward)
    assert 0.5 < share < 0.6  # the blocks are most of the work: about half of it per rank
    assert got.compute == pytest.approx(inner.compute * share)


def test_a_model_whose_layers_fit_nowhere_else_is_recommended_tensor_parallel(planned):
    source, facts, cluster = planned
    rows = plan_rows(source, facts, cluster, gpus=8, optimizer="adam")
    plain = min(r["device_peak"] for r in rows if "error" not in r and r["strategy"] != "mesh")
    tp = min(r["device_peak"] for r in rows if "error" not in r and r["strategy"] == "mesh")
    assert tp < plain  # zero3 gathers whole layers; tp gathers (or holds) an eighth of them
    small = dataclasses.replace(cluster, device_memory=(tp + plain) // 2)
    best = recommend(plan_rows(source, facts, small, gpus=8, optimizer="adam"))
    assert best is not None and best["session"].startswith("pt.Session(pt.Mesh(tp=")


def test_sequence_parallelism_cuts_a_ranks_activations_to_one_tp_th_and_hybrid_sharding_shards_per_group(planned):
    """Korthikanti et al. 2022, Table 2: (10 + 24/t)/34 of a replica's activations per rank under
    tensor parallelism, 1/t with sequence parallelism as well (checkpointed or not)."""
    from paratrain.plan.cost.memory import predict

    source, _, _ = planned
    model, activations = source.shared, 34 * 2**20

    def held(**kwargs):
        return predict(model, pt.Mesh(tp=4, **kwargs), world=8, activation_bytes=activations)[0].activations

    assert held(sequence_parallel=True) / held() == pytest.approx((1 / 4) / ((10 + 24 / 4) / 34), rel=1e-6)
    assert tensor_parallel.activation_fraction(4, True, checkpointed=True) == 1 / 4
    assert tensor_parallel.activation_fraction(4, False, checkpointed=True) == 1.0
    # hybrid sharding: a group's shards are those of ZeRO over 4 ranks, the activations 1/8 of the batch's
    hybrid = predict(model, pt.ZeRO(stage=3, replicate=2), world=8, activation_bytes=activations)
    (alone,) = {r for r in predict(model, pt.ZeRO(stage=3), world=4, activation_bytes=activations // 2)}
    assert len(hybrid) == 8 and set(hybrid) == {alone}
    with pytest.raises(pt.ConfigError, match="does not divide the world size 8"):
        predict(model, pt.ZeRO(stage=3, replicate=3), world=8)


def test_a_strategy_with_more_replicas_than_samples_is_not_planned(planned):
    """A batch of 2 on 8 devices: ddp's 8 replicas cannot each read a sample (the session would
    refuse the loader), tp4's 2 and tp8's 1 can; the recommendation is one that can."""
    source, _, cluster = planned
    facts = model_facts(source, 2, seq=16)
    rows = {r["label"]: r for r in plan_rows(source, facts, cluster, gpus=8, optimizer="adam")}
    assert "cannot give each of its 8 data-parallel replicas a sample" in rows["ddp"]["error"]
    assert "cannot give each of its 4 data-parallel replicas" in rows["tp2 x ddp"]["error"]
    assert "error" not in rows["tp4 x ddp"] and "error" not in rows["tp8 x ddp"]
    best = recommend(list(rows.values()))
    assert best is None or "error" not in rows[best["label"]]



@pytest.fixture(scope="module")
def gpt():
    """A transformers GPT-2, which a pipeline knows how to cut (pipeline/adapters.py)."""
    from paratrain.plan.model.source import from_config

    config = dict(model_type="gpt2", n_layer=4, n_embd=256, n_head=4, n_positions=64, vocab_size=512)
    source = from_config("gpt", config)
    return source, model_facts(source, 8, seq=64), dataclasses.replace(preset("h100-8x"), host_link=None)

def test_a_pipeline_of_tensor_parallel_stages_is_the_pipeline_on_the_cut_model(gpt):
    """Mesh(tp, pp): the pipeline's step over world / tp ranks on what a tp rank holds, its
    compute and bubble the cut share, plus each stage's blocks' tp all-reduces, which also
    stretch the bubble's slots; its memory is the pipeline's on the cut model."""
    from paratrain.plan.cost.memory import predict

    source, facts, cluster = gpt
    step, pipe = facts.step, pt.Pipeline(stages=2, microbatches=2)
    mesh = pt.Mesh(tp=2, dp="ddp", pp=pipe)
    got = predict_time(source, mesh, step, cluster, gpus=8, nodes=1, facts=facts)
    cut = ModelSource(source.name, lambda: tensor_parallel.cut_copy(source.shared, mesh), source.default_seq)
    inner = predict_time(cut, pipe, step, cluster, gpus=4, nodes=1, facts=facts)
    share = tensor_parallel.compute_fraction(2, step.block_flops, step.flops_forward)
    # each stage all-reduces for half the blocks, over its replica's batch (8 over 2 replicas)
    all_reduces = tensor_parallel.tp_seconds(step.block_output_bytes, tp=2, dp=2, accumulate=1, recompute=False,
                                             cluster=cluster) / 2
    assert inner.bubble > 0 and all_reduces > 0
    assert got.compute == pytest.approx(inner.compute * share)
    assert got.exposed_comm == pytest.approx(inner.exposed_comm + all_reduces)
    assert got.bubble == pytest.approx(inner.bubble * share * (1 + all_reduces / got.compute))
    ranks = predict(source.shared, mesh, world=8, activation_bytes=2**20, step=step)
    stages = predict(tensor_parallel.cut_copy(source.shared, mesh), pipe, world=4,
                     activation_bytes=round(2**20 * tensor_parallel.activation_fraction(2)), step=step)
    assert [r.params for r in ranks] == [stages[r // 2].params for r in range(8)]
    assert ranks[0].params != ranks[-1].params  # the stages hold different layers (the head on the last)
    # without tp it is the pipeline itself
    alone = predict_time(source, pt.Mesh(dp="ddp", pp=pipe), step, cluster, gpus=8, nodes=1, facts=facts)
    assert alone == predict_time(source, pipe, step, cluster, gpus=8, nodes=1, facts=facts)


def test_a_pipeline_of_tensor_parallel_stages_is_a_row_with_the_session_that_runs_it(gpt):
    from paratrain.plan.recommend import session_line

    source, facts, cluster = gpt
    mesh = pt.Mesh(tp=2, dp="ddp", pp=pt.Pipeline(stages=2, microbatches=2))
    assert session_line(mesh, facts.step) == ("pt.Session(pt.Mesh(tp=2, dp='ddp', pp=pt.Pipeline(stages=2, "
                                              "schedule='1f1b', microbatches=2)))")
    from paratrain.plan.memory_table import memory_rows
    row = memory_rows(source, gpus=8, gpus_per_node=8, optimizer="adam", activation_bytes=0, chosen=[mesh])[0]
    assert row["label"] == "tp2 x pipeline 2x2" and "error" not in row


def test_a_stages_replicas_reduce_across_the_nodes_that_hold_them(gpt):
    """The grid's pp is outermost: a stage's replicas are adjacent ranks, on one node when it
    holds them, else across nodes (the slower link)."""
    source, facts, cluster = gpt
    pipe = pt.Pipeline(stages=2, microbatches=2)
    one = predict_time(source, pipe, facts.step, cluster, gpus=16, nodes=2, facts=facts)  # a stage per node
    spread = predict_time(source, pipe, facts.step, cluster, gpus=16, nodes=4, facts=facts)  # a stage on two
    assert spread.comm > one.comm
