"""Buffers (BatchNorm's running statistics) under every strategy: torch DDP's rule, replica 0's
broadcast before each forward that follows a synchronised one, so every rank reports the same
model and evaluates alike. Each rank trains on its own data, so without the rule the ranks'
statistics drift apart."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import paratrain as pt
from paratrain.testing import run_on_ranks

STEPS = 3


def _bn_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 16), nn.ReLU(),
                         nn.Linear(16, 1))


def _data(replica: int, step: int):
    g = torch.Generator().manual_seed(100 * replica + step)
    return torch.randn(8, 4, generator=g) * (1 + replica), torch.randn(8, 1, generator=g)


STRATEGIES = {
    "ddp": (2, lambda: "ddp"),
    "hierarchical": (2, lambda: "hierarchical"),
    "zero1": (2, lambda: "zero1"),
    "zero2": (2, lambda: "zero2"),
    "zero3": (2, lambda: "zero3"),
    "zero3-units": (2, lambda: pt.ZeRO(stage=3, wrap_policy=pt.WrapPolicy(min_params=1))),
    "pipeline": (4, lambda: pt.Pipeline(stages=2, microbatches=1)),
    "mesh": (4, lambda: pt.Mesh(tp=2, tp_plan={"3": "colwise", "5": "rowwise"})),
}


def _train(topo, name):
    """STEPS steps on this replica's data, an evaluation of the same input, one step more: (the
    evaluation, every rank's state dict, torch DDP's after the same calls where it applies)."""
    strategy = STRATEGIES[name][1]()
    session = pt.Session(strategy, topology=topo, progress_bar=False)
    model = _bn_model()
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    replica = model.replica_index  # the ranks of one pipeline or tp group read the same data
    probe = torch.linspace(-1, 1, 12).view(3, 4)
    for step in range(STEPS + 1):
        if step == STEPS:  # the forward's broadcast makes every rank evaluate rank 0's statistics
            model.eval()
            with torch.no_grad():
                evaluated = model(probe)
            model.train()
        session.train_step(_data(replica, step), F.mse_loss)
    state = {k: v.clone() for k, v in session.full_state_dict().items()}  # synchronises the buffers
    reference = None
    if name not in ("pipeline", "mesh"):  # torch's DDP on the same data: same replicas, same rule
        plain = _bn_model()
        ddp = TorchDDP(plain)
        sgd = torch.optim.SGD(plain.parameters(), lr=0.1)
        for step in range(STEPS + 1):
            if step == STEPS:
                ddp.eval()
                with torch.no_grad():
                    ddp(probe)
                ddp.train()
            x, y = _data(topo.rank, step)
            sgd.zero_grad()
            F.mse_loss(ddp(x), y).backward()
            sgd.step()
        reference = {k: v.clone() for k, v in plain.state_dict().items()}
    return evaluated, state, reference


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_rank_holds_and_evaluates_the_same_buffers(name):
    results = run_on_ranks(_train, STRATEGIES[name][0], name, timeout=120)
    evaluated0, state0, reference = results[0]  # torch's rank 0 holds the buffers its DDP keeps
    assert state0["1.num_batches_tracked"] == STEPS + 1
    for rank, (evaluated, state, _) in enumerate(results):
        assert torch.equal(evaluated, evaluated0), f"rank {rank} evaluates differently from rank 0"
        for key, value in state0.items():
            assert torch.equal(state[key], value), f"rank {rank}'s {key} differs from rank 0's"
        if reference is not None:
            for key, value in reference.items():
                torch.testing.assert_close(state[key], value, rtol=0, atol=1e-6, msg=f"{key} on rank {rank}")
