"""Mixed precision through Session: bf16 autocast parity, and the fp16 grad scaler over sharded
gradients — an overflow seen by one rank makes every rank skip the step.

CPU autocast in torch 2.13 runs fp16 as well as bf16, so the fp16 path (autocast + scaler) is the
real one here, not a stand-in; on CUDA the same code runs under nccl."""

import pytest
import torch
import torch.nn.functional as F

import paratrain as pt
from paratrain.components.precision import GradScaler
from paratrain.testing import assert_same_params, max_param_diff, run_on_ranks
from tests.support.models import make_batches, make_model

STEPS, GLOBAL_BATCH, WORLD = 3, 16, 2


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


# -- the scaler alone (one process, nothing to reduce) -----------------------------------------------

def test_scaler_skips_and_backs_off_on_inf_then_grows_after_interval():
    scaler = GradScaler(init_scale=8.0, growth_interval=2)
    assert scaler.scale(torch.tensor(1.5)).item() == 12.0
    grads = [torch.tensor([8.0, 16.0])]
    assert scaler.unscale_(grads) is False and grads[0].tolist() == [1.0, 2.0]
    assert scaler.unscale_(grads) is False and grads[0].tolist() == [1.0, 2.0]  # once per step
    scaler.update()
    assert scaler.scale_value == 8.0  # one good step of two
    assert scaler.unscale_([torch.tensor([1.0, float("inf")])]) is True
    scaler.update()
    assert (scaler.scale_value, scaler.good_steps, scaler.skipped_steps) == (4.0, 0, 1)
    for _ in range(2):
        assert scaler.unscale_([torch.tensor([1.0])]) is False
        scaler.update()
    assert scaler.scale_value == 8.0  # grew after 2 good steps in a row
    again = GradScaler()
    again.load_state_dict(scaler.state_dict())
    assert again.state_dict() == scaler.state_dict()


def test_scaler_applies_the_token_factor_with_the_unscale():
    scaler = GradScaler(init_scale=4.0)
    grads = [torch.tensor([4.0, 8.0])]
    scaler.unscale_(grads, factor=0.5)
    assert grads[0].tolist() == [0.5, 1.0]


def test_bad_precision_and_scaler_settings_are_clear_errors():
    with pytest.raises(pt.ConfigError, match="precision must be one of"):
        pt.Session("single", precision="fp8")
    with pytest.raises(pt.ConfigError, match="grad_scaler is for precision='fp16'"):
        pt.Session("single", precision="bf16", grad_scaler=GradScaler())
    with pytest.raises(pt.ConfigError, match="growth_factor > 1"):
        GradScaler(growth_factor=1.0)


# -- bf16: DDP and ZeRO-3 against one process --------------------------------------------------------

def _train_mlp(session, topo, steps):
    """`steps` steps of the MLP, each rank on its slice of the global batch; the full state."""
    model = make_model("mlp")
    model, _ = session.setup(model, _sgd(model.parameters()))
    xs, ys = make_batches(steps, GLOBAL_BATCH)
    for step in range(steps):
        x, y = xs[step].chunk(topo.world_size)[topo.rank], ys[step].chunk(topo.world_size)[topo.rank]
        session.train_step((x, y), F.cross_entropy)
    return session.full_state_dict()


def _bf16_train(topo, strategy):
    return _train_mlp(pt.Session(strategy, precision="bf16", topology=topo, progress_bar=False), topo, STEPS)


def _reference(dtype, pieces):
    """One process; each step's batch in `pieces` chunks whose gradients accumulate (pieces=1:
    the whole batch at once)."""
    model = make_model("mlp")
    optimizer = _sgd(model.parameters())
    xs, ys = make_batches(STEPS, GLOBAL_BATCH)
    for step in range(STEPS):
        for x, y in zip(xs[step].chunk(pieces), ys[step].chunk(pieces)):
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(model(x), y) / pieces
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_bf16_matches_one_process_under_autocast(strategy):
    """Exact against one process that runs each rank's half-batch under bf16 autocast and
    accumulates: each half's bf16 matmuls round identically, and averaging two fp32 gradients
    ((a + b) / 2, or a/2 + b/2 in ZeRO-3) is exact in either order since halving is exact.

    Against the whole batch in one bf16 matmul the results differ by bf16 rounding (the
    reference rounds one product over 16 rows, we round two over 8): each gradient element by up
    to a few bf16 ulps (2^-8 relative), so over 3 SGD steps (lr 0.1, momentum 0.9: a gradient
    reaches the weights with factor at most 0.1·(1 + 1.9 + 2.71) < 0.6) and gradients below 1 in
    this model, the weights differ by well under 0.6 · 4 · 2^-8 ≈ 1e-2 (measured: 1.2e-4).
    And autocast must really be on: fp32 training ends 1.6e-4 away, where fp32 parity is ~1e-8."""
    ours = run_on_ranks(_bf16_train, WORLD, strategy)
    for state in ours:
        assert_same_params(state, _reference(torch.bfloat16, pieces=WORLD), atol=0)
        assert_same_params(state, _reference(torch.bfloat16, pieces=1), atol=1e-2)
    assert max_param_diff(ours[0], _reference(None, pieces=1)) > 1e-5


# -- fp16: an overflow on one rank, every rank skips -------------------------------------------------

# where to put the inf so that, after the gradient reduction, only rank 1 holds it: under ZeRO 1/2
# the bucket is in registration order, as torch's DDP lays it out (net.4.bias last: rank 1's
# half); under ZeRO-3 the flat buffer is in forward order (net.4.bias last). DDP replicates every
# gradient anyway. In a two-stage pipeline rank 0 holds the first layers ("0" of its stage) and
# rank 1 the rest.
TARGET = {"ddp": ("net.0", "weight"), "zero1": ("net.4", "bias"), "zero2": ("net.4", "bias"),
          "zero3": ("net.4", "bias"), "pipeline": ("0", "weight")}
POISONED_STEP = 2


def _poison_on(session, module_name: str, attr: str, state: dict) -> None:
    """While state["on"]: on rank 0 only, one element of `attr`'s gradient becomes inf. A tensor
    hook on whatever the module's attribute is at forward time (a parameter, or under ZeRO-3 a
    view of the gathered buffer), so the inf enters before any gradient communication."""
    def poison(grad):
        if not state["on"]:
            return grad
        grad = grad.clone()
        grad.view(-1)[-1] = float("inf")
        return grad

    def pre_forward(module, args):
        if state["on"] and state["armed"]:
            state["armed"] = False
            getattr(module, attr).register_hook(poison)

    if session.rank == 0:
        session.unwrap().get_submodule(module_name).register_forward_pre_hook(pre_forward)


class _Recording(GradScaler):
    """Notes whether this rank's own gradients held an inf, before the flag is reduced."""

    def unscale_(self, grads, group=None, *, factor=1.0):
        self.local_inf = any(not torch.isfinite(g).all() for g in grads)
        return super().unscale_(grads, group, factor=factor)


def _fp16_train(topo, strategy):
    scaler = _Recording(init_scale=2.0 ** 10, growth_interval=3)
    session = pt.Session(pt.Pipeline(stages=2, microbatches=2) if strategy == "pipeline" else strategy,
                         precision="fp16", grad_scaler=scaler, topology=topo, progress_bar=False)
    model = make_model("mlp").net if strategy == "pipeline" else make_model("mlp")
    model, _ = session.setup(model, _sgd(model.parameters()))
    state = {"on": False, "armed": True}
    _poison_on(session, *TARGET[strategy], state)
    xs, ys = make_batches(5, GLOBAL_BATCH)
    log, skipped = [], 0
    for step in range(5):
        x, y = xs[step].chunk(topo.world_size)[topo.rank], ys[step].chunk(topo.world_size)[topo.rank]
        state["on"] = step == POISONED_STEP
        before = {k: v.clone() for k, v in session.full_state_dict().items()}  # not live views
        if strategy == "pipeline":  # every stage reads the same batch
            session.train_step((xs[step], ys[step]), F.cross_entropy)
            returned = None
        else:
            with session.accumulation():
                session.backward(F.cross_entropy(model(x), y))
            returned = session.step()
        stepped, skipped = scaler.skipped_steps == skipped, scaler.skipped_steps
        assert returned in (None, stepped)  # step() says whether the optimizer stepped
        log.append({"stepped": stepped, "local_inf": scaler.local_inf, "scale": scaler.scale_value,
                    "unchanged": max_param_diff(before, session.full_state_dict()) == 0})
    return log, session.full_state_dict()


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "pipeline"])
def test_inf_on_one_rank_makes_every_rank_skip(strategy):
    results = run_on_ranks(_fp16_train, WORLD, strategy)
    logs = [log for log, _ in results]
    for log in logs:
        # scale 2^10; steps 0, 1 good; step 2 skipped: halved, count reset; steps 3, 4, then 5
        # would grow it (growth_interval 3)
        assert [e["stepped"] for e in log] == [True, True, False, True, True]
        assert [e["scale"] for e in log] == [1024.0, 1024.0, 512.0, 512.0, 512.0]
        assert [e["unchanged"] for e in log] == [False, False, True, False, False]
    seen = [log[POISONED_STEP]["local_inf"] for log in logs]
    if strategy == "pipeline":  # stage 0 holds the inf; stage 1 skipped on the reduced flag alone
        assert seen == [True, False]
        return
    # sharded: the inf lives in rank 1's slice only, so rank 0 skipped on the reduced flag alone
    assert seen == ([True, True] if strategy == "ddp" else [False, True])
    assert_same_params(results[0][1], results[1][1], atol=0)


def _fp16_clipped(topo, strategy, steps):
    scaler = GradScaler(init_scale=2.0 ** 12, growth_interval=2)
    session = pt.Session(strategy, precision="fp16", grad_scaler=scaler, max_grad_norm=0.05,
                         topology=topo, progress_bar=False)
    return _train_mlp(session, topo, steps), scaler.scale_value


def _torch_fp16_reference(steps, pieces):
    """torch.amp.GradScaler's documented loop: scale, backward, unscale_, clip, step, update."""
    model = make_model("mlp")
    optimizer = _sgd(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2)
    xs, ys = make_batches(steps, GLOBAL_BATCH)
    norms = []
    for step in range(steps):
        for x, y in zip(xs[step].chunk(pieces), ys[step].chunk(pieces)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y) / pieces
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item())
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    return model.state_dict(), scaler.get_scale(), norms


@pytest.mark.parametrize("strategy,world", [("single", 1), ("zero2", 2)])
def test_fp16_unscales_before_clipping_as_torch_does(strategy, world):
    """Same updates as torch's GradScaler loop: clipping sees the unscaled gradients (clipping
    the scaled ones would shrink every step by the scale, 2^12), and the scale grows after
    growth_interval good steps exactly as torch's does."""
    steps = 4
    expected, expected_scale, norms = _torch_fp16_reference(steps, pieces=world)
    assert min(norms) > 0.05  # the clip is active on every step
    for state, scale in run_on_ranks(_fp16_clipped, world, strategy, steps):
        assert scale == expected_scale == 2.0 ** 14
        assert_same_params(state, expected, atol=1e-6)  # measured: 7.5e-9
