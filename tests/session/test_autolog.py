"""What a Session logs by itself, and the backends users expect: every `every` optimizer steps one
row with loss, lr, grad norm, fp16 scale, samples and tokens per second and MFU, written to
metrics.csv, TensorBoard, Weights & Biases (offline) and MLflow (a local store)."""

import csv
import os
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain as pt
from paratrain.testing import run_on_ranks

STEPS, EVERY = 4, 2


class TokenModel(nn.Module):
    """Token ids (B, T) → logits (B, T, V): token inputs, so tokens per second can be counted."""

    def __init__(self, vocab=7, width=8):
        super().__init__()
        self.embed, self.out = nn.Embedding(vocab, width), nn.Linear(width, vocab)

    def forward(self, ids):
        return self.out(torch.tanh(self.embed(ids)))


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _train(topo, log_dir, backends):
    os.environ["WANDB_MODE"] = "offline"
    logging = pt.Logging(every=EVERY, backends=backends, project="autolog", flops_per_sample=3e4, peak_flops=1e9)
    session = pt.Session("ddp", topology=topo, progress_bar=False, log_dir=log_dir, logging=logging,
                         precision="fp16", max_grad_norm=1.0)
    torch.manual_seed(0)
    model = TokenModel()
    model, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(topo.rank)
    for _ in range(STEPS):
        ids = torch.randint(0, 7, (4, 5), generator=g)  # 20 tokens per rank per step
        session.train_step((ids, ids), _loss)
    session.close()


def test_rows_every_few_steps_with_what_users_compute_by_hand(tmp_path):
    run_on_ranks(_train, 2, str(tmp_path), ("tensorboard",))
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [EVERY, 2 * EVERY]
    for row in rows:
        assert float(row["lr"]) == 0.1 and float(row["loss"]) > 0 and float(row["grad_norm"]) > 0
        assert float(row["loss_scale"]) == 2.0 ** 16 and float(row["skipped_steps"]) == 0
        samples, tokens = float(row["samples_per_second"]), float(row["tokens_per_second"])
        assert samples > 0 and tokens == pytest.approx(5 * samples)  # 5 tokens a sample
        assert float(row["mfu"]) == pytest.approx(3e4 * samples / 2 / 1e9)  # per device
    assert list(tmp_path.glob("events.out.tfevents.*"))


def test_weights_and_biases_offline_and_mlflow_local_record_the_rows(tmp_path):
    pytest.importorskip("wandb")
    mlflow = pytest.importorskip("mlflow")
    run_on_ranks(_train, 2, str(tmp_path), ("wandb", "mlflow"), timeout=240)
    # W&B offline: the run's log holds the metrics (its format is W&B's own; the names are plain text)
    [run_file] = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    recorded = run_file.read_bytes()
    assert all(name.encode() in recorded for name in ("samples_per_second", "grad_norm", "loss_scale", "mfu"))
    # MLflow: a local file store in log_dir/mlruns, read back through its client
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    client = mlflow.tracking.MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    [experiment] = [e for e in client.search_experiments() if e.name == "autolog"]
    [run] = client.search_runs([experiment.experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [EVERY, 2 * EVERY]


def test_logging_needs_a_log_dir_and_known_backends():
    with pytest.raises(pt.ConfigError, match="writes into a log_dir"):
        pt.Session("single", logging=pt.Logging())
    with pytest.raises(pt.ConfigError, match="unknown logging backend"):
        pt.Session("single", log_dir="/tmp/never", logging=pt.Logging(backends=("neptune",)))
    pt.destroy()


def _custom_or_late(log_dir, custom):
    """One process; `custom`: the README's custom step (accumulation, backward, step); else
    train_step after a 1 s pause between Session() and the first micro-batch."""
    logging = pt.Logging(every=EVERY, backends=())
    session = pt.Session("single", progress_bar=False, log_dir=log_dir, logging=logging)
    torch.manual_seed(0)
    model = TokenModel()
    model, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ids = torch.randint(0, 7, (4, 5), generator=torch.Generator().manual_seed(0))
    if not custom:
        time.sleep(1.0)
    for _ in range(STEPS):
        if custom:
            with session.accumulation():
                session.backward(_loss(model(ids), ids))
            session.step()
        else:
            session.train_step((ids, ids), _loss)
    session.close()
    with open(os.path.join(log_dir, "metrics.csv")) as f:
        return list(csv.DictReader(f))


def test_a_custom_steps_rows_hold_its_loss_and_no_made_up_rate(tmp_path):
    """A custom step counts no samples: its rows leave the rate out (it wrote 0.0) and hold the
    loss (it was missing); the first row's rate starts at the first micro-batch, not at
    Session() (a pause before training made it tiny)."""
    rows = _custom_or_late(str(tmp_path / "custom"), custom=True)
    assert [int(r["step"]) for r in rows] == [EVERY, 2 * EVERY]
    assert all(float(r["loss"]) > 0 and not r.get("samples_per_second") for r in rows)
    rows = _custom_or_late(str(tmp_path / "late"), custom=False)
    assert float(rows[0]["samples_per_second"]) > 4 * EVERY / 0.5  # its 8 samples took far less than the pause
