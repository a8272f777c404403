"""Ranks that disagree on the sequence of collectives fail at once, naming the operations, when
`Session(debug_collectives=True)` (or PARATRAIN_DEBUG_COLLECTIVES=1, `paratrain run
--debug-collectives`) turns on torch's collective fingerprint checks."""

import os
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import paratrain as pt
from paratrain.cli.main import build_parser
from paratrain.distributed.comm import broadcast_object
from paratrain.distributed.topology import debug_collectives_requested, destroy, free_port
from paratrain.launch.run import export_env
from paratrain.testing import RankFailure, run_on_ranks
from tests.support.models import make_batches, make_model


def _debug_session(topo, by_env, strategy="ddp"):
    """A fresh default group created by a debugging Session (run_on_ranks made one without), the
    checks asked for by argument or, as `paratrain run --debug-collectives` does, by environment."""
    port = broadcast_object(free_port() if topo.rank == 0 else None)
    destroy()
    os.environ["MASTER_PORT"] = str(port)
    if by_env:
        os.environ["PARATRAIN_DEBUG_COLLECTIVES"] = "1"
    fresh = pt.Topology.from_env(rank=topo.rank, world_size=topo.world_size)
    return pt.Session(strategy, topology=fresh, progress_bar=False, debug_collectives=None if by_env else True)


def _disagree(topo, case, debug=True):
    session = _debug_session(topo, case == "other op") if debug else pt.Session("ddp", topology=topo, progress_bar=False)
    model = make_model("mlp")
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    xs, ys = make_batches(3, 4, seed=1)
    for step in range(3):
        if case == "skipped step" and topo.rank == 1 and step == 1:
            continue  # rank 1 drops a batch: its next collectives are one step behind
        session.train_step((xs[step], ys[step]), F.cross_entropy)
    if case == "other shape":
        dist.all_reduce(torch.ones(4 if topo.rank == 0 else 5))
    elif case == "other op":
        if topo.rank == 0:
            dist.all_reduce(torch.ones(4))
        else:
            dist.broadcast(torch.ones(4), src=0)
    dist.barrier()
    return pt.full_state_dict(model)


@pytest.mark.parametrize("case,message", [
    ("other shape", r"OpType=ALLREDUCE, TensorShape=\[(4|5)\](.|\n)*Tensor shapes: (4vs 5|5vs 4)"),
    ("other op", r"Op type: (ALLREDUCEvs BROADCAST|BROADCASTvs ALLREDUCE)"),
    # rank 0 is in its third step's all-reduce, rank 1 already at the barrier; torch names the
    # other rank's side by the internal gather/reduce its check was running (sequence number 0)
    ("skipped step", r"Rank \d is running collective: CollectiveFingerPrint\(SequenceNumber=\d+,? ?"
                     r"OpType=(ALLREDUCE|BARRIER)(.|\n)*Sequence number: \d+vs 0"),
])
def test_ranks_issuing_different_collectives_fail_naming_them(case, message):
    began = time.monotonic()
    with pytest.raises(RankFailure, match=r"Detected mismatch between collectives on ranks(.|\n)*" + message):
        run_on_ranks(_disagree, 2, case, timeout=60)
    assert time.monotonic() - began < 30  # not the 30 s collective timeout of run_on_ranks


def test_checks_change_nothing_when_ranks_agree():
    checked = run_on_ranks(_disagree, 2, "agree", timeout=60)
    plain = run_on_ranks(_disagree, 2, "agree", False, timeout=60)
    for a, b in zip(checked, plain):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Branches(nn.Module):
    """Two blocks of the same size, each a ZeRO-3 unit; `order` says which run, in what order."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(8, 3)
        self.order = (0, 1)

    def forward(self, x):
        for i in self.order:
            x = self.blocks[i](x)
        return self.head(x)


def _branches(topo, case, debug, world_size):
    strategy = pt.ZeRO(stage=3, wrap_policy=pt.WrapPolicy(module_classes=(nn.Sequential,)))
    session = _debug_session(topo, False, strategy) if debug else pt.Session(strategy, topology=topo, progress_bar=False)
    model = Branches()
    # "agree": the same order everywhere; "swapped": the last rank runs the blocks the other way
    # round; "exclusive": each rank runs one block, by its rank
    model.order = {"agree": (0, 1), "swapped": (1, 0) if topo.rank == world_size - 1 else (0, 1),
                   "exclusive": (topo.rank % 2,)}[case]
    model, optimizer = session.setup(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    torch.manual_seed(1)
    x, y = torch.randn(4 * world_size, 8), torch.randint(0, 3, (4 * world_size,))
    mine = slice(4 * topo.rank, 4 * topo.rank + 4)
    for _ in range(2):
        session.train_step((x[mine], y[mine]), F.cross_entropy)
    return pt.full_state_dict(model)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", ["swapped", "exclusive"])
def test_zero3_ranks_gathering_different_units_fail_naming_them(case, world_size):
    # the blocks have the same size: without the check the gathers pair up and mix their values
    first = [(1 if r == world_size - 1 else 0) if case == "swapped" else r % 2 for r in range(world_size)]
    gathers = "; ".join(f"rank {r} unit 'blocks.{i}'" for r, i in enumerate(first))
    with pytest.raises(RankFailure, match=r"UsageError: ZeRO stage 3: the ranks are gathering different units at "
                                          r"the same point \(" + re.escape(gathers) + r"\)(.|\n)*leave it out "
                                          r"of the wrap policy"):
        run_on_ranks(_branches, world_size, case, True, world_size, timeout=60)


@pytest.mark.parametrize("world_size", [2, 3])
def test_zero3_unit_check_changes_nothing_when_ranks_agree(world_size):
    checked = run_on_ranks(_branches, world_size, "agree", True, world_size, timeout=60)
    plain = run_on_ranks(_branches, world_size, "agree", False, world_size, timeout=60)
    model = Branches()  # and the same as one process on the whole batch
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    x, y = torch.randn(4 * world_size, 8), torch.randint(0, 3, (4 * world_size,))
    for _ in range(2):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    for a, b in zip(checked, plain):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(checked[0][k], v, rtol=0, atol=1e-6)


def _too_late(topo):
    pt.Session("ddp", topology=topo, debug_collectives=True)


def test_asking_for_checks_after_the_group_exists_is_a_clear_error():
    with pytest.raises(RankFailure, match="UsageError: debug_collectives must be on before the process group"):
        run_on_ranks(_too_late, 1, timeout=60)


def test_paratrain_run_debug_collectives_flag_reaches_the_workers(monkeypatch):
    # a copy: _export_env writes the launcher's variables, which must not reach later tests
    env = {k: v for k, v in os.environ.items() if k != "PARATRAIN_DEBUG_COLLECTIVES"}
    monkeypatch.setattr(os, "environ", env)
    args = build_parser().parse_args(["run", "-n", "2", "--debug-collectives", "train.py"])
    export_env(args)  # the launcher's environment, which the elastic agent hands every worker
    assert os.environ["PARATRAIN_DEBUG_COLLECTIVES"] == "1"
    assert debug_collectives_requested(None) and not debug_collectives_requested(False)
