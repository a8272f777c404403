"""How the package is built, checked: imports run one way, no file grows past what one reader
holds, and nothing above the parallel wrappers probes them instead of calling their protocol."""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "paratrain"

# Lower layers never import higher ones (README, "How it is built"). Inside a layer, imports must
# not form a cycle.
LAYERS = [
    {"errors", "flight_recorder", "worker", "hang_report", "postmortem", "flight_hooks", "cpu_malloc"},
    {"topology"},
    {"grid"},
    {"comm"},
    {"ring", "optim", "data", "loader", "precision", "accumulation", "sinks", "metrics", "contrastive",
     "activation_checkpointing", "materialize", "random_state"},
    {"parallel.base"},
    {"parallel.*"},
    {"strategy"},
    {"batch", "preemption", "autolog", "state_layout", "checkpoint_files", "checkpoint_dcp", "checkpoint_lock", "checkpoint_root", "checkpoint", "resume", "progress", "step", "step_watch",
     "weights", "export", "verify"},
    {"session_facts", "session"},
    # the planner (issue 12): above the strategies, whose layout code it reads
    {"plan", "plan.cluster", "plan.cluster_presets", "plan.comm_model", "plan.model_source", "plan.repeated_blocks", "plan.fake_step",
     "plan.block_regions", "plan.model_probe", "plan.optimizer_state", "plan.matmuls", "plan.calibrate_compute",
     "plan.layouts", "plan.zero3_backward", "plan.step_time", "plan.memory", "plan.memory_table", "plan.traffic",
     "plan.recommend", "plan.scaling"},
    {"plan.calibrate", "plan.plan_cli",  # calibrate starts ranks with testing.run_on_ranks
     "launch", "envinfo", "ckpt_cli", "verify_cli", "cli", "testing", "__init__", "__main__"},
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
        if name in layer or (name.startswith("parallel.") and "parallel.*" in layer and name != "parallel.base"):
            return index
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


def test_no_file_over_300_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 300}
    assert not long, f"split these by technique: {long}"


PROBE = re.compile(r"\b(hasattr|getattr)\((self\.)?(model|module|wrapped|stage|optimizer)\b")


@pytest.mark.parametrize("name", ["session", "strategy", "state_layout", "checkpoint", "resume",
                                  "progress", "parallel/base"])
def test_callers_use_the_protocol_instead_of_probing_wrappers(name):
    source = (PACKAGE / f"{name}.py").read_text()
    probes = [line.strip() for line in source.splitlines() if PROBE.search(line)]
    assert not probes, f"call the ParallelModule protocol (parallel/base.py) instead of: {probes}"
