"""``active_set``'s ``threads`` option measured (docs/solvers.md, stop 31): the same instances
solved with the dense BLAS capped at each thread count, on this machine's cores.

Run::

    PYTHONPATH=. python benchmarks/blas_threads.py [--families box,box_singular] [--n 1536 3072]
        [--threads 1 4 8 all] [--repeat 2] [--budget 400] [--json out.json]

Per instance: one float64 Cholesky of ``H + 1e-10 max diag H I`` (scipy, best of 2) with the
pools as they are and with each cap; then ``active_set`` through :func:`mergeqp.solve`
(certificate included, best of ``--repeat``) with each ``threads`` setting. A warm-up solve of a
small instance comes first. Prints a markdown table of seconds. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def cholesky_seconds(H: np.ndarray, cap: int | None) -> float:
    import scipy.linalg as sla
    from threadpoolctl import threadpool_limits

    A = H + 1e-10 * float(np.max(np.diag(H))) * np.eye(H.shape[0])
    best = float("inf")
    with threadpool_limits(limits=cap, user_api="blas"):
        for _ in range(2):
            B = A.copy()
            t = time.perf_counter()
            sla.cho_factor(B, check_finite=False, overwrite_a=True)
            best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="box,box_singular")
    ap.add_argument("--n", type=int, nargs="*", default=[1536, 3072])
    ap.add_argument("--threads", nargs="*", default=["1", "4", "8", "all"])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--budget", type=float, default=400.0, help="seconds; later instances are skipped past it")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from mergeqp import solve
    from mergeqp.solvers.blas_threads import usable_cores
    from mergeqp.solvers.instance_families import draw

    settings = [s if s in ("auto", "all") else int(s) for s in args.threads]
    print(f"{usable_cores()} usable cores", flush=True)
    small = draw("box", 0, n=384)
    for s in settings:
        solve(small.problem, small.constraints, solver="active_set", threads=s)
    start = time.perf_counter()
    rows = []
    for n in sorted(args.n):
        for fam in args.families.split(","):
            if time.perf_counter() - start > args.budget:
                print(f"skipped {fam} n = {n}: past the budget", flush=True)
                continue
            inst = draw(fam, 0, n=n)
            row = {"family": fam, "n": n, "cholesky": {}, "active_set": {}, "faces": {}, "certified": {}}
            for s in settings:
                row["cholesky"][str(s)] = cholesky_seconds(inst.problem.H, None if s in ("auto", "all") else s)
                best = float("inf")
                for _ in range(max(1, args.repeat if n < 12288 else 1)):
                    t = time.perf_counter()
                    sol = solve(inst.problem, inst.constraints, solver="active_set", threads=s)
                    best = min(best, time.perf_counter() - t)
                row["active_set"][str(s)] = best
                row["faces"][str(s)] = sol.iterations
                row["certified"][str(s)] = bool(sol.certificate.certified())
            print(json.dumps(row), flush=True)
            rows.append(row)
    keys = [str(s) for s in settings]
    print("\n| family | n | " + " | ".join(f"Cholesky, {k}" for k in keys) + " | "
          + " | ".join(f"active_set, {k}" for k in keys) + " | faces | certified |")
    print("|---|---|" + "---|" * (2 * len(keys) + 2))
    for r in rows:
        print(f"| {r['family']} | {r['n']} | " + " | ".join(f"{r['cholesky'][k]:.3f}" for k in keys) + " | "
              + " | ".join(f"{r['active_set'][k]:.3f}" for k in keys)
              + f" | {r['faces'][keys[-1]]} | {'yes' if all(r['certified'].values()) else 'NO'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
