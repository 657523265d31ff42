"""The per-atom simplex's column kernels (constraints/kernels.py, ``SetStructure.simplex_columns``):
the projection and the linear minimiser of a set whose sum groups are the columns of the (K, atoms)
view are those of the general sort-by-group kernels (capped_shift, and the knapsack on the same set
with one more group that sends it down the general path)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeqp.constraints import Box, Simplex
from mergeqp.constraints.kernels import SetStructure, capped_shift, lmo_structure, project_structure
from mergeqp.solvers.active_set import set_structure


def permuted(s: SetStructure, perm: np.ndarray) -> SetStructure:
    """The same set on the coordinates ``x[perm]`` (groups no longer columns)."""
    assert s.group is not None
    return SetStructure(s.lo[perm], s.hi[perm], s.group[perm], s.totals)


def test_which_sets_take_the_column_kernels() -> None:
    assert set_structure(Simplex(1.0), (4, 6)).simplex_columns == 4
    assert set_structure(Simplex(2.0) & Box(-1.0, np.inf), (3, 5)).simplex_columns == 3
    assert set_structure(Simplex(1.0) & Box(0.0, 0.8), (4, 6)).simplex_columns is None  # upper bounds
    assert set_structure(Box(0.0, 1.0), (4, 6)).simplex_columns is None
    s = set_structure(Simplex(1.0), (4, 6))
    assert permuted(s, np.roll(np.arange(24), 1)).simplex_columns is None
    # whole atoms taken out (the active-set presolve) keep the column layout
    keep = np.array([k * 6 + a for k in range(4) for a in (0, 2, 3, 5)])
    ids, group = np.unique(s.group[keep], return_inverse=True)
    assert SetStructure(s.lo[keep], s.hi[keep], group, s.totals[ids]).simplex_columns == 4


@settings(max_examples=80, deadline=None)
@given(K=st.integers(1, 6), m=st.integers(1, 20), total=st.sampled_from([0.0, 0.5, 1.0, 3.0]),
       lower=st.sampled_from([0.0, -0.5, "mixed"]), spread=st.sampled_from([1e-3, 1.0, 1e3]),
       ties=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_column_kernels_equal_the_general_ones(K, m, total, lower, spread, ties, seed) -> None:
    rng = np.random.default_rng(seed)
    n = K * m
    lo = rng.uniform(-1.0, 0.0, n) if lower == "mixed" else np.full(n, float(lower))
    group = np.tile(np.arange(m), K)
    totals = np.full(m, total) + np.bincount(group, lo, minlength=m)  # budget `total` above sum lo
    s = SetStructure(lo, np.full(n, np.inf), group, totals)
    assert s.simplex_columns == K
    v = spread * rng.standard_normal(n)
    if ties:
        v = np.round(v * 2.0 / spread) * spread / 2.0  # many equal entries in a column
    mine = project_structure(s, v)
    tau = capped_shift(v, lo, s.hi, group, totals)  # the general kernel (it never looks at the layout)
    theirs = np.clip(v - tau[group], lo, s.hi)
    np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-12 * (1.0 + spread))
    assert np.all(mine >= lo)
    np.testing.assert_allclose(np.bincount(group, mine, minlength=m), totals, atol=1e-12 * (1.0 + spread) * K)
    value, vertex = lmo_structure(s, v)
    # the general knapsack breaks ties by flat index: one more group of one coordinate, with an upper
    # bound, after the others leaves that order as it is and takes the general path
    extra = SetStructure(np.append(lo, 0.0), np.append(np.full(n, np.inf), 1.0), np.append(group, m),
                         np.append(totals, 1.0))
    assert extra.simplex_columns is None
    e_value, e_vertex = lmo_structure(extra, np.append(v, 0.0))
    assert vertex is not None and e_vertex is not None
    assert abs(value - e_value) <= 1e-12 * (1.0 + abs(value))
    np.testing.assert_array_equal(vertex, e_vertex[:n])  # the same vertex, ties broken alike


@settings(max_examples=40, deadline=None)
@given(which=st.integers(0, 5), far=st.sampled_from([1e6, 1e9, 1e12]), seed=st.integers(0, 2**31 - 1))
def test_far_points_project_onto_the_set(which, far, seed) -> None:
    """A point 1e6-1e12 out (a face solve along a flat direction ends there) lands on the set to the
    rounding of the set's own scale, not of the point's (it missed an L1 ball of radius 1.8 by 1.9e-7
    from 7e9 before the second pass)."""
    from mergeqp.constraints import GlobalSimplex, L1Ball

    rng = np.random.default_rng(seed)
    shape = (3, 5)
    cset = [L1Ball(1.8), L1Ball(0.7, rng.uniform(-0.2, 0.2, size=shape)), Box(-1, 1) & L1Ball(0.9),
            Simplex(1.0), Box(0.0, 0.8) & Simplex(1.0), GlobalSimplex(2.0)][which]
    s = set_structure(cset, shape)
    v = rng.standard_normal(15)
    v[rng.integers(15)] = far * rng.choice([-1.0, 1.0])
    v[rng.integers(15)] += far * rng.uniform(0.5, 1.0)
    y = project_structure(s, v)
    assert cset.violation(y.reshape(shape)) <= 1e-12
    assert np.max(np.abs(y)) <= 10.0
