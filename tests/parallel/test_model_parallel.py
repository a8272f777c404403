"""Naive model parallelism: layers on two (CPU or CUDA) devices, with and without micro-batches,
train exactly as one device does."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import paratrain as pt
from paratrain.distributed.grid import ProcessGrid
from paratrain.distributed.topology import Topology
from paratrain.errors import ConfigError
from paratrain.parallel.model_parallel import LayersOnDevices, ModelParallel
from paratrain.testing import assert_same_params, run_on_ranks
from tests.support.pipeline_models import batches, chain

STEPS = 3
CUDA = torch.cuda.device_count()


def _reference(steps=STEPS):
    model = chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    xs, ys = batches(steps)
    for x, y in zip(xs, ys):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _train_split(devices, microbatches, balance="layers"):
    model = chain()
    split = LayersOnDevices(model, devices, microbatches=microbatches, balance=balance)
    opt = torch.optim.SGD(split.parameters(), lr=0.1, momentum=0.9)
    xs, ys = batches()
    for x, y in zip(xs, ys):
        F.cross_entropy(split(x), y.to(split.output_device)).backward()
        opt.step()
        opt.zero_grad()
    return split, {k: v.cpu() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("devices,microbatches", [(("cpu", "cpu"), 1), (("cpu", "cpu"), 4),
                                                  (("cpu", "cpu", "cpu"), 3), (("cpu", "cpu"), 24)])
def test_layers_on_cpu_devices_train_like_one_device(devices, microbatches):
    split, state = _train_split(devices, microbatches)
    assert len(split.parts) == len(devices)
    assert_same_params(state, _reference(), atol=1e-6)  # measured: at most 3.0e-8


@pytest.mark.cuda
@pytest.mark.skipif(CUDA < 1, reason="needs a CUDA device (this machine has none)")
@pytest.mark.parametrize("microbatches", [1, 4])
def test_layers_on_cuda_devices_train_like_one_device(microbatches):
    devices = [f"cuda:{i % CUDA}" for i in range(2)]  # two devices, or one GPU twice
    split, state = _train_split(devices, microbatches)
    assert [next(p.parameters()).device for p in split.parts] == [torch.device(d) for d in devices]
    assert_same_params(state, _reference(), atol=1e-6)  # measured: at most 3.0e-8


def test_parts_follow_the_balance_and_keys_are_the_models():
    split = LayersOnDevices(chain(), ["cpu", "cpu"], balance="params")
    sizes = [sum(p.numel() for p in part.parameters()) for part in split.parts]
    assert abs(sizes[0] - sizes[1]) < 300  # of 1,125 parameters
    assert list(split.state_dict()) == ["module." + k for k in chain().state_dict()]


def _session(topo, microbatches):
    session = pt.Session(strategy=ModelParallel(devices=["cpu", "cpu"], microbatches=microbatches),
                         topology=topo, progress_bar=False)
    xs, ys = batches()
    loader = DataLoader(TensorDataset(xs.flatten(0, 1), ys.flatten()), batch_size=xs.shape[1])
    model = chain()
    model, opt, loader = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       loader)
    for batch in session.progress(loader):
        session.train_step(batch, F.cross_entropy)
    return session.unwrap().state_dict()


def test_session_with_model_parallel_strategy():
    states = run_on_ranks(_session, 1, 4)
    assert_same_params(states[0], _reference(), atol=1e-6)  # measured: at most 3.0e-8


def test_misuse():
    with pytest.raises(ConfigError, match="4 micro-batches do not divide the batch of 6"):
        LayersOnDevices(chain(), ["cpu", "cpu"], microbatches=4)(torch.randn(6, 12))
    with pytest.raises(ConfigError, match="cannot cut 9 layers into 10 stages"):
        LayersOnDevices(chain(), ["cpu"] * 10)
    with pytest.raises(ConfigError, match="runs in one process"):
        ModelParallel(devices=("cpu", "cpu")).setup(chain(), None, ProcessGrid(Topology.from_env({}, rank=0, world_size=2)))
    if CUDA == 0:
        with pytest.raises(ConfigError, match="has none"):
            ModelParallel().setup(chain(), None, ProcessGrid(Topology.from_env({})))
