"""``mergeqp sweep``: from one statistics collection, a table and plots over constraint sets,
parametrisations, bases and basis sizes (research).

``mergeqp sweep STATS.npz --out DIR [--constraints box:0,1 none] [--parametrisations scalar rows
columns] [--bases optimal standard svd random] [--sizes 1,2,4,8,16] [--seeds 0,1] [--solver auto]
[--no-figure]`` writes ``DIR/sweep.csv`` (one line per QP: constraint set, parametrisation,
basis, p, seed, variables, captured energy fraction, objective J(d), calibration MSE per output,
certified, Frank-Wolfe gap, seconds, and why a QP was skipped) and ``DIR/sweep.png`` (energy
fraction vs MSE; objective vs p). The statistics come from ``mergeqp collect --keep-samples``
(without kept samples, only what the file can build is swept). Exit code 1 if some QP was not
certified; 2 before any work for a bad name, size or seed, an output folder that is an input or
not empty (``--overwrite`` replaces it), and when no QP of the sweep could be built; 3 for a
statistics file with NaN or inf. The folder is written at once (``sweep.csv`` and ``sweep.png``
together, or neither).
"""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import ConfigError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("sweep", help="sweep constraint sets, parametrisations, bases and sizes on "
                                            "collected statistics (CSV + PNG)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stats", help="statistics file written by mergeqp collect (.npz)")
    p.add_argument("--out", required=True, help="output folder (sweep.csv, sweep.png)")
    p.add_argument("--constraints", nargs="+", default=["box:0,1"],
                   help="constraint sets (mergeqp solve spellings; 'none' for no constraint; default box:0,1)")
    p.add_argument("--parametrisations", nargs="*", default=["scalar", "rows", "columns"],
                   help="named parametrisations (default scalar rows columns)")
    p.add_argument("--bases", nargs="*", default=["optimal", "standard", "svd", "random"],
                   help="basis kinds (default optimal standard svd random)")
    p.add_argument("--sizes", default="1,2,4,8,16", help="basis sizes p, comma-separated (default 1,2,4,8,16)")
    p.add_argument("--seeds", default="0", help="seeds of seeded bases (random, or one registered with seeded=True), comma-separated (default 0)")
    p.add_argument("--solver", default="auto", help="QP solver (default auto)")
    p.add_argument("--task-weights", default=None,
                   help="'mean' or comma-separated weights, one per task, as collect --task-weights (the "
                        "statistics file holds each task's statistics unweighted; default: every task weighs 1)")
    p.add_argument("--no-figure", action="store_true", help="skip sweep.png")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _ints(text: str, what: str, minimum: int) -> tuple[int, ...]:
    try:
        values = tuple(dict.fromkeys(int(x) for x in text.split(",") if x.strip()))  # (each once, in order)
    except ValueError:
        raise ConfigError(f"{what} expects comma-separated integers, got {text!r}") from None
    if not values:
        raise ConfigError(f"{what} is empty")
    low = [v for v in values if v < minimum]
    if low:
        raise ConfigError(f"{what} must be integers >= {minimum}, got {low[0]}")
    return values


def run(args: argparse.Namespace) -> int:
    from ..experiments.sweep import check_sweep_names, sweep_statistics, write_sweep
    from ..io.atomic import check_output_folder
    from ..stats import load_stats
    from ..stats.bases import get_basis
    from .collect import parse_task_weights

    sizes, seeds = _ints(args.sizes, "--sizes", 1), _ints(args.seeds, "--seeds", 0)
    parametrisations, bases, solver = check_sweep_names(args.parametrisations, args.bases, args.solver)
    constraints = list(dict.fromkeys(args.constraints))
    check_output_folder(args.out, [args.stats], overwrite=args.overwrite, option="--out")
    task_weights = parse_task_weights(args.task_weights)
    stats = load_stats(args.stats)
    tasks = len(stats.task_names)
    if task_weights is not None and not isinstance(task_weights, str) and len(task_weights) != tasks:
        raise ConfigError(f"--task-weights has {len(task_weights)} weight(s) but {args.stats} holds {tasks} task(s) "
                          f"({', '.join(stats.task_names)})")
    notes = []
    above = [p for p in sizes if p > stats.r]
    if bases and above:
        notes.append(f"basis sizes {', '.join(map(str, above))} exceed the layer's r = {stats.r}: left out")
    if args.seeds != "0" and not any(get_basis(b).seeded for b in bases):
        notes.append("--seeds only varies seeded bases (random, or one registered with seeded=True), and none is "
                     "swept")
    for note in notes:
        print(f"note: {note}")
    rows = sweep_statistics(stats, constraints=constraints, parametrisations=parametrisations, bases=bases,
                            sizes=sizes, seeds=seeds, solver=solver, progress=not args.quiet,
                            task_weights=task_weights)
    done = [r for r in rows if not r.skipped]
    for r in rows:
        if r.skipped:
            print(f"skipped {r.label}: {r.skipped}")
    if not rows:
        raise ConfigError(f"no QP to sweep: every basis size exceeds the layer's r = {stats.r}, and no named "
                          f"parametrisation was given; nothing written")
    if not done:
        raise ConfigError(f"no QP of the sweep could be built from {args.stats} (every one was skipped, reasons "
                          f"above); nothing written")
    files = write_sweep(rows, args.out, figure=not args.no_figure, overwrite=args.overwrite)
    uncertified = [r for r in done if not r.certified]
    for r in uncertified:
        print(f"not certified: {r.label} (Frank-Wolfe gap {r.fw_gap:.3g})")
    print(f"{len(done)} QPs solved ({len(done) - len(uncertified)} certified), {len(rows) - len(done)} skipped; "
          f"wrote {', '.join(files.values())}")
    return 0 if not uncertified else 1
