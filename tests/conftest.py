import compileall
import os

from tests.support import ROOT_DIR

# Bytecode for paratrain and the tests' helpers, once, as `pip install` writes it for an installed
# package. Where PYTHONDONTWRITEBYTECODE is set (these development machines set it) nothing writes
# it otherwise, and every process the tests start (each rank of each `paratrain run`, each launcher)
# compiled some 100 modules from source: ~0.3 s of CPU apiece.
for folder in ("paratrain", "tests", "examples", "bench"):
    compileall.compile_dir(os.path.join(ROOT_DIR, folder), quiet=1)

# Multi-rank tests run CPU ranks over gloo, on a machine with a GPU too: there the automatic choice
# (nccl, cuda:LOCAL_RANK) has no GPU for rank 1 of `paratrain run -n 2` on a one-GPU machine, as
# a run of the suite on an H200 showed (2026-11-26). The `cuda` tests name their devices.
os.environ.setdefault("PARATRAIN_BACKEND", "gloo")

# matplotlib builds its font cache on first use by running `fc-list`: a process, which the guard
# below would pin on whichever unmarked test first draws a picture on a fresh machine. Built here.
try:
    import matplotlib.font_manager  # noqa: F401
except ImportError:
    pass


# -- the multiprocess marker ----------------------------------------------------------------------
# `pytest -m "not multiprocess and not slow"` runs the single-process tests alone, in about half a
# minute (`slow`: the few single-process tests of several seconds, marked by hand). A
# test is marked when it, a function of its module it calls (transitively), or a fixture of its
# module it uses, calls run_on_ranks
# or anything on `subprocess`/`multiprocessing`: read from the module's source, so nobody marks by
# hand. Where that reading misses a way to start a process, the guard below fails the unmarked test
# that starts one, naming the marker to add.
import ast  # noqa: E402
import multiprocessing.process  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402

_SPAWNERS = {"run_on_ranks", "Popen", "spawn", "start_processes"}
_SPAWNING_MODULES = {"subprocess", "multiprocessing", "mp"}
_spawning: dict[str, set[str]] = {}  # test module's path -> its functions that start processes


def _starts_processes(call: ast.Call) -> bool:
    f = call.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in _SPAWNING_MODULES:
        return True
    # a DataLoader with worker processes
    return any(k.arg == "num_workers" and not (isinstance(k.value, ast.Constant) and k.value.value == 0)
               for k in call.keywords)


def _spawning_functions(path: str) -> set[str]:
    """Names of the module's functions that start processes: directly, through each other, or
    through a function they import from another module of the tests that does (tests/support)."""
    if path in _spawning:
        return _spawning[path]
    _spawning[path] = set()  # a cycle of test modules importing each other ends here
    tree = ast.parse(open(path).read())
    seeds = set(_SPAWNERS)
    for node in tree.body:
        module = node.module if isinstance(node, ast.ImportFrom) else None
        source = os.path.join(ROOT_DIR, *(module or "").split(".")) + ".py"
        if module and module.startswith("tests.") and os.path.isfile(source):
            theirs = _spawning_functions(source)
            seeds |= {a.asname or a.name for a in node.names if a.name in theirs}
    calls: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = calls.setdefault(node.name, set())
            for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
                f = call.func
                names.add(f.id if isinstance(f, ast.Name) else getattr(f, "attr", ""))
                if _starts_processes(call):
                    names.add("Popen")
    spawning, grew = set(), True
    while grew:
        grew = False
        for name, called in calls.items():
            if name not in spawning and called & (seeds | spawning):
                spawning.add(name)
                grew = True
    _spawning[path] = spawning
    return spawning


def pytest_collection_modifyitems(config, items):
    for item in items:
        used = {getattr(item, "originalname", item.name), *getattr(item, "fixturenames", ())}
        if used & _spawning_functions(str(item.fspath)):  # the test, or a fixture it uses, starts processes
            item.add_marker(pytest.mark.multiprocess)


@pytest.fixture(autouse=True)
def _processes_need_the_marker(request, monkeypatch):
    if request.node.get_closest_marker("multiprocess"):
        yield
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} starts a process: mark it @pytest.mark.multiprocess "
                             "(tests/conftest.py did not see it from the source)")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    yield
