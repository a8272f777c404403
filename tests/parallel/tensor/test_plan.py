"""The tensor-parallel plan: resolved from the right place, refused by name when it cannot cut the
model (no processes: plan_for reads shapes only, on the meta device too)."""

import pytest
import torch
from torch import nn

import paratrain as pt
from paratrain.parallel.tensor.parallelize import parallelize
from paratrain.parallel.tensor.plan import COLWISE, GATHERED, ROWWISE, matches, plan_for
from paratrain.parallel.tensor.sequence import SequenceParallel
from tests.support.llama import PLAN, Llama


def test_patterns_match_one_part_per_star():
    assert matches("layers.*.attn.q", "layers.11.attn.q")
    assert not matches("layers.*.attn.q", "layers.1.attn.q.inner")
    assert not matches("layers.*", "layers.1.attn")


def test_the_given_plan_comes_first_then_the_models_own():
    model = Llama()
    assert plan_for(model, None, 2).source == "Llama.tp_plan"
    given = plan_for(model, {"layers.*.mlp.gate": "colwise", "layers.*.mlp.down": "rowwise"}, 2)
    assert given.source == "Mesh(tp_plan=...)" and given.styles == {
        "layers.0.mlp.gate": COLWISE, "layers.0.mlp.down": ROWWISE, "layers.1.mlp.gate": COLWISE,
        "layers.1.mlp.down": ROWWISE}


def test_a_meta_model_is_planned_without_memory():
    with torch.device("meta"):
        model = Llama(width=4096, hidden=11008, vocab=32000, heads=32, kv_heads=8)
    assert len(plan_for(model, None, 8).styles) == 14


def test_transformers_plan_is_read_under_the_base_model():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    plan = plan_for(model, None, 2)
    assert plan.source in ("LlamaForCausalLM.tp_plan", "LlamaConfig.base_model_tp_plan")  # transformers 5, 4
    assert plan.styles["model.layers.1.self_attn.q_proj"] == COLWISE
    assert plan.styles["model.layers.0.mlp.down_proj"] == ROWWISE
    assert plan.styles["lm_head"] == GATHERED  # the class's own _tp_plan: "colwise_gather_output"
    with pytest.raises(pt.ConfigError, match=r"tp=4 does not divide config.num_key_value_heads = 2"):
        plan_for(model, None, 4)


@pytest.mark.parametrize("kwargs,plan,tp,words", [
    (dict(heads=6, kv_heads=6, width=48), None, 4, r"tp=4 does not divide layers.0.attn.n_heads = 6"),
    (dict(heads=4, kv_heads=2), None, 4, r"tp=4 does not divide layers.0.attn.n_kv_heads = 2"),
    (dict(hidden=50), {"layers.*.mlp.up": "colwise"}, 4, r"tp=4 does not divide layers.0.mlp.up's out_features, 50"),
    (dict(hidden=50), {"layers.*.mlp.down": "rowwise"}, 4, r"layers.0.mlp.down's in_features, 50"),
    (dict(vocab=66), {"embed": "rowwise"}, 4, r"embed's vocabulary \(num_embeddings\), 66"),
    ({}, {"layers.*.attn": "colwise"}, 2, r"cuts layers.0.attn \(Attention\) colwise, which fits Linear only"),
    ({}, {"embed": "colwise"}, 2, r"cuts embed \(Embedding\) colwise"),
    ({}, {"layers.*.attn.query": "colwise"}, 2, r"names no module for \['layers.\*.attn.query'\]"),
    ({}, {"layers.*.attn.q": "column"}, 2, r"style\(s\) paratrain does not know: \{'layers.\*.attn.q': 'column'\}"),
])
def test_a_plan_that_cannot_cut_the_model_is_refused_by_name(kwargs, plan, tp, words):
    with pytest.raises(pt.ConfigError, match=words):
        plan_for(Llama(**kwargs), plan, tp)


def test_a_model_without_a_plan_is_told_how_to_give_one():
    with pytest.raises(pt.ConfigError, match=r"Mesh\(tp_plan="):
        plan_for(nn.Sequential(nn.Linear(4, 4)), None, 2)


def test_mesh_refuses_what_it_does_not_compose_yet():
    with pytest.raises(pt.ConfigError, match=r"it takes dp='zero1', 'zero2' or 'zero3' \(got 'ddp'\)"):
        pt.Mesh(tp=2, replicate=2)
    for kwargs in (dict(tp=1), dict(tp=2, cp=2), dict(tp=2, pp=pt.Pipeline(stages=2))):
        with pytest.raises(pt.ConfigError, match=r"needs tp > 1, and does not compose with pp or cp yet"):
            pt.Mesh(sequence_parallel=True, **kwargs)
    for dp in ("pipeline", "zero4", pt.Pipeline(stages=2)):
        with pytest.raises(pt.ConfigError, match=r"must be one of \['ddp', 'hierarchical', 'zero1', 'zero2', 'zero3'\]"):
            pt.Mesh(tp=2, dp=dp)
    assert pt.Mesh(tp=2, tp_plan=PLAN) == pt.Mesh(tp=2, tp_plan=dict(PLAN))


def sequence_parallel(model, plan):
    """Sequence parallelism's checks on `model` cut by `plan` at tp 2 (no process: they are static)."""
    parallelize(model, plan_for(model, plan, 2), None, 0, 2)
    return SequenceParallel(model, None)


def test_sequence_parallelism_names_what_it_cannot_cut():
    nested = {**PLAN, "layers.*.extra": "colwise"}  # a block's own colwise layer: the block would gather too
    model = Llama()
    for layer in model.layers:
        layer.extra = nn.Linear(32, 32)
    with pytest.raises(pt.ConfigError, match=r"layers\.0\.attn sits inside layers\.0, another"):
        sequence_parallel(model, nested)
    with pytest.raises(pt.ConfigError, match=r"lm_head is row-parallel outside every block"):
        sequence_parallel(Llama(), {**PLAN, "lm_head": "rowwise"})
    shared = Llama()  # a norm's weight also read inside the attention, where the sequence is whole
    shared.layers[0].attn.scale = shared.layers[0].attn_norm.weight
    with pytest.raises(pt.ConfigError, match=r"used both on the sequence's parts \(layers\.0\.attn_norm\.weight\) "
                                             r"and where it is whole \(layers\.0\.attn\.scale\)"):
        sequence_parallel(shared, PLAN)
    cut = sequence_parallel(Llama(tied=True, bias=True), PLAN)
    assert cut.blocks == [f"layers.{i}.{m}" for i in range(2) for m in ("attn", "mlp")]
    assert cut.summed == {"embed.weight", "lm_head.weight", "norm.weight",
                          *(f"layers.{i}.{n}" for i in range(2) for n in ("attn_norm.weight", "mlp_norm.weight",
                                                                            "mlp.down.bias"))}
