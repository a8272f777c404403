"""Checkpoints that a restart or a cluster can break: the newest is the one
written last, damage is detected and skipped, errors name the cause and the file, one job writes a
root, and resume says when it finds nothing."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.utils.data import DataLoader, TensorDataset

import paratrain as pt
from paratrain import checkpoint
from paratrain.testing import RankFailure, assert_same_params, run_on_ranks
from tests.support.full_disk import FullDisk, failing_create_stream
from tests.support.models import make_batches, make_model

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _session(topo, accumulate=1):
    session = pt.Session("ddp", topology=topo, progress_bar=False, seed=3, accumulate=accumulate)
    xs, ys = make_batches(1, 64, seed=7)
    model = make_model("mlp")
    session.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2),
                  DataLoader(TensorDataset(xs[0], ys[0]), batch_size=8, shuffle=True))
    return session


def _train(session, until_step, root=None):
    """Train until `until_step` optimizer steps in all, with `checkpoint(root)` after each."""
    while session.micro_step // session.accumulate < until_step:
        for batch in session.progress(session.loader):
            session.train_step(batch, F.cross_entropy)
            if root and session.micro_step % session.accumulate == 0:
                session.checkpoint(root, keep=3)
            if session.micro_step // session.accumulate >= until_step:
                break


def _steps_in(root):
    return sorted(p.name for p in Path(root).glob("step-*"))


def _warned(caught):
    return [str(w.message) for w in caught if issubclass(w.category, checkpoint.CheckpointWarning)]


# -- 1. the newest checkpoint is the one written last ------------------------------------------


def _accumulate_changes(topo, root):
    _train(_session(topo, accumulate=1), 8, root)  # keeps step-6, 7, 8
    second = _session(topo, accumulate=2)
    assert second.resume(root) and second.micro_step == 8  # optimizer step 4 at accumulate=2
    _train(second, 7, root)  # writes step-5, then step-6 and step-7 over the first run's
    third = _session(topo, accumulate=2)
    third.resume(root)
    replaced = json.loads((Path(root) / "step-00000006" / "paratrain.json").read_text())
    return (third.micro_step, second.full_state_dict(), third.full_state_dict(), _steps_in(root),
            checkpoint.latest(root).name, replaced["state"]["micro_step"])


def test_after_accumulate_changes_resume_and_prune_follow_the_order_of_writing(tmp_path):
    for micro, second, third, left, newest, replaced in run_on_ranks(_accumulate_changes, 2, str(tmp_path)):
        assert micro == 14  # step-7 of the second run, not the stale step-8 of the first
        assert_same_params(third, second, atol=0)
        assert left == ["step-00000005", "step-00000006", "step-00000007"]  # the stale step-8 pruned
        assert newest == "step-00000007"
        assert replaced == 12  # step-6 now holds the second run's state


# -- 2. a damaged newest checkpoint does not block restarts ------------------------------------


def _fall_back(topo, root):
    session = _session(topo)
    _train(session, 2, root)
    at_two = {k: v.clone() for k, v in session.full_state_dict().items()}
    _train(session, 3, root)
    if topo.rank == 0:  # the files sort as .metadata, __0_0, __1_0: rank 1 is the one checking __0_0
        shard = Path(root) / "step-00000003" / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:100])
    dist.barrier()
    fresh = _session(topo)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = fresh.resume(root)
    return resumed, fresh.micro_step, _warned(caught), at_two, fresh.full_state_dict(), checkpoint.latest(root).name


def test_resume_falls_back_past_a_damaged_newest_checkpoint_on_every_rank(tmp_path):
    ranks = run_on_ranks(_fall_back, 2, str(tmp_path))
    for rank, (resumed, micro, warned, at_two, state, newest) in enumerate(ranks):
        assert resumed and micro == 2
        assert_same_params(state, at_two, atol=0)
        assert newest == "step-00000002"  # latest() skips it too
        if rank == 0:
            assert len(warned) == 1 and "step-00000003" in warned[0]
            assert "__0_0.distcp is truncated (100 of" in warned[0]
        else:
            assert warned == []  # one warning, from rank 0


# -- 3. flipped bits are detected -------------------------------------------------------------


def _flip(path: Path, count: int) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
    path.write_bytes(bytes(data))


def test_flipped_bits_in_a_shard_are_detected_at_load(tmp_path):
    model = torch.nn.Linear(256, 256)
    checkpoint.save(tmp_path / "step-00000001", model)
    checkpoint.save(tmp_path / "step-00000002", model)
    _flip(tmp_path / "step-00000002" / "__0_0.distcp", 400)
    with pytest.raises(pt.ConfigError, match="__0_0.distcp does not match the sha256"):
        checkpoint.load(tmp_path / "step-00000002", torch.nn.Linear(256, 256))
    assert checkpoint.latest(tmp_path).name == "step-00000002"  # sizes alone cannot see it
    assert checkpoint.latest(tmp_path, verify=True).name == "step-00000001"


# -- 4. errors put the root cause and the file in their first line ----------------------------


def _first_line(fn) -> str:
    with pytest.raises(pt.ConfigError) as error:
        fn()
    line = str(error.value).splitlines()[0]
    assert "site-packages" not in line and "Traceback" not in line
    return line


def test_read_failures_name_the_file_and_the_cause_first(tmp_path):
    path, model = tmp_path / "c", torch.nn.Linear(64, 64)
    checkpoint.save(path, model)
    shard = path / "__0_0.distcp"
    whole = shard.read_bytes()
    shard.unlink()
    assert "__0_0.distcp is missing" in _first_line(lambda: checkpoint.load(path, model))
    shard.write_bytes(whole[:200])
    assert "__0_0.distcp is truncated (200 of" in _first_line(lambda: checkpoint.load(path, model))
    marker = json.loads((path / "paratrain.json").read_text())
    del marker["files"]  # as a checkpoint saved before checksums: DCP itself meets the short file
    (path / "paratrain.json").write_text(json.dumps(marker))
    line = _first_line(lambda: checkpoint.load(path, model))
    assert "cannot be read: __0_0.distcp is truncated or corrupt" in line and "(rank 0)" in line


def _disk_full_on_rank_1(topo, path):
    session = _session(topo)
    if topo.rank == 1:
        FileSystem.create_stream = failing_create_stream()
    try:
        session.save(path)
    except pt.CheckpointError as e:
        return str(e).splitlines()[0]


def test_a_full_disk_on_one_rank_is_named_on_every_rank(tmp_path):
    for line in run_on_ranks(_disk_full_on_rank_1, 2, str(tmp_path / "c")):
        assert line.startswith(f"saving {tmp_path / 'c'} failed: no space left on device (ENOSPC) "
                               "writing __1_0.distcp (rank 1)")


class _ZipWriterShortOfSpace(FullDisk):
    """A full disk as torch.save's zip writer meets it (a short write): no errno, only its check
    (test_a_real_full_disk_is_named meets the real one where a tmpfs can be mounted)."""

    def write(self, data):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")


def _save_error(path, model) -> str:
    with pytest.raises(pt.CheckpointError) as error:
        checkpoint.save(path, model)
    return str(error.value).splitlines()[0]


@pytest.mark.parametrize("free_after", [0, 1 << 30])
def test_a_disk_full_inside_torch_saves_zip_writer_is_named(tmp_path, monkeypatch, free_after):
    """Judged by the space left when the write failed: a full file system is named; with room
    left the zip writer's own error stands."""
    real_statvfs = os.statvfs

    def statvfs(path):
        real = real_statvfs(path)
        blocks = free_after // real.f_frsize
        return os.statvfs_result((real.f_bsize, real.f_frsize, real.f_blocks, blocks, blocks, *real[5:]))

    monkeypatch.setattr(FileSystem, "create_stream", failing_create_stream(_ZipWriterShortOfSpace))
    monkeypatch.setattr(os, "statvfs", statvfs)
    line = _save_error(tmp_path / "c", torch.nn.Linear(64, 64))
    if free_after == 0:
        assert line.startswith(f"saving {tmp_path / 'c'} failed: no space left on device (ENOSPC: 0 KiB free on the "
                               f"file system holding {tmp_path / 'c.partial'}) writing __0_0.distcp"), line
    else:
        assert "unexpected pos" in line and "ENOSPC" not in line, line


def test_a_real_full_disk_is_named(tmp_path):
    """The same on a 256 KiB tmpfs, where this machine lets a test mount one (root, Linux)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        line = _save_error(disk / "c", torch.nn.Linear(300, 300))
        assert line.startswith(f"saving {disk / 'c'} failed: no space left on device (ENOSPC"), line
    finally:
        subprocess.run(["umount", str(disk)], check=True)


# -- 5. one writing job per root ----------------------------------------------------------------


def _checkpoint_once(topo, root):
    session = _session(topo)
    _train(session, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session.checkpoint(root)
    lock = Path(root) / "paratrain.lock"
    holder = json.loads(lock.read_text()) if topo.rank == 0 else None  # before rank 0 closes
    session.close()
    return _warned(caught), holder, lock.exists()


def test_a_second_job_writing_a_locked_root_is_refused(tmp_path):
    first_job = object()
    checkpoint.lock_root(tmp_path, owner=first_job)  # this process is the first job, alive
    try:
        with pytest.raises(RankFailure, match=f"being written by another job: pid {os.getpid()} on"):
            run_on_ranks(_checkpoint_once, 2, str(tmp_path))
        assert _steps_in(tmp_path) == []
    finally:
        checkpoint.unlock_roots(owner=first_job)
    assert not (tmp_path / "paratrain.lock").exists()


def _write_lock(root: Path, **fields) -> Path:
    record = {"host": socket.gethostname(), "pid": 1, "job": "4242", "attempt": "0/0",
              "started": "2026-11-20T10:00:00", "command": "train.py", **fields}
    (root / "paratrain.lock").write_text(json.dumps(record))
    return root / "paratrain.lock"


def test_the_lock_of_a_dead_job_is_taken_over_with_a_warning_and_released_at_close(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    _write_lock(tmp_path, pid=int(dead.stdout))
    (warned, holder, still_there), _ = run_on_ranks(_checkpoint_once, 2, str(tmp_path))
    assert len(warned) == 1 and f"job 4242, pid {int(dead.stdout)}" in warned[0]
    assert "is no longer running" in warned[0]
    assert holder["pid"] != int(dead.stdout) and not still_there
    assert _steps_in(tmp_path) == ["step-00000001"]


def test_a_lock_from_another_host_is_stale_only_once_its_heartbeat_stops(tmp_path):
    lock, owner = _write_lock(tmp_path, host="node-17"), object()
    with pytest.raises(pt.ConfigError, match="being written by another job: job 4242, pid 1 on node-17"):
        checkpoint.lock_root(tmp_path, owner=owner)
    with pytest.raises(pt.ConfigError, match="being written by another job"):  # a plain save too
        checkpoint.save(tmp_path / "step-00000001", torch.nn.Linear(2, 2))
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    with pytest.warns(checkpoint.CheckpointWarning, match="its heartbeat is 3600 s old"):
        checkpoint.lock_root(tmp_path, owner=owner)
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    checkpoint.unlock_roots(owner=owner)
    assert not lock.exists()


def test_a_lock_left_under_this_very_pid_by_an_earlier_process_is_taken_over(tmp_path):
    """A job restarted in the same container gets its small pid again: the earlier process's lock
    (another start time) is stale, not another job. And a root reached through a symlink is the
    same root: the job holding it is not refused by itself."""
    lock, owner = _write_lock(tmp_path, pid=os.getpid(), job=""), object()
    with pytest.warns(checkpoint.CheckpointWarning, match=f"left by an earlier process {os.getpid()} on this host"):
        checkpoint.lock_root(tmp_path, owner=owner)
    (tmp_path.parent / f"{tmp_path.name}-link").symlink_to(tmp_path)
    checkpoint.lock_root(tmp_path.parent / f"{tmp_path.name}-link", owner=owner)
    checkpoint.unlock_roots(owner=owner)
    assert not lock.exists()


@pytest.mark.parametrize("deleted", ["lock", "root"])
def test_a_lock_or_root_deleted_while_the_job_runs_is_recreated_and_named(tmp_path, deleted):
    """Not "taken by another job … an unknown job": this job's own lock went, and it says so. A
    job that took the root meanwhile is still named as any second job is."""
    root = tmp_path / "run"
    session, model, _ = _one_process()
    xs, ys = make_batches(2, 8)
    session.train_step((xs[0], ys[0]), F.cross_entropy)
    session.checkpoint(root)
    if deleted == "lock":
        (root / "paratrain.lock").unlink()
    else:
        shutil.rmtree(root)
    session.train_step((xs[1], ys[1]), F.cross_entropy)
    what = f"the lock file {root / 'paratrain.lock'}" if deleted == "lock" else f"checkpoint root {root}, with"
    with pytest.warns(checkpoint.CheckpointWarning, match=re.escape(what) + ".* was deleted while this job held "
                      "the lock on .*; paratrain recreated it"):
        session.checkpoint(root)
    assert json.loads((root / "paratrain.lock").read_text())["pid"] == os.getpid()
    assert _steps_in(root) == (["step-00000002"] if deleted == "root" else ["step-00000001", "step-00000002"])
    (root / "paratrain.lock").unlink()
    _write_lock(root, host="node-17")  # another job, alive, took the root meanwhile
    with pytest.raises(pt.ConfigError, match="was taken by another job since this one took it: job 4242"):
        session.checkpoint(root)
    (root / "paratrain.lock").unlink()
    session.close()


def _one_process(model=None, accumulate=1, loader=None):
    """A single-process session over `model` (the MLP when None) with SGD at lr 0.1: (session,
    model, loader) as setup returned them."""
    session = pt.Session("single", progress_bar=False, accumulate=accumulate)
    model = make_model("mlp") if model is None else model
    out = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
    return session, model, out[2] if loader is not None else None


@pytest.mark.parametrize("killed_before", ["first rename", "second rename"])
def test_a_save_over_an_existing_name_killed_between_its_renames_leaves_its_newest_state(
        tmp_path, monkeypatch, killed_before):
    """Saving over `step-2` renames it to `step-2.old`, then `step-2.partial` to `step-2`: killed
    before the first rename, the root still holds the earlier `step-2`, as after any crashed save;
    killed between the two (no `step-2` left), the new save, complete, is the newest."""
    session, model, _ = _one_process()
    xs, ys = make_batches(3, 8)
    for x, y in zip(xs[:2], ys[:2]):
        session.train_step((x, y), F.cross_entropy)
        session.checkpoint(tmp_path)
    earlier = {k: v.clone() for k, v in model.state_dict().items()}
    session.train_step((xs[2], ys[2]), F.cross_entropy)
    session.micro_step = 2  # a save to the same name again (as after a resume with another accumulate)
    newest = {k: v.clone() for k, v in model.state_dict().items()}
    replace = os.replace

    def killed(src, dst):
        if str(src).endswith(".partial" if killed_before == "second rename" else "step-00000002"):
            raise KeyboardInterrupt("killed")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        session.checkpoint(tmp_path)
    monkeypatch.setattr(os, "replace", replace)
    session.close()
    resumed, again, _ = _one_process()
    assert resumed.resume(tmp_path) and resumed.micro_step == 2
    assert_same_params(again.state_dict(), newest if killed_before == "second rename" else earlier, atol=0)
    resumed.close()


# -- 6. resume says when it finds nothing, and takes a checkpoint directory --------------------


def _resume_paths(topo, root):
    _train(_session(topo), 2, root)
    with pytest.raises(pt.ConfigError) as typo:
        _session(topo).resume(root + "-typo", required=True)
    silent = _session(topo).resume(root + "-typo")
    direct = _session(topo)
    loaded = direct.resume(os.path.join(root, "step-00000001"), required=True)
    other = Path(root + "-other")
    _session(topo).save(other / "best")
    with pytest.raises(pt.ConfigError) as elsewhere:
        _session(topo).resume(other, required=True)
    return str(typo.value), silent, (loaded, direct.micro_step), str(elsewhere.value)


def test_resume_required_says_where_it_looked_and_a_checkpoint_directory_loads_itself(tmp_path):
    root = str(tmp_path / "ckpt")
    typo, silent, direct, elsewhere = run_on_ranks(_resume_paths, 1, root)[0]
    assert f"found no checkpoint: {root}-typo does not exist" in typo
    assert silent is False
    assert direct == (True, 1)  # step-1 itself, not the newest under it
    assert "holds no complete checkpoint" in elsewhere and "best/ is a checkpoint not named step-*" in elsewhere


# -- another model is not a damaged checkpoint -------------------------------------------------------

class _Scaled(torch.nn.Module):
    def __init__(self, buffer_size=None):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Tanh(), torch.nn.Linear(8, 5))
        if buffer_size is not None:
            self.register_buffer("scale", torch.ones(buffer_size))

    def forward(self, x):
        return self.net(x) * (self.scale.sum() if hasattr(self, "scale") else 1)


def _frozen_session(model):
    """Adam over every parameter, the first layer frozen (fine-tuning a model whose optimizer
    was made from model.parameters()): the frozen weight never has optimizer state."""
    model.net[0].weight.requires_grad_(False)
    session = pt.Session("single", progress_bar=False)
    model, opt = session.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
    return session, model, opt


def test_a_frozen_parameter_without_optimizer_state_resumes_exactly(tmp_path):
    xs, ys = make_batches(4, 8)
    session, model, opt = _frozen_session(_Scaled())
    for step in range(4):
        session.train_step((xs[step], ys[step]), F.cross_entropy)
        if step == 1:
            session.checkpoint(tmp_path)
    whole = {k: v.clone() for k, v in model.state_dict().items()}
    session.close()
    session, model, opt = _frozen_session(_Scaled())
    assert session.resume(tmp_path) and session.micro_step == 2
    assert not opt.state[model.module.net[0].weight]
    for step in range(2, 4):
        session.train_step((xs[step], ys[step]), F.cross_entropy)
    assert_same_params(model.state_dict(), whole, atol=0)
    session.close()


@pytest.mark.parametrize("change,message", [(None, r"it has no \['buffers/scale'\]"),
                                             (4, r"other sizes for \['buffers/scale'\]")])
def test_a_changed_buffer_is_another_model_not_a_damaged_checkpoint(tmp_path, change, message):
    session, _, _ = _one_process(_Scaled(buffer_size=None if change is None else 3))
    session.checkpoint(tmp_path)
    session.close()
    session, _, _ = _one_process(_Scaled(buffer_size=3 if change is None else change))
    with pytest.raises(pt.ConfigError, match="holds another model or optimizer state: " + message):
        session.resume(tmp_path)
    session.close()
    assert _steps_in(tmp_path) == ["step-00000000"]  # nothing moved away or pruned


def _accumulating_run(root, load=None, save_at=(), until=8):
    """accumulate=2 over a shuffled loader; saves `root/at-N` after micro-batch N."""
    xs, ys = make_batches(1, 96)
    shuffled = DataLoader(TensorDataset(xs[0], ys[0]), batch_size=4, shuffle=True)
    session, model, loader = _one_process(accumulate=2, loader=shuffled)
    if load is not None:
        session.load(load)
    while session.micro_step < until:
        for batch in session.progress(loader):
            session.train_step(batch, F.cross_entropy)
            if session.micro_step in save_at:
                session.save(Path(root) / f"at-{session.micro_step}")
            if session.micro_step >= until:
                break
    state = {k: v.clone() for k, v in model.state_dict().items()}
    session.close()
    return state


def test_a_resumed_run_saving_mid_window_records_the_window_start(tmp_path):
    """A save in the middle of an accumulation window records the loop as at the window's start;
    in a resumed run's first window too, so resuming from it ends as the run that never stopped."""
    whole = _accumulating_run(tmp_path / "a", save_at=(4,))
    _accumulating_run(tmp_path / "b", load=tmp_path / "a" / "at-4", save_at=(5,), until=5)
    assert json.loads((tmp_path / "b" / "at-5" / "paratrain.json").read_text())["state"]["micro_step"] == 4
    assert_same_params(_accumulating_run(tmp_path / "c", load=tmp_path / "b" / "at-5"), whole, atol=0)


def test_resuming_with_an_accumulate_that_does_not_divide_the_saved_micro_batch_is_refused(tmp_path):
    """Saved after micro-batch 3 at accumulate=1: resumed at accumulate=2 the first optimizer step
    would take one micro-batch scaled by 1/2 (a half step, silently); 3 divides it and resumes."""
    sessions = [_one_process(accumulate=accumulate)[0] for accumulate in (1, 2, 3)]
    xs, ys = make_batches(3, 8)
    for x, y in zip(xs, ys):
        sessions[0].train_step((x, y), F.cross_entropy)
    sessions[0].checkpoint(tmp_path)
    with pytest.raises(pt.ConfigError, match=r"after micro-batch 3 \(accumulate=1\); with accumulate=2 the first "
                                             r"optimizer step would take 1 micro-batch\(es\), not 2"):
        sessions[1].resume(tmp_path)
    assert sessions[1].micro_step == 0 and sessions[2].resume(tmp_path) and sessions[2].micro_step == 3
    for session in sessions:
        session.close()


def test_resume_warns_when_the_root_holds_checkpoints_under_other_names(tmp_path):
    """session.save(root / "epoch-3") is not what resume(root) looks for (step-*): starting from
    scratch then is said, with the checkpoint to pass."""
    session, _, _ = _one_process()
    session.save(tmp_path / "epoch-3")
    with pytest.warns(checkpoint.CheckpointWarning, match=r"starts from scratch: .* holds no checkpoint step-\*, "
                                                          r"but epoch-3/ is a checkpoint under another name"):
        assert not session.resume(tmp_path)
    assert session.resume(tmp_path / "epoch-3")
    session.close()


def test_a_checkpoint_without_its_marker_is_skipped_with_a_warning(tmp_path):
    """A `step-*` directory holding a save's files but no paratrain.json (its save never finished,
    or the file was removed) is named in a CheckpointWarning, as a truncated one is, and resume
    loads the checkpoint written before it."""
    session, model, _ = _one_process()
    xs, ys = make_batches(2, 8)
    session.train_step((xs[0], ys[0]), F.cross_entropy)
    session.checkpoint(tmp_path)
    earlier = {k: v.clone() for k, v in model.state_dict().items()}
    session.train_step((xs[1], ys[1]), F.cross_entropy)
    newest = session.checkpoint(tmp_path)
    session.close()
    (newest / "paratrain.json").unlink()
    resumed, again, _ = _one_process()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resumed.resume(tmp_path) and resumed.micro_step == 1
    assert _warned(caught) == [f"checkpoint {newest} is damaged: it has no paratrain.json, which every save "
                               "writes last (the save did not finish, or the file was removed); resume() skips it"]
    assert_same_params(again.state_dict(), earlier, atol=0)
    resumed.close()


def test_resuming_with_another_dataset_says_what_a_session_user_can_do(tmp_path):
    """The dataset lengths are named with the Session's way out (weights_only=True), and nothing
    of the session is changed by the refused load."""
    xs, ys = make_batches(1, 12)
    session, _, loader = _one_process(loader=DataLoader(TensorDataset(xs[0], ys[0]), batch_size=4))
    session.train_step(next(iter(loader)), F.cross_entropy)
    session.checkpoint(tmp_path)
    session.close()
    xs, ys = make_batches(1, 10)
    other, _, _ = _one_process(loader=DataLoader(TensorDataset(xs[0], ys[0]), batch_size=5))
    with pytest.raises(pt.ConfigError, match=r"saved while training on a dataset of 12 samples, but the loader "
                                             r"given to setup\(\) reads 10: .*session.resume\(root, weights_only=True\)"):
        other.resume(tmp_path)
    assert other.micro_step == 0 and other.epoch == 0
    assert other.resume(tmp_path, weights_only=True)
    other.close()
