"""The ``threads`` option of ``active_set`` and ``dense_ipm`` (:mod:`mergeqp.solvers.blas_threads`): the BLAS pools are
capped while a solve runs and restored after it, never enlarged, untouched on a machine with no
more cores than the cap; the answer does not depend on the cap; bad values are refused naming
the option."""

from __future__ import annotations

import pytest
from threadpoolctl import threadpool_info, threadpool_limits

import mergeqp.solvers.active_set as active_set
import mergeqp.solvers.blas_threads as bt
from mergeqp.errors import ValidationError
from mergeqp.solvers.instance_families import draw
from mergeqp.solvers.registry import solve


def _blas_threads() -> list[int]:
    return [int(lib["num_threads"]) for lib in threadpool_info() if lib["user_api"] == "blas"]


@pytest.fixture()
def seen(monkeypatch):
    """The BLAS pools' sizes observed inside every active-set run."""
    sizes: list[list[int]] = []
    real = active_set._Engine.run

    def run(self, x0):
        sizes.append(_blas_threads())
        return real(self, x0)

    monkeypatch.setattr(active_set._Engine, "run", run)
    return sizes


@pytest.mark.parametrize("setting, cap", [("auto", bt.AUTO_MAX_THREADS), ("all", None), (1, 1), (7, 7)])
def test_thread_cap(setting, cap):
    assert bt.thread_cap(setting) == cap
    assert bt.thread_cap(setting, auto=8) == (8 if setting == "auto" else cap)  # a solver's own "auto"


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "four", None])
def test_bad_values_are_refused_naming_the_option(bad):
    inst = draw("box", 0, n=96)
    with pytest.raises(ValidationError, match="active_set: option threads="):
        solve(inst.problem, inst.constraints, solver="active_set", threads=bad)


def test_pools_are_capped_during_the_solve_and_restored(monkeypatch, seen):
    monkeypatch.setattr(bt, "usable_cores", lambda: 64)  # as on a many-core machine
    inst = draw("box", 1, n=384)
    with threadpool_limits(limits=2, user_api="blas"):  # pools of 2 before the solve
        before = _blas_threads()  # (a single-threaded build among them stays at 1)
        capped = solve(inst.problem, inst.constraints, solver="active_set", threads=1)
        assert _blas_threads() == before  # restored
        free = solve(inst.problem, inst.constraints, solver="active_set", threads="all")
    assert max(before) == 2 and seen[0] and max(seen[0]) == 1 and seen[1] == before
    assert capped.info["blas_threads"] == 1 and "blas_threads" not in free.info
    assert capped.certificate.certified() and free.certificate.certified()
    assert capped.iterations == free.iterations
    assert capped.objective == pytest.approx(free.objective, rel=1e-12, abs=1e-12)


def test_a_pool_is_never_enlarged(monkeypatch, seen):
    monkeypatch.setattr(bt, "usable_cores", lambda: 64)
    inst = draw("box", 1, n=192)
    with threadpool_limits(limits=1, user_api="blas"):  # e.g. OMP_NUM_THREADS=1
        sol = solve(inst.problem, inst.constraints, solver="active_set")  # "auto": cap 4
    assert max(seen[0]) == 1 and "blas_threads" not in sol.info
    with threadpool_limits(limits=2, user_api="blas"):
        before = _blas_threads()
        solve(inst.problem, inst.constraints, solver="active_set", threads=3)  # above every pool
    assert seen[1] == before


def test_nothing_is_queried_with_no_more_cores_than_the_cap(monkeypatch):
    monkeypatch.setattr(bt, "usable_cores", lambda: bt.AUTO_MAX_THREADS)
    monkeypatch.setattr(bt, "_controller", None)
    inst = draw("box", 0, n=96)
    sol = solve(inst.problem, inst.constraints, solver="active_set")
    assert bt._controller is None and "blas_threads" not in sol.info


def test_dense_ipm_caps_at_its_own_auto(monkeypatch):
    """``dense_ipm``'s "auto" is its ``AUTO_THREADS`` (8: its time goes to large factorisations),
    not ``active_set``'s 4; the answer does not depend on the cap."""
    from mergeqp.solvers.dense_ipm import DenseIpmSolver

    monkeypatch.setattr(bt, "usable_cores", lambda: 64)
    caps = []
    real = bt.blas_threads

    def spy(setting, auto=bt.AUTO_MAX_THREADS):
        caps.append(bt.thread_cap(setting, auto))
        return real(setting, auto)

    import mergeqp.solvers.dense_ipm as dense_ipm
    monkeypatch.setattr(dense_ipm, "blas_threads", spy)
    inst = draw("sign", 0, n=192)
    auto = solve(inst.problem, inst.constraints, solver="dense_ipm")
    one = solve(inst.problem, inst.constraints, solver="dense_ipm", threads=1)
    assert caps == [DenseIpmSolver.AUTO_THREADS, 1] and DenseIpmSolver.AUTO_THREADS == 8
    assert auto.certificate.certified() and one.certificate.certified()
    assert auto.objective == pytest.approx(one.objective, rel=1e-9, abs=1e-12)
    with pytest.raises(ValidationError, match="dense_ipm: option threads="):
        solve(inst.problem, inst.constraints, solver="dense_ipm", threads="four")
