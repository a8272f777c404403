"""Mechanical mutants: one-point changes drawn from the syntax tree of the library, a second source
of bugs beside tools/mutation_check.py's list, which only holds bugs someone thought of.

    python tools/mutate_ast.py --list                    the sites, counted by package and kind
    python tools/mutate_ast.py --sample 30 --seed 1      30 sites drawn at random, each run against its tests
    python tools/mutate_ast.py --sample 30 --packages checkpoint

Kinds of change, at every site of paratrain/parallel/ and paratrain/checkpoint/ (or --packages):

    compare     a comparison operator for its neighbour: < and <=, > and >=, == and !=, is and
                is not, in and not in
    off-by-one  an integer constant in arithmetic, a comparison or an index, plus one
    drop        a statement that is only a call (`work.wait()`, `bucket.reset()`) becomes `pass`
    swap-args   the first two positional arguments of a call, where they differ (not of
                isinstance, getattr and the like, nor of max and min)

Error messages are left alone (constants inside f-strings and `raise` statements), and so are
annotations. Each drawn mutant runs as mutation_check.py runs its own (a copy of the repository,
the module rewritten there with ast.unparse, pytest -x with PYTHONPATH at the copy) against the
tests that should catch it: the test files mutation_check.py's hand-written mutants of that module
name, and the files of the module's mirror in tests/ whose names hold the module's name, or that
whole folder where none does. A survivor is a bug the tests miss, or a change that does not alter
behaviour (an operator at a value never met): read it before adding a test. The report counts
caught and survived per package.
"""

from __future__ import annotations

import argparse
import ast
import random
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mutation_check  # noqa: E402

ROOT = mutation_check.ROOT
PACKAGES = ("parallel", "checkpoint")
# calls whose first two arguments swapped fail at once or mean the same: not worth a run
UNSWAPPED = {"isinstance", "issubclass", "getattr", "setattr", "hasattr", "max", "min"}
SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
         ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}


@dataclass(frozen=True)
class Site:
    """One change: in `path` (relative to the repository), the node of `kind`'s type at `where`
    (line, column, end line, end column); `index`: which operator of a chained comparison."""

    path: str
    kind: str
    where: tuple[int, int, int, int]
    index: int = 0

    @property
    def package(self) -> str:
        return str(Path(self.path).parent)

    def describe(self) -> str:
        return f"{self.path}:{self.where[0]} {self.kind}"


def _position(node: ast.AST) -> tuple[int, int, int, int]:
    return node.lineno, node.col_offset, node.end_lineno, node.end_col_offset


def _left_alone(tree: ast.AST) -> set[int]:
    """ids of the nodes no mutant touches: inside f-strings, raise statements and annotations."""
    skip = set()
    for node in ast.walk(tree):
        roots: list[ast.AST] = []
        if isinstance(node, (ast.JoinedStr, ast.Raise)):
            roots = [node]
        elif isinstance(node, (ast.arg, ast.AnnAssign)) and node.annotation is not None:
            roots = [node.annotation]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            roots = [node.returns]
        skip.update(id(n) for root in roots for n in ast.walk(root))
    return skip


def _parents(tree: ast.AST) -> dict[int, ast.AST]:
    return {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def sites_in(path: Path, root: Path = ROOT) -> list[Site]:
    """Every mutable site of one module."""
    tree = ast.parse(path.read_text())
    skip, parent = _left_alone(tree), _parents(tree)
    rel = str(path.relative_to(root))
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Compare):
            out += [Site(rel, "compare", _position(node), i) for i, op in enumerate(node.ops) if type(op) in SWAPS]
        elif (isinstance(node, ast.Constant) and type(node.value) is int
              and isinstance(parent.get(id(node)), (ast.BinOp, ast.Compare, ast.Subscript, ast.Slice))):
            out.append(Site(rel, "off-by-one", _position(node)))
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            out.append(Site(rel, "drop", _position(node)))
        elif (isinstance(node, ast.Call) and len(node.args) >= 2 and getattr(node.func, "id", None) not in UNSWAPPED
              and not any(isinstance(a, ast.Starred) for a in node.args[:2])
              and ast.dump(node.args[0]) != ast.dump(node.args[1])):
            out.append(Site(rel, "swap-args", _position(node)))
    return out


def all_sites(packages: tuple[str, ...] = PACKAGES, root: Path = ROOT) -> list[Site]:
    return [s for package in packages for path in sorted((root / "paratrain" / package).rglob("*.py"))
            for s in sites_in(path, root)]


class _Mutate(ast.NodeTransformer):
    def __init__(self, site: Site):
        self.site, self.done = site, False

    def _is_site(self, node: ast.AST, kind: type) -> bool:
        return isinstance(node, kind) and not self.done and _position(node) == self.site.where

    def visit_Compare(self, node):
        if self.site.kind == "compare" and self._is_site(node, ast.Compare):
            node.ops[self.site.index] = SWAPS[type(node.ops[self.site.index])]()
            self.done = True
        return self.generic_visit(node)

    def visit_Constant(self, node):
        if self.site.kind == "off-by-one" and self._is_site(node, ast.Constant):
            self.done = True
            return ast.copy_location(ast.Constant(node.value + 1), node)
        return node

    def visit_Expr(self, node):
        if self.site.kind == "drop" and self._is_site(node, ast.Expr):
            self.done = True
            return ast.copy_location(ast.Pass(), node)
        return self.generic_visit(node)

    def visit_Call(self, node):
        if self.site.kind == "swap-args" and self._is_site(node, ast.Call):
            node.args[0], node.args[1] = node.args[1], node.args[0]
            self.done = True
        return self.generic_visit(node)


def mutated(source: str, site: Site) -> str:
    """`source` with the site's change, rewritten by ast.unparse (comments and layout go; the
    code is the same but for the change)."""
    tree = ast.parse(source)
    change = _Mutate(site)
    tree = ast.fix_missing_locations(change.visit(tree))
    if not change.done:
        raise LookupError(f"{site.describe()}: no such site in the source")
    return ast.unparse(tree)


def tests_for(site: Site, root: Path = ROOT) -> tuple[str, ...]:
    """The test files that should catch a change in the site's module (module docstring)."""
    module = root / site.path
    named = {t.split("::")[0] for m in mutation_check.MUTANTS for old, _ in m.edits
             if old in module.read_text() for t in m.tests}
    mirror = root / "tests" / Path(site.path).parent.relative_to("paratrain")
    stem = module.stem
    files = sorted(mirror.glob("test_*.py")) if mirror.is_dir() else []
    mine = [f for f in files if stem in f.stem] or files
    return tuple(sorted(named | {str(f.relative_to(root)) for f in mine}))


def run_site(site: Site, timeout: float) -> tuple[str, str, float]:
    with tempfile.TemporaryDirectory(prefix="mutant-ast-") as tmp:
        repo = mutation_check.copy_tree(Path(tmp))
        target = repo / site.path
        target.write_text(mutated(target.read_text(), site))
        return mutation_check.run_tests(repo, tests_for(site), timeout)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="count the sites by package and kind, run nothing")
    parser.add_argument("--sample", type=int, default=20, help="sites to draw and run")
    parser.add_argument("--seed", type=int, default=0, help="the draw's seed")
    parser.add_argument("--packages", nargs="+", default=list(PACKAGES), help="packages of paratrain/ to mutate")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per mutant's tests")
    args = parser.parse_args(argv)
    sites = all_sites(tuple(args.packages))
    if args.list:
        counts = Counter((s.package, s.kind) for s in sites)
        for (package, kind), n in sorted(counts.items()):
            print(f"{package:40} {kind:11} {n}")
        print(f"{len(sites)} sites")
        return 0
    drawn = random.Random(args.seed).sample(sites, min(args.sample, len(sites)))
    with tempfile.TemporaryDirectory(prefix="mutant-probe-") as tmp:
        mutation_check.probe(mutation_check.copy_tree(Path(tmp)))
    print("| site | change | tests run | result | first failing test | seconds |\n| --- | --- | --- | --- | --- | --- |")
    tally: Counter = Counter()
    for site in drawn:
        status, failed, seconds = run_site(site, args.timeout)
        tally[(site.package, status == "survived")] += 1
        source = (ROOT / site.path).read_text().splitlines()[site.where[0] - 1].strip()
        print(f"| {site.describe()} | `{source[:60]}` | {len(tests_for(site))} files | {status} | "
              f"{failed.removeprefix('tests/')} | {seconds:.0f} |", flush=True)
    print("\n| package | caught | survived |\n| --- | --- | --- |")
    for package in sorted({p for p, _ in tally}):
        print(f"| {package} | {tally[(package, False)]} | {tally[(package, True)]} |")
    survived = sum(n for (_, s), n in tally.items() if s)
    print(f"{len(drawn) - survived} of {len(drawn)} caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())
