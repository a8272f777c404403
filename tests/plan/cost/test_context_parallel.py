"""`paratrain plan` with context parallelism (plan/cost/context_parallel.py): the probe counts each
attention call's keys and values, a cp rank's memory is the inner strategy's over dp × cp ranks
plus the ring's two K, V blocks, and its step adds the ring's passes."""

import dataclasses

import pytest

import paratrain as pt
from paratrain.plan.cluster.presets import preset
from paratrain.plan.cost import comm_model
from paratrain.plan.cost.memory import predict
from paratrain.plan.model.probe import model_facts
from paratrain.plan.model.source import resolve
from paratrain.plan.recommend import plan_rows, predict_time
from tests.support.llama import Llama

BATCH, SEQ, LAYERS, HEADS, HEAD_DIM = 4, 64, 3, 4, 16


def small() -> Llama:
    """Grouped-query attention, whose two kv heads are repeated for SDPA (its k, v carry all 4)."""
    return Llama(vocab=64, width=HEADS * HEAD_DIM, layers=LAYERS, heads=HEADS, kv_heads=2, hidden=128)


@pytest.fixture(scope="module")
def planned():
    source = resolve("tests.plan.cost.test_context_parallel:small")
    return source, model_facts(source, BATCH, seq=SEQ), dataclasses.replace(preset("h100-8x"), host_link=None)


def test_the_probe_counts_every_attention_calls_keys_and_values(planned):
    _, facts, _ = planned
    assert facts.step.attention_calls == LAYERS
    assert facts.step.attention_kv_bytes == LAYERS * 2 * BATCH * HEADS * SEQ * HEAD_DIM * 4  # k and v, fp32


def test_a_cp_rank_holds_the_inner_strategys_share_and_two_kv_blocks(planned):
    source, facts, _ = planned
    how = dict(world=8, activation_bytes=facts.step.activation_peak_bytes, step=facts.step)
    block = facts.step.attention_kv_bytes / 8 / LAYERS  # one call's K, V on one of 8 ranks
    for dp, alone in (("ddp", pt.DDP()), ("zero3", pt.ZeRO(stage=3))):
        cp, inner = predict(source.shared, pt.Mesh(cp=2, dp=dp), **how), predict(source.shared, alone, **how)
        for ours, theirs in zip(cp, inner):
            assert ours.activations - theirs.activations == round(2 * block)
            assert dataclasses.replace(ours, activations=0) == dataclasses.replace(theirs, activations=0)


def test_a_cp_step_adds_the_rings_passes(planned):
    source, facts, cluster = planned
    block = facts.step.attention_kv_bytes / 8 / LAYERS
    one = comm_model.send_recv(block, cluster, same_node=True)
    # cp 2, per call: 1 block forward; in backward 1 block and 2 of its gradient
    want = LAYERS * 4 * one
    ring = predict_time(source, pt.Mesh(cp=2), facts.step, cluster, gpus=8, nodes=1, facts=facts)
    ddp = predict_time(source, pt.DDP(), facts.step, cluster, gpus=8, nodes=1, facts=facts)
    assert ring.comm - ddp.comm == pytest.approx(want, rel=1e-9)
    assert ring.exposed_comm - ddp.exposed_comm == pytest.approx(want, rel=1e-9)
    assert ring.compute == pytest.approx(ddp.compute, rel=1e-9)


def test_plan_rows_offer_cp_for_a_model_with_attention(planned):
    source, facts, cluster = planned
    rows = {r["label"]: r for r in plan_rows(source, facts, cluster, gpus=8, optimizer="adam")}
    assert rows["cp2 x ddp"]["session"] == "pt.Session(pt.Mesh(cp=2, dp='ddp'))"
    assert rows["cp2 x zero3"]["session"] == "pt.Session(pt.Mesh(cp=2, dp='zero3'))"
    mlp = resolve("tests.support.models:MLP")  # no attention: no sequence to cut
    assert not any(r["label"].startswith("cp") for r in plan_rows(mlp, model_facts(mlp, 8), cluster, gpus=8,
                                                                  optimizer="adam"))
