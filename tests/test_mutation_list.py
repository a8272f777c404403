"""tools/mutation_check.py's mutants stay applicable: each snippet is still in the package exactly
once, and each names test files that exist (the check itself runs outside the suite: too slow)."""

import os
import sys

from tests.support import ROOT_DIR

ROOT = ROOT_DIR
sys.path.insert(0, os.path.join(ROOT, "tools"))
import mutation_check  # noqa: E402


def test_every_mutant_still_applies_to_the_code():
    assert mutation_check.check(mutation_check.MUTANTS) == []


def test_every_mutant_names_existing_tests():
    assert len(mutation_check.MUTANTS) >= 10
    for mutant in mutation_check.MUTANTS:
        assert mutant.tests and all(os.path.exists(os.path.join(ROOT, t.split("::")[0])) for t in mutant.tests)


import ast  # noqa: E402
import random  # noqa: E402
from pathlib import Path  # noqa: E402

import mutate_ast  # noqa: E402


def test_mechanical_sites_cover_every_kind_in_every_package_and_leave_messages_alone():
    sites = mutate_ast.all_sites()
    kinds = {(s.package.split("/")[1], s.kind) for s in sites}
    assert kinds == {(p, k) for p in mutate_ast.PACKAGES for k in ("compare", "off-by-one", "drop", "swap-args")}
    messages = {}  # each module's raise statements and f-strings, as (start, end) spans
    for path in {s.path for s in sites}:
        messages[path] = [((n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset))
                          for n in ast.walk(ast.parse((Path(ROOT) / path).read_text()))
                          if isinstance(n, (ast.Raise, ast.JoinedStr))]
    for site in sites:
        assert not [span for span in messages[site.path] if span[0] <= site.where[:2] and site.where[2:] <= span[1]], \
            site.describe()


def test_a_mechanical_mutant_changes_its_module_at_its_site_only():
    sites = mutate_ast.all_sites()
    for site in random.Random(0).sample(sites, 60):  # every site parses; a sample is rewritten
        source = (Path(ROOT) / site.path).read_text()
        before, after = ast.unparse(ast.parse(source)).splitlines(), mutate_ast.mutated(source, site).splitlines()
        changed = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
        assert len(before) == len(after) and len(changed) == 1, site.describe()
        assert mutate_ast.mutated(source, site) == mutate_ast.mutated(source, site)  # the same each time
        tests = mutate_ast.tests_for(site)
        assert tests and all((Path(ROOT) / t).exists() for t in tests), site.describe()
