"""Step hooks (session/hooks.py): what a `Session(hooks=[...])` hook is called with, and when."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain as pt
from paratrain.testing import run_on_ranks


class Calls(pt.StepHook):
    def __init__(self):
        self.calls = []

    def on_setup(self, model):
        self.calls.append(("setup", type(model).__name__))

    def on_batch(self, inputs):
        self.calls.append(("batch", len(inputs)))

    def on_loss(self, loss, weight):
        self.calls.append(("loss", loss.requires_grad, weight))

    def before_step(self, model):
        # the gradients the optimizer is about to read: reduced over the ranks already
        self.calls.append(("before", model.module[0].weight.grad.clone()))

    def after_step(self, session, result):
        self.calls.append(("after", session.micro_step, result.stepped))


def _train(topo):
    torch.manual_seed(0)
    hook = Calls()
    session = pt.Session("ddp", topology=topo, progress_bar=False, accumulate=2, hooks=[hook])
    model = nn.Sequential(nn.Linear(4, 3))
    model, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(1 + topo.rank)  # each rank its own data
    for _ in range(4):
        session.train_step((torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)), F.mse_loss)
    session.close()
    return hook.calls


def test_a_hook_sees_each_micro_batch_its_loss_and_each_optimizer_step_in_order():
    ranks = run_on_ranks(_train, 2, timeout=120)
    names = [call[0] for call in ranks[0]]
    assert names == ["setup", "batch", "loss", "batch", "loss", "before", "after",
                     "batch", "loss", "batch", "loss", "before", "after"]
    calls = ranks[0]
    assert calls[0] == ("setup", "Sequential")  # the model as given, before the strategy wraps it
    assert calls[1] == ("batch", 5) and calls[2] == ("loss", False, None)  # detached
    assert calls[6] == ("after", 2, True) and calls[12] == ("after", 4, True)
    for step in (5, 11):  # the gradients are the ranks' average by then: the same on both
        assert torch.equal(ranks[0][step][1], ranks[1][step][1])


def test_an_object_that_is_no_hook_is_refused_by_name():
    with pytest.raises(pt.ConfigError, match="dict is no step hook"):
        pt.Session("single", progress_bar=False, hooks=[{}])
    pt.destroy()
