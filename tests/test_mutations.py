"""Every known-wrong variant of tests/mutations.py is caught: for each comparison
that must catch it (tests/comparisons.py, asserted by the engine test it names), the
unmutated reference passes and the mutated one fails under the comparison's own
element-wise tolerance (worst_share > 1, printed with -s / in the failure message)."""
import ast
import os

import pytest

import comparisons as C
from mutations import MUTATIONS, applied

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_mutation_names_existing_comparisons_and_tests():
    """Each variant names comparisons that exist, and each comparison names an engine
    test function that exists (so the report's "caught by" points at a real test)."""
    for name, mutation in MUTATIONS.items():
        assert mutation.caught_by, name
        for comparison in mutation.caught_by:
            assert comparison in C.COMPARISONS, (name, comparison)
    for comparison in C.COMPARISONS.values():
        path, function = comparison.test.split("::")
        with open(os.path.join(REPO, path)) as f:
            defined = {n.name for n in ast.walk(ast.parse(f.read())) if isinstance(n, ast.FunctionDef)}
        assert function in defined, comparison.test


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutation_is_caught(name):
    mutation = MUTATIONS[name]
    for comparison_name in mutation.caught_by:
        comparison = C.COMPARISONS[comparison_name]
        unmutated = comparison.share()
        assert unmutated <= 1, "%s fails without the mutation (worst_share %.3g)" % (comparison_name, unmutated)
        with applied(mutation):
            assert not C.reference_is_unmutated()
            mutated = comparison.share()
        assert C.reference_is_unmutated()
        print("%s caught by %s (%s): worst_share %.3g (unmutated %.3g)"
              % (name, comparison_name, comparison.test, mutated, unmutated))
        assert mutated > 1, ("%s (%s) is not caught by %s: worst_share %.3g"
                             % (name, mutation.what, comparison_name, mutated))
