"""`paratrain run` / `paratrain env` through real processes: the elastic agent, its workers, their exit.

Every job runs in its own session under a wall-clock bound; if it outlives the bound the whole
session is killed, so a failing test leaves nothing behind either.
"""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from paratrain.cli import main as cli
from paratrain.distributed.topology import free_port
from paratrain.launch import run as launch
from tests.support.launcher import assert_no_worker_left, finish, paratrain, results, start

# One worker script for every job; the mode (second argument) picks how it behaves. Each rank
# writes its pid first, so a test can check afterwards that no worker outlived the job.
WORKER = textwrap.dedent("""
    import json, os, sys, time
    import torch, torch.distributed as dist
    import paratrain as pt

    class Run:  # its log is in a reference cycle, held by a global: only the collector closes it
        def __init__(self, path):
            self.log, self.me = open(path, "w"), self

    out, mode = sys.argv[1], sys.argv[2]
    run = Run(os.path.join(out, "log" + os.environ["RANK"]))
    run.log.write("buffered, never flushed by the script")
    if mode == "restart" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        raise SystemExit("first attempt fails on purpose")
    topo = pt.Topology.from_env().init()
    with open(os.path.join(out, f"pid{topo.rank}"), "w") as f:
        f.write(str(os.getpid()))
    if mode == "raise" and topo.rank == 1:
        raise ValueError("rank 1 exploded on purpose")
    if mode in ("raise", "hang") and topo.rank != 0:
        time.sleep(120)  # never reaches the collective below
    if mode == "raise":
        time.sleep(120)  # rank 0 waits: the launcher must stop it
    total = torch.tensor([float(topo.rank + 1)])
    dist.all_reduce(total)
    seen = dict(rank=topo.rank, world=topo.world_size, node=topo.node_rank, nodes=topo.num_nodes,
                argv=sys.argv[3:], sum=total.item(), malloc=os.environ.get("MALLOC_MMAP_THRESHOLD_"))
    with open(os.path.join(out, f"rank{topo.rank}.json"), "w") as f:
        json.dump(seen, f)
    pt.destroy()
""")


@pytest.fixture
def job(tmp_path):
    """Write the worker script; return (cwd, output folder)."""
    (tmp_path / "worker.py").write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    return tmp_path, out


def test_script_runs_on_every_rank_with_its_arguments_unchanged(job):
    cwd, out = job
    # prefixes of the launcher's own options and of torchrun's are the script's too
    script_args = ["--flag", "value", "-n", "5", "--n", "5", "--max", "1", "--nproc", "4", "--ver"]
    proc = paratrain("run", "-n", "2", "worker.py", str(out), "ok", *script_args, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank, seen in enumerate(results(out, 2)):
        assert seen == dict(rank=rank, world=2, node=0, nodes=1, argv=script_args,
                            sum=3.0, malloc=str(2**30))  # cpu_malloc.py: freed blocks stay for the next step
        # the ranks exit as Python does (cli.py [Note: a quick exit]): the cycle is collected, its file flushed
        assert (out / f"log{rank}").read_text() == "buffered, never flushed by the script"


def test_importing_paratrain_changes_nothing_in_torch(tmp_path):
    check = ("import torch.distributed as d; f, p = d.all_reduce, d.P2POp.__init__; import paratrain; "
             "assert d.all_reduce is f and d.P2POp.__init__ is p, 'torch.distributed was patched'")
    proc = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]


PLAIN = textwrap.dedent("""
    import torch
    import torch.distributed as dist
    from torch.distributed import all_reduce  # taken before any paratrain code could run in a script

    dist.init_process_group("gloo")
    all_reduce(torch.ones(1))
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails after one all_reduce")
    dist.barrier()
""")


def test_a_script_that_never_imports_paratrain_is_recorded_and_reported(tmp_path):
    """Each rank `paratrain run` starts attaches the worker and the flight recorder before the script
    runs (launch/rank.py): the failure summary names the rank's own exception (the worker's note)
    and the collectives, with the script's lines (the recorder), though the script never imports
    paratrain and took all_reduce from torch before anything else."""
    (tmp_path / "plain.py").write_text(PLAIN)
    proc = paratrain("run", "-n", "2", "--timeout", "20", "plain.py", cwd=tmp_path, timeout=90)
    assert proc.returncode == 1
    summary = [line for line in proc.stderr.splitlines() if line.startswith("paratrain run:")]
    assert summary[0].startswith("paratrain run: rank 1 failed (exit code 1"), summary
    assert summary[0].endswith("ValueError: rank 1 fails after one all_reduce; see its output above"), summary
    assert any("#0 all_reduce(float32[1]) on the world group (ranks 0, 1) at plain.py:7" in line
               for line in summary), summary
    assert any("rank 0 called barrier at plain.py:10" in line for line in summary), summary


def test_failing_rank_fails_the_job_and_stops_the_others(job):
    cwd, out = job
    proc = paratrain("run", "-n", "2", "worker.py", str(out), "raise", cwd=cwd)
    assert proc.returncode == 1
    assert "ValueError: rank 1 exploded on purpose" in proc.stderr
    assert "paratrain run: rank 1 failed (exit code 1" in proc.stderr
    assert "stopped by the launcher: rank 0" in proc.stderr
    assert "Traceback" not in proc.stderr.split("paratrain run: rank 1 failed")[1]
    assert_no_worker_left(out, 2)


def test_rank_missing_a_collective_times_out_instead_of_hanging(job):
    cwd, out = job
    began = time.monotonic()
    proc = paratrain("run", "-n", "2", "--timeout", "5", "worker.py", str(out), "hang", cwd=cwd,
                     timeout=35)
    assert proc.returncode != 0
    assert "timed out" in proc.stderr.lower()
    # rank 0 gave up first, but the summary blames rank 1, which never came (test_launcher_faults.py)
    assert "paratrain run: rank 1 never reached the collective that rank 0 was waiting in" in proc.stderr
    assert "paratrain run: rank 0 gave up waiting in a collective" in proc.stderr
    assert time.monotonic() - began < 35
    assert_no_worker_left(out, 2)


def test_module_form_and_max_restarts(job, monkeypatch):
    cwd, out = job  # the first attempt exits 1, the restarted group succeeds
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")  # the user's own allocator setting stands
    proc = paratrain("run", "-n", "1", "--max-restarts", "1", "-m", "worker", str(out), "restart",
                     "--epochs", "3", cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "first attempt fails on purpose" in proc.stderr
    assert results(out, 1) == [dict(rank=0, world=1, node=0, nodes=1, argv=["--epochs", "3"], sum=1.0,
                                    malloc="131072")]


def test_env_as_a_plain_process(tmp_path):
    proc = paratrain("env", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip()
    assert line.startswith("[rank 0] rank=0 local_rank=0 world_size=1 ")
    assert "launcher=single" in line and "intra_node_ranks=0 inter_node_ranks=0" in line


def test_only_processes_paratrain_started_leave_their_imports_out_of_collection(tmp_path):
    """cli.py [Note: a quick exit]: the `paratrain` command's own process freezes what its imports
    made; a process that imports paratrain, or calls cli.main, does not (nor do the ranks: above)."""
    frozen = "import gc; print(gc.get_freeze_count())"
    plain = subprocess.run([sys.executable, "-c", f"import paratrain; {frozen}"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert plain.stdout.split() == ["0"], plain.stderr[-2000:]
    command = subprocess.run([sys.executable, "-c", "import sys; from paratrain.cli import main as cli; "
                              f"sys.argv = ['paratrain', 'env']; cli.main(); {frozen}"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert int(command.stdout.split()[-1]) > 10000, command.stdout + command.stderr[-2000:]
    before = gc.get_freeze_count()
    cli.main(["env"])  # a caller's process (this one): its objects are its own business
    assert gc.get_freeze_count() == before


def test_env_under_run_prints_every_rank(tmp_path):
    proc = paratrain("run", "-n", "2", "--timeout", "7", "--backend", "gloo", "-m", "paratrain", "env",
                     cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    places = sorted(line for line in lines if " rank=" in line)
    assert len(places) == 2
    for rank, line in enumerate(places):
        assert line.startswith(f"[rank {rank}] rank={rank} local_rank={rank} world_size=2 ")
        for field in ("backend=gloo", "launcher=torchrun", "timeout=7s", "intra_node_ranks=0,1",
                      f"inter_node_ranks={rank}"):
            assert field in line
    # the node's software once, from its local rank 0, as `accelerate env` shows it
    software = [line for line in lines if " torch=" in line]
    assert len(software) == 1 and software[0].startswith("[rank 0] python=")
    assert f"torch={torch.__version__}" in software[0]
    # what this machine has, as the test process sees it (an H200's run printed True and its name)
    gpus = "cuda_available=True nccl=" if torch.cuda.is_available() else "cuda_available=False gpus=none"
    assert gpus in software[0]
    if torch.cuda.is_available():
        assert f"gpus={torch.cuda.get_device_name(0)}:" in software[0]


def test_two_nodes_on_loopback_form_one_world(job):
    cwd, out = job
    port = str(free_port())
    nodes = [start("run", "--nnodes", "2", "--node-rank", str(node), "-n", "1", "--master-addr",
                   "127.0.0.1", "--master-port", port, "worker.py", str(out), "ok", cwd=cwd)
             for node in (0, 1)]
    for proc in [finish(p) for p in nodes]:
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(s["rank"], s["node"], s["nodes"], s["sum"]) for s in results(out, 2)] == [
        (0, 0, 2, 3.0), (1, 1, 2, 3.0)]


def test_unreachable_master_is_reported_not_a_traceback(job, monkeypatch):
    cwd, out = job
    monkeypatch.setenv("PET_RDZV_CONF", "timeout=2")  # torchrun's rendezvous wait, read from the env
    proc = paratrain("run", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                     "--master-port", str(free_port()), "worker.py", str(out), "ok", cwd=cwd)
    assert proc.returncode == 1 and "paratrain run: the nodes could not meet" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv,message", [
    (["run", "-n", "0", "x.py"], "-n must be at least 1"),
    (["run", "--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "x.py"], "--node-rank must be in 0 … 1"),
    (["run", "--nnodes", "2", "x.py"], "--nnodes 2 needs --master-addr"),
    (["run", "-n", "2"], "required: script.py | module"),
    (["run", "missing.py"], "script 'missing.py' not found"),
    (["run", "--timeout", "0", "x.py"], "--timeout must be a positive number"),
    (["run", "--master-port", "70000", "x.py"], "--master-port must be in 1 … 65535"),
    (["run", "--backend", "mpi", "x.py"], "invalid choice: 'mpi'"),
    (["run", "-n", "two", "x.py"], "invalid int value: 'two'"),
    ([], "required: {run,verify,env,ckpt,plan}"),
])
def test_bad_input_is_one_line_and_status_2(argv, message, tmp_path, monkeypatch, capsys):
    (tmp_path / "x.py").write_text("")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and err.count("\n") == 1, err


def test_bad_input_from_the_command_line(tmp_path):
    proc = paratrain("run", "-n", "0", "x.py", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == "paratrain run: error: -n must be at least 1 process per node; got 0\n"


def test_version_from_the_console_script(tmp_path):
    # pip puts the script beside the interpreter it installed into, on PATH or not
    script = Path(sys.executable).parent / "paratrain"
    assert script.is_file(), f"no console script at {script}: install the package (pip install -e .)"
    proc = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout.startswith("paratrain ")


RANK = ["-m", "paratrain.launch.rank", "--"]  # every rank starts there (launch/rank.py)


@pytest.mark.parametrize("argv,expected", [
    (["run", "-n", "4", "t.py", "--lr", "1"], ["--nproc-per-node", "4", "--max-restarts", "0",
                                              "--standalone", *RANK, "t.py", "--lr", "1"]),
    (["run", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--max-restarts", "3",
      "-m", "pkg.train"],
     ["--nproc-per-node", "1", "--max-restarts", "3", "--rdzv-backend", "static", "--nnodes", "2",
      "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29500", *RANK, "-m", "pkg.train"]),
])
def test_torchrun_command_line(argv, expected):
    assert launch.torchrun_argv(cli.build_parser().parse_args(argv)) == expected


def test_two_nodes_meet_at_a_c10d_rendezvous_on_loopback(job):
    """torchrun's dynamic rendezvous, passed through: the nodes join at an endpoint under an id
    and get their node ranks there (no --node-rank, no --master-addr)."""
    cwd, out = job
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [start("run", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                   "--rdzv-id", "loopback", "--log-dir", str(cwd / f"logs{node}"), "-n", "1", "worker.py",
                   str(out), "ok", cwd=cwd) for node in (0, 1)]
    for proc in [finish(p, timeout=120) for p in nodes]:
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted((s["rank"], s["nodes"], s["sum"]) for s in results(out, 2)) == [(0, 2, 3.0), (1, 2, 3.0)]
    assert list((cwd / "logs0").iterdir())  # --log-dir reached torchrun


@pytest.mark.parametrize("argv,expected", [
    (["run", "--nnodes", "1:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400", "--tee", "3",
      "--local-addr", "10.0.0.2", "t.py"],
     ["--nproc-per-node", "1", "--max-restarts", "0", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400",
      "--rdzv-id", "paratrain", "--nnodes", "1:4", "--tee", "3", "--local-addr", "10.0.0.2", *RANK, "t.py"]),
])
def test_torchrun_flags_pass_through(argv, expected):
    assert launch.torchrun_argv(cli.build_parser().parse_args(argv)) == expected


@pytest.mark.parametrize("argv,message", [
    (["run", "--nnodes", "1:4", "x.py"], "needs a dynamic rendezvous"),
    (["run", "--nnodes", "2", "--rdzv-backend", "c10d", "x.py"], "needs --rdzv-endpoint"),
    (["run", "--nnodes", "a:b", "x.py"], "--nnodes takes a number of nodes or MIN:MAX"),
])
def test_bad_rendezvous_flags(argv, message, tmp_path):
    proc = paratrain(*argv, cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr


def test_a_signal_exits_0_only_when_every_rank_checkpointed_on_it(capsys):
    """`paratrain run` stopped by SIGTERM: 0 when each local rank left its preemption note (the
    whole path is tests/session/test_preemption.py's), else 128 + the signal, as a shell reports it."""

    from paratrain.launch.run import _stopped_by

    assert _stopped_by(signal.SIGTERM, {}, {}, local_ranks=2) == 143
    assert _stopped_by(signal.SIGTERM, {0: "ckpt/step-00000006"}, {}, local_ranks=2) == 143  # rank 1 was killed
    assert "stopped by SIGTERM" in capsys.readouterr().err
    assert _stopped_by(signal.SIGUSR1, {0: "ckpt/step-00000006", 1: "ckpt/step-00000006"}, {}, local_ranks=2) == 0
    assert "every rank checkpointed (ckpt/step-00000006) and exited 0" in capsys.readouterr().err
    assert _stopped_by(signal.SIGTERM, {}, {0: "CheckpointError: full", 1: "CheckpointError: full"},
                       local_ranks=2) == 143
    assert capsys.readouterr().err == ("paratrain run: stopped by SIGTERM; the checkpoint on SIGTERM failed (ranks "
                                       "0, 1: CheckpointError: full). A resume starts from the newest checkpoint "
                                       "saved before it\n")
