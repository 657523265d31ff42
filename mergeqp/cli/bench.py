"""``mergeqp bench``: run chosen solvers over the reference problems and print a table.

    mergeqp bench                                   # committed instances, all solvers
    mergeqp bench --problems vit3072 --solvers active_set,clarabel --constraint box:0,1
    mergeqp bench --problems all --json bench.json

Columns: problem, n, constraint set, solver, seconds (wall clock of ``solve``, setup + solve +
certificate), objective, certified relative gap (the certificate's Frank-Wolfe / duality gap
over the certificate's scale ``max(|J|, 1e-8 (|c| + |d'Hd|/2 + |g'd|))``), certified yes/no at ``--rel-tol``, and the relative difference
to the stored reference optimum when one exists. This is a benchmark, not a test: numbers
depend on the machine.

Exit codes: 0 when at least one cell ran (failed cells are listed on stderr); 2 when every cell
failed or was skipped (nothing was measured), or for a bad argument; 4 when ``--json`` cannot
be written (it is checked before the run and written atomically).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

from ..errors import ConfigError, MergeQPError, unknown
from ..io.atomic import check_output_file, write_json_atomic


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench", help="benchmark solvers on the reference problems",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--problems", default="committed",
                   help="comma-separated instance names, 'committed' (default) or 'all' "
                        "(large ones are generated and cached under problems/generated/)")
    p.add_argument("--solvers", default="all",
                   help="comma-separated solver names or 'all' (default: every available solver)")
    p.add_argument("--constraint", action="append", default=None, metavar="SPEC",
                   help="constraint set, e.g. box:0,1 or 'box:0,1 & simplex' (repeatable; "
                        "'l1:L1R' uses the instance's L1 radius; 'none' = unconstrained). "
                        "Default: box:0,1 and simplex")
    p.add_argument("--repeat", type=int, default=1, help="runs per cell; the fastest is reported (default 1)")
    p.add_argument("--rel-tol", type=float, default=1e-8, help="relative gap for 'certified' (default 1e-8)")
    p.add_argument("--max-n", type=int, default=None,
                   help="skip solvers other than active_set/torch_fista above this n (default: none)")
    p.add_argument("--opt", action="append", default=[], metavar="SOLVER.KEY=VALUE",
                   help="a solver option, e.g. torch_fista.dtype=float32 (repeatable)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    p.set_defaults(func=run)


def _names(arg: str, known: dict[str, Any], kind: str, committed_only: bool = False) -> list[str]:
    if arg in ("all", "committed"):
        if kind == "problem" and arg == "committed":
            return [n for n, s in known.items() if getattr(s, "committed", True)]
        return list(known)
    names = [s.strip() for s in arg.split(",") if s.strip()]
    if not names:
        raise ConfigError(f"--{kind}s is empty; valid: all, {', '.join(known)}")
    for name in names:
        if name not in known:
            raise unknown(kind, name, known)
    return names


def parse_options(items: list[str], solvers: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``["torch_fista.dtype=float32", ...]`` -> ``{"torch_fista": {"dtype": "float32"}}``."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        solver, dot, opt = key.partition(".")
        if not sep or not dot or not opt:
            raise ConfigError(f"--opt {item!r}: expected SOLVER.KEY=VALUE")
        if solver not in solvers:
            raise unknown("solver", solver, solvers)
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out.setdefault(solver, {})[opt] = value
    for solver, opts in out.items():
        solvers[solver].check_options(opts)  # unknown keys fail now, not inside the table
    return out


def bench_rows(problems: list[str], solvers: list[str], constraints: list[str], repeat: int = 1,
               rel_tol: float = 1e-8, max_n: int | None = None, echo: Any = None,
               options: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Run every (problem, constraint, solver) cell; returns one dict per cell."""
    from ..certificate import forget_factorisation
    from ..solvers.reference_problems import (
        constraint_from_spec,
        load_reference_problem,
        load_references,
        resolve_spec,
    )
    from ..solvers.registry import SOLVERS, solve

    rows = []
    for name in problems:
        problem = load_reference_problem(name)
        try:
            refs = load_references(name)
        except MergeQPError:
            refs = {}
        radius = refs.get("l1_radius")
        if radius is None and any("L1R" in c for c in constraints):
            from ..solvers.reference_problems import choose_l1_radius

            radius = choose_l1_radius(problem)
        for spec in constraints:
            spec_r = resolve_spec(spec, radius)
            cset = constraint_from_spec(spec_r) if spec_r != "none" else constraint_from_spec("")
            ref = refs.get("optima", {}).get(spec_r, {}).get("objective")
            for solver in solvers:
                row: dict[str, Any] = {"problem": name, "n": problem.n, "constraint": spec_r, "solver": solver}
                why = SOLVERS[solver].available() or SOLVERS[solver].supports(problem, cset)
                if why is None and max_n is not None and problem.n > max_n and solver not in ("active_set", "torch_fista"):
                    why = f"skipped: n > --max-n {max_n}"
                if why is not None:
                    row.update(skipped=why)
                    rows.append(row)
                    if echo:
                        echo(row)
                    continue
                best = None
                for _ in range(max(1, repeat)):
                    forget_factorisation(problem)  # every run pays for its certificate in full
                    t0 = time.perf_counter()
                    try:
                        sol = solve(problem, cset, solver=solver, rel_tol=rel_tol,
                                    **(options or {}).get(solver, {}))
                    except MergeQPError as exc:
                        row.update(error=f"{type(exc).__name__}: {exc}")
                        break
                    seconds = time.perf_counter() - t0
                    if best is None or seconds < best[0]:
                        best = (seconds, sol)
                if best is not None:
                    seconds, sol = best
                    cert = sol.certificate
                    assert cert is not None
                    row.update(
                        seconds=seconds, objective=sol.objective, relative_gap=cert.relative_gap,
                        certified=cert.certified(rel_tol), status=sol.status.value,
                        iterations=sol.iterations, timings=dict(sol.timings),
                        vs_reference=None if ref is None else (sol.objective - ref) / max(abs(ref), 1e-300),
                    )
                rows.append(row)
                if echo:
                    echo(row)
    return rows


HEADER = f"{'problem':12s} {'n':>6s} {'constraint':24s} {'solver':15s} {'seconds':>9s} {'objective':>18s} {'rel. gap':>9s} {'cert':>4s} {'vs ref':>9s}"


def format_row(row: dict[str, Any]) -> str:
    head = f"{row['problem']:12s} {row['n']:6d} {row['constraint']:24s} {row['solver']:15s}"
    if "skipped" in row:
        return f"{head} {'-':>9s}  (not run: {row['skipped']})"
    if "error" in row:
        return f"{head} {'-':>9s}  (error: {row['error']})"
    gap = row["relative_gap"]
    gap_s = f"{gap:9.1e}" if math.isfinite(gap) else f"{'inf':>9s}"
    ref = row["vs_reference"]
    ref_s = f"{ref:9.1e}" if ref is not None else f"{'-':>9s}"
    return (f"{head} {row['seconds']:9.3f} {row['objective']:18.10g} {gap_s} "
            f"{'yes' if row['certified'] else 'NO':>4s} {ref_s}")


def run(args: argparse.Namespace) -> int:
    from ..solvers.reference_problems import REFERENCE_SPECS, constraint_from_spec, resolve_spec
    from ..solvers.registry import SOLVERS

    problems = _names(args.problems, REFERENCE_SPECS, "problem")
    solvers = _names(args.solvers, SOLVERS, "solver")
    if args.repeat < 1:
        raise ConfigError("--repeat must be >= 1")
    constraints = args.constraint or ["box:0,1", "simplex"]
    if args.solvers == "all":  # every available solver (closed_form only for 'none')
        solvers = [s for s in solvers if SOLVERS[s].available() is None
                   and (s != "closed_form" or "none" in constraints)]
    options = parse_options(args.opt, SOLVERS)
    if args.json:  # fail before the run, not after it
        check_output_file(args.json, "--json")
    for spec in constraints:  # a bad spec fails before the table starts (L1R: any radius parses)
        if spec != "none":
            constraint_from_spec(resolve_spec(spec, 1.0))
    print(HEADER)
    print("-" * len(HEADER))
    rows = bench_rows(problems, solvers, constraints, repeat=args.repeat, rel_tol=args.rel_tol,
                      max_n=args.max_n, echo=lambda r: print(format_row(r), flush=True), options=options)
    if args.json:
        write_json_atomic(args.json, {"rel_tol": args.rel_tol, "rows": rows}, indent=1, default=str)
    failed = [r for r in rows if "error" in r]
    measured = [r for r in rows if "error" not in r and "skipped" not in r]
    if failed:
        print(f"mergeqp bench: {len(failed)} of {len(rows)} cell(s) failed: "
              + "; ".join(f"{r['problem']} / {r['constraint']} / {r['solver']}" for r in failed[:10])
              + (" ..." if len(failed) > 10 else ""), file=sys.stderr)
    if not measured:
        raise ConfigError(f"no cell of the benchmark ran: {len(failed)} failed and "
                          f"{len(rows) - len(failed)} were skipped (see the table); nothing was measured")
    return 0
