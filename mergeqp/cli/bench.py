"""``mergeqp bench``: run chosen solvers over the reference problems and print a table.

    mergeqp bench                                   # committed instances, all solvers
    mergeqp bench --problems vit3072 --solvers active_set,clarabel --constraint box:0,1
    mergeqp bench --problems all --json bench.json
    mergeqp bench --family box,simplex --n 3072 --solvers auto,active_set,clarabel
    mergeqp bench --untuned 30 --seed 7 --solvers auto --clock cpu

``--family NAME`` (comma-separated, or ``all``) benchmarks drawn instances of the seeded
families of :mod:`mergeqp.solvers.instance_families` instead of the reference problems
(``--n`` unknowns, ``--seed`` the draw) and adds a column ``x chol``: each solver's time over
the time of one dense Cholesky factorisation of H measured in the same process (of
``H + 1e-10 max diag H I``, so that a singular H factorises; the same flops). ``auto`` is a
valid solver name for both. ``--untuned COUNT`` draws COUNT variants of the box, simplex and L1
families from ``--seed`` (:func:`~mergeqp.solvers.instance_families.untuned_variants`: the number of
models, the rank and conditioning of H, the share of the optimum at a bound; ``--n`` unknowns,
default 3072), names each row by its variant (``--family`` reruns one) and ends with a line per
solver: how many variants it certified within 3 Choleskys of H, the median and the largest ratio.

Columns: problem, n, constraint set, solver, seconds (wall clock of ``solve``, or CPU time with
``--clock cpu``; setup + solve + certificate), objective, certified relative gap (the certificate's Frank-Wolfe / duality gap
over the certificate's scale ``max(|J|, 1e-8 (|c| + |d'Hd|/2 + |g'd|))``), certified at ``--rel-tol`` (``yes``;
``flr``: not, but the gap is within its own float64 rounding, optimal to float64 precision as on
interpolating problems with J* ~ 0; ``NO``), and the relative difference
to the stored reference optimum when one exists. This is a benchmark, not a test: numbers
depend on the machine.

Exit codes: 0 when at least one cell ran (failed cells are listed on stderr); 2 when every cell
failed or was skipped (nothing was measured), or for a bad argument, including a ``--json`` place
refused before the run (a folder, not writable, an input); 4 when writing ``--json`` fails after
the run (a full disk; it is written atomically).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import scipy.linalg as sla

from ..errors import ConfigError, MergeQPError, interruption, unknown
from ..io.atomic import check_output_file, write_json_atomic


#: ``--clock``: how the solvers (and with ``--family`` the Cholesky) are timed
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


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
                   help="above this n, run only the solvers marked to scale (large_n_benchmark: active_set, "
                        "torch_fista) and auto (default: none)")
    p.add_argument("--opt", action="append", default=[], metavar="SOLVER.KEY=VALUE",
                   help="a solver option, e.g. torch_fista.dtype=float32 (repeatable)")
    p.add_argument("--family", default=None, metavar="NAMES",
                   help="benchmark drawn instances of these instance families (comma-separated or 'all'; a "
                        "variant of one as FAMILY:key=value:..., keys K, r, c, N, cond, at_bounds, planted, "
                        "set_type, dead, e.g. box:K=8:r=80:cond=1e9:c=4:N=30:at_bounds=0.95) instead of --problems; "
                        "times are also given as multiples of one Cholesky of H")
    p.add_argument("--untuned", type=int, default=None, metavar="COUNT",
                   help="benchmark COUNT variants of the box, simplex and L1 families drawn at random (from --seed; "
                        "models, rank, conditioning, share at a bound: instances nobody tuned a solver for) with "
                        "--n unknowns (default 3072) instead of --problems, and summarise each solver's ratios to "
                        "one Cholesky; each row names its variant, which --family reruns")
    p.add_argument("--n", type=int, default=None, help="unknowns of the family instances (default: the family's)")
    p.add_argument("--seed", type=int, default=0, help="which instance of each family (default 0)")
    p.add_argument("--sequence", type=int, default=0, metavar="T",
                   help="with --family: also solve T related QPs (same H, g perturbed by a random walk of "
                        "steps of --sequence-step times g's RMS, as a trust region's sequence) cold and "
                        "warm-started from the previous solution, and print both totals and how far the "
                        "optimum moved per step")
    p.add_argument("--sequence-step", type=float, default=None, metavar="F",
                   help="with --sequence: each step of the random walk of g, as a fraction of g's RMS "
                        "(default 0.01)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="time by the wall clock (default) or by this process's CPU time "
                        "(steadier on a shared machine; equal to wall time when BLAS uses one thread)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write the rows as JSON ('rows': one per cell; 'sequences': one per --sequence "
                        "run); '-' writes the JSON to standard output and the table to standard error")
    p.set_defaults(func=run)


def _names(arg: str, known: dict[str, Any], kind: str, committed_only: bool = False) -> list[str]:
    if arg in ("all", "committed"):
        if kind == "problem" and arg == "committed":
            return [n for n, s in known.items() if getattr(s, "committed", True)]
        return list(known)
    names = list(dict.fromkeys(s.strip() for s in arg.split(",") if s.strip()))  # (each once)
    if not names:
        option = {"family": "--family"}.get(kind, f"--{kind}s")
        raise ConfigError(f"{option} is empty; valid: all, {', '.join(known)}")
    for name in names:
        if kind == "family" and ":" in name:  # a variant, FAMILY:key=value:...: checked by its parser
            from ..solvers.instance_families import get_family

            get_family(name)
        elif name not in known:
            raise unknown(kind, name, known)
    return names


def parse_options(items: list[str], solvers: dict[str, Any], running: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """``["torch_fista.dtype=float32", ...]`` -> ``{"torch_fista": {"dtype": "float32"}}``; options of a
    solver that is not among ``running`` (the run's ``--solvers``) are refused (they would be ignored)."""
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
        if running is not None and solver not in running:
            raise ConfigError(f"--opt {solver}.{next(iter(opts))}: {solver} is not among --solvers "
                              f"({', '.join(running)}), so its options would be ignored; add it to --solvers")
    return out


def check_json_output(path: str, inputs: list[str] | tuple[str, ...] = ()) -> None:
    """``--json PATH`` before the run: :func:`check_output_file`, and an existing file is replaced only
    when it holds JSON (an earlier table): a problem file, a script or anything else named by mistake is
    kept (a review replaced a committed problem .npz this way)."""
    check_output_file(path, "--json", inputs)
    if os.path.isfile(path) and os.path.getsize(path) > 0:  # (an empty file, e.g. from mktemp, is replaced)
        try:
            with open(path, encoding="utf-8") as fh:
                earlier = json.load(fh)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            raise ConfigError(f"--json {path} exists and is not a JSON file; outputs never replace other files: "
                              f"choose another path (or remove it)") from None
        if not (isinstance(earlier, dict) and "rows" in earlier):
            # (a review, stop 74: --family ... --json problems/tiny96.json replaced the committed optima)
            raise ConfigError(f"--json {path} exists and is not an earlier bench table (no 'rows'); outputs never "
                              f"replace other files: choose another path (or remove it)")


def bench_rows(problems: list[str], solvers: list[str], constraints: list[str], repeat: int = 1,
               rel_tol: float = 1e-8, max_n: int | None = None, echo: Any = None,
               options: dict[str, dict[str, Any]] | None = None,
               clock: Callable[[], float] = time.perf_counter) -> list[dict[str, Any]]:
    """Run every (problem, constraint, solver) cell (a solver is a registry name or ``auto``);
    returns one dict per cell. ``clock``: as :func:`bench_cell`'s."""
    from ..solvers.reference_problems import (
        constraint_from_spec,
        load_reference_problem,
        load_references,
        resolve_spec,
    )
    rows: list[dict[str, Any]] = []
    for name in problems:
        problem = load_reference_problem(name)
        try:
            refs = load_references(name)
        except MergeQPError as exc:  # none stored (generated instances), or a damaged file: said
            if "damaged" in str(exc):
                print(f"mergeqp bench: warning: {exc}; the column 'vs ref' stays empty", file=sys.stderr)
            refs = {}
        radius = refs.get("l1_radius")
        if radius is None and any("L1R" in c for c in constraints):
            from ..solvers.reference_problems import choose_l1_radius

            radius = choose_l1_radius(problem)
        for spec in constraints:
            spec_r = resolve_spec(spec, radius)
            cset = constraint_from_spec(spec_r) if spec_r != "none" else constraint_from_spec("")
            ref = refs.get("optima", {}).get(spec_r, {}).get("objective")
            base = {"problem": name, "n": problem.n, "constraint": spec_r}
            rows.extend(bench_cell(problem, cset, base, solvers, repeat, rel_tol, max_n, echo, options, ref,
                                   clock=clock))
    return rows


def bench_cell(problem: Any, cset: Any, base: dict[str, Any], solvers: list[str], repeat: int = 1,
               rel_tol: float = 1e-8, max_n: int | None = None, echo: Any = None,
               options: dict[str, dict[str, Any]] | None = None, ref: float | None = None,
               cholesky: Callable[[], float] | None = None,
               clock: Callable[[], float] = time.perf_counter) -> list[dict[str, Any]]:
    """Run each solver (a registry name or ``auto``) on one problem; one row per solver, the
    fastest of ``repeat`` runs. ``cholesky``: times one Cholesky of H; it runs right before each
    run, and ``vs_cholesky`` is the smallest ratio of a run to the Cholesky just before it (so a
    change of the machine's load between cells does not skew the ratio). ``clock``: wall
    (``time.perf_counter``, default) or this process's CPU time (``time.process_time``)."""
    from ..certificate import forget_factorisation
    from ..solvers.registry import SOLVERS, choose_solver, declines, solve

    rows = []
    for solver in solvers:
        row: dict[str, Any] = {**base, "solver": solver}
        if solver == "auto":
            try:
                why = choose_solver(problem, cset) and None
            except MergeQPError as exc:
                why = str(exc)
        else:
            why = SOLVERS[solver].available() or declines(SOLVERS[solver], problem, cset)
        if (why is None and max_n is not None and problem.n > max_n and solver != "auto"
                and not SOLVERS[solver].large_n_benchmark):
            why = f"skipped: n > --max-n {max_n}"
        if why is not None:
            row.update(skipped=why)
            rows.append(row)
            if echo:
                echo(row)
            continue
        best = None
        ratio = math.inf
        for _ in range(max(1, repeat)):
            forget_factorisation(problem)  # every run pays for its certificate in full
            chol = cholesky() if cholesky is not None else None
            t0 = clock()
            try:
                sol = solve(problem, cset, solver=solver, rel_tol=rel_tol, **(options or {}).get(solver, {}))
            except MergeQPError as exc:
                if interruption(exc) is not None:  # Ctrl-C / SIGTERM stop the run (exit 130), not this cell
                    raise
                row.update(error=f"{type(exc).__name__}: {exc}")
                break
            seconds = clock() - t0
            if chol:
                ratio = min(ratio, seconds / chol)
            if best is None or seconds < best[0]:
                best = (seconds, sol)
        if best is not None:
            seconds, sol = best
            cert = sol.certificate
            assert cert is not None
            row.update(
                seconds=seconds, objective=sol.objective, relative_gap=cert.relative_gap,
                certified=cert.certified(rel_tol), status=sol.status.value, chosen=sol.solver,
                at_rounding_floor=bool(cert.feasible and cert.at_rounding_floor),
                iterations=sol.iterations, timings=dict(sol.timings),
                vs_reference=None if ref is None else (sol.objective - ref) / max(abs(ref), 1e-300),
            )
            if cholesky is not None:
                row["vs_cholesky"] = ratio
        rows.append(row)
        if echo:
            echo(row)
    return rows


def cholesky_seconds(H: np.ndarray, repeat: int = 2, clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of one dense Cholesky factorisation of ``H + 1e-10 max diag H I`` (``(n, n)``,
    float64; the ridge lets a singular H factorise at the same cost), fastest of ``repeat``."""
    M = np.array(H, dtype=np.float64)
    M[np.diag_indices_from(M)] += 1e-10 * max(float(np.max(np.diag(M))), np.finfo(float).tiny)
    best = math.inf
    for _ in range(max(1, repeat)):
        work = M.copy()
        t0 = clock()
        sla.cho_factor(work, lower=False, overwrite_a=True, check_finite=False)
        best = min(best, clock() - t0)
    return best


def family_rows(families: list[str], solvers: list[str], n: int | None = None, seed: int = 0, repeat: int = 1,
                rel_tol: float = 1e-8, echo: Any = None,
                options: dict[str, dict[str, Any]] | None = None,
                clock: Callable[[], float] = time.perf_counter) -> list[dict[str, Any]]:
    """Benchmark instance ``seed`` of each family (``n`` unknowns): one row per solver, with
    ``vs_cholesky`` and, for planted families, ``vs_reference`` to the planted optimum."""
    from ..solvers.instance_families import draw

    rows: list[dict[str, Any]] = []
    for name in families:
        inst = draw(name, seed, n)
        assert inst.problem.H is not None
        H = inst.problem.H
        base = {"problem": name, "n": inst.problem.n, "constraint": inst.constraints.spec, "seed": seed}
        rows.extend(bench_cell(inst.problem, inst.constraints, base, solvers, repeat, rel_tol, None, echo,
                               options, inst.objective, lambda H=H: cholesky_seconds(H, 1, clock), clock))
    return rows


#: ``--sequence`` at most this many QPs, each step at most this many times g's RMS
MAX_SEQUENCE = 100_000
MAX_SEQUENCE_STEP = 1e3


def sequence_row(family: str, solver: str, steps: int, n: int | None = None, seed: int = 0,
                 rel_tol: float = 1e-8, options: dict[str, Any] | None = None,
                 clock: Callable[[], float] = time.perf_counter, step: float = 0.01) -> dict[str, Any]:
    """Solve ``steps`` related QPs of instance ``seed`` of ``family`` -- the same H and set, ``g``
    moved by a random walk of steps of ``step`` (default 1%) of its RMS, as the trust region's
    sequence -- cold and warm-started (``x0`` the previous solution). Seconds of each whole
    sequence (solve and certificate), their ratio to one Cholesky of H, whether every point
    certified, and ``optimum_moves``: the median over the steps of ``|d_t - d_{t-1}| / |d_{t-1}|``
    (Euclidean norms; the warm pass's points), i.e. how related the QPs are. (On the planted
    families a 1% step moves the optimum by ~40%: their bound multipliers spread over four decades
    and H's flat directions let a small change of g carry d across the box.)"""
    from ..certificate import forget_factorisation
    from ..solvers.instance_families import draw
    from ..solvers.registry import solve

    inst = draw(family, seed, n)
    P = inst.problem
    assert P.H is not None
    rng = np.random.default_rng(seed)
    size = step * float(np.sqrt(np.mean(P.g ** 2)))
    gs = np.cumsum(size * rng.standard_normal((steps, P.n)), axis=0) + P.g
    problems = [P.with_linear_term(gt) for gt in gs]  # one H array: what depends on H alone is reused
    chol = cholesky_seconds(P.H, clock=clock)
    row: dict[str, Any] = {"problem": family, "n": P.n, "constraint": inst.constraints.spec, "solver": solver,
                           "steps": steps, "step": step, "cholesky_seconds": chol}
    moves: list[float] = []
    for mode in ("cold", "warm"):
        for prob in problems:  # neither pass inherits factorisations from the other
            forget_factorisation(prob)
        t0 = clock()
        x0, certified = None, True
        for prob in problems:
            if mode == "cold":
                forget_factorisation(prob)  # a cold solve reuses nothing computed before it
            sol = solve(prob, inst.constraints, solver=solver, x0=x0, rel_tol=rel_tol, **(options or {}))
            assert sol.certificate is not None
            certified &= sol.certificate.certified(rel_tol)
            if mode == "warm" and x0 is not None:
                moves.append(float(np.linalg.norm(sol.d - x0) / max(np.linalg.norm(x0), np.finfo(float).tiny)))
            x0 = sol.d if mode == "warm" else None
        row[f"{mode}_seconds"] = clock() - t0
        row[f"{mode}_certified"] = certified
    row["warm_over_one_cold"] = row["warm_seconds"] / (row["cold_seconds"] / steps)
    row["optimum_moves"] = float(np.median(moves)) if moves else None
    return row


def header(width: int = 16) -> str:
    """The table's header, its problem column ``width`` wide (the longest name: variants are long)."""
    return (f"{'problem':{width}s} {'n':>6s} {'constraint':24s} {'solver':15s} {'seconds':>9s} {'objective':>18s} "
            f"{'rel. gap':>9s} {'cert':>4s} {'vs ref':>9s}")


HEADER = header()


def format_row(row: dict[str, Any], width: int = 16) -> str:
    head = f"{row['problem']:{width}s} {row['n']:6d} {row['constraint']:24s} {row['solver']:15s}"
    if "skipped" in row:
        return f"{head} {'-':>9s}  (not run: {row['skipped']})"
    if "error" in row:
        return f"{head} {'-':>9s}  (error: {row['error']})"
    gap = row["relative_gap"]
    gap_s = f"{gap:9.1e}" if math.isfinite(gap) else f"{'inf':>9s}"
    ref = row["vs_reference"]
    ref_s = f"{ref:9.1e}" if ref is not None else f"{'-':>9s}"
    chol = f" {row['vs_cholesky']:7.2f}" if "vs_cholesky" in row else ""
    return (f"{head} {row['seconds']:9.3f} {row['objective']:18.10g} {gap_s} "
            f"{_cert_cell(row):>4s} {ref_s}{chol}")


def _cert_cell(row: dict[str, Any]) -> str:
    """``yes`` (certified at ``--rel-tol``), ``flr`` (not, but the gap is within its own float64
    rounding: optimal to float64 precision, as on interpolating problems where J* ~ 0 and what
    ``solve`` accepts, docs/certificates.md), else ``NO``."""
    if row["certified"]:
        return "yes"
    return "flr" if row.get("at_rounding_floor") else "NO"


def run(args: argparse.Namespace) -> int:
    from ..solvers.instance_families import FAMILIES
    from ..solvers.reference_problems import REFERENCE_SPECS, constraint_from_spec, resolve_spec
    from ..solvers.registry import SOLVERS

    solvers = _names(args.solvers, {"auto": None, **SOLVERS}, "solver")
    if args.repeat < 1:
        raise ConfigError("--repeat must be >= 1")
    if not 0 <= args.rel_tol < math.inf:  # (nan fails this too)
        raise ConfigError(f"--rel-tol must be finite and >= 0, got {args.rel_tol}")
    if args.max_n is not None and args.max_n < 1:
        raise ConfigError(f"--max-n must be >= 1, got {args.max_n}")
    if args.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")
    if args.untuned is not None:
        if args.family is not None:
            raise ConfigError("--untuned draws its own variants: give --family or --untuned, not both")
        if not 1 <= args.untuned <= MAX_UNTUNED:
            raise ConfigError(f"--untuned must be between 1 and {MAX_UNTUNED}, got {args.untuned}")
        from ..solvers.instance_families import UNTUNED_CHOICES, untuned_variants

        n = UNTUNED_N if args.n is None else args.n
        if n < 2:
            raise ConfigError(f"--n must be >= 2, got {n}")
        _check_family_memory(n, math.lcm(*UNTUNED_CHOICES["K"]))  # (a size it suggests suits every K)
        if not any(n % k == 0 for k in UNTUNED_CHOICES["K"]):
            raise ConfigError(f"--n {n} must be a multiple of one of {', '.join(map(str, UNTUNED_CHOICES['K']))} "
                              f"(the number of models of a variant)")
        variants = untuned_variants(args.untuned, n, args.seed)  # (each spelling carries its r = n / K)
        return _run_families(args, variants, solvers, n=None, untuned=True)
    if args.family is not None:
        return _run_families(args, _names(args.family, FAMILIES, "family"), solvers, n=args.n)
    problems = _names(args.problems, REFERENCE_SPECS, "problem")
    constraints = args.constraint or ["box:0,1", "simplex"]
    if args.solvers == "all":  # every available solver (closed_form only for 'none')
        solvers = [s for s in solvers if s == "auto" or (SOLVERS[s].available() is None
                   and (s != "closed_form" or "none" in constraints))]
    options = parse_options(args.opt, SOLVERS, solvers)
    if args.json not in (None, "-"):  # fail before the run, not after it; never over a benchmarked instance
        check_json_output(args.json, _instance_files(problems))
    if args.n is not None or args.seed != 0 or args.sequence or args.sequence_step is not None:
        raise ConfigError("--n, --seed, --sequence and --sequence-step apply to --family only")
    constraints = list(dict.fromkeys(constraints))
    for spec in constraints:  # a bad spec fails before the table starts (L1R: any radius parses)
        if spec != "none":
            if not all(part.strip() for part in spec.split("&")):
                raise ConfigError(f"--constraint {spec!r}: an empty part around '&'")
            constraint_from_spec(resolve_spec(spec, 1.0))
    table = _table_stream(args)
    print(HEADER, file=table)
    print("-" * len(HEADER), file=table)
    rows = bench_rows(problems, solvers, constraints, repeat=args.repeat, rel_tol=args.rel_tol,
                      max_n=args.max_n, echo=lambda r: print(format_row(r), file=table, flush=True), options=options,
                      clock=CLOCKS[args.clock])
    return _finish(args, rows)


def _table_stream(args: argparse.Namespace) -> Any:
    """Where the table goes: standard output, or standard error when ``--json -`` takes standard output."""
    return sys.stderr if args.json == "-" else sys.stdout


def _instance_files(problems: list[str]) -> list[str]:
    """The files of the named reference instances (problem ``.npz``, optima ``.json``, the stored
    optimal points under ``refs/``): inputs that ``--json`` must not replace."""
    from ..solvers.reference_problems import problem_path, reference_path

    out: list[str] = []
    for name in problems:
        npz = problem_path(name)
        out += [str(npz), str(reference_path(name)), str(npz.parent / "refs")]
    return out


#: copies of an n x n float64 H a family benchmark holds at once (the instance's H, the generator's
#: copy, the Cholesky benchmark's two: measured at n = 12288, docs/solvers.md)
FAMILY_H_COPIES = 4


def _check_family_memory(n: int, K: int = 1) -> None:
    """Refuse an ``--n`` whose instances cannot fit in the memory available (a raw numpy
    allocation error otherwise, exit 1), naming the sizes and the largest ``--n`` (a multiple of
    the family's ``K``) that fits."""
    from ..io.memory import available_memory_bytes, human_bytes

    need = FAMILY_H_COPIES * 8 * n * n
    free = available_memory_bytes()
    if free is not None and need > free:
        fits = int((free / (FAMILY_H_COPIES * 8)) ** 0.5) // K * K  # (suggested 25141 for K = 4, a QA review)
        raise ConfigError(f"--n {n}: the instance's H and its copies need about {human_bytes(need)}, more than the "
                          f"{human_bytes(free)} available; --n {fits} fits")


def family_memory_bytes(family: Any) -> int:
    """About what drawing and benchmarking one instance of ``family`` holds at once: the copies of
    H (:data:`FAMILY_H_COPIES`), the generator's residual activations ``(K, N, r)`` and their flat
    copy, the downstream map ``(c, r)``, the targets ``(N, c)`` and ``L'L`` ``(r, r)``."""
    n = int(family.n)
    return 8 * (FAMILY_H_COPIES * n * n + 2 * int(family.N) * n + int(family.c) * int(family.r)
                + int(family.N) * int(family.c) + int(family.r) ** 2)


def _check_variant_memory(families: Sequence[Any], every: bool = False) -> list[str]:
    """Refuse a family (a variant's ``r``, ``c`` or ``N``) whose instance cannot fit in the memory
    available: only ``--n`` was checked, and ``box:r=60000`` or ``box:N=100000000`` ended in a numpy
    MemoryError (exit 70) or the kernel's out-of-memory killer (a review, stop 74). ``every``
    (``--family all``): such a family is left out with a note instead (``box_llama`` alone refused the
    whole run on a small machine); the names of those that fit."""
    from ..io.memory import available_memory_bytes, human_bytes

    free = available_memory_bytes()
    if free is None:
        return [fam.name for fam in families]
    kept = []
    for fam in families:
        need = family_memory_bytes(fam)
        if need <= free:
            kept.append(fam.name)
            continue
        what = (f"its instance (n = {fam.n}, K = {fam.K} x r = {fam.r}, c = {fam.c}, N = {fam.N}) needs about "
                f"{human_bytes(need)}, more than the {human_bytes(free)} available")
        if not every:
            raise ConfigError(f"--family {fam.name}: {what}; choose smaller r, c or N (or --n)")
        print(f"note: family {fam.name} left out: {what}", file=sys.stderr)
    if not kept:
        raise ConfigError(f"no family's instance fits in the {human_bytes(free)} available; give a smaller --n")
    return kept


#: ``--untuned``: at most this many variants; their unknowns without ``--n`` (the goal's size, issue 17)
MAX_UNTUNED = 10_000
UNTUNED_N = 3072
#: ``--untuned``'s summary counts the variants a solver certified within this many Choleskys (issue 17's goal)
UNTUNED_GOAL = 3.0
#: issue 17's rule for ``auto``: never more than this times the fastest solver that certifies the same instance
AUTO_GOAL = 1.5


def _run_families(args: argparse.Namespace, families: list[str], solvers: list[str], n: int | None,
                  untuned: bool = False) -> int:
    from ..solvers.registry import SOLVERS

    if args.problems != "committed" or args.constraint or args.max_n is not None:
        raise ConfigError("--family and --untuned benchmark drawn instances: --problems, --constraint and --max-n do not apply")
    from ..solvers.instance_families import get_family

    if not 0 <= args.sequence <= MAX_SEQUENCE:  # (a billion ran out of memory, a QA review, stop 73)
        raise ConfigError(f"--sequence must be between 0 and {MAX_SEQUENCE}, got {args.sequence}")
    if args.sequence_step is not None and not args.sequence:
        raise ConfigError("--sequence-step applies with --sequence T only")
    step = 0.01 if args.sequence_step is None else args.sequence_step
    if not 0 < step <= MAX_SEQUENCE_STEP:  # (nan fails this too; 1e308 overflowed g)
        raise ConfigError(f"--sequence-step must be finite, > 0 and at most {MAX_SEQUENCE_STEP:g}, got {step}")
    every = untuned or (args.family or "").strip() == "all"
    if n is not None:  # a bad size fails before the table starts
        if n < 1:
            raise ConfigError(f"--n must be a positive number of unknowns, got {n}")
        multiple = 1
        for name in families:
            multiple = math.lcm(multiple, int(get_family(name).K))
        odd = [name for name in families if n % int(get_family(name).K)] if every else []
        if len(odd) == len(families):
            raise ConfigError(f"--n {n}: no family's number of models divides it (a multiple of {multiple} suits "
                              f"every one)")
        _check_family_memory(n, multiple)  # (a size it suggests suits every family)
        # (a review of stop 75: box_llama's K = 3 refused --family all --n 640 as a whole)
        for name in odd:
            print(f"note: family {name} left out: n = {n} is not a multiple of its K = {get_family(name).K}",
                  file=sys.stderr)
        families = [name for name in families if name not in odd]
        for name in families:
            get_family(name).with_n(n)
    fitting = set(_check_variant_memory([get_family(name) if n is None else get_family(name).with_n(n)
                                         for name in families], every=every))
    families = [name for name in families if get_family(name).name in fitting]
    if args.solvers == "all":  # every available solver that can take a constrained problem
        solvers = [s for s in solvers if s == "auto" or (SOLVERS[s].available() is None and s != "closed_form")]
    options = parse_options(args.opt, SOLVERS, solvers)
    if args.json not in (None, "-"):
        check_json_output(args.json)
    table = _table_stream(args)
    width = max(16, *(len(name) for name in families))
    print(header(width) + f" {'x chol':>7s}", file=table)
    print("-" * (len(header(width)) + 8), file=table)
    clock = CLOCKS[args.clock]
    rows = family_rows(families, solvers, n=n, seed=args.seed, repeat=args.repeat, rel_tol=args.rel_tol,
                       echo=lambda r: print(format_row(r, width), file=table, flush=True), options=options, clock=clock)
    sequences: list[dict[str, Any]] = []
    for name in families if args.sequence > 0 else []:
        for solver in solvers:
            try:
                row = sequence_row(name, solver, args.sequence, n, args.seed, args.rel_tol, options.get(solver),
                                   clock, step)
            except MergeQPError as exc:
                if interruption(exc) is not None:  # (a review, stop 74: SIGTERM ended one sequence, then the next ran)
                    raise
                print(f"{name} / {solver}: sequence failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            sequences.append(row)
            print(f"{name} {solver}: {args.sequence} related QPs: cold {row['cold_seconds']:.3f} s, warm "
                  f"{row['warm_seconds']:.3f} s = {row['warm_over_one_cold']:.2f} cold solves "
                  f"(certified: cold {row['cold_certified']}, warm {row['warm_certified']}; steps of "
                  f"{step:g} x RMS(g) moved the optimum by a median {_share(row['optimum_moves'])})",
                  file=table, flush=True)
    extra: dict[str, Any] = {}
    if untuned:
        summary = untuned_summary(rows, args.rel_tol)
        for line in summary:
            print(line, file=table)
        extra["untuned"] = {"count": args.untuned, "n": UNTUNED_N if args.n is None else args.n, "seed": args.seed,
                            "goal_choleskys": UNTUNED_GOAL, "summary": summary}
    return _finish(args, rows, sequences, extra)


def untuned_summary(rows: list[dict[str, Any]], rel_tol: float = 1e-8, goal: float = UNTUNED_GOAL) -> list[str]:
    """``--untuned``'s lines, one per solver: of the variants it ran on, how many it certified (at
    ``rel_tol``), how many of those within ``goal`` Choleskys of H, the median and the largest ratio,
    and the variant of the largest (to rerun with ``--family``); where ``auto`` ran beside other solvers, also
    :func:`auto_summary`'s line (issue 17's rule for ``auto``)."""
    lines = []
    for solver in dict.fromkeys(r["solver"] for r in rows):
        ran = [r for r in rows if r["solver"] == solver and "error" not in r and "skipped" not in r]
        if not ran:
            continue
        ratios = np.array([r["vs_cholesky"] for r in ran])
        seconds = np.array([r["seconds"] for r in ran])
        certified = [r for r in ran if r["certified"]]
        within = sum(1 for r in certified if r["vs_cholesky"] <= goal)
        worst = ran[int(np.argmax(ratios))]
        floor = sum(1 for r in ran if not r["certified"] and r.get("at_rounding_floor"))
        at_floor = f", {floor} more at the rounding floor (flr)" if floor else ""
        lines.append(f"untuned {solver}: {within} of {len(ran)} variants certified at {rel_tol:g} within {goal:g} "
                     f"Choleskys of H ({len(certified)} certified{at_floor}); time / one Cholesky: median "
                     f"{float(np.median(ratios)):.2f}, largest {float(ratios.max()):.2f} ({worst['problem']}, "
                     f"seed {worst.get('seed', 0)}); seconds: median {float(np.median(seconds)):.3g}, largest "
                     f"{float(seconds.max()):.3g}")
    auto = auto_summary(rows, rel_tol)
    return lines + ([auto] if auto else [])


def auto_summary(rows: list[dict[str, Any]], rel_tol: float = 1e-8, goal: float = AUTO_GOAL) -> str | None:
    """``auto`` against the fastest solver that certified the same variant (rows of one variant share
    its ``problem`` and ``seed``): on how many of the variants where some solver certified ``auto`` did
    too within ``goal`` times that solver's seconds, and the largest ratio (infinite where ``auto`` did
    not certify). ``None`` where no other solver ran beside ``auto``."""
    variants: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for r in rows:
        if "error" not in r and "skipped" not in r:
            variants.setdefault((r["problem"], r.get("seed", 0)), []).append(r)
    counted, within, worst = 0, 0, (0.0, None)
    for (problem, seed), cell in variants.items():
        autos = [r for r in cell if r["solver"] == "auto"]
        certified = [r for r in cell if r["certified"]]
        if not autos or len(cell) < 2 or not certified:
            continue
        counted += 1
        fastest = min(r["seconds"] for r in certified)
        ratio = autos[0]["seconds"] / fastest if autos[0]["certified"] and fastest > 0 else math.inf
        within += ratio <= goal
        if ratio >= worst[0]:
            worst = (ratio, f"{problem}, seed {seed}")
    if not counted:
        return None
    largest = f"{worst[0]:.2f}x" if math.isfinite(worst[0]) else "auto not certified"
    return (f"untuned auto against the fastest certifying solver: within {goal:g}x on {within} of {counted} variants; "
            f"largest {largest} ({worst[1]})")


def _share(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.3g}%"


def _finish(args: argparse.Namespace, rows: list[dict[str, Any]], sequences: list[dict[str, Any]] | None = None,
            extra: dict[str, Any] | None = None) -> int:
    """Write ``--json`` (``-``: standard output), list failed cells on stderr; an error when nothing
    was measured."""
    if args.json:
        payload: dict[str, Any] = {"rel_tol": args.rel_tol, "rows": rows}
        if sequences is not None:
            payload["sequences"] = sequences
        payload.update(extra or {})
        if args.json == "-":
            print(json.dumps(payload, indent=1, default=str), flush=True)
        else:
            write_json_atomic(args.json, payload, indent=1, default=str)
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
