"""Session end to end: the same script under 'single' and 'ddp' trains the same model."""


import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import paratrain as pt
from paratrain.testing import assert_same_params, run_on_ranks
from tests.support.models import make_batches, make_model

EPOCHS, GLOBAL_BATCH = 2, 8


def _dataset():
    xs, ys = make_batches(1, 40, seed=3)
    return TensorDataset(xs[0], ys[0])


def _train(topo, strategy, accumulate, max_grad_norm=None):
    if strategy == "zero3-units":  # stage 3 cut into several units, one per Linear
        strategy = pt.ZeRO(stage=3, wrap_policy=pt.WrapPolicy(module_classes=(torch.nn.Linear,)))
    session = pt.Session(strategy=strategy, accumulate=accumulate, seed=5,
                         max_grad_norm=max_grad_norm, topology=topo, progress_bar=False)
    model = make_model("mlp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(_dataset(), batch_size=GLOBAL_BATCH // accumulate, shuffle=True)
    model, optimizer, loader = session.setup(model, optimizer, loader)
    seen = []  # per epoch, the inputs this rank trained on
    for _ in range(EPOCHS):
        rows = []
        for batch in session.progress(loader):
            rows.append(batch[0].clone())
            session.train_step(batch, F.cross_entropy)
        seen.append(torch.cat(rows))
    return session.full_state_dict(), seen, session.epoch


@pytest.mark.parametrize("world,accumulate,clip", [(2, 1, None), (4, 1, None), (2, 2, None),
                                                   (2, 1, 0.05)])
def test_ddp_session_equals_single_session(world, accumulate, clip):
    single, _, _ = run_on_ranks(_train, 1, "single", accumulate, clip)[0]
    results = run_on_ranks(_train, world, "ddp", accumulate, clip)
    for state, _, epochs in results:
        assert epochs == EPOCHS
        assert_same_params(state, single, atol=1e-6)  # measured: at most 6.0e-8


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "zero3-units"])
@pytest.mark.parametrize("accumulate,clip", [(1, 0.05), (2, None)])
def test_zero_session_equals_single_session(strategy, accumulate, clip):
    single, _, _ = run_on_ranks(_train, 1, "single", accumulate, clip)[0]
    for state, _, _ in run_on_ranks(_train, 2, strategy, accumulate, clip):
        assert_same_params(state, single, atol=1e-6)  # measured: at most 6.0e-8


def _indices(rows: torch.Tensor) -> list[int]:
    """Which samples of the dataset these input rows are (its rows are distinct random vectors)."""
    matches = (rows[:, None, :] == _dataset().tensors[0][None]).all(-1).nonzero()
    assert len(matches) == len(rows)
    return matches[:, 1].tolist()


def test_ranks_read_disjoint_shares_that_cover_each_epoch():
    per_rank = [[_indices(rows) for rows in seen] for _, seen, _ in run_on_ranks(_train, 2, "ddp", 1)]
    for epoch in range(EPOCHS):
        first, second = (rank[epoch] for rank in per_rank)
        assert len(first) == len(second) == 20 and not set(first) & set(second)
        assert sorted(first + second) == list(range(40))  # every sample once per epoch
    assert per_rank[0][0] != per_rank[0][1]  # reshuffled: another order, and another share


def _misuse(topo, case):
    session = pt.Session("ddp", topology=topo, progress_bar=False)
    model = make_model("mlp")
    if case == "optimizer of another model":
        session.setup(model, torch.optim.SGD(make_model("mlp").parameters(), lr=0.1))
    elif case == "batch not divisible":
        session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      DataLoader(_dataset(), batch_size=3))
    elif case == "step before setup":
        session.train_step((torch.zeros(2, 12), torch.zeros(2, dtype=torch.long)), F.cross_entropy)


@pytest.mark.parametrize("case,error,message", [
    ("optimizer of another model", "ConfigError", "not parameters of the model"),
    ("batch not divisible", "ConfigError", "multiple of the 2 data-parallel replicas"),
    ("step before setup", "UsageError", "call session.setup"),
])
def test_misuse_is_a_clear_error(case, error, message):
    with pytest.raises(pt.testing.RankFailure, match=f"{error}: .*{message}"):
        run_on_ranks(_misuse, 2, case, timeout=60)


def test_unknown_strategy_names_the_choices():
    with pytest.raises(pt.ConfigError, match=r"unknown strategy 'zero9'.*'ddp'"):
        pt.Session(strategy="zero9")


def _single_on_two(topo):
    pt.Session("single", topology=topo).setup(make_model("mlp"))


def test_single_strategy_refuses_many_processes():
    with pytest.raises(pt.testing.RankFailure, match="strategy 'single' runs one process"):
        run_on_ranks(_single_on_two, 2, timeout=60)


def test_accumulate_must_be_positive():
    with pytest.raises(pt.ConfigError, match="accumulate must be at least 1"):
        pt.Session("single", accumulate=0)


def test_train_step_names_the_batch_it_expects():
    session = pt.Session("single", progress_bar=False)
    try:
        session.setup(make_model("mlp"), None)
        with pytest.raises(pt.UsageError, match="batch = \\(inputs, targets\\), or a dict of model inputs; got a tuple of 3"):
            session.train_step((torch.zeros(2, 12),) * 3, F.cross_entropy)
        with pytest.raises(pt.UsageError, match="gives loss_fn\\(outputs, targets\\) its 'labels'.*keys \\['x'\\]"):
            session.train_step({"x": torch.zeros(2, 12)}, F.cross_entropy)
    finally:
        session.close()


def test_progress_counts_epochs_of_the_training_loader_only():
    session = pt.Session("single", progress_bar=False)
    try:
        model = make_model("mlp")
        _, _, train = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    DataLoader(_dataset(), batch_size=8, shuffle=True))
        for _ in session.progress(DataLoader(_dataset(), batch_size=8)):  # validation: no epoch
            pass
        for _ in session.progress(train):
            break  # an interrupted pass is not an epoch either
        assert session.epoch == 0
        for _ in session.progress(train):
            pass
        assert session.epoch == 1 and train.sampler.epoch == 0
    finally:
        session.close()


def _outputs_alive_in_backward(topo, strategy):
    """Whether train_step's model outputs were still alive when backward reached the first layer."""
    import weakref
    session = pt.Session(strategy, topology=topo, progress_bar=False)
    model = make_model("mlp")
    model, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    outputs, alive = {}, []
    first = next(p for p in session.unwrap(model).parameters())
    first.register_hook(lambda g: alive.append(outputs["ref"]() is not None))

    def loss_fn(out, y):
        outputs["ref"] = weakref.ref(out)
        return F.cross_entropy(out, y)

    xs, ys = make_batches(1, 8)
    session.train_step((xs[0], ys[0]), loss_fn)
    return alive


def _autocast_in_backward(topo, strategy, manual):
    """Whether autocast was on when backward reached each parameter, under precision="bf16"."""
    pipeline = strategy == "pipeline"
    session = pt.Session(pt.Pipeline(stages=2, microbatches=2) if pipeline else strategy, precision="bf16",
                         topology=topo, progress_bar=False)
    model = make_model("mlp").net if pipeline else make_model("mlp")
    model, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    seen = []
    for p in session.unwrap(model).parameters():
        p.register_hook(lambda g: seen.append(torch.is_autocast_enabled("cpu")))
    xs, ys = make_batches(1, 8)
    if manual:
        with session.accumulation():
            assert torch.is_autocast_enabled("cpu")  # forward and the loss run under it
            session.backward(F.cross_entropy(model(xs[0]), ys[0]))
        session.step()
    else:
        session.train_step((xs[0], ys[0]), F.cross_entropy)
    return seen


@pytest.mark.parametrize("strategy,world,manual", [("single", 1, False), ("single", 1, True), ("ddp", 1, False),
                                                   ("pipeline", 2, False)])
def test_backward_runs_with_autocast_off(strategy, world, manual):
    """torch's AMP recipe runs backward outside autocast. On CUDA the autograd engine hands the
    caller's autocast on to its device threads, and a bf16 GPT step under it ran 4 more kernels
    per block on an H200 (torch.profiler); here backward runs on the calling thread, where a
    gradient hook sees the same state."""
    for seen in run_on_ranks(_autocast_in_backward, world, strategy, manual):
        assert seen and not any(seen), seen


@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_train_step_lets_the_outputs_go_before_backward(strategy):
    """A language model's logits are batch × tokens × vocabulary (64 MiB for bench/session.py's
    GPT; gigabytes at a 50k vocabulary): autograd keeps what backward needs, so train_step drops
    the outputs once the loss is computed, as a plain loop does. Held through backward they cost
    that memory and, in bench/session.py, 2-3 % of the GPT's step."""
    assert run_on_ranks(_outputs_alive_in_backward, 1, strategy) == [[False]]


# -- per-rank randomness, the size of a sharded model ------------------------------------------

def _seeds_and_sizes(topo):
    session = pt.Session("zero3", topology=topo, progress_bar=False)
    model = make_model("mlp")
    expected = sum(p.numel() for p in model.parameters())
    model, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    xs, ys = make_batches(1, 4, seed=1)
    session.train_step((xs[0], ys[0]), F.cross_entropy)
    return session.rank_seed, session.num_parameters(), session.num_parameters(trainable_only=True), expected


def test_rank_seeds_differ_and_parameter_counts_are_whole_under_zero3():
    results = run_on_ranks(_seeds_and_sizes, 2)
    assert results[0][0] != results[1][0]
    for _, total, trainable, expected in results:
        assert total == trainable == expected
