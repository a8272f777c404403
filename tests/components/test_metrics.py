"""Metric logging: the mean over ranks, one CSV row per call, written by rank 0 only."""

import csv
import sys

import pytest
import torch
import torch.nn.functional as F

import paratrain as pt
from paratrain.components.metrics import MetricsLogger
from paratrain.testing import run_on_ranks
from tests.support.models import make_batches, make_model


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def _log_on_ranks(topo, root):
    # each rank gets its own directory, so that a write by any rank but 0 would show
    session = pt.Session("ddp", topology=topo, progress_bar=False, log_dir=f"{root}/rank{topo.rank}")
    model = make_model("mlp")
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    xs, ys = make_batches(3, 4, seed=2)
    means = []
    for step in range(3):
        session.train_step((xs[step], ys[step]), F.cross_entropy)
        # rank r reports r + 10·step and a tensor metric; the row holds their means
        means.append(session.log(loss=torch.tensor(topo.rank + 10.0 * step), acc=0.25 * (topo.rank + 1)))
    return means


def test_csv_holds_the_mean_over_ranks_one_row_per_call_written_by_rank_zero(tmp_path):
    results = run_on_ranks(_log_on_ranks, 2, str(tmp_path), timeout=60)
    assert results[0] == results[1] == [{"acc": 0.375, "loss": 0.5 + 10 * s} for s in range(3)]
    assert not (tmp_path / "rank1").exists()
    rows = _rows(tmp_path / "rank0" / "metrics.csv")
    assert rows[0] == ["step", "acc", "loss"]  # step = optimizer steps taken (one per train_step)
    assert [[int(r[0]), float(r[1]), float(r[2])] for r in rows[1:]] == [
        [1, 0.375, 0.5], [2, 0.375, 10.5], [3, 0.375, 20.5]]


def test_a_new_metric_adds_a_column_and_a_resumed_run_appends(tmp_path):
    session = pt.Session("single", progress_bar=False, log_dir=tmp_path)
    try:
        session.log(step=1, loss=2.0)
        session.log(step=2, loss=1.0, val_loss=1.5)  # e.g. once per epoch
        assert _rows(tmp_path / "metrics.csv") == [["step", "loss", "val_loss"], ["1", "2.0", ""],
                                                   ["2", "1.0", "1.5"]]
    finally:
        session.close()
    again = MetricsLogger(tmp_path, is_main=True, tensorboard=False)  # after a restart
    again.log(3, loss=0.5)
    assert _rows(tmp_path / "metrics.csv")[1:] == [["1", "2.0", ""], ["2", "1.0", "1.5"], ["3", "0.5", ""]]


@pytest.mark.parametrize("metrics,message", [
    (dict(loss=torch.ones(3)), "takes scalars; 'loss' has shape \\(3,\\)"),
    (dict(), "at least one metric"),
    (dict(step=3.0), "'step' is the row's key"),
])
def test_bad_metrics_are_usage_errors(tmp_path, metrics, message):
    with pytest.raises(pt.UsageError, match=message):
        MetricsLogger(tmp_path, is_main=True, tensorboard=False).log(0, **metrics)
    assert not (tmp_path / "metrics.csv").exists()


def test_tensorboard_events_when_it_is_installed(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed; metrics.csv is written without it")
    logger = MetricsLogger(tmp_path, is_main=True)
    logger.log(1, loss=1.0)
    logger.close()
    assert list(tmp_path.glob("events.out.tfevents.*")) and (tmp_path / "metrics.csv").exists()


def test_asking_for_tensorboard_without_it_is_a_config_error(tmp_path, monkeypatch):
    # as if it were not installed: None in sys.modules makes the import fail
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(pt.ConfigError, match="pip install tensorboard"):
        MetricsLogger(tmp_path, is_main=True, tensorboard=True)
