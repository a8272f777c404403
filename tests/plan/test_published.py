"""bench/plan_published.py (the planner against published runs) and the preset it adds."""

import dataclasses
import json
import os
import sys

import pytest

from paratrain.plan.cluster.cluster import GB, from_dict
from paratrain.plan.cluster.presets import preset
from paratrain.plan.model.probe import model_facts
from paratrain.plan.model.source import from_config
from tests.support import ROOT_DIR

ROOT = ROOT_DIR
sys.path.insert(0, os.path.join(ROOT, "bench"))
import plan_published  # noqa: E402


def test_the_v100_dgx2h_preset_validates_and_says_where_each_figure_comes_from():
    cluster = preset("v100-dgx2h")
    assert from_dict(json.loads(json.dumps(dataclasses.asdict(cluster)))) == cluster  # what a cluster file holds
    assert cluster.gpus_per_node == 16 and cluster.inter.bandwidth == 100 * GB / 16  # 8 adapters per 16 GPUs
    assert cluster.intra.bandwidth == 300 * GB / 2  # 300 GB/s both directions together
    assert "bf16" not in cluster.peak_flops  # a V100 has no bf16
    for figure in ("peak_flops", "optimizer_rate", "elementwise_rate", "matmul_efficiency", "device_memory",
                   "host_memory", "intra.bandwidth", "inter.bandwidth", "latency"):
        assert cluster.sources[figure]


@pytest.mark.slow
def test_equation_3_is_the_flops_the_planner_counts_within_2_percent():
    """Narayanan et al.'s Eq. (3) leaves out what is not a matmul; probe counts matmuls and
    attention with the recompute, so the two agree closely for the bench's 1.2B GPT."""
    gpt = plan_published.GPT_1_2B
    step = model_facts(from_config("gpt", gpt.config()), 8, gpt.seq, precision="fp16").checkpointed
    assert step.flops_forward + step.flops_backward == pytest.approx(gpt.flops(8), rel=0.02)


@pytest.mark.slow
def test_the_bench_writes_every_setting_with_its_reference_and_error(tmp_path, capsys):
    out = tmp_path / "published.json"
    plan_published.main(["--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == len(plan_published.SETTINGS)
    for row in rows:
        assert {"paper", "where", "setting", "published", "unit", "predicted", "error", "note"} <= set(row)
        assert row["paper"] and row["where"] and row["setting"] and row["unit"]
        if row["predicted"] is None:  # not predicted: the note says why
            assert row["error"] is None and row["note"].startswith(("not comparable", "not rebuilt", "not compared"))
        else:
            assert row["error"] == pytest.approx(row["predicted"] / row["published"] - 1)
            assert row["planned"]["fits"] != ("does not fit" in row["note"])  # a row that cannot fit says why
            assert row["planned"]["step_seconds"] > 0
    assert sum(row["error"] is not None for row in rows) >= 3
    assert "within 25 %:" in capsys.readouterr().out


def test_docs_table_is_the_committed_results():
    """Each compared row of bench/results/plan_published.json is in its benchmark page's table."""
    rows = json.load(open(os.path.join(ROOT, "bench", "results", "plan_published.json")))["rows"]
    readme = open(os.path.join(ROOT, "docs", "benchmarks", "plan_published.md")).read()
    assert [r["published"] for r in rows] == [s.published for s in plan_published.SETTINGS]
    for row in rows:
        if row["error"] is not None:
            assert "| {} | {} | {} |".format(*plan_published.cells(row)) in readme, row["where"]
