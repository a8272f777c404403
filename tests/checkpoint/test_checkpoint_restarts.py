"""Two restarts that once broke checkpoints, run as a user runs them, one `paratrain run` per job:

- a job restarted with another `accumulate` writes step numbers below the first job's; after two
  restarts the job still ends on the newest state (point 1);
- a byte flipped in the newest checkpoint's shard is detected, and the next job resumes from the
  checkpoint before it, with a warning naming the damaged one (points 2 and 3);
- a NaN gradient on one rank, with a finite loss, stops the step on every rank, and the newest
  checkpoint stays the finite one before it (point 9).
"""

import subprocess
import sys
import textwrap

import torch

from paratrain.testing import assert_same_params
from tests.support import ROOT_DIR

ROOT = ROOT_DIR

SCRIPT = textwrap.dedent('''
    import sys
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    import paratrain as pt

    root, out, accumulate, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    poison_at = int(sys.argv[5]) if len(sys.argv) > 5 else 0  # rank 1's gradient turns NaN at this step
    session = pt.Session("ddp", accumulate=accumulate, progress_bar=False, seed=0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    def poison(module, args, output):  # rank 1's first layer's output gradient: the loss stays finite
        if session.micro_step + 1 == poison_at:
            output.register_hook(lambda g: g * float("nan"))
    if poison_at and session.rank == 1:
        model[0].register_forward_hook(poison)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
    model, optimizer, loader = session.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2),
                                             DataLoader(data, batch_size=8, shuffle=True))
    if session.resume(root):
        session.print(f"resumed at micro-batch {session.micro_step}")
    while session.micro_step // accumulate < steps:  # `steps` optimizer steps in all
        for batch in session.progress(loader):
            session.train_step(batch, F.cross_entropy)
            if session.micro_step % accumulate == 0:
                session.checkpoint(root, keep=3)
            if session.micro_step // accumulate == steps:
                break
    state = session.full_state_dict()
    if session.is_main:
        torch.save(state, out)
    session.close()
''')


def _job(tmp_path, out: str, accumulate: int, steps: int, *poison_at: int, fails: bool = False) -> str:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "paratrain", "run", "-n", "2", "--timeout", "120", str(script),
           str(tmp_path / "ckpt"), str(tmp_path / out), str(accumulate), str(steps), *map(str, poison_at)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert (done.returncode != 0) == fails, done.stderr[-3000:]
    return done.stdout + done.stderr


def _steps(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "ckpt").glob("step-*"))


def test_a_job_restarted_with_another_accumulate_ends_on_the_newest_state(tmp_path):
    _job(tmp_path, "first.pt", accumulate=1, steps=8)  # step-6, 7, 8 (micro-batch 8)
    log = _job(tmp_path, "second.pt", accumulate=2, steps=7)  # step-5, 6, 7 (micro-batch 14)
    assert "resumed at micro-batch 8" in log
    log = _job(tmp_path, "third.pt", accumulate=2, steps=7)  # nothing left to train
    assert "resumed at micro-batch 14" in log  # not the first job's stale step-8
    assert _steps(tmp_path) == ["step-00000005", "step-00000006", "step-00000007"]
    assert_same_params(torch.load(tmp_path / "third.pt"), torch.load(tmp_path / "second.pt"), atol=0)


def test_a_flipped_byte_in_the_newest_shard_makes_the_next_job_resume_from_the_one_before(tmp_path):
    _job(tmp_path, "straight.pt", accumulate=1, steps=3)
    shard = tmp_path / "ckpt" / "step-00000003" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit of one byte
    shard.write_bytes(bytes(data))
    log = _job(tmp_path, "resumed.pt", accumulate=1, steps=3)
    assert "step-00000003 is damaged: __1_0.distcp does not match the sha256" in log
    assert "resume() skips it" in log and "resumed at micro-batch 2" in log
    # step 3 trained again from step 2, exactly as the first time (RNG and data order resume too)
    assert_same_params(torch.load(tmp_path / "resumed.pt"), torch.load(tmp_path / "straight.pt"), atol=0)


def test_a_nan_gradient_on_one_rank_stops_every_rank_and_the_newest_checkpoint_stays_finite(tmp_path):
    log = _job(tmp_path, "poisoned.pt", 1, 5, 3, fails=True)  # rank 1's gradient is NaN in step 3 of 5
    assert log.count("gradient is NaN or infinite although the loss was finite") >= 2  # raised on both ranks
    assert not (tmp_path / "poisoned.pt").exists()
    assert _steps(tmp_path) == ["step-00000001", "step-00000002"]  # step 3 never stepped nor saved
    log = _job(tmp_path, "resumed.pt", 1, 2)  # nothing left to train: load the newest and save it
    assert "resumed at micro-batch 2" in log
    resumed = torch.load(tmp_path / "resumed.pt")
    assert all(torch.isfinite(v).all() for v in resumed.values())
    (tmp_path / "clean").mkdir()
    _job(tmp_path / "clean", "straight.pt", 1, 2)  # the same 2 steps, never poisoned
    assert_same_params(resumed, torch.load(tmp_path / "clean" / "straight.pt"), atol=0)
