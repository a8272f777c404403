"""`paratrain run` when things go wrong around the ranks (issue 16, points 16-18): a SIGKILLed
launcher takes its workers with it."""

from __future__ import annotations

import os
import signal
import textwrap
import time

import pytest

from test_cli import _running, paratrain, start

# Writes its pid, then (second argument "gate") waits for a file before importing paratrain, so
# that a test can kill the launcher before the worker has asked to die with it.
SLEEPER = textwrap.dedent("""
    import os, sys, time
    out, gate = sys.argv[1], sys.argv[2]
    rank = os.environ["RANK"]
    with open(os.path.join(out, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    while gate == "gate" and not os.path.exists(os.path.join(out, "go")):
        time.sleep(0.05)
    import paratrain
    open(os.path.join(out, f"armed{rank}"), "w").close()
    time.sleep(120)
""")

def _wait_for(paths, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"never appeared: {[p.name for p in paths if not p.exists()]}"
        time.sleep(0.05)


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
@pytest.mark.parametrize("when", ["running", "starting"])
def test_workers_die_when_the_launcher_is_sigkilled(tmp_path, when):
    """'running': the workers had imported paratrain; 'starting': the launcher died first, and
    each worker finds it gone when it imports paratrain (the race that PR_SET_PDEATHSIG misses)."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    out = tmp_path / "out"
    out.mkdir()
    launcher = start("run", "-n", "2", "sleeper.py", str(out), "gate" if when == "starting" else "-",
                     cwd=tmp_path)
    pids = []
    try:
        _wait_for([out / "pid0", out / "pid1"])
        pids = [int((out / f"pid{r}").read_text()) for r in range(2)]
        if when == "running":
            _wait_for([out / "armed0", out / "armed1"])
        os.kill(launcher.pid, signal.SIGKILL)  # what the OOM killer does
        launcher.wait(10)
        if when == "starting":
            while any(_running(p) and _parent(p) == launcher.pid for p in pids):
                time.sleep(0.05)  # re-parented: the launcher is gone before they import paratrain
            (out / "go").touch()
        deadline = time.monotonic() + 10
        while (alive := [p for p in pids if _running(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive, f"workers {alive} outlived their SIGKILLed launcher by 10 s"
    finally:
        for pid in [p for p in pids if _running(p)]:
            os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.communicate()
