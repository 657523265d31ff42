"""``mergeqp solve`` and ``mergeqp certify``: solve a merge QP stored in an ``.npz`` file, or
certify a point computed elsewhere.

    mergeqp solve PROBLEM.npz --constraint box:0,1 [--constraint simplex] --solver auto --out sol.json
    mergeqp certify PROBLEM.npz --point d.npy --constraint box:0,1

The problem file holds ``H`` (n x n), ``g`` (n), optional ``c`` (scalar) and ``shape``
(K, n_atoms); for ``--constraint sign`` also ``deltas`` (K, r, m) and ``parametrisation``
(rows | columns | scalar). Several ``--constraint`` options intersect (so does ``a & b``).

Exit codes: 0 when the answer is certified at ``--rel-tol``; 1 when it is not (the reasons are
printed); 2 for bad input (missing or malformed file, unknown constraint or solver name,
infeasible constraints, an output path that is an input or cannot be written), with one line
naming the problem; 3 for NaN / inf in the problem or the point; 4 when a write fails (the
previous file is kept: every output is written atomically); 130 when interrupted.
The outputs (``--out``; ``solve``'s ``--save-d``) are checked before any work and written exactly at the names
given; ``--out -`` prints the JSON on standard output (the summary then goes to standard error).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import BadDataError, ConfigError, ValidationError
from ..io.atomic import check_output_file, save_npy_atomic, write_json_atomic

#: ``--out -``: the JSON on standard output
STDOUT = "-"
#: the outputs that may go to standard output (JSON); ``--save-d`` (binary .npy) may not
STDOUT_OUTPUTS = ("the solution", "the certificate")

CONSTRAINT_HELP = ("constraint set, repeatable (intersection): box:LO,HI | simplex[:TOTAL] | "
                   "global_simplex[:TOTAL] | l1:RADIUS[,CENTER] | nonneg | sign[:DENSITY] | none; "
                   "default: none")


def register(subparsers: Any) -> None:
    """Add the ``solve`` and ``certify`` subcommands."""
    p = subparsers.add_parser(
        "solve", help="solve a merge QP (.npz) and certify the answer",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("problem", metavar="PROBLEM.npz", help="problem file (H, g, c, shape[, deltas])")
    _common(p)
    p.add_argument("--solver", default="auto",
                   help="solver name or 'auto' (default); see mergeqp.available_solvers()")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="solver option, repeatable (e.g. --option max_iter=500); values are "
                        "Python literals (numbers, True/False) or plain strings")
    p.add_argument("--x0", default=None, metavar="D",
                   help="warm start: a point d (K x n_atoms), in any format --point of 'mergeqp certify' "
                        "reads (e.g. an earlier 'mergeqp solve --out' file); active_set also takes its "
                        "face as the first active-set guess with --option start_face=point")
    p.add_argument("--out", default=None, metavar="SOL.json",
                   help="write the solution as JSON (objective, d as K x n_atoms, solver, certificate); "
                        "'-': standard output (the summary goes to standard error)")
    p.add_argument("--save-d", default=None, metavar="D.npy",
                   help="also write d (K x n_atoms) as .npy, exactly at this name (no suffix is added)")
    p.set_defaults(func=run_solve)

    c = subparsers.add_parser(
        "certify", help="certify a point d computed elsewhere; exit 0 only if certified",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument("problem", metavar="PROBLEM.npz", help="problem file (H, g, c, shape[, deltas])")
    c.add_argument("--point", required=True, metavar="D",
                   help="the point: .npy (K x n_atoms or flat), .npz (array 'd'), .json (a "
                        "'mergeqp solve --out' file, whose recorded constraints are used when no "
                        "--constraint is given, or a nested list), or .txt/.csv")
    _common(c)
    c.add_argument("--out", default=None, metavar="CERT.json",
                   help="write the certificate as JSON; '-': standard output (the summary goes to standard error)")
    c.set_defaults(func=run_certify)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--constraint", action="append", default=[], metavar="SPEC", help=CONSTRAINT_HELP)
    p.add_argument("--rel-tol", type=float, default=1e-6,
                   help="certified when the gap is at most rel-tol * |J(d)| (default 1e-6)")
    p.add_argument("--abs-tol", type=float, default=0.0,
                   help="also certified when the gap is at most this, in units of J (default 0; "
                        "useful where J* = 0, which no relative test short of exactness passes)")
    p.add_argument("--feas-tol", type=float, default=1e-7,
                   help="largest tolerated constraint violation, times max(1, |d|_inf) (default 1e-7)")
    p.add_argument("--pinv", action="store_true",
                   help="always compute the unconstrained bound c - g'H^+g/2 and the distance to "
                        "-H^+ g (one Cholesky, an eigendecomposition for a singular H; by default only "
                        "up to n = 2048 and for a definite H)")


# ---------------------------------------------------------------------- helpers
def _check_outputs(args: argparse.Namespace, outputs: list[tuple[str | None, str]]) -> None:
    """Before reading anything heavy: every output path is writable, is no input, and no two
    outputs share a path."""
    from ..problem import problem_file_path

    # the problem as it will be read (PATH or PATH.npz), the point to certify, the warm start
    inputs = [p for p in (problem_file_path(args.problem), getattr(args, "point", None), getattr(args, "x0", None))
              if p]
    seen: dict[str, str] = {}
    for path, what in outputs:
        if path is None or (path == STDOUT and what in STDOUT_OUTPUTS):
            continue
        if path == STDOUT:  # (a file named '-' was written: stop 73)
            raise ConfigError(f"{what} is binary and cannot go to standard output ('-'); give a file name, "
                              f"e.g. ./d.npy")
        check_output_file(path, what, inputs)
        key = os.path.realpath(path)
        if key in seen:
            raise ConfigError(f"{what} and {seen[key]} would both be written to {path}; give two paths")
        seen[key] = what


def _load(args: argparse.Namespace) -> tuple[Any, Any]:
    from ..constraints import parse_constraints
    from ..problem import load_problem_file

    problem, context = load_problem_file(args.problem)
    cset = parse_constraints(args.constraint, context)
    if not all(0 <= t < math.inf for t in (args.rel_tol, args.feas_tol, args.abs_tol)):
        raise ConfigError(f"--rel-tol, --feas-tol and --abs-tol must be finite and >= 0, got {args.rel_tol}, "
                          f"{args.feas_tol}, {args.abs_tol}")
    return problem, cset


def _check_auto_options(problem: Any, cset: Any, solver: str, options: dict[str, Any]) -> None:
    """With ``--solver auto``, ``--option`` goes to the solver ``auto`` picks for this problem:
    name it when it does not take an option (and say how to pick another)."""
    if solver != "auto" or not options:
        return
    from ..solvers.registry import choose_solver

    chosen = choose_solver(problem, cset)
    try:
        chosen.check_options(options)
    except ValidationError as exc:
        raise ConfigError(f"--option {', '.join(options)}: --solver auto chose {chosen.name} for this problem, "
                          f"and {exc}; pass --solver NAME to send options to another solver") from None


def _parse_options(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--option {item!r}: expected KEY=VALUE")
        try:
            value: Any = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            value = raw.strip()
        out[key] = value
    return out


def load_point(path: str, what: str = "point file") -> np.ndarray:
    """Read a point from ``.npy``, ``.npz`` (array ``d``, or its only array), ``.json`` (a
    solution written by ``mergeqp solve --out``, ``{"d": ...}`` or a nested list) or text
    (``.txt`` / ``.csv``, whitespace or comma separated). ``what`` names it in errors."""
    if not os.path.exists(path):
        raise ValidationError(f"{what} not found: {path}")
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".json":
            with open(path, encoding="utf-8") as fh:
                obj = json.load(fh)
            value = obj.get("d") if isinstance(obj, dict) else obj
            if value is None:
                raise ValidationError(f"{what} {path}: the JSON object has no key 'd'")
            arr = np.asarray(value, dtype=np.float64)
        elif ext == ".npz":
            with np.load(path, allow_pickle=False) as data:
                if "d" in data.files:
                    arr = data["d"]
                elif len(data.files) == 1:
                    arr = data[data.files[0]]
                else:
                    raise ValidationError(
                        f"{what} {path} holds {sorted(data.files)}; name the point's array 'd'"
                    )
        elif ext in (".txt", ".csv", ".tsv"):
            arr = np.loadtxt(path, delimiter="," if ext == ".csv" else None, ndmin=1)
        else:
            arr = np.load(path, allow_pickle=False)
            if not isinstance(arr, np.ndarray):
                raise ValidationError(f"{what} {path} is an archive; use the .npz extension")
    except ValidationError:
        raise
    except Exception as exc:  # noqa: BLE001 - any unreadable file, one clear line
        if "allow_pickle" in str(exc):  # numpy's advice to unpickle would run a file's code
            why = "not a NumPy array file (.npy), or one of pickled Python objects (never loaded)"
        elif "inhomogeneous" in str(exc) or "sequence" in str(exc):
            why = "its d is not a rectangular array of numbers (rows of different lengths)"
        else:
            why = f"{type(exc).__name__}: {exc}"
        raise ValidationError(f"cannot read {what} {path}: {why}") from None
    arr = np.asarray(arr)
    if np.issubdtype(arr.dtype, np.number) and not np.all(np.isfinite(arr)):
        raise BadDataError(f"{what} {path}: d holds {int(np.sum(~np.isfinite(arr)))} non-finite "
                           f"value(s) (NaN or inf)")
    return arr


def _point(problem: Any, path: str, what: str) -> np.ndarray:
    """The point in ``path`` (:func:`load_point`) checked against the problem's shape; errors name
    ``what`` (which file it is) and the path."""
    from ..certificate import check_point_shape

    arr = load_point(path, what)
    try:
        return check_point_shape(problem, arr)
    except ValidationError as exc:
        raise ValidationError(f"{what} {path}: {exc}") from None


def _recorded(path: str) -> dict[str, Any]:
    """What a ``mergeqp solve --out`` file records beside its point: ``constraint_specs`` (a list of
    strings) and ``problem`` (a path); ``{}`` for other point files, or where they are missing or
    malformed (the point itself is read, and its errors reported, by :func:`load_point`)."""
    if os.path.splitext(path)[1].lower() != ".json":
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            obj = json.load(fh)
    except (OSError, ValueError):
        return {}
    if not isinstance(obj, dict):
        return {}
    out: dict[str, Any] = {}
    specs = obj.get("constraint_specs")
    if isinstance(specs, list) and all(isinstance(x, str) for x in specs):
        out["constraint_specs"] = specs
    if isinstance(obj.get("problem"), str):
        out["problem"] = obj["problem"]
    return out


def _with_recorded_constraints(args: argparse.Namespace, say: Callable[[str], None]) -> None:
    """``certify --point SOL.json`` of a ``solve --out`` file: without ``--constraint``, the constraints
    the file records are used (it was certified against none, "NOT CERTIFIED gap 11.6", stop 74); with
    ``--constraint``, a note where they differ; a note where the file was solved for another problem."""
    rec = _recorded(args.point)
    specs = rec.get("constraint_specs")
    if specs is not None and not args.constraint and specs:
        args.constraint = list(specs)
        say(f"constraints from the point file {args.point}: {' & '.join(specs)} (pass --constraint to choose others)")
    elif specs is not None and list(args.constraint) != list(specs):
        say(f"note: the point file {args.point} records the constraints {' & '.join(specs) or 'none'}; certifying "
            f"against {' & '.join(args.constraint) or 'none'}, as given")
    solved_for = rec.get("problem")
    if solved_for is not None:
        from ..problem import problem_file_path

        given = problem_file_path(args.problem)
        if os.path.realpath(solved_for) != os.path.realpath(given):
            say(f"note: the point file {args.point} was solved for the problem {solved_for}, not {given}")


def _write_json(path: str, payload: dict[str, Any], say: Callable[[str], None]) -> None:
    """``payload`` at ``path`` (atomically), or on standard output for ``-``."""
    if path == STDOUT:
        print(json.dumps(payload, indent=1))
        return
    write_json_atomic(path, payload, indent=1)
    say(f"wrote {path}")


def _say(args: argparse.Namespace) -> Callable[[str], None]:
    """Where the summary goes: standard output, or standard error when ``--out -`` takes standard output."""
    stream = sys.stderr if args.out == STDOUT else sys.stdout
    return lambda msg: print(msg, file=stream)


def _not_certified(command: str, cert: Any, rel_tol: float) -> int:
    reasons = "; ".join(cert.reasons(rel_tol)) or "not certified"
    print(f"mergeqp {command}: NOT CERTIFIED: {reasons}", file=sys.stderr)
    return 1


# ---------------------------------------------------------------------- commands
def run_solve(args: argparse.Namespace) -> int:
    """Solve, print the summary and certificate, optionally write JSON; exit 0 iff certified."""
    from ..solvers.registry import solve

    say = _say(args)
    _check_outputs(args, [(args.out, "the solution"), (args.save_d, "d (--save-d)")])
    options = _parse_options(args.option)
    problem, cset = _load(args)
    x0 = None if args.x0 is None else _point(problem, args.x0, "--x0 file (the warm start)")
    _check_auto_options(problem, cset, args.solver, options)
    # the command prints the pseudo-inverse facts where certify computes them by default (one
    # Cholesky, up to n = 2048); solve() from Python skips them unless asked
    solution = solve(problem, cset, solver=args.solver, x0=x0, rel_tol=args.rel_tol,
                     feas_tol=args.feas_tol, abs_tol=args.abs_tol, pinv=True if args.pinv else None, **options)
    say(f"problem {args.problem}: n = {problem.n} ({problem.K} models x {problem.n_atoms} atoms)")
    say(solution.summary())
    if options:
        say(f"options {options} were passed to solver {solution.solver}")
    if args.out:
        payload = solution.to_dict()
        payload["problem"] = os.path.abspath(args.problem)
        payload["constraint_specs"] = list(args.constraint)
        _write_json(args.out, payload, say)
    if args.save_d:
        save_npy_atomic(args.save_d, solution.d)
        say(f"wrote {args.save_d}")
    cert = solution.certificate
    if cert is None or not cert.certified(args.rel_tol):
        return _not_certified("solve", cert, args.rel_tol) if cert is not None else 1
    return 0


def run_certify(args: argparse.Namespace) -> int:
    """Certify ``--point``; print the certificate; exit 0 iff certified."""
    from ..certificate import certify

    say = _say(args)
    _check_outputs(args, [(args.out, "the certificate")])
    _with_recorded_constraints(args, say)
    problem, cset = _load(args)
    d = _point(problem, args.point, "point file")
    cert = certify(problem, cset, d, rel_tol=args.rel_tol, feas_tol=args.feas_tol,
                   pinv=True if args.pinv else None, abs_tol=args.abs_tol)
    say(f"problem {args.problem}: n = {problem.n} ({problem.K} models x {problem.n_atoms} atoms); "
          f"point {args.point}")
    say(cert.explain(args.rel_tol))
    if args.out:
        payload = cert.to_dict()
        payload["certified"] = cert.certified(args.rel_tol)
        payload["problem"] = os.path.abspath(args.problem)
        payload["point"] = os.path.abspath(args.point)
        payload["constraint_specs"] = list(args.constraint)
        _write_json(args.out, payload, say)
    if not cert.certified(args.rel_tol):
        return _not_certified("certify", cert, args.rel_tol)
    return 0
