"""Solver registry (insertion order = preference order) and the ``solve`` entry point."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from ..certificate import DEFAULT_FEAS_TOL, DEFAULT_REL_TOL, certify, reuse_linear_minimum, tolerance
from ..constraints import ConstraintSet, as_constraint_set, check_feasible
from ..errors import (
    InfeasibleError,
    MergeQPError,
    SolverError,
    UnboundedError,
    UnsupportedError,
    ValidationError,
    check_new_name,
    check_signature,
    first_line,
    failure_text,
    interruption,
    unknown,
)
from ..problem import MergeQP
from ..solution import Solution, SolveStatus
from .active_set import ActiveSetSolver
from . import base
from .base import QPSolver, RawResult
from .clarabel_solver import ClarabelSolver
from .closed_form import ClosedFormSolver
from .cvxpy_solvers import CvxpyClarabelSolver, CvxpyOSQPSolver
from .dense_ipm import DenseIpmSolver
from .osqp_solver import OSQPSolver
from .torch_active_set import TorchActiveSetSolver
from .torch_ipm import TorchIpmSolver
from .torch_solvers import TorchAdamSolver, TorchFISTASolver
from .unbounded import unbounded_after_solve, unbounded_claim

SOLVERS: dict[str, QPSolver] = {}

def register_solver(solver: QPSolver) -> None:
    """Add a solver to the registry (explicitly; nothing registers on import side effects)."""
    if not isinstance(solver, QPSolver):
        raise ValidationError(f"register_solver expects a QPSolver instance, got {type(solver).__name__}")
    if solver.name == "auto":
        raise ValidationError("solver name 'auto' is reserved (solver='auto' chooses among the registered solvers); "
                              "choose another name")
    check_new_name("solver", solver.name, SOLVERS)
    if "," in solver.name:
        raise ValidationError(f"solver name {solver.name!r} contains a comma (lists of solvers are comma-separated)")
    if not isinstance(solver.defaults, Mapping):
        raise ValidationError(f"solver {solver.name!r}: defaults must be a mapping of option name -> default, "
                              f"got {type(solver.defaults).__name__}")
    check_signature("solver", solver.name, "solve(problem, constraints, x0=None, **options)", solver.solve,
                    (None, None), {"x0": None})
    SOLVERS[solver.name] = solver


def get_solver(name: str) -> QPSolver:
    if not isinstance(name, str):
        raise ValidationError(f"solver must be one solver's name (a string) or 'auto', got {type(name).__name__} "
                              f"{name!r:.80}")
    if name not in SOLVERS:
        raise unknown("solver", name, ["auto", *SOLVERS])
    return SOLVERS[name]


def available_solvers() -> dict[str, str | None]:
    """Solver name -> ``None`` if usable here, else why not."""
    return {name: s.available() for name, s in SOLVERS.items()}


def choose_solver(problem: MergeQP, cset: ConstraintSet) -> QPSolver:
    """The ``auto`` dispatch: the first registered solver that is available, supports the
    problem and does not decline it for ``auto`` (registration order encodes the measured
    preference; the thresholds are in docs/solvers.md):

    unconstrained with explicit H -> ``closed_form``; boxes with explicit H and ``n >=
    torch_active_set.AUTO_MIN_N`` (``AUTO_MIN_N_STARTED`` once the process has started CUDA) on a
    CUDA device whose free memory holds three copies of H -> ``torch_active_set``; box / simplex /
    L1 sets with explicit H and ``n <= ActiveSetSolver.auto_max_n``, or larger while its work
    arrays fit in the available memory -> ``active_set``; sets with a projection and a matrix-vector-only (or too large) H ->
    ``torch_fista``; other polyhedral sets (sign consensus) with explicit H: on a CUDA device
    from ``torch_ipm.AUTO_MIN_N`` (``AUTO_MIN_N_STARTED`` once the process has started CUDA) while
    its arrays fit in the GPU's free memory -> ``torch_ipm``, else from
    ``DenseIpmSolver.auto_min_n`` (up to its memory rule) -> ``dense_ipm``, else -> ``clarabel``; user CVXPY constraints -> ``cvxpy_clarabel``.
    ``torch_adam`` (the paper's heuristic) is never chosen automatically."""
    reasons = []
    for s in SOLVERS.values():
        why = _passes_over(s, problem, cset)
        if why is None:
            return s
        reasons.append(f"{s.name}: {why}")
    raise UnsupportedError("no registered solver handles this problem:\n  " + "\n  ".join(reasons))


def declines(solver: QPSolver, problem: MergeQP, cset: ConstraintSet) -> str | None:
    """``solver.supports(problem, cset)``: ``None`` (it handles them) or its reason; a ``supports``
    that raises or answers something else (a user's solver) is a reason naming that, so that
    ``auto`` passes over it and a solver chosen by name is refused with it. A
    :class:`ValidationError` (wrong input, e.g. a user set whose ``linear_form`` raises or has the
    wrong size, named by :func:`~mergeqp.constraints.forms.checked_linear_form`) is raised as it is:
    no solver can take that set."""
    try:
        why = solver.supports(problem, cset)
    except ValidationError:  # the input is wrong (a user set's linear_form, named): no solver can take it
        raise
    except MergeQPError as exc:  # an error that names its own cause: as it is
        return first_line(exc, 300)
    except Exception as exc:  # noqa: BLE001 - a user's solver: say so, never a traceback from here
        return f"its supports() raised {type(exc).__name__}: {first_line(exc, 200)}"
    if why is None or isinstance(why, str):
        return why or None
    return f"its supports() returned {why!r}; it must return None (supported) or a reason (a string)"


def solve(
    problem: MergeQP,
    constraints: Any = None,
    solver: str = "auto",
    *,
    x0: np.ndarray | None = None,
    certify_result: bool = True,
    rel_tol: float = DEFAULT_REL_TOL,
    feas_tol: float = DEFAULT_FEAS_TOL,
    check_feasibility: bool = True,
    abs_tol: float = 0.0,
    pinv: bool | None = False,
    **options: Any,
) -> Solution:
    """Solve ``min_{d in C} 1/2 d'Hd + g'd + c`` and certify the answer.

    ``constraints``: ``None``, a :class:`~mergeqp.constraints.ConstraintSet`, a spec string
    (``"box:0,1"``), a callable (user CVXPY constraints) or a list of these (intersection).
    ``solver``: a registry name or ``"auto"``. ``options`` go to the solver (unknown options
    are an error listing the valid ones). ``abs_tol`` (units of J, default 0) is recorded in
    the certificate: ``certified()`` also accepts a gap up to it (for ``J* = 0``). ``pinv``: the
    certificate's pseudo-inverse facts (unconstrained bound ``c - g'H^+g/2``, distance to
    ``-H^+ g``), which the proof of optimality does not use: ``False`` (default) skips them, so a
    solve never pays the Cholesky of H they cost (at n = 640 as much as the solve itself);
    ``None`` computes them where :func:`~mergeqp.certificate.certify` does by default; ``True``
    always (or call ``certify(problem, constraints, solution.d, pinv=True)`` afterwards). Raises :class:`~mergeqp.errors.InfeasibleError`
    for an empty constraint set, :class:`~mergeqp.errors.UnknownNameError` for a bad solver name.
    """
    if not isinstance(problem, MergeQP):
        raise ValidationError(f"problem must be a MergeQP, got {type(problem).__name__}")
    rel_tol, feas_tol, abs_tol = (tolerance("rel_tol", rel_tol), tolerance("feas_tol", feas_tol),
                                  tolerance("abs_tol", abs_tol))
    t0 = time.perf_counter()
    cset = as_constraint_set(constraints)
    if check_feasibility:
        check_feasible(cset, problem.shape)
    else:
        cset.validate(problem.shape)
    _check_in_range(problem, cset)
    chosen = choose_solver(problem, cset) if solver == "auto" else get_solver(solver)
    if solver != "auto":
        why = chosen.available() or declines(chosen, problem, cset)
        if why is not None:
            raise UnsupportedError(f"solver {chosen.name!r} cannot solve this problem: {why}")
    if options:  # the names and kinds its defaults declare (a user's solver need not check them itself)
        QPSolver.check_options(chosen, options)
    if x0 is not None:
        x0 = problem.flat(x0, "x0 (the warm start)").reshape(problem.shape)
    setup = time.perf_counter() - t0
    fallback = solver == "auto" and certify_result and not options
    try:
        sol = _run(chosen, problem, cset, x0, certify_result, rel_tol, feas_tol, setup, options, pinv,
                   checked=check_feasibility)
    except SolverError as exc:
        if not fallback or isinstance(exc, UnboundedError):  # a proof of unboundedness is final
            raise
        sol = _auto_fallback(problem, cset, None, exc, chosen.name, x0, rel_tol, feas_tol, t0, pinv,
                             check_feasibility, abs_tol)
        if not getattr(exc, "ray_searched", False):  # the refuted claim's own search found no ray
            sol = _unless_unbounded(problem, cset, sol)
        return _with_abs_tol(sol, abs_tol)
    looked = _unbounded_gap(sol)  # before any fallback: a verified ray ends the solve at once
    sol = _unless_unbounded(problem, cset, sol)
    if fallback and not _settled(sol, rel_tol, abs_tol, problem.n):
        sol = _auto_fallback(problem, cset, sol, None, chosen.name, x0, rel_tol, feas_tol, t0, pinv,
                             check_feasibility, abs_tol)
        if not looked:
            sol = _unless_unbounded(problem, cset, sol)
    return _with_abs_tol(sol, abs_tol)


def _unbounded_gap(sol: Solution) -> bool:
    """The answer's certificate proves no finite bound (J may be unbounded below on the set)."""
    cert = sol.certificate
    return cert is not None and not math.isfinite(cert.fw_gap) and not cert.certified()


def _unless_unbounded(problem: MergeQP, cset: ConstraintSet, sol: Solution) -> Solution:
    """``sol``, unless no bound certified it and J provably falls without bound on the set along a
    ray found from H and g (:func:`~mergeqp.solvers.unbounded.unbounded_after_solve`): then that
    :class:`UnboundedError` (stop 55: such problems came back as uncertified points far out)."""
    if _unbounded_gap(sol):
        error = unbounded_after_solve(problem, cset, sol.solver)
        if error is not None:
            raise error
    return sol


#: a set whose point nearest 0 lies beyond this (infinity norm) is refused: products of two coordinates
#: (``d'Hd``, the certificate's sums) leave float64's range there, whatever H
FAR_OUT = 1e150


def _check_in_range(problem: MergeQP, cset: ConstraintSet) -> None:
    """A :class:`ValidationError` when the set's point nearest 0 (a set with a projection) lies beyond
    :data:`FAR_OUT`: every point of the set is that far out, where ``d'Hd`` and the certificate's sums
    cannot be computed in float64 (before stop 52, ``box:1e308,1e308`` ran every solver for seconds
    and ended "not certified" at an infeasible point). Only the coordinates' size is judged, never J
    (a far point can have a small J along a null direction of H). A projection that fails is left to
    the solve."""
    if not cset.has_projection:
        return
    try:
        with np.errstate(all="ignore"):
            nearest = np.asarray(cset.project(np.zeros(problem.shape)), dtype=np.float64)
    except Exception:  # noqa: BLE001 - a user's projection: judged by the solve, as before
        return
    if nearest.shape != tuple(problem.shape) or not np.all(np.isfinite(nearest)):
        return
    far = float(np.max(np.abs(nearest), initial=0.0))
    if far > FAR_OUT:
        raise ValidationError(
            f"the constraint set {cset.spec} lies beyond float64's range for a QP: its point nearest 0 has "
            f"|d|_inf = {far:.3g} (above {FAR_OUT:.0e}), where products of two coefficients overflow; rescale "
            f"the set's bounds (and H, g, c) to the problem's range")


def _with_abs_tol(sol: Solution, abs_tol: float) -> Solution:
    """The solution with ``abs_tol`` (checked by :func:`solve`) recorded in its certificate
    (see ``Certificate.certified``)."""
    abs_tol = float(abs_tol)
    if sol.certificate is None or abs_tol == 0:
        return sol
    return dataclasses.replace(sol, certificate=dataclasses.replace(sol.certificate, abs_tol=abs_tol))


def _run(chosen: QPSolver, problem: MergeQP, cset: ConstraintSet, x0: np.ndarray | None,
         certify_result: bool, rel_tol: float, feas_tol: float, setup: float,
         options: dict[str, Any], pinv: bool | None = False, checked: bool = False) -> Solution:
    """One solver's solve, checked and certified. ``checked``: the set was shown non-empty before
    (:func:`check_feasible`), so a solver's claim that it is empty is its numerics, not a proof:
    a :class:`SolverError` (which ``auto`` falls back from), not an :class:`InfeasibleError`."""
    t1 = time.perf_counter()
    with reuse_linear_minimum():  # (a solver that certified its own point: one LP, not two)
        try:
            # a solver's floating-point overflow (a problem scaled near float64's range, a float32 copy
            # of H) is its numerics, judged by the float64 certificate below: no numpy warning on stderr
            with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
                raw = chosen.solve(problem, cset, x0=x0, **options)
        except UnboundedError as exc:
            if getattr(exc, "verified", False):
                raise
            # a claim that did not go through the shared float64 check (a user's solver): check it
            raise unbounded_claim(problem, cset, chosen.name, f"its claim: {exc}") from exc
        except InfeasibleError as exc:
            if not checked:
                raise
            gmax = float(np.max(np.abs(problem.g), initial=0.0))
            raise SolverError(
                f"{exc}; but the set was shown non-empty before the solve (its closed form or an LP), so this "
                f"is {chosen.name}'s numerics on this problem (max |g| {gmax:.3g}): rescale H and g, or try "
                f"another solver") from exc
        except MergeQPError:
            raise
        except Exception as exc:
            # (one line, and where: a user's solver's bug is named in the user's file, a review of stop 75)
            raise SolverError(f"solver {chosen.name!r} failed: {failure_text(exc)}") from exc
        t2 = time.perf_counter()
        return _checked(chosen, problem, cset, raw, certify_result, rel_tol, feas_tol, pinv, setup, t1, t2)


def _checked(chosen: QPSolver, problem: MergeQP, cset: ConstraintSet, raw: Any, certify_result: bool,
             rel_tol: float, feas_tol: float, pinv: bool | None, setup: float, t1: float, t2: float) -> Solution:
    """A solver's raw answer checked (a RawResult whose d has the problem's shape, real and finite;
    its objective finite) and certified."""
    if not isinstance(raw, RawResult):
        raise SolverError(f"solver {chosen.name!r} returned {type(raw).__name__}, not a RawResult(d, status, ...)")
    status = _status(chosen, raw.status)
    iterations, info = _extras(chosen, raw)
    d = np.asarray(raw.d)
    if d.shape not in (tuple(problem.shape), (problem.n,)):
        raise SolverError(f"solver {chosen.name!r} returned d of shape {d.shape}, expected {tuple(problem.shape)} "
                          f"(models x atoms) or ({problem.n},)")
    if not (np.issubdtype(d.dtype, np.floating) or np.issubdtype(d.dtype, np.integer)):
        raise SolverError(f"solver {chosen.name!r} returned d of dtype {d.dtype}, not real numbers")
    d = d.astype(np.float64).reshape(problem.shape)
    if not np.all(np.isfinite(d)):
        raise SolverError(f"solver {chosen.name!r} returned non-finite coefficients")
    with np.errstate(over="ignore", invalid="ignore"):
        objective = problem.objective(d)
    if not np.isfinite(objective):
        raise SolverError(
            f"solver {chosen.name!r}: the objective overflows float64 at its point "
            f"(|d|_inf = {float(np.max(np.abs(d))):.3g}); rescale H, g and c"
        )
    cert = certify(problem, cset, d, rel_tol=rel_tol, feas_tol=feas_tol, pinv=pinv) if certify_result else None
    t3 = time.perf_counter()
    return Solution(
        d=d, objective=objective, status=status, solver=chosen.name,
        iterations=iterations, certificate=cert, constraints=cset.spec, info=info,
        parametrisation=_recorded_parametrisation(problem),
        layer=problem.metadata.get("layer") if isinstance(problem.metadata.get("layer"), str) else None,
        timings={"setup": setup + raw.setup_seconds, "solve": t2 - t1 - raw.setup_seconds,
                 "certify": t3 - t2, "total": setup + t3 - t1},
    )


def _status(chosen: QPSolver, status: Any) -> SolveStatus:
    """A solver's status as a :class:`SolveStatus` (its value, e.g. ``"optimal"``, is accepted from a
    user's solver); anything else is a :class:`SolverError` naming the solver and the valid values."""
    if isinstance(status, SolveStatus):
        return status
    try:
        return SolveStatus(status)
    except (ValueError, TypeError):
        valid = ", ".join(f"SolveStatus.{s.name}" for s in SolveStatus)
        raise SolverError(f"solver {chosen.name!r} returned status {status!r}; RawResult.status must be one of "
                          f"{valid} (or its value, e.g. 'optimal')") from None


def _extras(chosen: QPSolver, raw: RawResult) -> tuple[int, dict[str, Any]]:
    """A solver's ``iterations`` (a whole number >= 0) and ``info`` (a mapping with string keys, whose
    values ``Solution.to_dict`` writes as JSON: what JSON lacks is written as its text), checked where
    they are received: a user's solver's ``iterations="many"`` or ``info=None`` failed later, in
    ``to_dict`` or ``solve --out``, naming neither the solver nor the field (stop 74)."""
    it = raw.iterations
    if isinstance(it, bool) or not isinstance(it, (int, np.integer, float, np.floating)) \
            or not math.isfinite(float(it)) or float(it) < 0 or float(it) != int(it):
        raise SolverError(f"solver {chosen.name!r} returned iterations={it!r}; RawResult.iterations must be a "
                          f"whole number >= 0")
    info = raw.info
    if not isinstance(info, Mapping):
        raise SolverError(f"solver {chosen.name!r} returned info of type {type(info).__name__}; RawResult.info "
                          f"must be a dict (use {{}} for none)")
    bad = [k for k in info if not isinstance(k, str)]
    if bad:
        raise SolverError(f"solver {chosen.name!r} returned info with the non-string key {bad[0]!r}; "
                          f"RawResult.info's keys must be strings")
    return int(it), dict(info)


def _recorded_parametrisation(problem: MergeQP) -> dict[str, Any] | None:
    """The parametrisation the problem's metadata names (``{"name": ..., ...}``), or ``None``."""
    rec = problem.metadata.get("parametrisation")  # (a Mapping: MergeQP validates it)
    return dict(rec) if isinstance(rec, Mapping) and isinstance(rec.get("name"), str) else None


def _settled(sol: Solution, rel_tol: float, abs_tol: float = 0.0, n: int | None = None) -> bool:
    """No fallback is needed after ``sol``: certified, or (for ``n`` above
    :data:`~mergeqp.solvers.base.AUTO_FLOOR_FALLBACK_MAX_N`, or unknown) feasible at the float64
    rounding floor."""
    cert = sol.certificate
    if cert is None or cert.certified(rel_tol, abs_tol):
        return True
    floor_settles = n is None or n > base.AUTO_FLOOR_FALLBACK_MAX_N
    return floor_settles and cert.feasible and cert.at_rounding_floor


def _rank(sol: Solution, rel_tol: float, abs_tol: float = 0.0) -> tuple[bool, bool, bool, float]:
    """Sort key: feasible before infeasible, certified (at ``rel_tol`` or ``abs_tol``) before not (a point at
    the rounding floor with a smaller gap was kept over a certified one, stop 74), settled before not, then
    the smaller gap."""
    cert = sol.certificate
    assert cert is not None
    return (not cert.feasible, not cert.certified(rel_tol, abs_tol), not _settled(sol, rel_tol, abs_tol),
            cert.fw_gap)


def _fallback_order(problem: MergeQP, cset: ConstraintSet, first_name: str) -> list[str]:
    """The solvers that rank themselves ``auto``'s fallbacks after ``first_name`` (their
    :meth:`~mergeqp.solvers.base.QPSolver.auto_fallback` gives a number for this problem), in
    increasing rank (registration order among equals), where available and supporting it (tried
    even where they decline ``auto``: they take every set they support)."""
    ranked: list[tuple[float, int, str]] = []
    for i, (name, solver) in enumerate(SOLVERS.items()):
        if name == first_name:
            continue
        rank = _fallback_rank(solver, problem, cset)
        if rank is not None and _passes_over(solver, problem, cset, auto=False) is None:
            ranked.append((rank, i, name))
    return [name for _, _, name in sorted(ranked)]


def _last_resort(problem: MergeQP, cset: ConstraintSet, first_name: str) -> list[str]:
    """Up to :data:`~mergeqp.solvers.base.AUTO_FALLBACK_MAX_N` variables, every registered solver
    other than ``first_name`` that ranks itself no fallback here, is available, takes the problem
    and set and does not decline ``auto``, in registration order (a user's solver for a set the
    fallbacks cannot take is tried too). Asked only when no solver found a point inside the set:
    an availability check can be an import (CVXPY's took 0.8 s), paid only where these run."""
    if problem.n > base.AUTO_FALLBACK_MAX_N:
        return []
    return [name for name, solver in SOLVERS.items()
            if name != first_name and _fallback_rank(solver, problem, cset) is None
            and _passes_over(solver, problem, cset) is None]


def _fallback_rank(solver: QPSolver, problem: MergeQP, cset: ConstraintSet) -> float | None:
    """``solver.auto_fallback(problem, cset)`` as a finite number, or ``None`` (not a fallback here;
    also for a user's ``auto_fallback`` that raises or answers something else than a number)."""
    try:
        rank = solver.auto_fallback(problem, cset)
    except Exception:  # noqa: BLE001 - a user's solver: not a fallback
        return None
    if isinstance(rank, bool) or not isinstance(rank, (int, float, np.integer, np.floating)):
        return None
    try:
        value = float(rank)
    except OverflowError:  # (an int beyond float's range)
        return None
    return value if math.isfinite(value) else None


def _passes_over(solver: QPSolver, problem: MergeQP, cset: ConstraintSet, auto: bool = True) -> str | None:
    """Why ``auto`` passes over ``solver`` for this problem and set (``None``: it may run it): not
    available here, does not support them, or (with ``auto``) declines them for ``auto``; a user's
    ``auto_declines`` that raises counts as a decline."""
    why = solver.available() or declines(solver, problem, cset)
    if why is not None or not auto:
        return why
    try:
        return solver.auto_declines(problem, cset)
    except Exception as exc:  # noqa: BLE001 - a user's solver: pass over it
        return f"its auto_declines() raised {type(exc).__name__}"


def _auto_fallback(problem: MergeQP, cset: ConstraintSet, first: Solution | None,
                   error: SolverError | None, first_name: str, x0: np.ndarray | None,
                   rel_tol: float, feas_tol: float, t0: float, pinv: bool | None = False,
                   checked: bool = False, abs_tol: float = 0.0) -> Solution:
    """``auto``'s answer when its first choice failed or did not certify: try the solvers that rank
    themselves its fallbacks for this problem, then the other registered solvers that take the
    problem and set where no point inside the set was found (:func:`_fallback_order`,
    :func:`_last_resort`) until one settles, and keep the best certificate;
    ``info["auto_tried"]`` and a certificate note record what was tried."""
    tried: list[dict[str, Any]] = []
    candidates: list[Solution] = []
    if first is not None:
        candidates.append(first)
        assert first.certificate is not None
        tried.append({"solver": first_name, "fw_gap": first.certificate.fw_gap,
                      "certified": first.certificate.certified(rel_tol, abs_tol)})
    else:
        tried.append({"solver": first_name, "error": str(error)})

    def inside() -> bool:
        return any(c.certificate.feasible for c in candidates if c.certificate)

    def order() -> Iterator[str]:
        yield from _fallback_order(problem, cset, first_name)
        # the other solvers are the last resort for a point inside the set (asked only then)
        for name in ([] if inside() else _last_resort(problem, cset, first_name)):
            if inside():
                return
            yield name

    for name in order():
        alt = SOLVERS[name]
        try:
            sol = _run(alt, problem, cset, x0, True, rel_tol, feas_tol, 0.0, {}, pinv, checked)
        except UnboundedError:
            raise  # the first choice's point cannot be optimal: J has no minimum
        except MergeQPError as exc:
            if interruption(exc) is not None or (isinstance(exc, InfeasibleError) and not checked and not candidates):
                raise  # (a claim that the set is empty, where nothing showed it is not, is the answer)
            # a fallback's own failure (a SolverError, or any other error of its own, e.g. a user's solver's
            # ValidationError) is recorded and the next one tried, whether or not a point was found before
            tried.append({"solver": name, "error": str(exc)})
            continue
        assert sol.certificate is not None
        tried.append({"solver": name, "fw_gap": sol.certificate.fw_gap,
                      "certified": sol.certificate.certified(rel_tol, abs_tol)})
        candidates.append(sol)
        if _settled(sol, rel_tol, abs_tol, n=problem.n):
            break
    if not candidates:
        assert error is not None
        raise error
    best = min(candidates, key=lambda s: _rank(s, rel_tol, abs_tol))
    assert best.certificate is not None
    summary = "; ".join(
        f"{t['solver']}: " + (f"error {t['error']}" if "error" in t else
                              f"gap {t['fw_gap']:.3g}{' (certified)' if t['certified'] else ''}")
        for t in tried)
    note = (f"auto: {first_name} " + ("failed" if first is None else "did not certify")
            + f"; tried {summary}; kept {best.solver}'s point")
    cert = dataclasses.replace(best.certificate, notes=(*best.certificate.notes, note))
    timings = dict(best.timings, total=time.perf_counter() - t0)
    return dataclasses.replace(best, certificate=cert, info={**best.info, "auto_tried": tried},
                               timings=timings)


register_solver(ClosedFormSolver())
register_solver(TorchActiveSetSolver())
register_solver(ActiveSetSolver())
register_solver(TorchFISTASolver())
register_solver(TorchIpmSolver())
register_solver(DenseIpmSolver())
register_solver(ClarabelSolver())
register_solver(CvxpyClarabelSolver())
register_solver(OSQPSolver())
register_solver(CvxpyOSQPSolver())
register_solver(TorchAdamSolver())
