"""The large-instance figures of ``docs/solvers.md`` (issue 17, item 6): the torch solver on a GPU
against one Cholesky of H on the same GPU, and the dense active set on the machine's CPU cores.

Run (on a machine with CUDA; on CPU it runs too, with ``device`` cpu)::

    PYTHONPATH=. python benchmarks/gpu_solvers.py [--n 12288 24576] [--family box_llama[,box,...]]
        [--problems llama12288] [--repeat 1] [--budget 420] [--json out.json]

For each instance: the seconds to draw it; one Cholesky of ``H + 1e-10 max diag H I`` in float64
on the device (torch, best of 3 after a warm-up) and on the CPU (numpy, all cores, one run);
``torch_active_set`` and ``torch_fista`` (float64, on the device) and ``active_set`` (on the
CPU) through :func:`mergeqp.solve`, certificate included (``--solvers``; the best of ``--repeat``
runs, after one warm-up solve of a small instance by each solver, so that no row pays for the
device's first kernels or the thread pools' start); with ``--before`` also
``torch_fista`` with the host's ``n x n`` product at every progress check (the version before
its device-side gradient, by switching that off in the same process). Per solve: wall seconds, the ratio to the
device's Cholesky, face or FISTA iterations, the certified relative gap, and the device's peak
memory beyond H. Prints a markdown table; ``--json`` writes the rows. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _sync(torch, device) -> None:  # noqa: ANN001 - torch passed in, imported lazily
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_cholesky(torch, H: np.ndarray, device) -> float:  # noqa: ANN001
    A = torch.tensor(np.array(H), dtype=torch.float64, device=device)  # a copy: H is not touched
    A.diagonal().add_(1e-10 * float(A.diagonal().max()))
    best = float("inf")
    for i in range(4):  # the first is a warm-up
        _sync(torch, device)
        t = time.perf_counter()
        L = torch.linalg.cholesky(A)
        _sync(torch, device)
        if i:
            best = min(best, time.perf_counter() - t)
        del L
    del A
    return best


def cpu_cholesky(H: np.ndarray) -> float:
    import scipy.linalg as sla

    A = H + 1e-10 * float(np.max(np.diag(H))) * np.eye(H.shape[0])
    t = time.perf_counter()
    sla.cho_factor(A, check_finite=False, overwrite_a=True)
    return time.perf_counter() - t


def run_solver(torch, problem, cset, name: str, dev, chol: float, repeat: int = 1, **options) -> dict:  # noqa: ANN001
    from mergeqp import solve

    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
    seconds = float("inf")
    for _ in range(max(1, repeat)):
        t = time.perf_counter()
        sol = solve(problem, cset, solver=name, **options)
        seconds = min(seconds, time.perf_counter() - t)
    row = {"solver": name, "options": {k: str(v) for k, v in options.items()}, "seconds": seconds,
           "x_device_cholesky": seconds / chol if chol else None, "iterations": sol.iterations,
           "objective": sol.objective, "relative_gap": sol.certificate.relative_gap,
           "certified": bool(sol.certificate.certified()), "status": sol.status.value}
    if dev.type == "cuda" and name.startswith("torch"):
        h_bytes = problem.n * problem.n * 8
        row["device_peak_beyond_H_GB"] = (torch.cuda.max_memory_allocated(dev) - before - h_bytes) / 1e9
    return row


def common_arguments(ap: argparse.ArgumentParser) -> None:
    """``--repeat``, ``--budget`` and ``--json`` (shared with ``gpu_ipm.py``)."""
    ap.add_argument("--repeat", type=int, default=1, help="best of this many runs of each solver")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; later instances are skipped past it")
    ap.add_argument("--json", default=None)


def device_banner(torch):  # noqa: ANN001, ANN201 - torch passed in, imported lazily; a torch.device
    """The device the benchmark runs on (CUDA if present), printed with torch's version and the cores."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"torch {torch.__version__}, {os.cpu_count()} CPU cores", flush=True)
    return device


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="*", default=[12288, 24576])
    ap.add_argument("--family", default="box_llama", help="a family, or several separated by commas")
    ap.add_argument("--problems", nargs="*", default=["llama12288"])
    ap.add_argument("--solvers", nargs="*", default=["torch_active_set", "torch_fista", "active_set"])
    ap.add_argument("--before", action="store_true",
                    help="also torch_fista with its progress checks on the host (the version before)")
    common_arguments(ap)
    args = ap.parse_args()

    import torch

    from mergeqp.constraints.parse import parse_constraints
    from mergeqp.solvers import torch_solvers
    from mergeqp.solvers.instance_families import draw
    from mergeqp.solvers.reference_problems import load_reference_problem

    device = device_banner(torch)
    start = time.perf_counter()
    sizes = sorted(args.n)
    families = [f for f in args.family.split(",") if f]
    instances = ([("family", f, n) for f in families for n in sizes[:1]]
                 + [("problem", name, None) for name in args.problems]
                 + [("family", f, n) for n in sizes[1:] for f in families])
    small = draw(families[0] if families else "box", 0, n=384)  # warm-up: first kernels, thread pools
    for name in args.solvers:
        run_solver(torch, small.problem, small.constraints, name, device, 0.0,
                   **({"device": str(device)} if name.startswith("torch") else {}))
    rows = []
    for kind, name, n in instances:
        if time.perf_counter() - start > args.budget:
            print(f"skipped {name} {n or ''}: past the budget", flush=True)
            continue
        t = time.perf_counter()
        if kind == "family":
            inst = draw(name, 0, n=n)
            problem, cset, label = inst.problem, inst.constraints, f"{name} (n = {n})"
        else:
            problem = load_reference_problem(name)
            cset, label = parse_constraints("box:0,1", problem.shape), f"{name} box:0,1"
        drawn = time.perf_counter() - t
        chol = device_cholesky(torch, problem.H, device)
        chol_cpu = cpu_cholesky(problem.H)
        print(f"{label}: drawn in {drawn:.1f} s; Cholesky {chol * 1e3:.1f} ms on {device}, "
              f"{chol_cpu:.2f} s on the CPU", flush=True)
        runs = []
        for name in args.solvers:
            opts = {"device": str(device)} if name.startswith("torch") else {}
            runs.append(run_solver(torch, problem, cset, name, device, chol, args.repeat, **opts))
            print(json.dumps(runs[-1]), flush=True)
        if args.before:
            saved = torch_solvers._TorchQP.float64_gradient
            torch_solvers._TorchQP.float64_gradient = lambda self, x: None  # the version before: host checks
            try:
                before = run_solver(torch, problem, cset, "torch_fista", device, chol, device=str(device))
            finally:
                torch_solvers._TorchQP.float64_gradient = saved
            before["solver"] = "torch_fista (host checks, before)"
            runs.append(before)
        for r in runs:
            r.update({"instance": label, "n": problem.n, "device": str(device), "device_cholesky_s": chol,
                      "cpu_cholesky_s": chol_cpu, "x_cpu_cholesky": r["seconds"] / chol_cpu})
        rows.extend(runs)
        del problem, cset
    print("\n| instance | solver | seconds | x device Cholesky | x CPU Cholesky | iterations | rel. gap | certified | device peak beyond H (GB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        peak = r.get("device_peak_beyond_H_GB")
        print(f"| {r['instance']} | {r['solver']} | {r['seconds']:.2f} | {r['x_device_cholesky']:.1f} | "
              f"{r['x_cpu_cholesky']:.2f} | {r['iterations']} | {r['relative_gap']:.1e} | "
              f"{'yes' if r['certified'] else 'no'} | {'' if peak is None else f'{peak:.2f}'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
