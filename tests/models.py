"""Small models that exercise what data-parallel code gets wrong: BatchNorm buffers, dropout,
tied weights, unused parameters, parameter sizes not divisible by the world size."""

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in=12, hidden=33, classes=5):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                                 nn.Tanh(), nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


class ConvBN(nn.Module):
    """Convolution + BatchNorm: running statistics are buffers that DDP broadcasts."""

    def __init__(self, classes=5):
        super().__init__()
        self.conv = nn.Conv2d(1, 6, 3, padding=1, bias=False)  # a bias before BatchNorm has no effect
        self.bn = nn.BatchNorm2d(6)
        self.head = nn.Linear(6 * 4 * 3, classes)

    def forward(self, x):  # x: (B, 12) seen as a 1×4×3 image
        h = torch.relu(self.bn(self.conv(x.view(-1, 1, 4, 3))))
        return self.head(h.flatten(1))


class Dropout(MLP):
    def __init__(self):
        super().__init__()
        self.net.insert(2, nn.Dropout(0.3))


class Tied(nn.Module):
    """Input embedding and output projection share one weight (as in GPT-2)."""

    def __init__(self, vocab=5, d=12):
        super().__init__()
        self.proj_in = nn.Linear(12, d)
        self.embed = nn.Embedding(vocab, d)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x):
        h = torch.tanh(self.proj_in(x)) + self.embed.weight.mean(0)
        return self.out(h)


class Unused(MLP):
    """A parameter that never takes part in the forward."""

    def __init__(self):
        super().__init__()
        self.spare = nn.Linear(7, 7)


class Sometimes(MLP):
    """A head used only for batches whose first feature sums positive: which ranks use it
    differs from step to step and from micro-batch to micro-batch."""

    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(12, 5)

    def forward(self, x):
        out = self.net(x)
        return out + self.extra(x) if x[:, 0].sum() > 0 else out


MODELS = {"mlp": MLP, "bn": ConvBN, "dropout": Dropout, "tied": Tied, "unused": Unused,
          "sometimes": Sometimes}


def make_model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def make_batches(steps: int, global_batch: int, seed: int = 1):
    """`steps` global batches of (x: (G, 12), y: (G,) in 0..4)."""
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(steps, global_batch, 12, generator=g)
    ys = torch.randint(0, 5, (steps, global_batch), generator=g)
    return xs, ys
