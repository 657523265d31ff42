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

import numpy as np

from ..constraints.parse import layer_context, parse_constraint
from ..errors import BadDataError, ConfigError, MergeQPError, ValidationError, interruption, lookup
from ..io.atomic import atomic_folder, savefig_atomic, write_text_atomic
from ..solvers.registry import SOLVERS, solve
from ..stats.bases import get_basis, make_basis
from ..stats.parametrisation import as_parametrisation, named_parametrisations

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

    @property
    def label(self) -> str:
        """``rows (box:0,1)``, ``svd:4 (none)``, ``random:4 seed 1 (box:0,1)``: the QP in messages."""
        what = self.parametrisation if self.parametrisation != "basis" else f"{self.basis}:{self.p}"
        seed = f" seed {self.seed}" if self.basis == "random" else ""
        return f"{what}{seed} ({self.constraints})"


def check_sweep_names(parametrisations: Sequence[str], bases: Sequence[str],
                      solver: str) -> tuple[list[str], list[str], str]:
    """Before any work: the named parametrisations, basis kinds (each once, in order) and the solver
    of a sweep, every name checked against its registry (:class:`ConfigError` naming the first
    bad one, with the valid names)."""
    params = list(dict.fromkeys(parametrisations))
    for name in params:
        if ":" in name or name == "basis":
            raise ConfigError(f"--parametrisations {name!r}: a sweep takes named parametrisations here "
                              f"({', '.join(named_parametrisations())}); bases are swept by --bases KIND --sizes P "
                              f"[--seeds S]")
        try:
            as_parametrisation(name)
        except ValidationError as exc:
            raise ConfigError(f"--parametrisations: {exc}") from None
    kinds = list(dict.fromkeys(bases))
    for kind in kinds:
        name, sep, rest = kind.partition(":")
        if sep:  # (docs/statistics.md promised this hint; a review, stop 74: 'unknown basis name svd:2')
            raise ConfigError(f"--bases {kind!r}: a sweep takes basis kinds here; {kind} belongs in "
                              f"--bases {name} --sizes {rest.split(':')[0]}")
        get_basis(kind)
    if solver != "auto":
        lookup("solver", solver, {"auto": None, **SOLVERS})
    if not params and not kinds:
        raise ConfigError("nothing to sweep: give --parametrisations or --bases")
    return params, kinds, solver


def sweep_statistics(stats: Any, *, constraints: Sequence[str] = ("box:0,1",),
                     parametrisations: Sequence[str] = SWEEP_PARAMETRISATIONS,
                     bases: Sequence[str] = SWEEP_BASES, sizes: Sequence[int] = (1, 2, 4, 8),
                     seeds: Sequence[int] = (0,), solver: str = "auto", progress: bool = False,
                     task_weights: Any = None) -> list[SweepRow]:
    """Every (constraint set, parametrisation) and (constraint set, basis, p[, seed]) QP of
    ``stats``; sizes above ``r`` are left out; ``seeds`` only vary random bases; ``task_weights``
    (as :meth:`~mergeqp.stats.CalibrationStats.task_weight_vector` takes them: ``None``, ``"mean"``,
    K numbers) weigh the tasks in every QP, basis and energy fraction (and the MSE's count). Every constraint
    set is parsed first (a bad spelling is a :class:`ValidationError` before any QP); a QP these
    statistics cannot build, or a set its solver cannot take, is a row with the reason in
    ``skipped``; an interruption or non-finite data stops the sweep."""
    from tqdm.auto import tqdm

    if not constraints:
        raise ValidationError("a sweep needs at least one constraint set")
    context = layer_context(np.asarray(stats.deltas), "rows")
    for spec in constraints:
        try:
            parse_constraint(spec, context)
        except MergeQPError as exc:
            raise ConfigError(f"--constraints {spec!r}: {exc}") from None
    w = stats.task_weight_vector(task_weights)
    scale = float(w @ np.asarray(stats.task_counts, dtype=np.float64)) * float(stats.c) or 1.0
    jobs: list[tuple[str, str, int, int]] = [(name, "", 0, 0) for name in parametrisations]
    for kind in bases:
        for p in sizes:
            if not 1 <= int(p) <= stats.r:
                continue
            for seed in (seeds if get_basis(kind).seeded else (0,)):
                jobs.append(("basis", kind, int(p), int(seed)))
    rows: list[SweepRow] = []
    bar = tqdm(total=len(constraints) * len(jobs), desc="sweep", unit="QP", disable=not progress)
    try:
        for spec in constraints:
            for name, kind, p, seed in jobs:
                rows.append(_one(stats, spec, name, kind, p, seed, solver, scale, task_weights))
                bar.update(1)
    finally:
        bar.close()
    return rows


def _one(stats: Any, spec: str, name: str, kind: str, p: int, seed: int, solver: str, scale: float,
         task_weights: Any = None) -> SweepRow:
    t0 = time.perf_counter()
    nan = float("nan")
    try:
        if name == "basis":
            param = make_basis(kind, stats, p, seed=seed, task_weights=task_weights)
            energy = float(stats.energy_report(param, task_weights).fraction)
        else:
            param, energy = name, nan
        problem = stats.problem(param, task_weights=task_weights)
        D = np.asarray(stats.deltas)
        cset = parse_constraint(spec, layer_context(
            D, name, lambda: stats.parametrisation(param).parameter_atoms(*D.shape[1:])))
        sol = solve(problem, cset, solver=solver)
    except MergeQPError as exc:  # a parametrisation these statistics cannot build, a set the solver cannot take, ...
        if interruption(exc) is not None or isinstance(exc, BadDataError):
            raise
        return SweepRow(spec, name, kind, p, seed, 0, nan, nan, nan, False, nan, time.perf_counter() - t0,
                        skipped=str(exc).splitlines()[0])
    return SweepRow(spec, name, kind, p, seed, problem.n, energy, float(sol.objective), float(sol.objective) / scale,
                    bool(sol.certificate.certified()), float(sol.certificate.fw_gap), time.perf_counter() - t0)


def write_sweep(rows: Sequence[SweepRow], out_dir: str, figure: bool = True, overwrite: bool = False) -> dict[str, str]:
    """Write ``sweep.csv`` (one line per :class:`SweepRow`) and, with ``figure``, ``sweep.png``
    as the folder ``out_dir``, at once (:func:`~mergeqp.io.atomic.atomic_folder`: both files or
    neither; a non-empty ``out_dir`` is replaced only with ``overwrite``); returns
    ``{"csv": path, "png": path}``."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=[f.name for f in fields(SweepRow)], lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow(asdict(row))
    out = {"csv": os.path.join(out_dir, "sweep.csv")}
    with atomic_folder(out_dir, overwrite=overwrite) as staging:
        write_text_atomic(staging / "sweep.csv", buffer.getvalue())
        if figure:
            _figure(rows, os.fspath(staging / "sweep.png"))
            out["png"] = os.path.join(out_dir, "sweep.png")
    return out


def _figure(rows: Sequence[SweepRow], path: str) -> str:
    import matplotlib  # optional heavy dependency: only drawn figures need it

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    done = [r for r in rows if not r.skipped]
    groups = _groups([r for r in done if r.parametrisation == "basis"])
    colours = plt.get_cmap("tab20" if len(groups) > 10 else "tab10")
    specs = list(dict.fromkeys(spec for spec, _ in groups))
    markers = "os^Dvx*P<>"
    for i, ((spec, kind), group) in enumerate(groups.items()):
        label = f"{kind} ({spec})"
        style = {"color": colours(i % colours.N), "marker": markers[specs.index(spec) % len(markers)]}
        left.scatter([r.energy_fraction for r in group], [r.mse for r in group], label=label, s=18, **style)
        by_p: dict[int, list[float]] = {}
        for r in group:
            by_p.setdefault(r.p, []).append(r.objective)
        ps = sorted(by_p)
        right.plot(ps, [sum(by_p[p]) / len(by_p[p]) for p in ps], label=label, **style)
    named = [r for r in done if r.parametrisation != "basis"]
    for i, r in enumerate(named):  # horizontal lines, labelled in the legend (labels on the axis overlapped)
        right.axhline(r.objective, linestyle=(0, (1, 1 + i % 3)), linewidth=1, color=str(0.2 + 0.5 * i / max(1, len(named))),
                      label=f"{r.parametrisation} ({r.constraints})")
    left.set_xlabel("captured energy fraction tr(SP)/tr(S)")
    left.set_ylabel("calibration MSE per output (linearised)")
    right.set_xscale("log", base=2)
    right.set_xlabel("basis size p")
    right.set_ylabel("objective J(d) (random bases: mean over seeds)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # (an empty legend is a matplotlib warning on stderr)
            ax.legend(fontsize=7)
    fig.tight_layout()
    savefig_atomic(fig, path)
    plt.close(fig)
    return path


def _groups(rows: Sequence[SweepRow]) -> dict[tuple[str, str], list[SweepRow]]:
    out: dict[tuple[str, str], list[SweepRow]] = {}
    for r in rows:
        out.setdefault((r.constraints, r.basis), []).append(r)
    return out
