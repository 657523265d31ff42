"""A research sweep over one statistics collection: constraint sets x parametrisations x bases x
basis sizes, each QP solved and certified, with the captured energy of every basis.

:func:`sweep_statistics` takes :class:`~mergeqp.stats.CalibrationStats` (``mergeqp collect
--keep-samples`` writes them; without kept samples only what the file can build is swept, and
the rest is skipped with the reason) and returns one :class:`SweepRow` per QP;
:func:`write_sweep` writes them as ``sweep.csv`` and ``sweep.png`` (energy fraction against the
calibration error per output, and objective against ``p``). The objective is the linearised
calibration squared error ``J(d)``; ``mse`` is ``J(d) / (n_samples x c)``, the mean squared
error per compared output on the calibration set (no test set is involved).
"""

from __future__ import annotations

import csv
import io
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from ..errors import MergeQPError, ValidationError
from ..io.atomic import savefig_atomic, write_text_atomic
from ..solvers.registry import solve
from ..stats.bases import make_basis

#: default basis kinds and the named (basis-free) parametrisations of a sweep
SWEEP_BASES = ("optimal", "standard", "svd", "random")
SWEEP_PARAMETRISATIONS = ("scalar", "rows", "columns")


@dataclass(frozen=True)
class SweepRow:
    """One QP of a sweep: ``constraints`` (a ``mergeqp solve`` spelling), ``parametrisation``
    (``rows`` ... or ``basis``), ``basis`` and ``p`` (basis kind and size; ``""`` / ``0`` for a
    named parametrisation), ``seed`` (random bases), ``n_variables``, ``energy_fraction``
    (``tr(SP)/tr(S)``, ``nan`` for a named parametrisation), ``objective`` (``J(d)``), ``mse``
    (``J / (n_samples c)``), ``certified``, ``fw_gap``, ``seconds``, and ``skipped`` (why the QP
    could not be built, else ``""``)."""

    constraints: str
    parametrisation: str
    basis: str
    p: int
    seed: int
    n_variables: int
    energy_fraction: float
    objective: float
    mse: float
    certified: bool
    fw_gap: float
    seconds: float
    skipped: str = ""


def sweep_statistics(stats: Any, *, constraints: Sequence[str] = ("box:0,1",),
                     parametrisations: Sequence[str] = SWEEP_PARAMETRISATIONS,
                     bases: Sequence[str] = SWEEP_BASES, sizes: Sequence[int] = (1, 2, 4, 8),
                     seeds: Sequence[int] = (0,), solver: str = "auto") -> list[SweepRow]:
    """Every (constraint set, parametrisation) and (constraint set, basis, p[, seed]) QP of
    ``stats``; sizes above ``r`` are left out; ``seeds`` only vary random bases."""
    if not constraints:
        raise ValidationError("a sweep needs at least one constraint set")
    scale = float(stats.n_samples * stats.c) or 1.0
    jobs: list[tuple[str, str, int, int]] = [(name, "", 0, 0) for name in parametrisations]
    for kind in bases:
        for p in sizes:
            if not 1 <= int(p) <= stats.r:
                continue
            for seed in (seeds if kind == "random" else (0,)):
                jobs.append(("basis", kind, int(p), int(seed)))
    rows: list[SweepRow] = []
    for spec in constraints:
        for name, kind, p, seed in jobs:
            rows.append(_one(stats, spec, name, kind, p, seed, solver, scale))
    return rows


def _one(stats: Any, spec: str, name: str, kind: str, p: int, seed: int, solver: str, scale: float) -> SweepRow:
    t0 = time.perf_counter()
    nan = float("nan")
    try:
        if name == "basis":
            param = make_basis(kind, stats, p, seed=seed)
            energy = float(stats.energy_report(param).fraction)
        else:
            param, energy = name, nan
        problem = stats.problem(param)
        sol = solve(problem, spec, solver=solver)
    except MergeQPError as exc:  # a parametrisation these statistics cannot build, a bad constraint, ...
        return SweepRow(spec, name, kind, p, seed, 0, nan, nan, nan, False, nan, time.perf_counter() - t0,
                        skipped=str(exc).splitlines()[0])
    return SweepRow(spec, name, kind, p, seed, problem.n, energy, float(sol.objective), float(sol.objective) / scale,
                    bool(sol.certificate.certified()), float(sol.certificate.fw_gap), time.perf_counter() - t0)


def write_sweep(rows: Sequence[SweepRow], out_dir: str, figure: bool = True) -> dict[str, str]:
    """Write ``sweep.csv`` (one line per :class:`SweepRow`) and, with ``figure``, ``sweep.png``
    into ``out_dir`` (created); returns ``{"csv": path, "png": path}``."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "sweep.csv")
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=[f.name for f in fields(SweepRow)], lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow(asdict(row))
    write_text_atomic(path, buffer.getvalue())
    out = {"csv": path}
    if figure:
        out["png"] = _figure(rows, os.path.join(out_dir, "sweep.png"))
    return out


def _figure(rows: Sequence[SweepRow], path: str) -> str:
    import matplotlib  # optional heavy dependency: only drawn figures need it

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    done = [r for r in rows if not r.skipped]
    for (spec, kind), group in _groups([r for r in done if r.parametrisation == "basis"]).items():
        label = f"{kind} ({spec})"
        left.scatter([r.energy_fraction for r in group], [r.mse for r in group], label=label, s=18)
        by_p: dict[int, list[float]] = {}
        for r in group:
            by_p.setdefault(r.p, []).append(r.objective)
        ps = sorted(by_p)
        right.plot(ps, [sum(by_p[p]) / len(by_p[p]) for p in ps], marker="o", label=label)
    for r in done:
        if r.parametrisation != "basis":
            right.axhline(r.objective, linestyle=":", linewidth=1, color="gray")
            right.annotate(f"{r.parametrisation} ({r.constraints})", (1, r.objective), fontsize=7, color="gray")
    left.set_xlabel("captured energy fraction tr(SP)/tr(S)")
    left.set_ylabel("calibration MSE per output (linearised)")
    right.set_xscale("log", base=2)
    right.set_xlabel("basis size p")
    right.set_ylabel("objective J(d) (random bases: mean over seeds)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    right.legend(fontsize=7)
    fig.tight_layout()
    savefig_atomic(fig, path)
    plt.close(fig)
    return path


def _groups(rows: Sequence[SweepRow]) -> dict[tuple[str, str], list[SweepRow]]:
    out: dict[tuple[str, str], list[SweepRow]] = {}
    for r in rows:
        out.setdefault((r.constraints, r.basis), []).append(r)
    return out
