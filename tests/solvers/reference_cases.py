"""The committed reference instances of ``problems/`` as parametrisation lists (needed when the
test modules are imported, so they are values, not fixtures): instance names, the exact solvers
with the options the tests use, and ``(instance, constraint spec)`` cases."""

from __future__ import annotations

from mergeqp.solvers.reference_problems import REFERENCE_SPECS, load_references

COMMITTED = [n for n, s in REFERENCE_SPECS.items() if s.committed]

#: exact solvers and the options the tests use (torch_fista in float64 to a tight gap)
EXACT_SOLVERS = {
    "active_set": {},
    "clarabel": {},
    "osqp": {},
    "cvxpy_clarabel": {},
    "cvxpy_osqp": {},
    "torch_fista": {"dtype": "float64", "tol": 1e-9, "device": "cpu", "max_iter": 50000},
}


def reference_cases(full_on: tuple[str, ...] = ("tiny96", "singular192", "k1_100"),
                    light: tuple[str, ...] = ("box:0,1", "simplex")) -> list[tuple[str, str]]:
    """(instance, constraint spec) pairs: every stored spec on the small instances, the
    ``light`` ones on the others (mnist640)."""
    cases = []
    for name in COMMITTED:
        refs = load_references(name)
        for spec in refs["optima"]:
            if name in full_on or spec in light:
                cases.append((name, spec))
    return cases
