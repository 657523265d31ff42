#!/usr/bin/env python
"""Generate the reference merge QPs and their certified optima.

    python problems/generate.py                 # committed small instances (problems/*.npz + *.json)
    python problems/generate.py --large         # also vit3072 and llama12288 (problems/generated/)
    python problems/generate.py tiny96 mnist640 # chosen instances

The instances are synthetic diagonal merge QPs built as in the paper (see
``mergeqp.solvers.reference_problems``); generation is deterministic (fixed seeds). For each
constraint set the best certified point among the reference solvers is stored
(objective, d file, solver, gap) with the other solvers' objectives as a cross-check.
"""

from __future__ import annotations

import argparse
import sys

from mergeqp.solvers.reference_problems import (
    REFERENCE_SPECS,
    build_references,
    load_reference_problem,
    problem_path,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"instances (default: the committed ones); known: {', '.join(REFERENCE_SPECS)}")
    parser.add_argument("--large", action="store_true", help="also the large, git-ignored instances")
    parser.add_argument("--regenerate", action="store_true", help="rebuild the .npz even if it exists")
    args = parser.parse_args(argv)
    names = args.names or [n for n, s in REFERENCE_SPECS.items() if s.committed or args.large]
    for name in names:
        path = problem_path(name)
        if args.regenerate and path.exists():
            if REFERENCE_SPECS[name].saved:
                print(f"{name}: saved from a real run, not regenerated (its optima are recomputed)")
            else:
                path.unlink()
        problem = load_reference_problem(name)
        print(f"{name}: n = {problem.n}, shape {problem.shape} -> {path}")
        out = build_references(name)
        for spec, ref in out["optima"].items():
            print(f"  {spec:28s} J* = {ref['objective']:.12g}  ({ref['solver']}, relative gap {ref['relative_gap']:.1e})")
        for bad in out["infeasible"]:
            print(f"  {bad['constraints']:28s} infeasible (checked)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
