"""Train a small CNN on scikit-learn's bundled digits (1797 images of 8×8 pixels, 10 classes).

    paratrain run -n 2 examples/digits.py --strategy ddp       # two processes, our DDP
    paratrain run -n 2 examples/digits.py --strategy pipeline  # two stages, 1F1B, 4 micro-batches
    python examples/digits.py --strategy single                # one process, the reference

The loop is a single-device loop; `pt.Session` makes it distributed. At the end rank 0 prints
`test accuracy: …` and the throughput, and writes `metrics.csv` and `loss.png` to `--out`.
"""

from __future__ import annotations

import argparse
import csv
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain as pt


def net(classes: int = 10) -> nn.Sequential:
    """A small CNN, one layer after another: an nn.Sequential, so the pipeline can cut it too."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),   # (B, 32, 8, 8)
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),  # (B, 64, 8, 8)
        nn.MaxPool2d(2),                             # (B, 64, 4, 4)
        nn.Flatten(), nn.Dropout(0.25), nn.Linear(64 * 4 * 4, 128),
        nn.ReLU(), nn.Linear(128, classes),
    )


def digits(seed: int, test_fraction: float = 0.2) -> tuple[TensorDataset, TensorDataset]:
    """Train and test splits of sklearn's digits, pixels scaled to [0, 1]."""
    x, y = _load_digits()  # x: (1797, 64) in 0..16, y: (1797,)
    x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    test, train = order[: int(len(x) * test_fraction)], order[int(len(x) * test_fraction):]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def _load_digits():
    """sklearn's `load_digits(return_X_y=True)`, read from the file it reads: importing sklearn
    costs every rank about 1.3 s of start-up (this machine), for 1797 rows of a bundled CSV."""
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")  # locates the package without importing it
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz") if spec else ""
    if not os.path.exists(path):  # another sklearn layout: ask sklearn itself
        from sklearn.datasets import load_digits

        return load_digits(return_X_y=True)
    table = np.loadtxt(path, delimiter=",")  # 64 pixel columns, then the label
    return table[:, :-1], table[:, -1].astype(int)


@torch.no_grad()
def accuracy(model: nn.Module, data: TensorDataset, device: torch.device) -> float:
    model.eval()
    x, y = data.tensors
    predicted = model(x.to(device)).argmax(1).cpu()
    correct = (predicted == y).sum().item()
    model.train()
    return correct / len(y)


def save_results(out: str, rows: list[dict], losses: list[float]) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "metrics.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses, label="training loss (rank 0)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss.png"), dpi=100)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="ddp", help="single | ddp | zero1 | zero2 | zero3 | pipeline")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, over all ranks")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/digits")
    args = parser.parse_args(argv)

    session = pt.Session(strategy=args.strategy, seed=args.seed, accumulate=args.accumulate)
    train, test = digits(args.seed)
    model = net()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    # drop_last: every step sees a full batch (the pipeline's micro-batches must divide it);
    # the 30 samples left out change with each epoch's shuffle
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model, optimizer, loader = session.setup(model, optimizer, loader)

    rows, losses, start = [], [], time.perf_counter()
    for epoch in range(args.epochs):
        epoch_losses = []
        for batch in session.progress(loader):
            epoch_losses.append(session.train_step(batch, F.cross_entropy).item())
        losses += epoch_losses
        mean_loss = pt.mean_metrics(sum(epoch_losses) / len(epoch_losses))
        test_acc = accuracy(model, test, session.device)  # through the wrapper, on every rank
        rows.append(dict(epoch=epoch, loss=round(mean_loss, 6), test_accuracy=round(test_acc, 4),
                         samples_per_s=round(session.samples_per_second, 1)))
        session.print(f"epoch {epoch}: loss {mean_loss:.4f}  test accuracy {test_acc:.4f}  "
                      f"{session.samples_per_second:.0f} samples/s")
    elapsed = time.perf_counter() - start
    test_acc = accuracy(model, test, session.device)
    session.print(f"test accuracy: {test_acc:.4f}")
    session.print(f"samples per second: {len(train) * args.epochs / elapsed:.0f} "
                  f"({session.world_size} process(es), strategy {args.strategy}, {elapsed:.1f} s)")
    if session.is_main:
        save_results(args.out, rows, losses)
        print(f"wrote {args.out}/metrics.csv and {args.out}/loss.png")
    session.close()
    return test_acc


if __name__ == "__main__":
    main()
