"""Jobs started through `paratrain run` as a user starts them, for the tests that run them: each in
a session of its own under a wall-clock bound, killed whole if it outlives it, so a failing test
leaves nothing running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest


def start(*args: str, cwd) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "paratrain", *args], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 45) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the agent and every worker it started
        stdout, stderr = proc.communicate()
        pytest.fail(f"`paratrain {' '.join(proc.args[3:])}` ran past {timeout}s:\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def paratrain(*args: str, cwd, timeout: float = 45) -> subprocess.CompletedProcess:
    return finish(start(*args, cwd=cwd), timeout)


def results(out, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def assert_no_worker_left(out, world: int) -> None:
    pids = [int((out / f"pid{r}").read_text()) for r in range(world) if (out / f"pid{r}").exists()]
    assert pids, "no worker wrote its pid"
    deadline = time.monotonic() + 5
    while (alive := [p for p in pids if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"worker processes {alive} outlived the job"


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def wait_for(paths, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"never appeared: {[p.name for p in paths if not p.exists()]}"
        time.sleep(0.05)


def sleep_after_writing_pid(topo, out):
    """A rank that writes its pid (atomically) and sleeps: for tests of what ends it."""
    with open(os.path.join(out, f"pid{topo.rank}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(out, f"pid{topo.rank}.tmp"), os.path.join(out, f"pid{topo.rank}"))
    time.sleep(120)
