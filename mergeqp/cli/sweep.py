"""``mergeqp sweep``: from one statistics collection, a table and plots over constraint sets,
parametrisations, bases and basis sizes (research).

``mergeqp sweep STATS.npz --out DIR [--constraints box:0,1 none] [--parametrisations scalar rows
columns] [--bases optimal standard svd random] [--sizes 1,2,4,8] [--seeds 0,1] [--solver auto]
[--no-figure]`` writes ``DIR/sweep.csv`` (one line per QP: constraint set, parametrisation,
basis, p, seed, variables, captured energy fraction, objective J(d), calibration MSE per output,
certified, Frank-Wolfe gap, seconds, and why a QP was skipped) and ``DIR/sweep.png`` (energy
fraction vs MSE; objective vs p). The statistics come from ``mergeqp collect --keep-samples``
(without kept samples, only what the file can build is swept). Exit code 1 if some QP was not
certified.
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
                   help="constraint sets (mergeqp solve spellings; 'none' for no constraint)")
    p.add_argument("--parametrisations", nargs="*", default=["scalar", "rows", "columns"],
                   help="named parametrisations (default scalar rows columns)")
    p.add_argument("--bases", nargs="*", default=["optimal", "standard", "svd", "random"],
                   help="basis kinds (default optimal standard svd random)")
    p.add_argument("--sizes", default="1,2,4,8,16", help="basis sizes p, comma-separated (default 1,2,4,8,16)")
    p.add_argument("--seeds", default="0", help="seeds of random bases, comma-separated (default 0)")
    p.add_argument("--solver", default="auto", help="QP solver (default auto)")
    p.add_argument("--no-figure", action="store_true", help="skip sweep.png")
    p.set_defaults(func=run)


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{what} expects comma-separated integers, got {text!r}") from None
    if not values:
        raise ConfigError(f"{what} is empty")
    return values


def run(args: argparse.Namespace) -> int:
    from ..experiments.sweep import sweep_statistics, write_sweep
    from ..stats import load_stats

    sizes, seeds = _ints(args.sizes, "--sizes"), _ints(args.seeds, "--seeds")
    stats = load_stats(args.stats)
    rows = sweep_statistics(stats, constraints=args.constraints, parametrisations=args.parametrisations,
                            bases=args.bases, sizes=sizes, seeds=seeds, solver=args.solver)
    files = write_sweep(rows, args.out, figure=not args.no_figure)
    done = [r for r in rows if not r.skipped]
    print(f"{len(done)} QPs solved ({sum(r.certified for r in done)} certified), {len(rows) - len(done)} skipped; "
          f"wrote {', '.join(files.values())}")
    for r in rows:
        if r.skipped:
            print(f"skipped {r.parametrisation} {r.basis}{':' + str(r.p) if r.p else ''} ({r.constraints}): {r.skipped}")
    return 0 if all(r.certified for r in done) else 1
