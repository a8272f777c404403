"""Small models that exercise what data-parallel code gets wrong: BatchNorm buffers, dropout,
tied weights, unused parameters, parameter sizes not divisible by the world size."""

import contextlib
import gc
import warnings

import torch
import torch.nn.functional as F
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


class Branches(nn.Module):
    """Two heads summed, computed in the order `swap` says: backward produces the gradients of the
    one computed last first, so ranks that differ in `swap` see their gradients in other orders."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(12, 5), nn.Linear(12, 5)
        self.swap = False

    def forward(self, x):
        if self.swap:
            hb = self.b(x)
            return self.a(x) + hb
        ha = self.a(x)
        return ha + self.b(x)


class Stack(nn.Module):
    """Blocks in an nn.ModuleList that their owner's forward iterates, as nn.TransformerEncoder
    and GPTs do: nobody calls the list itself."""

    class Trunk(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

        def forward(self, h):
            for block in self.blocks:
                h = torch.tanh(block(h))
            return h

    def __init__(self):
        super().__init__()
        self.inp, self.trunk, self.out = nn.Linear(12, 16), self.Trunk(), nn.Linear(16, 5)

    def forward(self, x):
        return self.out(self.trunk(torch.tanh(self.inp(x))))


MODELS = {"mlp": MLP, "bn": ConvBN, "dropout": Dropout, "tied": Tied, "unused": Unused,
          "sometimes": Sometimes, "branches": Branches, "stack": Stack}


def make_model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def make_batches(steps: int, global_batch: int, seed: int = 1):
    """`steps` global batches of (x: (G, 12), y: (G,) in 0..4)."""
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(steps, global_batch, 12, generator=g)
    ys = torch.randint(0, 5, (steps, global_batch), generator=g)
    return xs, ys


# per-replica statistics, masks or branches: the reference cuts the batch the way the ranks do
CHUNKED = {"bn", "dropout", "sometimes"}


def make_optimizer(kind: str, params):
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01)
    if kind == "adamw":  # its defaults hold a key its constructor does not take
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def piece_seed(step: int, piece: int) -> int:
    """The dropout seed of one piece of one global batch, the same for a rank and the reference."""
    return 1000 * step + piece


def train_on_rank(topo, model, optimizer, *, steps: int, global_batch: int, accumulate: int = 1,
                  no_sync: bool = True) -> None:
    """The ranks' side of the parity tests: each step, this rank's `accumulate` pieces of the
    global batch (no_sync() on all but the last; `no_sync=False`: every backward synchronises),
    each loss divided by `accumulate`."""
    xs, ys = make_batches(steps, global_batch)
    pieces = topo.world_size * accumulate
    for step in range(steps):
        for micro in range(accumulate):
            index = topo.rank * accumulate + micro
            x, y = xs[step].chunk(pieces)[index], ys[step].chunk(pieces)[index]
            torch.manual_seed(piece_seed(step, index))
            with model.no_sync() if no_sync and micro < accumulate - 1 else contextlib.nullcontext():
                (F.cross_entropy(model(x), y) / accumulate).backward()
        optimizer.step()
        optimizer.zero_grad()


def reference(name: str, optim: str, *, world: int, accumulate: int, steps: int,
              global_batch: int, data_seed: int = 1) -> dict[str, torch.Tensor]:
    """One process on the same global batches (`make_batches(..., seed=data_seed)`). For the
    CHUNKED models the batch is cut into the ranks' pieces (each its own statistics, seeded mask
    or branch), losses averaged."""
    model = make_model(name)
    opt = make_optimizer(optim, model.parameters())
    xs, ys = make_batches(steps, global_batch, seed=data_seed)
    pieces = world * accumulate if name in CHUNKED else 1
    for step in range(steps):
        for index, (x, y) in enumerate(zip(xs[step].chunk(pieces), ys[step].chunk(pieces))):
            torch.manual_seed(piece_seed(step, index))
            (F.cross_entropy(model(x), y) / pieces).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.named_parameters()}


def mse_in_output_dtype(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """F.mse_loss with the target cast to the output's dtype: torch 2.9's backward of mse_loss
    fails for a bf16 output against an fp32 target ("Found dtype Float but expected BFloat16"),
    where 2.13's promotes (seen running the suite on torch 2.9.1)."""
    return F.mse_loss(output, target.to(output.dtype))


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """`t`'s storage, or None for a tensor that has none: on torch 2.9 gc.get_objects() can hold an
    undefined tensor, whose untyped_storage() raises NotImplementedError."""
    try:
        return t.untyped_storage()
    except NotImplementedError:
        return None


@contextlib.contextmanager
def counting_new_objects():
    """Inside, gc.collect() and gc.get_objects() walk only what was made inside: what exists on
    entry (torch's and paratrain's ~180k objects) is frozen. It existed before any count, so no
    count looks for it, and walking it cost 0.22 s a count in one process, more with ranks sharing
    2 cores; tests/plan/cost/test_memory.py counts five times per strategy (its three runs of every
    strategy: 112 s -> 15 s)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def storages(tensors) -> dict[int, int]:
    """Distinct storages of `tensors` that hold memory: data pointer → bytes."""
    out = {}
    for t in tensors:
        storage = storage_of(t) if t is not None else None
        if storage is not None and storage.nbytes():
            out[storage.data_ptr()] = storage.nbytes()
    return out


def live_tensors() -> list[torch.Tensor]:
    """Every tensor reachable from Python, after a collection."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on torch.distributed's deprecated reduce_op warns
        warnings.simplefilter("ignore", FutureWarning)
        return [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]


def live_storages() -> dict[int, int]:
    """Every tensor storage reachable from Python: data pointer → bytes."""
    return storages(live_tensors())


def resumed_mlp_state(topo, root) -> dict:
    """The full state of a single-process "mlp" session resumed from the newest checkpoint in
    `root` (for run_on_ranks: the session needs a topology)."""
    import paratrain as pt

    session = pt.Session("single", topology=topo, progress_bar=False)
    model = make_model("mlp")
    model, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert session.resume(root)
    return session.full_state_dict()
