"""`pt.testing` is public: it loads with the package, and loading it changes nothing in torch."""

import subprocess
import sys

import torch

import paratrain as pt

# run in a fresh interpreter: this one's tests have installed the flight recorder's hooks
IMPORT_ONLY = """
import sys, torch, torch.distributed as dist, torch.nn as nn
from torch.nn.modules import module
before = {name: getattr(dist, name) for name in dir(dist)}
methods = {cls: dict(vars(cls)) for cls in (nn.Module, torch.Tensor, dist.P2POp)}
import paratrain as pt
assert "paratrain.testing" in sys.modules, "paratrain.testing is not loaded"
print(pt.testing.run_on_ranks.__name__, pt.testing.assert_same_params.__name__)
print("changed:", sorted(n for n, f in before.items() if getattr(dist, n) is not f))
print("methods:", sorted(f"{c.__name__}.{n}" for c, d in methods.items() for n, f in vars(c).items() if d.get(n) is not f))
print("hooks:", [len(h) for h in (module._global_forward_hooks, module._global_forward_pre_hooks,
                                   module._global_backward_hooks, module._global_module_registration_hooks)])
"""


def test_testing_loads_with_the_package_and_touches_nothing_in_torch():
    out = subprocess.run([sys.executable, "-c", IMPORT_ONLY], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["run_on_ranks assert_same_params", "changed: []", "methods: []",
                                       "hooks: [0, 0, 0, 0]"]


def _sum_of_ranks(topology):
    value = torch.tensor([float(topology.rank)])
    torch.distributed.all_reduce(value)
    return value


def test_pt_testing_runs_ranks_and_compares_what_they_hold():
    assert "testing" in pt.__all__
    results = pt.testing.run_on_ranks(_sum_of_ranks, 2, timeout=60)
    assert [r.item() for r in results] == [1.0, 1.0]
    pt.testing.assert_same_params({"w": results[0]}, {"w": results[1]}, atol=0)
