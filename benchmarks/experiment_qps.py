"""The QPs that the experiments themselves solve, timed against one Cholesky of their H
(docs/solvers.md, stop 77): real merge QPs, next to the synthetic instance families of
``mergeqp bench``.

Run::

    # 1. run an experiment (its quick preset, seed 0) and keep every QP the merges solve
    PYTHONPATH=. python benchmarks/experiment_qps.py record lm runs/qps-lm
    PYTHONPATH=. python benchmarks/experiment_qps.py record text runs/qps-text
    PYTHONPATH=. python benchmarks/experiment_qps.py record mnist runs/qps-mnist [--full]
    # 2. solve them again, cold and from the run's own starting point, against one Cholesky
    PYTHONPATH=. python benchmarks/experiment_qps.py time runs/qps-lm [--json out.json]

``record`` wraps :func:`mergeqp.solvers.registry.solve` (and every ``mergeqp`` module's binding of
it) while the experiment runs, and writes, for each QP with a dense H of at least ``--min-n``
unknowns, ``qNNN.npz`` (:meth:`~mergeqp.problem.MergeQP.save_npz`) and ``qNNN.pkl`` (the constraint
set, the starting point ``x0`` the run passed, the other options, and the solver, time and
objective seen in the run; a pickle: read only folders you wrote). The experiment's own outputs go to
``OUT/run``. ``time`` solves each QP with ``auto`` (best of ``--repeat``, CPU time, certificate
included), cold and, where the run passed one, from its ``x0``, and times the Cholesky that
``mergeqp bench`` times (:func:`mergeqp.cli.bench.cholesky_seconds`, best of 3) in the same process; prints one line per QP and a summary
per size. A measurement, not a test: run with ``OMP_NUM_THREADS=1`` for the goal's one-thread
figures.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import pickle
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@contextlib.contextmanager
def recording(folder: str | Path, min_n: int = 256) -> Iterator[list[dict[str, Any]]]:
    """Within the block, every call of ``solve`` from ``mergeqp``'s modules is recorded into
    ``folder`` (QPs with a dense H of at least ``min_n`` unknowns); yields the list of their
    records (``meta`` of each ``.pkl``)."""
    from mergeqp.solvers import registry

    original = registry.solve
    out = Path(folder)
    if any(out.glob("q*.npz")):
        raise SystemExit(f"{out} already holds recorded QPs: record into a new folder")
    out.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    count = [0]

    def recorded(problem: Any, constraints: Any = None, solver: str = "auto", **kw: Any) -> Any:
        t0 = time.process_time()
        sol = original(problem, constraints, solver, **kw)
        seconds = time.process_time() - t0
        index = count[0]
        count[0] += 1
        if problem.H is not None and problem.n >= min_n:
            name = f"q{index:03d}"
            problem.save_npz(str(out / f"{name}.npz"))
            cert = sol.certificate
            meta = {"file": f"{name}.npz", "n": problem.n, "solver": solver, "chosen": sol.solver,
                    "seconds": seconds, "objective": float(sol.objective),
                    "certified": None if cert is None else bool(cert.certified(kw.get("rel_tol", 1e-8)))}
            options = {k: v for k, v in kw.items() if k != "x0"}
            with open(out / f"{name}.pkl", "wb") as fh:
                pickle.dump({"constraints": constraints, "x0": kw.get("x0"), "options": options, "meta": meta}, fh)
            records.append(meta)
        return sol

    bound = [m for name, m in list(sys.modules.items())
             if name.startswith("mergeqp") and getattr(m, "solve", None) is original]
    for module in bound:
        module.solve = recorded  # type: ignore[attr-defined]
    registry.solve = recorded  # type: ignore[assignment]
    try:
        yield records
    finally:
        registry.solve = original  # type: ignore[assignment]
        for module in bound:
            module.solve = original  # type: ignore[attr-defined]


def record(experiment: str, out: Path, full: bool, min_n: int, threads: int) -> None:
    """Run ``experiment`` (``lm``, ``text`` or ``mnist``; quick preset unless ``full``, seed 0) and
    keep its QPs in ``out``."""
    # import the experiment (and through it the merge layer) first, so that its modules' bindings of
    # solve exist when recording() looks for them
    if experiment == "lm":
        from mergeqp.experiments.lm import run_lm_experiment as run
    elif experiment == "text":
        from mergeqp.experiments.text import run_text_experiment as run
    elif experiment == "mnist":
        from mergeqp.experiments.mnist import run_mnist_experiment as run
    else:
        raise SystemExit(f"experiment must be lm, text or mnist, got {experiment!r}")
    for name in ("mergeqp.merge.multilayer", "mergeqp.merge.trust_region"):  # the modes' QP solves
        importlib.import_module(name)

    with recording(out, min_n) as records:
        run(str(out / "run"), quick=not full, seed=0, threads=threads, figures=False)
    print(f"{len(records)} QPs of at least {min_n} unknowns recorded in {out}")


def time_folder(folder: str | Path, repeat: int = 3, rel_tol: float = 1e-8) -> list[dict[str, Any]]:
    """Solve every recorded QP of ``folder`` again with ``auto`` (cold, and from the run's ``x0``
    where it passed one) and time one Cholesky of its H; one row per QP."""
    from mergeqp.certificate import forget_factorisation
    from mergeqp.cli.bench import cholesky_seconds
    from mergeqp.problem import MergeQP
    from mergeqp.solvers.registry import solve

    paths = sorted(Path(folder).glob("q*.npz"))
    if not paths:
        raise SystemExit(f"{folder}: no recorded QPs (qNNN.npz) there; make them with: record EXPERIMENT {folder}")
    rows = []
    for path in paths:
        with open(path.with_suffix(".pkl"), "rb") as fh:
            rec = pickle.load(fh)
        P = MergeQP.load_npz(str(path))
        assert P.H is not None
        # a run's options belong to the solver it named; auto takes its own
        options = rec["options"] if rec["meta"]["solver"] == "auto" else {}
        options = {k: v for k, v in options.items() if k != "rel_tol"}
        row: dict[str, Any] = {"file": path.name, "n": P.n, "cholesky_seconds": cholesky_seconds(P.H, repeat=3, clock=time.process_time),
                               "constraints": str(rec["constraints"])[:60]}
        starts = [("cold", None)] + ([("warm", rec["x0"])] if rec["x0"] is not None else [])
        for label, x0 in starts:
            best, certified, sol = np.inf, True, None
            for _ in range(repeat):
                forget_factorisation(P)
                t0 = time.process_time()
                sol = solve(P, rec["constraints"], solver="auto", x0=x0, rel_tol=rel_tol, **options)
                best = min(best, time.process_time() - t0)
                certified &= sol.certificate is not None and sol.certificate.certified(rel_tol)
            assert sol is not None
            row[f"{label}_seconds"] = best
            row[f"{label}_certified"] = bool(certified)
            row[f"{label}_solver"] = sol.solver
            row[f"{label}_objective"] = float(sol.objective)
        row["cold_over_cholesky"] = row["cold_seconds"] / row["cholesky_seconds"]
        rows.append(row)
    return rows


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """One line per size: how many QPs, certified, ``auto``'s time (ms) and its ratio to one
    Cholesky (median, largest), and warm against cold where the run passed a start."""
    by: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by[row["n"]].append(row)
    lines = []
    for n, group in sorted(by.items()):
        secs = np.array([r["cold_seconds"] for r in group])
        ratio = np.array([r["cold_over_cholesky"] for r in group])
        cert = sum(r["cold_certified"] for r in group)
        line = (f"n = {n}: {len(group)} QPs, {cert} certified; auto cold {np.median(secs) * 1e3:.1f} ms median, "
                f"{secs.max() * 1e3:.1f} ms largest; / one Cholesky {np.median(ratio):.2f} median, "
                f"{ratio.max():.2f} largest, within 3x {int(np.sum(ratio <= 3))}; within 20 ms {int(np.sum(secs <= 0.02))}")
        warm = [r for r in group if "warm_seconds" in r]
        if warm:
            w = sum(r["warm_seconds"] for r in warm)
            c = sum(r["cold_seconds"] for r in warm)
            line += f"; the {len(warm)} with the run's start: warm {w:.3f} s against cold {c:.3f} s"
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record", help="run an experiment and keep its QPs")
    r.add_argument("experiment", choices=("lm", "text", "mnist"))
    r.add_argument("out", type=Path)
    r.add_argument("--full", action="store_true", help="the experiment's full preset instead of its quick one")
    r.add_argument("--min-n", type=int, default=256, help="keep QPs with at least this many unknowns")
    r.add_argument("--threads", type=int, default=2)
    t = sub.add_parser("time", help="solve recorded QPs again against one Cholesky")
    t.add_argument("folder", type=Path)
    t.add_argument("--repeat", type=int, default=3)
    t.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.command == "record":
        record(args.experiment, args.out, args.full, args.min_n, args.threads)
        return 0
    rows = time_folder(args.folder, args.repeat)
    for row in rows:
        warm = (f"; warm {row['warm_seconds'] * 1e3:.1f} ms {'certified' if row['warm_certified'] else 'NOT certified'}"
                if "warm_seconds" in row else "")
        print(f"{row['file']} n = {row['n']} {row['constraints']}: chol {row['cholesky_seconds'] * 1e3:.1f} ms, "
              f"auto ({row['cold_solver']}) {row['cold_seconds'] * 1e3:.1f} ms = {row['cold_over_cholesky']:.2f}x, "
              f"{'certified' if row['cold_certified'] else 'NOT certified'}{warm}")
    for line in summary(rows):
        print(line)
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "summary": summary(rows)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
