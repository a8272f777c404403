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
