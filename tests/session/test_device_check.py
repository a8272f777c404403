"""The finite check without a wait for the device (step.py, DeviceCheck): with a fused optimizer
on a GPU, the check's total becomes the optimizer's found_inf, its fused kernels skip a
non-finite step on the device, and the host raises one optimizer step later.

On this CPU machine the choice is made as on a GPU (`_on_the_cpu_too`): CPU fused AdamW takes
found_inf the same way, so the skip, the late error, and the state after it are tested here; the
cuda-marked test checks a GPU takes that path by itself."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import paratrain as pt
import paratrain.session.progress as progress_module
from paratrain.components.optim import skips_on_device
from paratrain.session.step import DeviceCheck
from paratrain.testing import max_param_diff, run_on_ranks
from tests.support.models import make_batches, make_model

XS, YS = make_batches(3, 12, seed=5)
CUDA = torch.cuda.device_count()


def _on_the_cpu_too():
    """DeviceCheck.wanted without its CUDA condition: what a GPU run chooses, on CPU tensors."""
    DeviceCheck.wanted = staticmethod(lambda optimizer, scaler, nan_check: (
        nan_check and scaler is None and skips_on_device(optimizer)))


def _fused_adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)


def _poisoned_run(topo, strategy, poison_step, what="gradient", device_check=True, clip=None, tmp=None):
    """Three optimizer steps of the MLP with fused AdamW; at `poison_step` rank 1's gradient of the
    first layer (or its loss) turns NaN. Returns, per step: the error its train_step raised (or
    None) and how far the parameters moved in it; then the optimizer's step counts and the
    whole state dict after the last."""
    if device_check:
        _on_the_cpu_too()
    session = pt.Session(strategy, topology=topo, progress_bar=False, max_grad_norm=clip)
    model = make_model("mlp")
    model, opt = session.setup(model, _fused_adamw(model))
    assert (session._on_device is not None) == device_check
    poison = {"on": False}
    if topo.rank == 1 and what == "gradient":
        def poisoned(module, args, out):
            if poison["on"]:
                out.register_hook(lambda g: g * float("nan"))
        session.unwrap(model).net[0].register_forward_hook(poisoned)
    steps = []
    for i in range(3):
        poison["on"] = i == poison_step
        x, y = XS[i].chunk(topo.world_size)[topo.rank], YS[i].chunk(topo.world_size)[topo.rank]
        nan_loss = what == "loss" and poison["on"] and topo.rank == 1
        loss_fn = (lambda out, t: F.cross_entropy(out, t) * float("nan")) if nan_loss else F.cross_entropy
        before = {k: v.clone() for k, v in session.full_state_dict().items()}
        try:
            if tmp is not None and i == poison_step + 1:
                session.checkpoint(tmp)
            session.train_step((x, y), loss_fn)
            error = None
        except pt.UsageError as e:
            error = str(e)
        steps.append((error, max_param_diff(before, session.full_state_dict())))
        if error is not None:
            break
    counts = sorted({float(s["step"]) for s in opt.state.values()})
    return steps, counts, session.full_state_dict()


@pytest.mark.parametrize("strategy, clip", [("ddp", None), ("ddp", 1.0), ("zero1", None), ("zero2", None),
                                            ("zero3", None), ("zero3", 1.0)])
def test_a_nan_gradient_is_skipped_on_the_device_and_stops_every_rank_at_the_next_step(strategy, clip):
    for steps, counts, _ in run_on_ranks(_poisoned_run, 3, strategy, 1, clip=clip, timeout=180):
        (first, moved0), (second, moved1), (third, moved2) = steps
        assert first is None and moved0 > 0
        assert second is None and moved1 == 0  # the fused kernels left every parameter as it was
        assert third is not None and "a gradient was NaN or infinite at optimizer step 1" in third
        assert "skipped that step on the device" in third and moved2 == 0
        assert counts == [1.0]  # the skipped step's count was undone, as torch's GradScaler does


def test_a_nan_loss_is_named_by_its_micro_batch_one_step_later():
    results = run_on_ranks(_poisoned_run, 2, "ddp", 0, "loss", timeout=120)
    for rank, (steps, counts, _) in enumerate(results):
        assert steps[0] == (None, 0.0) and len(steps) == 2 and steps[1][1] == 0
        if rank == 1:
            assert steps[1][0].startswith("the loss is nan at optimizer step 0 (micro-batch 0, epoch 0) on rank 1")
        else:  # its gradients are the average of rank 1's NaN ones
            assert "a gradient was NaN or infinite at optimizer step 0" in steps[1][0]
        assert counts == [0.0]  # the one step taken was skipped: its count undone


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_finite_steps_are_the_same_as_with_the_check_on_the_host(strategy):
    """found_inf = 0 changes nothing: three clean steps give the same parameters, to the bit."""
    device = run_on_ranks(_poisoned_run, 3, strategy, None, timeout=120)
    host = run_on_ranks(_poisoned_run, 3, strategy, None, device_check=False, timeout=120)
    for (steps, counts, state), (host_steps, host_counts, host_state) in zip(device, host):
        assert [e for e, _ in steps] == [None] * 3 and counts == host_counts == [3.0]
        assert max_param_diff(state, host_state) == 0


def test_a_checkpoint_after_a_skipped_step_raises_its_error_and_is_not_written(tmp_path):
    for steps, _, _ in run_on_ranks(_poisoned_run, 2, "ddp", 0, tmp=str(tmp_path), timeout=120):
        assert len(steps) == 2 and "at optimizer step 0" in steps[1][0]
    assert not list(tmp_path.glob("step-*"))


def _single_after_a_nan_step(monkeypatch, **kwargs):
    """A session on the CPU, checked as on a GPU, whose one optimizer step had a NaN loss."""
    monkeypatch.setattr(DeviceCheck, "wanted", staticmethod(lambda optimizer, scaler, nan_check: nan_check))
    session = pt.Session("single", progress_bar=False, **kwargs)
    model = make_model("mlp")
    model, opt = session.setup(model, _fused_adamw(model))
    session.train_step((XS[0], YS[0]), lambda out, y: F.cross_entropy(out, y) * float("nan"))
    return session


def test_close_raises_the_last_steps_error_unless_another_is_on_its_way(monkeypatch):
    with pytest.raises(pt.UsageError, match="the loss is nan at optimizer step 0"):
        _single_after_a_nan_step(monkeypatch).close()
    with pytest.raises(pt.UsageError, match="the loss is nan at optimizer step 0"):
        with _single_after_a_nan_step(monkeypatch):
            raise SystemExit(0)  # a script's own exit is no error: the step's is raised
    with pytest.raises(KeyError, match="the user's own"):
        with _single_after_a_nan_step(monkeypatch):
            raise KeyError("the user's own")


def test_loading_a_checkpoint_after_a_skipped_step_raises_its_error_first(monkeypatch, tmp_path):
    with pt.Session("single", progress_bar=False) as session:
        model = make_model("mlp")
        session.setup(model, _fused_adamw(model))
        session.train_step((XS[1], YS[1]), F.cross_entropy)
        session.save(tmp_path / "good")
    session = _single_after_a_nan_step(monkeypatch)
    with pytest.raises(pt.UsageError, match="the loss is nan at optimizer step 0"):
        session.load(tmp_path / "good")
    session.load(tmp_path / "good")  # the error was said: the load goes on
    session.close()


def test_a_progress_pass_raises_its_last_steps_error_when_it_ends(monkeypatch):
    monkeypatch.setattr(DeviceCheck, "wanted", staticmethod(lambda optimizer, scaler, nan_check: nan_check))
    session = pt.Session("single", progress_bar=False)
    model = make_model("mlp")
    data = TensorDataset(XS.reshape(-1, 12), YS.reshape(-1))
    model, opt, loader = session.setup(model, _fused_adamw(model), DataLoader(data, batch_size=12))
    seen = []
    with pytest.raises(pt.UsageError, match="the loss is nan at optimizer step 2"):
        for batch in session.progress(loader):
            last = len(seen) == len(loader) - 1
            session.train_step(batch, lambda out, y: F.cross_entropy(out, y) * (float("nan") if last else 1.0))
            seen.append(batch)
    assert len(seen) == 3 and session.epoch == 0  # the pass did not count as done
    session.close()


def test_the_progress_bar_reads_the_loss_only_when_it_redraws(monkeypatch):
    """Reading the loss waits for the device: a bar that redraws twice a second reads it as
    often, not at every step (a 24-step pass in under half a second: once at most)."""
    reads = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append(1) or item(t))

    def one_pass():
        reads.clear()
        with pt.Session("single", progress_bar=True, nan_check=False) as session:
            model = make_model("mlp")
            data = TensorDataset(torch.randn(24, 12), torch.randint(0, 5, (24,)))
            model, opt, loader = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                               DataLoader(data, batch_size=1))
            for batch in session.progress(loader):
                session.train_step(batch, F.cross_entropy)
        return len(reads)

    rule = progress_module._redraw_due
    monkeypatch.setattr(progress_module, "_redraw_due", lambda bar: False)
    elsewhere = one_pass()  # what the session reads besides the bar
    monkeypatch.setattr(progress_module, "_redraw_due", lambda bar: True)
    assert one_pass() == elsewhere + 24  # a redraw due at every step: a read at every step
    monkeypatch.setattr(progress_module, "_redraw_due", rule)
    assert one_pass() <= elsewhere + 1  # tqdm's own rule: at most one redraw in this pass


def test_the_device_check_is_chosen_only_for_fused_optimizers_stepping_cuda_tensors():
    model = make_model("mlp")
    fused, plain = _fused_adamw(model), torch.optim.AdamW(model.parameters())
    assert skips_on_device(fused) and skips_on_device(torch.optim.Adam(model.parameters(), fused=True))
    assert not skips_on_device(plain)
    # fused SGD takes found_inf, but its first step would keep momentum buffers it never wrote
    assert not skips_on_device(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True))
    params = list(model.parameters())
    mixed = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "fused": False}], fused=True)
    assert not skips_on_device(mixed)  # a group on the foreach path would refuse found_inf
    assert not DeviceCheck.wanted(fused, None, True)  # CPU tensors: waiting costs nothing there
    assert not DeviceCheck.wanted(plain, None, True)
    with pt.Session("single", progress_bar=False) as session:  # and a Session on the CPU waits
        session.setup(model, fused)
        assert session._on_device is None


def _on_a_gpu(topo):
    session = pt.Session("ddp", topology=topo, progress_bar=False, precision="bf16")
    model = make_model("mlp")
    model, opt = session.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01, fused=True))
    chosen = session._on_device is not None
    x, y = XS[0].cuda(), YS[0].cuda()
    session.train_step((x, y), F.cross_entropy)
    before = {k: v.clone() for k, v in session.full_state_dict().items()}
    session.train_step((x, y), lambda out, t: F.cross_entropy(out, t) * float("nan"))
    moved = max_param_diff(before, session.full_state_dict())
    try:
        session.train_step((x, y), F.cross_entropy)
        error = None
    except pt.UsageError as e:
        error = str(e)
    return chosen, moved, error


@pytest.mark.cuda
@pytest.mark.skipif(CUDA == 0, reason="needs a CUDA device; this machine has none")
def test_on_a_gpu_a_fused_optimizer_is_checked_on_the_device():
    chosen, moved, error = run_on_ranks(_on_a_gpu, 1, backend="nccl", timeout=120)[0]
    assert chosen and moved == 0
    assert error is not None and error.startswith("the loss is nan at optimizer step 1")
