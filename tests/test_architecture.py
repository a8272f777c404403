"""How the package is built, checked: imports run one way, every module sits in the package of its
family, and nothing above the parallel wrappers probes them instead of calling their protocol."""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "paratrain"

# [Note: the layers] Lower layers never import higher ones; inside a layer, imports must not form
# a cycle. A name is a module ("session.session") or a package with everything in it ("data.*",
# which also covers data/__init__.py); a module listed by name wins over its package's pattern.
# The failure tools, the worker and the CPU allocator's settings sit at the bottom: the
# collectives record into the flight recorder, and a rank attaches its worker before torch loads.
LAYERS = [
    {"errors", "debug", "debug.flight_recorder", "debug.flight_hooks", "debug.hang_report", "debug.postmortem",
     "launch", "launch.worker", "launch.cpu_malloc", "launch.stopped"},
    {"distributed", "distributed.topology"},
    {"distributed.grid"},
    {"distributed.comm"},
    {"distributed.ring", "data.*", "components.*"},
    {"parallel.base"},
    {"parallel.*"},                          # the strategies, each in its own file or folder
    {"parallel.registry"},                   # strategy names -> the objects above
    {"checkpoint.*", "debug.verify", "session.*"},
    {"session.session", "session"},
    {"plan.model.*", "plan.cluster.*"},      # the planner's model and machines
    {"plan.cost.*"},                         # reads the strategies' layout code, and both of those
    {"plan.*"},                              # the tables, the search
    {"plan.cluster.calibrate",               # starts ranks with testing.run_on_ranks
     "launch.run", "launch.rank", "cli.*", "testing", "__init__", "__main__"},
]


def _modules() -> dict[str, Path]:
    """Dotted name (without "paratrain.") → file; a package is its __init__ (the root: "__init__")."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts.pop()
        out[".".join(parts)] = path
    return out


def _layer(name: str) -> int:
    for index, layer in enumerate(LAYERS):
        if name in layer:
            return index
    packages = [(len(p), i) for i, layer in enumerate(LAYERS) for p in layer
                if p.endswith(".*") and (name == p[:-2] or name.startswith(p[:-1]))]
    if packages:
        return max(packages)[1]  # the longest pattern that covers it
    raise AssertionError(f"paratrain/{name.replace('.', '/')}.py is in no layer of {__file__}: add it")


def _imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every paratrain import, outside
    `if TYPE_CHECKING:` blocks (annotations only, never run)."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and getattr(node.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name.removeprefix("paratrain."), [], node.lineno) for a in node.names
                    if a.name.startswith("paratrain.")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "paratrain":
            base = node.module.removeprefix("paratrain").removeprefix(".")
            for alias in node.names:
                sub = f"{base}.{alias.name}".lstrip(".")
                if sub in modules:  # `from paratrain import comm`: the module itself
                    out.append((sub, [], node.lineno))
                else:
                    out.append((base or "__init__", [alias.name], node.lineno))
    return out


def _graph() -> dict[str, list[tuple[str, list[str], int]]]:
    modules = _modules()
    return {name: _imports(path, modules) for name, path in modules.items()}


def test_every_import_runs_down_the_layers():
    upward = []
    for name, imports in _graph().items():
        for target, _, line in imports:
            if _layer(target) > _layer(name):
                upward.append(f"paratrain/{name.replace('.', '/')}.py:{line} imports {target}")
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_no_import_cycle():
    graph = {name: {t for t, _, _ in imports if t != name} for name, imports in _graph().items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_no_private_name_is_imported_from_another_module():
    private = [f"paratrain/{name.replace('.', '/')}.py:{line} takes {n} from {target}"
               for name, imports in _graph().items() for target, names, line in imports
               for n in names if n.startswith("_")]
    assert not private, "give shared helpers public names:\n" + "\n".join(private)


def test_every_module_sits_in_a_package_named_for_its_family():
    """The folders are the architecture (DESIGN.md, "Layout"): only the public entry points sit at
    the top of the package."""
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "errors.py", "testing.py"], loose


PROBE = re.compile(r"\b(hasattr|getattr)\((self\.)?(model|module|wrapped|stage|optimizer)\b")


@pytest.mark.parametrize("name", ["session/session", "parallel/registry", "checkpoint/layout",
                                  "checkpoint/save_load", "session/resume", "session/progress", "parallel/base"])
def test_callers_use_the_protocol_instead_of_probing_wrappers(name):
    source = (PACKAGE / f"{name}.py").read_text()
    probes = [line.strip() for line in source.splitlines() if PROBE.search(line)]
    assert not probes, f"call the ParallelModule protocol (parallel/base.py) instead of: {probes}"
