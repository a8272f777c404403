"""Checkpoint on preemption, as a cluster does it: SIGTERM to `paratrain run` in the middle of an
epoch (the agent signals every process of each rank, its loader workers too); the ranks finish the
optimizer step, checkpoint and exit 0; the requeued job resumes and ends bitwise equal to a run
that was never interrupted."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.nn.functional as F

import paratrain as pt
from tests.support import ROOT_DIR

ROOT = ROOT_DIR

SCRIPT = textwrap.dedent('''
    import sys, time
    import torch, torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import paratrain as pt

    out, slow = sys.argv[1], float(sys.argv[2])
    if sys.argv[3:] == ["full-disk"]:  # every checkpoint file's writes fail as on a full disk
        import os
        sys.path.insert(0, os.getcwd())  # the repository: paratrain run starts the script there
        from torch.distributed.checkpoint.filesystem import FileSystem
        from tests.support.full_disk import failing_create_stream
        FileSystem.create_stream = failing_create_stream()
    session = pt.Session("ddp", checkpoint_on_preempt=f"{out}/ckpt", progress_bar=False, seed=3)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g))
    model, opt, loader = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       DataLoader(data, batch_size=8, shuffle=True, num_workers=2))
    if session.resume(f"{out}/ckpt"):
        session.print(f"resumed at step {session.micro_step}")
    for epoch in range(session.epoch, 3):
        for batch in session.progress(loader):
            session.train_step(batch, F.cross_entropy)
            if session.is_main:
                open(f"{out}/step", "w").write(str(session.micro_step))
            time.sleep(slow)
    if session.is_main:
        torch.save(session.full_state_dict(), f"{out}/final.pt")
''')


def _launch(tmp_path, out, slow, *more):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    os.makedirs(out, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "paratrain", "run", "-n", "2", str(script), str(out), str(slow),
                             *more],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _step(out) -> int:
    try:
        return int((out / "step").read_text() or 0)
    except (OSError, ValueError):
        return 0


def test_sigterm_checkpoints_at_a_step_and_the_requeued_job_ends_as_if_never_stopped(tmp_path):
    whole = _launch(tmp_path, tmp_path / "whole", 0.0)
    assert whole.wait(timeout=120) == 0, whole.stderr.read()[-3000:]

    out = tmp_path / "stopped"
    first = _launch(tmp_path, out, 0.2)
    deadline = time.monotonic() + 90
    while _step(out) < 5 and time.monotonic() < deadline:  # in the first epoch (12 steps)
        time.sleep(0.05)
    first.send_signal(signal.SIGTERM)
    code = first.wait(timeout=60)
    stdout = first.stdout.read()
    assert code == 0, f"a preempted job checkpoints and exits 0; got {code}\n" + stdout[-3000:]
    saved = re.search(r"preempted by SIGTERM: saved \S*step-(\d+)", stdout)
    assert saved, stdout + first.stderr.read()[-3000:]
    stopped_at = int(saved.group(1))  # the step being trained when the signal came, completed
    assert 5 <= stopped_at < 36 and not (out / "final.pt").exists()

    again = _launch(tmp_path, out, 0.0)
    assert again.wait(timeout=120) == 0, again.stderr.read()[-3000:]
    assert f"resumed at step {stopped_at}" in again.stdout.read()
    resumed, expected = torch.load(out / "final.pt"), torch.load(tmp_path / "whole" / "final.pt")
    assert all(torch.equal(resumed[k], expected[k]) for k in expected)


def test_a_preemption_checkpoint_that_fails_is_named_by_the_launcher(tmp_path):
    """A full disk: not only "stopped by SIGTERM", but that the checkpoint failed, and why."""
    out = tmp_path / "full"
    job = _launch(tmp_path, out, 0.2, "full-disk")
    deadline = time.monotonic() + 90
    while _step(out) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    code, stderr = job.wait(timeout=60), job.stderr.read()
    summary = [line for line in stderr.splitlines() if line.startswith("paratrain run: stopped by")]
    assert code == 143 and summary, stderr[-3000:]
    assert summary[0].startswith(f"paratrain run: stopped by SIGTERM; the checkpoint on SIGTERM failed (ranks 0, 1: "
                                 f"CheckpointError: saving {out / 'ckpt'}/step-"), summary[0]
    assert "no space left on device (ENOSPC)" in summary[0], summary[0]
    assert summary[0].endswith("A resume starts from the newest checkpoint saved before it"), summary[0]


def test_the_preemption_checkpoint_prunes_none_of_the_runs_own(tmp_path):
    """A run keeping ten checkpoints in the root it is preempted into keeps them all: the
    preemption's save does not prune to the default three."""
    session = pt.Session("single", checkpoint_on_preempt=str(tmp_path), progress_bar=False)
    model = torch.nn.Linear(4, 2)
    session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batch = (torch.randn(8, 4), torch.randint(0, 2, (8,)))
    for _ in range(5):
        session.train_step(batch, F.cross_entropy)
        session.checkpoint(tmp_path, keep=10)
    session.preemption.signalled = signal.SIGTERM
    with pytest.raises(SystemExit) as stopped:
        session.train_step(batch, F.cross_entropy)
    assert stopped.value.code == 0
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [f"step-{n:08d}" for n in range(1, 7)]
