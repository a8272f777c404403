"""The planner's walk of a ZeRO-3 backward (plan/cost/zero3_backward.py) against a real one.

A real zero3 backward at world 3 is watched at the two moments the walk models, for every flat:
when autograd's gradient has arrived (before the previous reduction is waited for) and when it
has been put in the flat's buffer. At each, the bytes of the gathered units, the gradient buffers
(filling and reducing), the shards' gradients and autograd's tensor are summed from the live
tensors; the most of them must equal the walk's figure (`late_backward`), to the byte.
"""

import pytest
import torch
from torch import nn

import paratrain as pt
from paratrain.parallel.zero import flat_shard
from paratrain.plan.cost.memory import predict
from paratrain.testing import run_on_ranks

UNITS = pt.WrapPolicy(module_classes=(nn.Linear,))


def _model() -> nn.Sequential:
    """Units of 234 elements (a weight and a bias: copied into the buffer), 324 (one weight,
    3 × 108: the buffer is autograd's gradient), 323 (padded to 324 at world 3: copied) and 54.
    Without prefetch the most is held as the 324's gradient arrives, the 323's still reducing;
    with it, as the 323's weight is copied in."""
    return nn.Sequential(nn.Linear(12, 18), nn.Tanh(), nn.Linear(18, 18, bias=False), nn.Tanh(),
                         nn.Linear(18, 17), nn.Tanh(), nn.Linear(17, 3))


def _nbytes(t) -> int:
    return t.untyped_storage().nbytes() if t is not None else 0


def _held(model, arrived: torch.Tensor | None) -> int:
    """Gathered units, gradient buffers (filling and reducing), shards' gradients and, when it is
    not a buffer already, autograd's gradient `arrived`: their bytes."""
    flats = [f for u in model.units for f in u.flats]
    buffers = [f.grad for f in flats if f.grad is not None] + [f._reduce[2] for f in flats if f._reduce is not None]
    counted = {b.untyped_storage().data_ptr() for b in buffers}
    total = sum(_nbytes(f.full) for f in flats) + sum(_nbytes(b) for b in buffers)
    total += sum(_nbytes(f.shard.grad) for f in flats)
    if arrived is not None and arrived.untyped_storage().data_ptr() not in counted:
        total += _nbytes(arrived)
    return total


def _watch(topo, prefetch: bool) -> int:
    """The most a backward held at once at the moments the walk models (after a first step)."""
    seen: list[int] = []
    torch.manual_seed(0)
    model = _model()
    strategy = pt.ZeRO(stage=3, wrap_policy=UNITS, prefetch=prefetch)
    wrapped, opt = strategy.setup(model, torch.optim.Adam(model.parameters(), lr=1e-3), strategy.grid(topo))
    arrived_at = flat_shard.FlatShard.grad_arrived

    def after_copy(self, index):  # the buffer holds it; autograd's tensor is still alive in this frame
        arrived = self.leaves[index][1].grad
        done = arrived_at(self, index)
        seen.append(_held(wrapped, arrived))
        return done

    flat_shard.FlatShard.grad_arrived = after_copy
    for flat in (f for u in wrapped.units for f in u.flats):
        for _, leaf in flat.leaves:  # autograd's gradient is made, not yet accumulated: the reduction
            leaf.register_hook(lambda grad: seen.append(_held(wrapped, grad)))  # before is not waited for
    x, y = torch.randn(6, 12), torch.randn(6, 3)
    for _ in range(2):
        seen.clear()
        opt.zero_grad()
        wrapped.forward_backward(x, y, nn.functional.mse_loss, 1.0)
        opt.step()
    return max(seen)


@pytest.mark.parametrize("prefetch", [True, False])
def test_the_walk_equals_the_most_a_real_backward_holds(prefetch):
    with torch.device("meta"):
        model = _model()
    want = predict(model, pt.ZeRO(stage=3, wrap_policy=UNITS, prefetch=prefetch), world=3)[0]
    for rank, got in enumerate(run_on_ranks(_watch, 3, prefetch, timeout=120)):
        assert got == want.late_backward, (rank, got, want.late_backward)
    # the sum of the largest of each, which the walk replaces, is more
    assert want.late_backward < want.gathered + want.comm_buffers + want.fresh_grads
