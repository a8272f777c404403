"""torch's nn.SyncBatchNorm runs on GPUs only: on the CPU it is refused at setup, by name, under
every strategy, instead of raising at the first forward."""

import re

import pytest
import torch
from torch import nn

import paratrain as pt
from paratrain.testing import run_on_ranks

MESSAGE = (r"1 is a torch.nn.SyncBatchNorm, which runs on GPUs only \(this job's device is cpu\): keep "
           r"nn.BatchNorm on the CPU")


def _converted():
    return nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)))


def _setup(topo, strategy):
    torch_says = None
    try:  # what setup spares the user: torch's own error, at the first training forward
        nn.SyncBatchNorm(4).train()(torch.randn(3, 4))
    except ValueError as error:
        torch_says = str(error)
    session = pt.Session(strategy, topology=topo, progress_bar=False)
    model = _converted()
    try:
        session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    except pt.ConfigError as error:
        return torch_says, str(error)
    return torch_says, None


@pytest.mark.parametrize("strategy,world", [("single", 1), ("ddp", 2), ("zero3", 2), ("zero2", 2)])
def test_torch_sync_batchnorm_on_the_cpu_is_refused_at_setup(strategy, world):
    for torch_says, refusal in run_on_ranks(_setup, world, strategy, timeout=120):
        assert torch_says is not None and "expected input tensor to be on GPU" in torch_says
        assert refusal is not None and re.search(MESSAGE, refusal), refusal


def test_a_session_without_ranks_refuses_it_too():
    with pt.Session("single", progress_bar=False) as session, pytest.raises(pt.ConfigError, match=MESSAGE):
        session.setup(_converted())
    assert isinstance(_converted()[1], nn.SyncBatchNorm)  # what the user converted, as torch does

