"""DataParallel (one process, several devices) on lists of CPU devices: plain and balanced
training equal single-device training, uneven last batches included; and through a Session."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import paratrain as pt
from paratrain.parallel.dp import DP, DataParallel, gather, replicate, scatter
from paratrain.testing import assert_same_params, run_on_ranks
from tests.support.models import make_batches, make_model

BATCHES = (10, 7, 2)  # the last smaller than three devices: only two replicas get rows
CUDA = torch.cuda.device_count()


def batches():
    xs, ys = make_batches(1, sum(BATCHES), seed=4)
    return list(zip(xs[0].split(BATCHES), ys[0].split(BATCHES)))


def train(model, step_loss):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches():
        step_loss(x, y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def reference(name, devices):
    """One device, the same batches. BatchNorm normalises each replica's rows with their own
    statistics, so for it the reference runs the same row chunks one after another."""
    model = make_model(name)
    pieces = len(devices) if name == "bn" else 1
    return train(model, lambda x, y: F.cross_entropy(
        torch.cat([model(c) for c in x.tensor_split(min(pieces, len(x)))]), y))


def data_parallel(name, devices, balanced):
    dp = DataParallel(make_model(name), devices)
    if balanced:
        return train(dp.module, lambda x, y: dp.loss(x, y, F.cross_entropy))
    return train(dp.module, lambda x, y: F.cross_entropy(dp(x), y))


@pytest.mark.parametrize("balanced", [False, True], ids=["plain", "balanced"])
@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("name", ["mlp", "tied", "bn"])
def test_equals_single_device_training(name, devices, balanced):
    cpus = ["cpu"] * devices
    ours = data_parallel(name, cpus, balanced)
    assert_same_params(ours, reference(name, cpus), atol=1e-6)  # measured: at most 1.2e-7


@pytest.mark.cuda
@pytest.mark.skipif(CUDA == 0, reason="needs a CUDA device; this machine has none")
@pytest.mark.parametrize("balanced", [False, True], ids=["plain", "balanced"])
def test_equals_single_device_training_on_cuda(balanced):
    devices = [0, 1] if CUDA >= 2 else [0, 0]  # one GPU: two replicas share it, threads and all
    model = make_model("mlp").cuda()
    dp = DataParallel(model, devices)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches():
        x, y = x.cuda(), y.cuda()
        loss = dp.loss(x, y, F.cross_entropy) if balanced else F.cross_entropy(dp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    got = {n: p.detach().cpu() for n, p in model.named_parameters()}
    assert_same_params(got, reference("mlp", ["cpu"] * 2), atol=1e-6)  # measured: at most 1.2e-7


def test_replicas_are_separate_modules_whose_gradients_reach_the_model():
    model = make_model("tied")
    replicas = replicate(model, [torch.device("cpu")] * 3)
    assert len({id(r) for r in replicas}) == 3 and all(r is not model for r in replicas)
    assert all(r.out.weight is r.embed.weight for r in replicas)  # ties survive replication
    x = torch.randn(6, 12)
    sum(r(c).square().sum() for r, c in zip(replicas, x.chunk(3))).backward()
    single = make_model("tied")
    single(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), single.parameters()):
        # gradients of a squared sum reach 270: within 1e-6 of the largest (measured: 1.3e-7)
        assert (p.grad - q.grad).abs().max() <= 1e-6 * q.grad.abs().max(), name


def test_scatter_and_gather_keep_structure_and_order():
    x, mask = torch.arange(10.).view(5, 2), torch.arange(5)
    chunks = scatter(((x,), {"mask": mask, "scale": 2.0}), [torch.device("cpu")] * 3)
    assert [c[0][0].shape[0] for c in chunks] == [2, 2, 1]
    assert all(c[1]["scale"] == 2.0 for c in chunks)
    outputs = [{"y": c[0][0], "n": c[1]["mask"].sum()} for c in chunks]
    joined = gather(outputs, torch.device("cpu"))
    assert torch.equal(joined["y"], x) and joined["n"].tolist() == [1, 5, 4]


def test_a_failing_replica_names_itself():
    dp = DataParallel(torch.nn.Linear(3, 2), ["cpu", "cpu"])
    with pytest.raises(RuntimeError, match="replica 0 failed"):
        dp(torch.randn(4, 5))


def _session(topo, strategy):
    session = pt.Session(strategy=strategy, seed=5, topology=topo, progress_bar=False)
    model = make_model("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    xs, ys = make_batches(1, 22, seed=3)  # 22 samples, batch 8: the last batch has 6
    loader = DataLoader(TensorDataset(xs[0], ys[0]), batch_size=8, shuffle=True)
    model, opt, loader = session.setup(model, opt, loader)
    for batch in session.progress(loader):
        session.train_step(batch, F.cross_entropy)
    return type(model).__name__, session.unwrap(model).state_dict()


def test_session_with_dp_equals_single():
    strategies = ["single", DP(devices=("cpu",) * 3), DP(devices=("cpu",) * 3, balanced=True)]
    (_, single), (kind, plain), (_, balanced) = (run_on_ranks(_session, 1, s)[0] for s in strategies)
    assert kind == "DataParallel"
    assert_same_params(plain, single, atol=1e-6)  # measured: at most 1.2e-7
    assert_same_params(balanced, single, atol=1e-6)  # measured: at most 1.2e-7
