"""The GPU figures of ``torch_ipm`` in ``docs/solvers.md`` (issue 17, items 2 and 6): the interior
point on sign-consensus sets with its dense work on the GPU, against ``dense_ipm`` on the CPU cores
and against one Cholesky of H on each.

Run (on a machine with CUDA; on CPU it runs too, with ``device`` cpu)::

    PYTHONPATH=. python benchmarks/gpu_ipm.py [--n 3072 6144 12288] [--sets box&sign,l1&sign]
        [--solvers torch_ipm dense_ipm auto torch_ipm:crossover=True] [--repeat 1] [--budget 420]
        [--json out.json]

Instances: the ``sign`` family (``mergeqp.solvers.instance_families``: K = 4 models, box [0, 1]
and TIES sign consensus), seed 0, at each n; its set as drawn (``box&sign``) or the sign rows with
a per-atom simplex (``simplex&sign``), an L1 ball of radius ``r / 4`` (``l1&sign``) or both the
box and that ball (``box&l1&sign``). For each: one float64 Cholesky of ``H + 1e-10 max diag H I``
on the device (best of 3 after a warm-up) and on the CPU (all cores, one run); each solver through
:func:`mergeqp.solve` (certificate included; wall clock, the best of ``--repeat``, after a warm-up
solve of an n = 384 instance by each); a solver named ``NAME:key=value,...`` gets those options.
Prints a markdown table; ``--json`` writes the rows. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_solvers import common_arguments, cpu_cholesky, device_banner, device_cholesky  # noqa: E402

SETS = ("box&sign", "simplex&sign", "l1&sign", "box&l1&sign")


def sign_instance(kind: str, n: int, seed: int = 0):  # noqa: ANN201 - (problem, set)
    from mergeqp.constraints import Box, L1Ball, Simplex, intersect
    from mergeqp.solvers.instance_families import draw

    inst = draw("sign", seed, n=n)
    sign = [m for m in inst.constraints.members() if m.name == "sign"][0]
    r = inst.problem.shape[1]
    sets = {"box&sign": inst.constraints, "simplex&sign": intersect([Simplex(1.0), sign]),
            "l1&sign": intersect([L1Ball(r / 4), sign]),
            "box&l1&sign": intersect([Box(0.0, 1.0), L1Ball(r / 4), sign])}
    if kind not in sets:
        raise SystemExit(f"unknown set {kind!r}: one of {', '.join(SETS)}")
    return inst.problem, sets[kind]


def run(torch, problem, cset, name: str, dev, repeat: int, profile: str | None = None) -> dict:  # noqa: ANN001
    from mergeqp import solve

    name, _, spec = name.partition(":")  # "torch_ipm:crossover=True,correctors=1"
    opts = {k: ast.literal_eval(v) for k, v in (kv.split("=", 1) for kv in spec.split(",") if kv)}
    if name.startswith("torch"):
        opts.setdefault("device", str(dev))
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
    seconds = float("inf")
    for _ in range(max(1, repeat)):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        sol = solve(problem, cset, solver=name, **opts)
        seconds = min(seconds, time.perf_counter() - t)
    if profile:  # one more solve under cProfile: its 30 most expensive calls (with callees) and
        # 20 (alone) appended to the file
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        solve(problem, cset, solver=name, **opts)
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
        with open(profile, "a") as f:
            f.write(f"\n## {name} {spec} n = {problem.n} {cset.spec}\n{out.getvalue()}")
    row = {"solver": name + (f" ({spec})" if spec else ""), "chosen": sol.solver, "seconds": seconds,
           "iterations": sol.iterations,
           "factorisations": sol.info.get("factorisations"), "crossover": sol.info.get("crossover"),
           "crossover_seconds": sol.info.get("crossover_seconds"),
           "timings": {k: round(float(v), 4) for k, v in sol.timings.items()},
           "objective": sol.objective, "relative_gap": sol.certificate.relative_gap,
           "certified": bool(sol.certificate.certified(1e-8)), "status": sol.status.value}
    if dev.type == "cuda":
        row["device_peak_beyond_H_GB"] = (torch.cuda.max_memory_allocated(dev) - before
                                          - 8 * problem.n ** 2) / 1e9
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="*", default=[3072, 6144, 12288])
    ap.add_argument("--sets", default=",".join(SETS), help="sets separated by commas: " + ", ".join(SETS))
    ap.add_argument("--solvers", nargs="*", default=["torch_ipm", "dense_ipm", "auto"])
    ap.add_argument("--profile", default=None, help="a file: each solver's solve profiled once more (cProfile)")
    common_arguments(ap)
    args = ap.parse_args()

    import torch

    device = device_banner(torch)
    start = time.perf_counter()
    sets = [s for s in args.sets.split(",") if s]
    small, small_set = sign_instance(sets[0], 384)
    for name in args.solvers:  # warm-up: the device's first kernels, the thread pools
        run(torch, small, small_set, name, device, 1)
    rows = []
    for n in sorted(args.n):
        for kind in sets:
            if time.perf_counter() - start > args.budget:
                print(f"skipped {kind} n = {n}: past the budget", flush=True)
                continue
            t = time.perf_counter()
            problem, cset = sign_instance(kind, n)
            drawn = time.perf_counter() - t
            chol = device_cholesky(torch, problem.H, device)
            chol_cpu = cpu_cholesky(problem.H)
            print(f"{kind} n = {n}: drawn in {drawn:.1f} s; Cholesky {chol * 1e3:.1f} ms on {device}, "
                  f"{chol_cpu:.2f} s on the CPU", flush=True)
            for name in args.solvers:
                row = run(torch, problem, cset, name, device, args.repeat, args.profile)
                row.update({"set": kind, "n": n, "device": str(device), "device_cholesky_s": chol,
                            "cpu_cholesky_s": chol_cpu, "x_device_cholesky": row["seconds"] / chol,
                            "x_cpu_cholesky": row["seconds"] / chol_cpu})
                rows.append(row)
                print(json.dumps(row), flush=True)
            del problem, cset
    print("\n| set | n | solver (chosen) | seconds | x device Cholesky | x CPU Cholesky | IPM iterations "
          "| float32 / float64 factorisations | certified | device peak beyond H (GB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        f = r["factorisations"] or {}
        peak = r.get("device_peak_beyond_H_GB")
        print(f"| {r['set']} | {r['n']} | {r['solver']} ({r['chosen']}) | {r['seconds']:.2f} | "
              f"{r['x_device_cholesky']:.1f} | {r['x_cpu_cholesky']:.2f} | {r['iterations']} | "
              f"{f.get('float32', '')} / {f.get('float64', '')} | {'yes' if r['certified'] else 'no'} | "
              f"{'' if peak is None else f'{peak:.2f}'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
