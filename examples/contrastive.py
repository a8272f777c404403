"""SimCLR-style contrastive learning on scikit-learn's digits, negatives local or from every rank.

    paratrain run -n 2 examples/contrastive.py                     # local, then global negatives
    paratrain run -n 2 examples/contrastive.py --negatives global

SimCLR (Chen et al. 2020): two random augmentations of each image go through one encoder and a
projection head; the NT-Xent loss pulls the two views of an image together and pushes it away
from the other images of the batch (its negatives). With `--negatives local` each rank's loss
sees only its own share of the batch; with `global` the embeddings of all ranks are gathered
with gradients (`paratrain.components.contrastive.gather_embeddings`), so training equals one process on
the whole batch. Labels are used only at the end, by a linear probe: a logistic regression on
the frozen encoder's features (train split), scored on the test split. Rank 0 prints
`linear-probe accuracy (<setting>): …` for each setting, and the same probe on a randomly
initialised encoder for comparison.
"""

from __future__ import annotations

import argparse
import math
import time
from functools import partial

import torch
import torch.nn.functional as F
from digits import digits  # examples/digits.py: the same train/test split
from torch import nn
from torch.utils.data import DataLoader

import paratrain as pt
from paratrain.components.contrastive import gather_embeddings, nt_xent_loss


class Encoder(nn.Module):
    """CNN features h (128) for the probe; projection head z (32) for the loss (SimCLR §2.1)."""

    def __init__(self, features: int = 128, projection: int = 32):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),   # (B, 32, 8, 8)
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),  # (B, 64, 8, 8)
            nn.MaxPool2d(2), nn.Flatten(),               # (B, 1024)
            nn.Linear(64 * 4 * 4, features), nn.ReLU(),  # (B, 128)
        )
        self.head = nn.Sequential(nn.Linear(features, features), nn.ReLU(), nn.Linear(features, projection))

    def forward(self, x):  # x: (B, 1, 8, 8) → z: (B, 32)
        return self.head(self.features(x))


def augment(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A random view of each image (B, 1, 8, 8): rotation ±15°, scale 0.9–1.1, shift ±1 pixel,
    then pixel noise and a dropped 3×3 patch (SimCLR §3: crop + distortion, scaled to 8×8)."""
    b = x.shape[0]
    angle = (torch.rand(b, generator=g) - 0.5) * math.radians(30)
    scale = 0.9 + 0.2 * torch.rand(b, generator=g)
    shift = (torch.rand(b, 2, generator=g) - 0.5) * 0.5  # grid units: ±1 pixel of 8
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    theta = torch.stack([torch.stack([cos, -sin, shift[:, 0]], 1),
                         torch.stack([sin, cos, shift[:, 1]], 1)], 1)  # (B, 2, 3)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)  # (B, 8, 8, 2)
    view = F.grid_sample(x, grid, align_corners=False, padding_mode="zeros")
    view = view + 0.1 * torch.randn(view.shape, generator=g)
    corner = torch.randint(0, 6, (b, 2), generator=g)
    r0, c0 = corner[:, 0, None, None], corner[:, 1, None, None]  # (B, 1, 1)
    rows, cols = torch.arange(8).view(1, 8, 1), torch.arange(8).view(1, 1, 8)
    patch = (rows >= r0) & (rows < r0 + 3) & (cols >= c0) & (cols < c0 + 3)  # (B, 8, 8)
    return view.masked_fill(patch.unsqueeze(1), 0.0)


@torch.no_grad()
def probe_accuracy(encoder: Encoder, train, test) -> float:
    """Logistic regression on frozen features (the standard linear evaluation, SimCLR §4)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    encoder.eval()
    (xtr, ytr), (xte, yte) = train.tensors, test.tensors
    device = next(encoder.parameters()).device
    htr = encoder.features(xtr.to(device)).cpu().numpy()  # (n, 128)
    hte = encoder.features(xte.to(device)).cpu().numpy()
    encoder.train()
    scaler = StandardScaler().fit(htr)
    clf = LogisticRegression(max_iter=1000).fit(scaler.transform(htr), ytr.numpy())
    return float(clf.score(scaler.transform(hte), yte.numpy()))


def train(negatives: str, args, train_set) -> Encoder:
    """Contrastive training from the same initial weights for every setting (a session each)."""
    session = pt.Session(strategy="ddp", seed=args.seed)
    torch.manual_seed(args.seed)
    model = Encoder()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model, optimizer, loader = session.setup(model, optimizer, loader)
    scope = {"local": "local", "global": "world", "node": "node"}[negatives]
    groups = session.grid.node_groups() if scope == "node" else None
    gather = partial(gather_embeddings, scope=scope, groups=groups)

    def loss_fn(z, _labels):  # z: (2b, 32), both views of this rank's b images
        return nt_xent_loss(*z.chunk(2), temperature=args.temperature, gather=gather)

    g = torch.Generator().manual_seed(1000 * args.seed + session.rank)  # each rank its own views
    for epoch in range(args.epochs):
        losses = []
        for x, labels in session.progress(loader, desc=f"{negatives} epoch {epoch}"):
            views = torch.cat([augment(x, g), augment(x, g)])  # (2b, 1, 8, 8)
            losses.append(session.train_step((views, labels), loss_fn).item())
        if epoch % 5 == 4 or epoch == args.epochs - 1:
            mean_loss = pt.mean_metrics(sum(losses) / len(losses))
            session.print(f"[{negatives}] epoch {epoch}: loss {mean_loss:.4f}")
    return session.unwrap(model)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--negatives", default="local,global",
                        help="comma-separated settings, each local | global | node (default: local,global)")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=128, help="global batch, over all ranks")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--temperature", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    settings = args.negatives.split(",")
    if not set(settings) <= {"local", "global", "node"}:
        parser.error(f"--negatives takes local, global or node; got {args.negatives!r}")

    session = pt.Session(strategy="ddp", seed=args.seed)
    train_set, test_set = digits(args.seed)
    if session.is_main:
        torch.manual_seed(args.seed)
        print(f"linear-probe accuracy (random encoder): {probe_accuracy(Encoder(), train_set, test_set):.4f}")
    results = {}
    for negatives in settings:
        start = time.perf_counter()
        encoder = train(negatives, args, train_set)
        if session.is_main:
            results[negatives] = probe_accuracy(encoder, train_set, test_set)
            seconds = time.perf_counter() - start
            print(f"linear-probe accuracy ({negatives} negatives, {session.world_size} process(es), "
                  f"batch {args.batch_size}): {results[negatives]:.4f}  [{seconds:.1f} s]")
    session.close()
    return results


if __name__ == "__main__":
    main()
