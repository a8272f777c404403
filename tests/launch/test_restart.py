"""A worker killed with SIGKILL mid-training: `paratrain run --max-restarts 1` restarts the job,
which resumes from the last checkpoint and ends with exactly the parameters of a run that was
never interrupted."""

import subprocess
import sys
import textwrap

import torch

from tests.support import ROOT_DIR

ROOT = ROOT_DIR

SCRIPT = textwrap.dedent('''
    import os, signal, sys
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    import paratrain as pt

    root, out, steps, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    session = pt.Session("ddp", progress_bar=False, seed=0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(40, 8, generator=g), torch.randint(0, 3, (40,), generator=g))
    model, optimizer, loader = session.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2),
                                             DataLoader(data, batch_size=8, shuffle=True))
    if session.resume(root):
        print(f"rank {session.rank} resumed at step {session.micro_step}", flush=True)
    step = session.micro_step
    while step < steps:
        for batch in session.progress(loader):
            session.train_step(batch, F.cross_entropy)
            step += 1
            session.checkpoint(root, keep=2)
            first_try = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            if step == kill_at and session.rank == 1 and first_try:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == steps:
                break
    if session.is_main:
        torch.save(session.full_state_dict(), out)
''')


def _run(tmp_path, name, kill_at):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out, root = tmp_path / f"{name}.pt", tmp_path / f"{name}-checkpoints"
    # a generous collective timeout: a loaded machine may take long to start the restarted workers
    cmd = [sys.executable, "-m", "paratrain", "run", "-n", "2", "--max-restarts", "1", "--timeout", "120",
           str(script), str(root), str(out), "9", str(kill_at)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out), done.stdout + done.stderr


def test_a_killed_worker_restarts_and_resumes_bitwise(tmp_path):
    straight, _ = _run(tmp_path, "straight", kill_at=-1)
    restarted, log = _run(tmp_path, "killed", kill_at=6)
    assert "resumed at step 6" in log  # the job really restarted from the checkpoint
    assert straight.keys() == restarted.keys()
    assert all(torch.equal(straight[k], restarted[k]) for k in straight)
