"""Skipped and strange steps are never silent: an fp16 step skipped for an
inf, a loss scale halved on k steps in a row and a gradient-norm jump each give a rank-0
StepWarning and a row in metrics.csv; a normal run gives neither. On 2 real ranks under DDP
(CPU autocast runs fp16)."""

from __future__ import annotations

import csv
import warnings

import pytest
import torch
import torch.nn.functional as F

import paratrain as pt
from paratrain.testing import run_on_ranks
from tests.support.models import make_batches, make_model

STEPS = 12


def _train(topo, case, log_dir):
    fp16 = case in ("normal fp16", "one skip", "skips in a row")
    session = pt.Session("ddp", topology=topo, progress_bar=False, log_dir=log_dir, max_grad_norm=float("inf"),
                         precision="fp16" if fp16 else "32", logging=pt.Logging(every=0),
                         step_warnings=pt.StepWarnings(halvings=3, grad_norm_factor=10, window=8))
    model = make_model("mlp")
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    poisoned = {"one skip": {4}, "skips in a row": {4, 5, 6}}.get(case, set())
    state = {"step": 0}
    first = next(p for p in session.unwrap().parameters())
    first.register_hook(lambda g: g * float("inf") if state["step"] in poisoned else g)  # before the all-reduce
    xs, ys = make_batches(STEPS, 8, seed=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            state["step"] = step
            spike = 1000.0 if case == "norm jump" and step == 9 else 1.0
            session.train_step((xs[step][topo.rank::2], ys[step][topo.rank::2]),
                               lambda out, y: F.cross_entropy(out, y) * spike)
    session.metrics.close()
    return [(str(w.message), w.filename) for w in caught if issubclass(w.category, pt.StepWarning)]


def _rows(log_dir):
    with open(log_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("case", ["normal fp16", "normal 32"])
def test_a_normal_run_warns_of_nothing(tmp_path, case):
    said = run_on_ranks(_train, 2, case, str(tmp_path), timeout=120)
    assert said == [[], []]
    assert not (tmp_path / "metrics.csv").exists()  # no event row (and no automatic ones: every=0)


def test_a_skipped_fp16_step_is_named_on_rank_0_and_logged(tmp_path):
    rank0, rank1 = run_on_ranks(_train, 2, "one skip", str(tmp_path), timeout=120)
    assert rank1 == []
    assert [m for m, _ in rank0] == ["optimizer step 5 was skipped: an fp16 gradient held inf or NaN on some "
                                     "rank; the loss scale is now 32768. A few skips while the scale settles "
                                     "are normal"]
    assert rank0[0][1] == __file__  # pointed at the user's train_step line
    rows = _rows(tmp_path)
    assert [(r["step"], r["skipped_step"], r["loss_scale"]) for r in rows] == [("5", "1.0", "32768.0")]


def test_a_loss_scale_halved_k_times_in_a_row_is_named(tmp_path):
    rank0, rank1 = run_on_ranks(_train, 2, "skips in a row", str(tmp_path), timeout=120)
    assert rank1 == []
    messages = [m for m, _ in rank0]
    assert len(messages) == 4 and messages[3].startswith(
        "the fp16 loss scale was halved on 3 optimizer steps in a row (now 8192, at step 7): ")
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == ["5", "6", "7"]
    assert rows[-1]["loss_scale_halvings"] == "3.0" and rows[0]["loss_scale_halvings"] == ""


def test_a_gradient_norm_jump_is_named(tmp_path):
    rank0, rank1 = run_on_ranks(_train, 2, "norm jump", str(tmp_path), timeout=120)
    assert rank1 == [] and len(rank0) == 1
    assert rank0[0][0].startswith("the gradient norm at optimizer step 10 is ")
    assert "x the median of the last 8 steps" in rank0[0][0] and rank0[0][0].endswith("the step was taken")
    row, = _rows(tmp_path)
    assert row["step"] == "10" and float(row["grad_norm_spike"]) > 100 * float(row["grad_norm_median"])


def test_bad_settings_are_clear_errors():
    with pytest.raises(pt.ConfigError, match="StepWarnings needs halvings >= 1"):
        pt.StepWarnings(grad_norm_factor=0.5)
