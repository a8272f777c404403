"""The entry point of every rank `paratrain run` starts: `python -m paratrain.launch.rank [-m]
TARGET ARGS...`.

A library import changes nothing in torch, so what a rank does for its launcher happens here,
before the user's code runs, in this order:

1. attach the worker (launch/worker.py): die with the launcher, and leave the notes its failure
   summary reads (torch is loaded by then, with the package: a launcher that died meanwhile is
   noticed by attach itself);
2. install the flight recorder's hooks (debug/flight_hooks.py), so that every collective the script
   issues is recorded, whether or not it imports paratrain, and even where it takes
   `from torch.distributed import all_reduce` before anything else;
3. run the script (or, after -m, the module) as `python` would: `__name__ == "__main__"`,
   `sys.argv` as the script expects it, and the script's own folder first on sys.path;
4. note that the script ended, before the interpreter's exit handlers run: a crash in one of them
   (a library's teardown) is then not reported as a rank that failed in its script.
"""

from __future__ import annotations

import builtins
import os
import runpy
import sys
import types

from paratrain.debug import flight_hooks
from paratrain.launch import worker


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--"]:  # torchrun_argv's separator, which some Pythons' argparse keep
        argv = argv[1:]
    module = argv[:1] == ["-m"]
    target, args = (argv[1], argv[2:]) if module else (argv[0], argv[1:])
    worker.attach()
    flight_hooks.install()
    sys.argv = [target, *args]
    try:
        if module:
            runpy._run_module_as_main(target)  # what `python -m` itself calls: sys.argv[0], __main__
        else:
            _run_script(target)
    except SystemExit:
        worker.script_ended()
        raise
    worker.script_ended()  # an exception instead reaches the worker's excepthook


def _run_script(path: str) -> None:
    """Run the script at `path` as `python path` does: in a module named __main__ that stays in
    sys.modules until the interpreter exits, with the script's folder first on sys.path. (runpy's
    run_path lends the script a module only while it runs: what the script's globals keep, such as
    an open file in a reference cycle, is then never finalized, and its buffered writes are lost.)"""
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __builtins__=builtins, __cached__=None)
    sys.modules["__main__"] = main
    sys.path[0] = os.path.dirname(os.path.abspath(path))
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    exec(code, main.__dict__)


if __name__ == "__main__":
    main()
