"""The paper's language-model experiment on a real small Llama (``mergeqp experiment lm``).

:func:`run_lm_experiment`, deterministically from a seed:

1. loads each domain's offline texts (:data:`DOMAINS`: BBC News, WordNet glosses, fortunes, or
   any :class:`~mergeqp.experiments.corpora.Corpus`) and splits it into disjoint, seeded train /
   calibration / held-out test texts (:func:`split_domains`);
2. fine-tunes the base (SmolLM2-135M-Instruct by default) once per domain, training only the MLPs
   (or the modules ``finetune_modules``: ``self_attn``, ...) of the last ``finetune_blocks`` blocks
   through the split forward (cached hidden states entering the first trained block); the
   fine-tunes are cached by key (:mod:`.finetune_lm`);
3. merges the fine-tunes through the product's own run layer (:func:`mergeqp.run.run_merge` with a
   :class:`~mergeqp.run.MergeConfig` built here and calibration prompt files written in a work
   folder): the QP in every mode (``single``: the last fine-tuned linear layer; ``sequential``,
   ``hybrid``, ``joint``, ``trust_region``: every fine-tuned linear layer) with the Euclidean and
   the KL output metric, and every baseline (task arithmetic with its scaling chosen on the
   calibration texts, TIES, DARE-TIES, soup, Fisher, RegMean); when mergekit is importable, also
   mergekit's own ``linear`` / ``task_arithmetic`` / ``ties`` / ``dare_ties`` via ``mergekit-yaml``
   on the same folders (its entry point called once per method in one subprocess, :mod:`.mergekit_driver`);
4. evaluates the base, each fine-tune and every merge on each domain's held-out texts
   (cross-entropy, logit MSE and KL to the domain's fine-tune; :mod:`.lm_eval`) and on the
   calibration texts (used only to choose the task-arithmetic scaling and the recommended merge);
5. checks the paper's LLM claims and the issue's LM goal as measured and writes ``results.json``,
   ``report.md`` and PNG figures (:mod:`.lm_report`), atomically.

Every setting lives in :class:`LmConfig` (its merge and statistics settings in one
:class:`LmMergeSettings`); ``quick()`` and ``full()`` are the presets.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ValidationError, check_integer, unit_grid, unknown
from ..io.atomic import atomic_folder, check_writable_folder, nearest_existing, write_json_atomic
from ..io.progress import library_bars
from ..io.workdir import work_folder
from ..merge.modes import MERGE_MODES, TrustRegionMode
from ..output_metrics import OUTPUT_METRICS
from ..jsonutil import to_jsonable
from ..io.checkpoint import read_config
from ..run.architectures import ARCHITECTURES, causal_lm_obstacle
from ..run.auto import AUTO_FOLDS, AUTO_MODE_OPTIONS
from ..run.merge_plan import context_length
from .corpora import Corpus, bbc_news, check_corpus_name, corpus_files, fortunes, wordnet_glosses
from .finetune_lm import (
    FINETUNE_RECORD,
    FinetuneSettings,
    block_layout,
    check_vocabulary,
    finetune_causal_lm,
    finetune_key,
    load_tokenizer_of,
    smollm2_folder,
    split_block,
)
from .kfold import contiguous_folds
from .lm_claims import MULTITASK, evaluate_lm_claims, lm_goal, recommended_merge
from .lm_eval import ModelTensors, UpperEvaluator, file_names, same_model
from .lm_report import write_lm_outputs

#: default cache of the base model and the fine-tunes (``--cache`` / ``MERGEQP_CACHE`` override it)
DEFAULT_CACHE = "~/.cache/mergeqp"
QP_MODES = ("single", "sequential", "hybrid", "joint", "trust_region")
#: the output metrics a run compares by default (any registered one may be named: ``mergeqp.output_metrics``)
DEFAULT_METRICS = ("euclidean", "kl", "cross_entropy")
#: the product's recommended merge for causal language models (``docs/lm.md`` has the measurements
#: behind it): ``method: auto`` (a trust region from the start with the lowest held-out calibration
#: objective among the candidate merges, stopped early on those batches) on the calibration
#: prompts' cross-entropy, over the rows of each fine-tuned module's last layer (``down_proj`` of the
#: fine-tuned MLPs, ``o_proj`` of fine-tuned attention: :data:`MODULE_OUTPUTS`)
RECOMMENDED_RUN = "trust_region:cross_entropy"
#: the layer selector of the recommended merge, ``qp_atoms`` and ``output_space``: the last
#: fine-tuned linear layer of each fine-tuned module (see :func:`select_layers`)
MODULE_OUTPUTS = "module_outputs"
MERGEKIT_METHODS = ("linear", "task_arithmetic", "ties", "dare_ties")
#: the seed of the reference fine-tuned on every domain's train texts (``LmConfig.multitask``, the row
#: ``MULTITASK``) is ``seed * 1000 + MULTITASK_SEED`` (domain i's fine-tune: ``seed * 1000 + i``)
MULTITASK_SEED = 999

#: the QP runs of quick mode, one per mode: single, sequential and hybrid with the paper's Euclidean
#: metric, joint with the KL metric, the trust region as the recommended merge (cross-entropy metric);
#: full mode runs every mode with every metric
QUICK_RUNS = ("single:euclidean", "sequential:euclidean", "hybrid:euclidean", "joint:kl", RECOMMENDED_RUN)
#: baselines besides task arithmetic (which always runs: it is tuned and starts the hybrid mode)
BASELINES = ("soup", "ties", "dare_ties", "fisher", "regmean", "regmean_sequential")
#: baselines that can be atoms of the ``rows+baselines`` trust region (merged tensor-wise or from
#: calibration statistics; ``regmean_sequential`` is a model method of the run layer)
ATOM_BASELINES = ("task_arithmetic", "soup", "ties", "dare_ties", "fisher", "regmean")
#: merges besides the mode x metric grid (issue #16's): ``qp_atoms``, the recommended merge's trust
#: region with every baseline's merged residual as an atom (``rows+baselines``: RegMean, Fisher,
#: TIES and the tuned task arithmetic are feasible points of each step's QP); ``output_space``,
#: the full-matrix output-space merge of the same layers (KL metric on the top-k tokens:
#: it fits the fine-tunes' outputs, so not the prompts' cross-entropy)
EXTRA_RUNS = ("qp_atoms", "output_space")
#: the QP runs of full mode: every mode with the Euclidean and the KL metric, and the recommended
#: merge (the class defaults add the cross-entropy metric to every mode)
FULL_RUNS = (*(f"{mode}:{metric}" for mode in QP_MODES for metric in ("euclidean", "kl")), RECOMMENDED_RUN)
#: full mode runs ``qp_atoms``; ``output_space`` (its CG alone took 20 minutes at quick mode's size)
#: is left to the class defaults
FULL_EXTRA_RUNS: tuple[str, ...] = ("qp_atoms",)
#: quick mode leaves out both (its 10-minute budget): ``output_space``'s matrix-free CG took 20 of a
#: quick run's 45 minutes, ``qp_atoms`` 188 of 1,022 s (docs/lm.md)
QUICK_EXTRA_RUNS: tuple[str, ...] = ()


#: domain name -> loader of its :class:`Corpus` (``register_domain`` adds more)
DOMAINS: dict[str, Callable[[], Corpus]] = {}


def register_domain(name: str, loader: Callable[[], Corpus], *, replace_existing: bool = False) -> None:
    """Make ``name`` a valid ``--domains`` entry: ``loader()`` returns its texts as a Corpus."""
    check_corpus_name(name)
    if not callable(loader):
        raise ValidationError(f"domain {name!r}: the loader must be callable (returning a Corpus), "
                              f"got {type(loader).__name__}")
    if name in DOMAINS and not replace_existing:
        raise ValidationError(f"domain {name!r} is already registered")
    DOMAINS[name] = loader


register_domain("bbc_news", bbc_news)
register_domain("wordnet_glosses", wordnet_glosses)
register_domain("fortunes", fortunes)
DEFAULT_DOMAINS = ("bbc_news", "wordnet_glosses", "fortunes")


@dataclass(frozen=True)
class LmMergeSettings:
    """Every merge and statistics setting of the experiment (the one place to change them).

    QP: ``runs`` (``"mode:metric"`` labels; ``None``: every one of ``modes`` x ``metrics``);
    ``parametrisation``: per mode, or per ``"mode:metric"`` (which wins), the run layer's
    ``method`` keys (``parametrisation``, ``basis``, ``rank``, ``mode_options``, ...) plus
    ``layers`` (``all`` fine-tuned linear layers, ``last``, or a glob on their names; default
    ``last`` for ``single``, else ``all``) and ``start`` (a baseline name started from, for a mode
    that takes one); ``outputs`` per metric (the run layer's ``output`` block besides ``metric``:
    by default the exact objective for ``euclidean``, ``restrict: none`` (its statistics go
    through the folded head, docs/lm-statistics.md), for ``kl`` the top-``k`` tokens of each
    fine-tune, the only foldable KL, and for ``cross_entropy`` the model's top 16 tokens and the
    rest as one logit with a 64-row sketch per prompt); ``recommended``: the run reported as the
    product's recommended merge (:data:`RECOMMENDED_RUN`);
    ``calibration_max_length`` tokens per prompt and ``calibration_batch_size`` prompts per batch
    for the statistics; ``balance`` (the run layer's ``calibration.balance``; default ``tokens``:
    each domain's objective divided by its number of compared tokens, so that the merges minimise
    a sum of per-domain means, as the reported metric averages per-domain means: domains of short
    texts, e.g. WordNet glosses, are not outweighed by those of long ones; ``none``: every token
    alike); ``trust_region`` (``mode_options`` of ``trust_region``); the hybrid mode
    starts from the calibration-tuned task arithmetic. Baselines: ``ta_scalings`` (task
    arithmetic's scaling, chosen by the mean calibration cross-entropy), the other ``baselines``
    (of :data:`BASELINES`) with ``ties_density``, ``dare_density`` and ``regmean_alphas`` (RegMean's
    ``alpha``, chosen among them by the mean cross-entropy of calibration texts that the RegMean it
    scores was not fitted to, ``tuning_folds``-fold: each domain's calibration texts cut into that many
    contiguous folds, as ``method: auto`` cuts its batches; the RegMean paper tunes alpha on validation
    data; ``tuning_folds: 1`` scores each RegMean on the texts it was fitted to, the rule of stop 78;
    one value: no choice; ``regmean_sequential``, RegMean with each layer's Gram matrices at the merged
    model's inputs (RegMean++, also in FusionBench), chooses its alpha among the same values the same way);
    ``mergekit`` methods (run when mergekit is importable).
    ``solver``: the QP solver (``auto``). ``extra_runs`` (of :data:`EXTRA_RUNS`): ``qp_atoms``
    (``atoms``: the ``rows+baselines`` trust region, the recommended run's layers, metric and mode
    options, from the soup) and ``output_space`` (``output_space``: its ``params``, ``layers``
    and ``metric``)."""

    modes: tuple[str, ...] = QP_MODES
    metrics: tuple[str, ...] = DEFAULT_METRICS
    runs: tuple[str, ...] | None = None
    parametrisation: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: {
        **{m: {"parametrisation": "scalar"} for m in QP_MODES},
        RECOMMENDED_RUN: {"parametrisation": "rows", "layers": MODULE_OUTPUTS, "start": "auto",
                          "constraints": [], "mode_options": dict(AUTO_MODE_OPTIONS)}})
    outputs: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: {
        "euclidean": {"restrict": "none"}, "kl": {"restrict": "topk", "k": 64},
        "cross_entropy": {"restrict": "topk", "k": 16, "sketch": 64}})
    recommended: str = RECOMMENDED_RUN
    calibration_max_length: int = 48
    calibration_batch_size: int = 8
    balance: str = "tokens"
    trust_region: Mapping[str, Any] = field(default_factory=lambda: {"max_steps": 4})
    ta_scalings: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
    baselines: tuple[str, ...] = BASELINES
    ties_density: float = 0.5
    dare_density: float = 0.5
    regmean_alphas: tuple[float, ...] = (0.1, 0.5, 0.9)
    tuning_folds: int = AUTO_FOLDS
    mergekit: tuple[str, ...] = MERGEKIT_METHODS
    solver: str = "auto"
    extra_runs: tuple[str, ...] = EXTRA_RUNS
    atoms: Mapping[str, Any] = field(default_factory=lambda: {
        "baselines": ("regmean", "fisher", "ties", "task_arithmetic"), "layers": MODULE_OUTPUTS,
        "metric": "cross_entropy", "start": "soup"})
    output_space: Mapping[str, Any] = field(default_factory=lambda: {
        "params": {"reference": "soup", "ridge": 0.1, "max_iter": 40}, "layers": MODULE_OUTPUTS, "metric": "kl"})

    def __post_init__(self) -> None:
        modes = sorted(MERGE_MODES)  # the registry: a user's registered mode runs too
        for m in self.modes:
            if m not in MERGE_MODES:
                raise unknown("QP mode", m, modes)
            if m not in self.parametrisation:
                raise ValidationError(f"parametrisation: no entry for mode {m!r}")
        for label in self.runs or ():
            mode, _, metric = label.partition(":")
            if mode not in MERGE_MODES or metric not in OUTPUT_METRICS:
                raise ValidationError(f"runs: {label!r} is not 'mode:metric' with a mode of {modes} and a "
                                      f"registered metric ({', '.join(OUTPUT_METRICS)})")
            if mode not in self.parametrisation and label not in self.parametrisation:
                raise ValidationError(f"parametrisation: no entry for run {label!r}")
            if metric not in self.outputs:
                raise ValidationError(f"outputs: no entry for metric {metric!r} (run {label!r})")
        for m in self.metrics:
            if m not in OUTPUT_METRICS:
                raise unknown("output metric", m, list(OUTPUT_METRICS))
            if m not in self.outputs:
                raise ValidationError(f"outputs: no entry for metric {m!r}")
            if "metric" in self.outputs[m]:
                raise ValidationError(f"outputs[{m!r}] sets 'metric'; the key is the metric")
        for m, block in self.outputs.items():  # refused now, not at the merge after the fine-tuning
            if m in OUTPUT_METRICS and isinstance(block, dict):
                why = OUTPUT_METRICS[m].problem(block.get("field", "logits"), block.get("restrict", "none"),
                                                block.get("pool", "none"), block.get("matrix") is not None)
                if why is not None:
                    raise ValidationError(f"outputs[{m!r}]: {why}")
        for m in self.baselines:
            if m not in BASELINES:
                raise unknown("baseline", m, list(BASELINES))
        for m in self.mergekit:
            if m not in MERGEKIT_METHODS:
                raise unknown("mergekit method", m, list(MERGEKIT_METHODS))
        if not self.ta_scalings or any(not np.isfinite(s) or s <= 0 for s in self.ta_scalings):
            raise ValidationError(f"ta_scalings must be positive numbers, got {self.ta_scalings}")
        object.__setattr__(self, "regmean_alphas", unit_grid("regmean_alphas (RegMean's alpha)", self.regmean_alphas))
        check_integer("tuning_folds", self.tuning_folds, 1)
        if self.balance not in ("none", "tokens"):
            raise unknown("calibration balance", self.balance, ["none", "tokens"])
        for m in self.extra_runs:
            if m not in EXTRA_RUNS:
                raise unknown("extra run", m, list(EXTRA_RUNS))
        for m in self.atoms.get("baselines", ()):
            if m not in ATOM_BASELINES:
                raise unknown("atoms baseline", m, list(ATOM_BASELINES))
        runs = {"qp_atoms": ("atoms", self.atoms), "output_space": ("output_space", self.output_space)}
        for name, block in (runs[r] for r in self.extra_runs):
            if block.get("metric") not in self.outputs:
                raise ValidationError(f"{name}: metric {block.get('metric')!r} has no 'outputs' entry (valid: "
                                      f"{list(self.outputs)})")

    def qp_runs(self) -> list[tuple[str, str]]:
        """``(mode, metric)`` of every QP run, in order."""
        if self.runs is not None:
            return [tuple(label.split(":", 1)) for label in self.runs]  # type: ignore[misc]
        return [(mode, metric) for mode in self.modes for metric in self.metrics]

    def run_settings(self, mode: str, metric: str) -> dict[str, Any]:
        """The ``parametrisation`` entry of a run: its ``"mode:metric"`` entry over its mode's."""
        out = dict(self.parametrisation.get(mode, {}))
        out.update(self.parametrisation.get(f"{mode}:{metric}", {}))
        return out


@dataclass(frozen=True)
class LmConfig:
    """Every setting of the language experiment (``quick()`` / ``full()`` presets).

    Texts per domain: ``train_texts`` (fine-tuning), ``calibration_texts`` (merge statistics,
    the task-arithmetic scaling and the recommended merge), ``test_texts`` (held-out evaluation
    only); ``min_chars``: shorter texts are dropped first. Fine-tuning: the modules
    ``finetune_modules`` (names inside a decoder block: ``mlp``, ``self_attn``, ``mlp.down_proj``,
    ...; every parameter under them) of the last ``finetune_blocks`` blocks, ``finetune_steps``
    Adam steps of ``finetune_batch`` texts of at most ``finetune_max_length`` tokens at
    ``finetune_lr``. ``multitask``: also fine-tune one model
    by the same recipe on every domain's train texts (each seen once: ``finetune_steps`` times the
    number of domains), a reference row (``multitask``) of what one model trained on all the data
    reaches. Evaluation: ``eval_max_length`` tokens per text, ``eval_batch`` texts per batch.
    ``merge``: :class:`LmMergeSettings`."""

    train_texts: int = 1024
    calibration_texts: int = 64
    test_texts: int = 128
    min_chars: int = 20
    finetune_blocks: int = 2
    finetune_modules: tuple[str, ...] = ("mlp",)
    finetune_steps: int = 128
    finetune_batch: int = 8
    finetune_max_length: int = 64
    finetune_lr: float = 2e-3
    multitask: bool = True
    eval_max_length: int = 64
    eval_batch: int = 8
    merge: LmMergeSettings = field(default_factory=LmMergeSettings)

    def __post_init__(self) -> None:
        for name in ("train_texts", "calibration_texts", "test_texts", "finetune_blocks", "finetune_steps",
                     "finetune_batch", "finetune_max_length", "eval_max_length", "eval_batch"):
            check_integer(f"LmConfig.{name}", getattr(self, name))
        check_integer("LmConfig.min_chars", self.min_chars, minimum=0)
        if not (isinstance(self.finetune_lr, (int, float)) and 0 < self.finetune_lr < math.inf):
            raise ValidationError(f"LmConfig.finetune_lr must be a positive finite number, got {self.finetune_lr!r}")
        if self.eval_max_length < 2 or self.finetune_max_length < 2:
            raise ValidationError("eval_max_length and finetune_max_length must be >= 2 tokens")
        modules = (self.finetune_modules,) if isinstance(self.finetune_modules, str) else self.finetune_modules
        object.__setattr__(self, "finetune_modules", tuple(modules))
        bad = [m for m in self.finetune_modules
               if not isinstance(m, str) or not m.strip(".") or any(c in m for c in "*?[]") or m != m.strip()]
        if not self.finetune_modules or bad:
            raise ValidationError(f"LmConfig.finetune_modules must be one or more module names inside a decoder "
                                  f"block (e.g. 'mlp', 'self_attn', 'mlp.down_proj'), got {self.finetune_modules!r}")

    @classmethod
    def full(cls) -> LmConfig:
        """Sized for the 60-minute target on 2 CPU cores, fine-tuning included (measured: 35-46 minutes,
        docs/lm.md): twice quick mode's fine-tuning texts at twice its length, 4/3 of its calibration
        texts at 1.5x the length, twice its test texts at 1.5x the length; every mode with the
        Euclidean and the KL metric, the recommended merge and ``qp_atoms``. The class defaults
        (every mode with every metric, ``output_space``, 1,024 / 64 / 128 texts) are for a GPU or
        more cores: about three hours on 2 cores, extrapolated, not measured."""
        return cls(train_texts=512, calibration_texts=32, test_texts=96, finetune_steps=64, finetune_max_length=64,
                   eval_max_length=48,
                   merge=LmMergeSettings(calibration_max_length=48, calibration_batch_size=8,
                                         trust_region={"max_steps": 3}, runs=FULL_RUNS,
                                         extra_runs=FULL_EXTRA_RUNS))

    @classmethod
    def quick(cls) -> LmConfig:
        """Fewer texts, steps and tokens (docs/lm.md has the measured time). Each fine-tune sees
        its train texts once (32 steps x 8 = 256 texts): two passes over fewer texts memorised them
        and made every fine-tune worse on its own held-out texts than the soup of all three."""
        return cls(train_texts=256, calibration_texts=24, test_texts=48, finetune_steps=32, finetune_max_length=32,
                   eval_max_length=32,
                   merge=LmMergeSettings(calibration_max_length=24, calibration_batch_size=6, ta_scalings=(0.5, 1.0),
                                         trust_region={"max_steps": 2}, runs=QUICK_RUNS,
                                         extra_runs=QUICK_EXTRA_RUNS))


def with_overrides(config: LmConfig, **changes: Any) -> LmConfig:
    """``config`` with fields replaced (``merge`` fields by name too)."""
    merge_fields = {k: v for k, v in changes.items() if k in LmMergeSettings.__dataclass_fields__}
    top = {k: v for k, v in changes.items() if k not in merge_fields}
    bad = [k for k in top if k not in LmConfig.__dataclass_fields__]
    if bad:
        raise unknown("LM experiment setting", bad[0], sorted({*LmConfig.__dataclass_fields__,
                                                                *LmMergeSettings.__dataclass_fields__}))
    merge = replace(config.merge, **merge_fields) if merge_fields else config.merge
    return replace(config, merge=merge, **top)


@dataclass(frozen=True)
class DomainSplit:
    """One domain's disjoint texts: ``train`` (fine-tuning), ``calibration``, ``test``."""

    name: str
    train: tuple[str, ...]
    calibration: tuple[str, ...]
    test: tuple[str, ...]


def split_domains(corpora: Sequence[Corpus], config: LmConfig, seed: int) -> list[DomainSplit]:
    """Disjoint, seeded train / calibration / test texts per corpus (stratified by label; texts
    shorter than ``min_chars`` and duplicates within a corpus are dropped first, so no text is in
    two parts)."""
    names = [c.name for c in corpora]
    if len(set(names)) != len(names):
        raise ValidationError(f"domain names must be distinct, got {names}")
    if len(corpora) < 2:
        raise ValidationError(f"merging needs two or more domains, got {names}")
    out = []
    for i, c in enumerate(corpora):
        seen: set[str] = set()
        keep = []
        for j, t in enumerate(c.texts):
            if len(t) >= config.min_chars and t not in seen:
                seen.add(t)
                keep.append(j)
        kept = c.subset(keep)
        want = config.train_texts + config.calibration_texts + config.test_texts
        if len(kept) < want:
            raise ValidationError(f"domain {c.name!r} has {len(kept)} distinct texts of >= {config.min_chars} "
                                  f"characters; the experiment needs {want} (train {config.train_texts} + "
                                  f"calibration {config.calibration_texts} + test {config.test_texts})")
        train, calib, test = kept.split((config.train_texts, config.calibration_texts, config.test_texts),
                                        seed=seed * 1000 + i)
        out.append(DomainSplit(c.name, train.texts, calib.texts, test.texts))
    return out


def default_cache() -> Path:
    """The cache folder: ``$MERGEQP_CACHE`` when set, else ``~/.cache/mergeqp``."""
    return Path(os.environ.get("MERGEQP_CACHE") or DEFAULT_CACHE).expanduser()


# ---------------------------------------------------------------------------------------------- #
# measuring a step: wall time and peak resident memory


class PeakRss:
    """Samples a process's resident set size every ``interval`` s in a thread while in use; ``peak``
    (bytes) is the largest sample, ``start`` the first. ``pid`` ``None``: this process."""

    def __init__(self, pid: int | None = None, interval: float = 0.02) -> None:
        import psutil  # optional dependency: memory measurement only

        self._proc = psutil.Process(pid)
        self.interval = interval
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _rss(self) -> int:
        try:
            return int(self._proc.memory_info().rss)
        except Exception:  # the process ended between samples
            return 0

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())


@contextmanager
def measured(record: dict[str, Any]) -> Iterator[None]:
    """Time a step and sample this process's RSS; fills ``record`` with ``seconds``,
    ``peak_rss_mb`` (whole process) and ``rss_increase_mb`` (peak minus the RSS at the start)."""
    t = time.perf_counter()
    with PeakRss() as rss:
        yield
    record["seconds"] = time.perf_counter() - t
    record["peak_rss_mb"] = rss.peak / 2**20
    record["rss_increase_mb"] = (rss.peak - rss.start) / 2**20


# ---------------------------------------------------------------------------------------------- #
# merges


@dataclass
class _Context:
    """What the merge steps share."""

    base: Path
    finetunes: list[tuple[str, Path]]
    calibration_files: list[Path]
    layers: list[str]
    work: Path
    device: str
    seed: int
    settings: LmMergeSettings
    evaluator_tensors: Callable[..., ModelTensors]
    say: Callable[[str], None]
    progress: bool


def merge_config(ctx: _Context, method: Mapping[str, Any], layers: Sequence[str], metric: str = "euclidean") -> Any:
    """The run layer's :class:`~mergeqp.run.MergeConfig` of one merge of this experiment."""
    import pydantic  # the run layer's schema is pydantic

    from ..run.schema import MergeConfig  # deferred: the schema loads every registry (only when merging)

    s = ctx.settings
    raw = {
        "base": str(ctx.base),
        "models": [{"name": name, "path": str(folder), "calibration": {"path": str(cal), "holdout": 0}}
                   for (name, folder), cal in zip(ctx.finetunes, ctx.calibration_files)],
        "layers": list(layers),
        "method": dict(method),
        "calibration": {"max_length": s.calibration_max_length, "batch_size": s.calibration_batch_size,
                        "holdout": 0, "balance": s.balance},
        "output": {**dict(s.outputs[metric]), "metric": metric},
        "device": ctx.device,
        "evaluate": False,
        "seed": ctx.seed,
    }
    try:
        return MergeConfig.model_validate({**raw, "root": str(ctx.work)})
    except pydantic.ValidationError as exc:
        raise ValidationError(f"the lm experiment's merge {dict(method)} is not a valid run-layer config "
                              f"(check LmMergeSettings): {exc}") from None


def select_layers(layers: Sequence[str], selector: str) -> list[str]:
    """``all`` of ``layers``, the ``last``, ``module_outputs`` or those matching a glob (at least one).

    ``module_outputs``: the last of ``layers`` (in the model's order) in each module, a module being a
    layer's name without its last component: ``down_proj`` of a Llama block's MLP (``gate_proj``,
    ``up_proj``, ``down_proj``), ``o_proj`` of its attention (``q_proj`` ... ``o_proj``), GPT-2's
    ``c_proj``: the projection that writes a fine-tuned module's result back into the residual
    stream in these architectures, whichever modules were fine-tuned."""
    import fnmatch

    if selector == "all":
        return list(layers)
    if selector == "last":
        return list(layers[-1:])
    if selector == MODULE_OUTPUTS:
        last: dict[str, str] = {}
        for name in layers:
            last[name.rpartition(".")[0]] = name
        return [name for name in layers if name in last.values()]
    chosen = [name for name in layers if fnmatch.fnmatchcase(name, selector)]
    if not chosen:
        raise ValidationError(f"layers {selector!r} matches none of the fine-tuned layers {list(layers)}")
    return chosen


def read_folder_state(folder: Path) -> dict[str, Any]:
    """Every tensor of a Hugging Face folder's safetensors files."""
    from safetensors.torch import load_file  # optional heavy dependency (experiment extra)

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValidationError(f"no .safetensors file in {folder}")
    state: dict[str, Any] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def run_layer_merge(ctx: _Context, label: str, method: Mapping[str, Any], layers: Sequence[str],
                    metric: str = "euclidean") -> tuple[ModelTensors, dict[str, Any]]:
    """One merge through :func:`mergeqp.run.run_merge`; returns the merged model's tensors that
    differ from the base and a record (settings, time, memory, the run report's summary)."""
    from ..run.pipeline import run_merge  # deferred: the pipeline loads every registry (only when merging)

    cfg = merge_config(ctx, method, layers, metric)
    record: dict[str, Any] = {"method": dict(method), "layers": list(layers), "metric": metric}
    ctx.say(f"merging {label}")
    with measured(record):  # in memory: the evaluation needs the tensors, not a 0.5 GB folder per merge
        result = run_merge(cfg, None, progress=False, write=False)
    report = result.report
    record["report"] = _report_summary(report)
    assert result.tensors is not None
    tensors = ctx.evaluator_tensors(result.tensors, complete=False)
    return tensors, record


def _report_summary(report: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of a run report worth keeping: per layer the objective and certificate, notes."""
    layers = []
    for layer in report.get("layers", []) or []:
        cert = layer.get("certificate") or {}
        layers.append({k: layer.get(k) for k in ("layer", "objective_before", "objective_after",
                                                 "objective_after_exact", "objective_at", "baselines") if k in layer}
                      | {"certified": cert.get("certified")})
    out: dict[str, Any] = {"layers": layers, "notes": list(report.get("notes", []) or [])}
    for key in ("start_selection", "trust_region", "joint", "comparison", "output_space_layers"):
        if key in report:
            out[key] = report[key]
    return out


def mergekit_available() -> str | None:
    """The ``mergekit-yaml`` command when mergekit is importable, else ``None``."""
    if importlib.util.find_spec("mergekit") is None:
        return None
    sibling = Path(sys.executable).parent / "mergekit-yaml"
    return str(sibling) if sibling.is_file() else shutil.which("mergekit-yaml")


def mergekit_yaml(method: str, base: Path, finetunes: Sequence[tuple[str, Path]], ta_scaling: float,
                  density: float) -> str:
    """A mergekit YAML for ``method`` on the same folders: ``linear`` (equal weights, normalised:
    the soup), ``task_arithmetic`` (weight = the calibration-tuned scaling per model), ``ties`` /
    ``dare_ties`` (``density``, weight 1, mergekit's default normalisation)."""
    import yaml  # pyyaml, a core dependency (config files)

    params: dict[str, Any] = {"weight": 1.0}
    if method == "task_arithmetic":
        params = {"weight": float(ta_scaling)}
    elif method in ("ties", "dare_ties"):
        params = {"weight": 1.0, "density": float(density)}
    doc: dict[str, Any] = {"models": [{"model": str(f), "parameters": dict(params)} for _, f in finetunes],
                           "merge_method": method, "dtype": "float32"}
    if method != "linear":
        doc["base_model"] = str(base)
    return yaml.safe_dump(doc, sort_keys=False)


def run_mergekit(ctx: _Context, command: str, methods: Sequence[str], ta_scaling: float
                 ) -> dict[str, tuple[ModelTensors, dict[str, Any]]]:
    """mergekit's ``methods``: for each, the ``mergekit-yaml SPEC OUT`` command with the same options,
    all run in one subprocess (:mod:`.mergekit_driver`: mergekit-yaml's own entry point called once
    per merge, so torch, transformers and mergekit are imported once instead of once per method).
    Each record has that merge's own wall time, CPU seconds and peak resident memory."""
    if not methods:
        return {}
    options = ["--no-copy-tokenizer", "--random-seed", str(ctx.seed)]
    if ctx.device.startswith("cuda"):  # mergekit runs on CPU unless --cuda is given
        options.append("--cuda")
    pairs: list[tuple[str, Path, dict[str, Any]]] = []
    for method in methods:
        spec = ctx.work / f"mergekit_{method}.yml"
        spec.write_text(mergekit_yaml(method, ctx.base, ctx.finetunes, ta_scaling, ctx.settings.dare_density
                                      if method == "dare_ties" else ctx.settings.ties_density))
        out = ctx.work / f"mergekit_{method}"
        cmd = [Path(command).name, str(spec), str(out), *options]
        pairs.append((method, out, {"command": " ".join(cmd), "yaml": spec.read_text()}))
    result_file = ctx.work / "mergekit_result.json"
    driver = [sys.executable, "-m", "mergeqp.experiments.mergekit_driver", str(result_file),
              *(x for method, out, _ in pairs for x in (str(ctx.work / f"mergekit_{method}.yml"), str(out))),
              "--", *options]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    ctx.say(f"mergekit {', '.join(methods)}")
    t = time.perf_counter()
    proc = subprocess.Popen(driver, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    with PeakRss(proc.pid) as rss:
        output, _ = proc.communicate()
    seconds = time.perf_counter() - t
    try:
        done = json.loads(result_file.read_text())
    except (OSError, ValueError):
        done = {"merges": [], "error": None}
    if proc.returncode != 0:
        why = done.get("error") or output[-2000:]
        raise ValidationError(f"mergekit-yaml failed in the mergekit step (exit {proc.returncode}): {why}")
    merges = done["merges"]
    results: dict[str, tuple[ModelTensors, dict[str, Any]]] = {}
    for (method, out, record), usage in zip(pairs, merges):
        record["seconds"] = usage["seconds"]
        record["cpu_seconds"] = usage["cpu_seconds"]
        per_merge = bool(usage.get("peak_is_per_merge")) and usage.get("peak_rss_mb") is not None
        record["peak_rss_mb"] = usage["peak_rss_mb"] if per_merge else rss.peak / 2**20
        record["rss_increase_mb"] = None
        record["memory_note"] = ("peak RSS of the mergekit process during this merge (its imports included)"
                                 if per_merge else "peak RSS of the mergekit process over all its merges")
        record["process_note"] = (f"the {len(pairs)} mergekit-yaml commands ran in one process "
                                  f"(mergeqp.experiments.mergekit_driver), {seconds:.1f} s in all with its start")
        results[method] = (ctx.evaluator_tensors(read_folder_state(out)), record)
        shutil.rmtree(out, ignore_errors=True)
    return results


# ---------------------------------------------------------------------------------------------- #
# the experiment


def baseline_params(mset: LmMergeSettings, seed: int, regmean_alpha: float | None = None) -> dict[str, dict[str, Any]]:
    """The run-layer parameters of each of :data:`BASELINES` in this experiment (RegMean's ``alpha``:
    ``regmean_alpha``, the one chosen on the calibration texts; default the first of ``regmean_alphas``)."""
    alpha = mset.regmean_alphas[0] if regmean_alpha is None else regmean_alpha
    return {"soup": {}, "ties": {"density": mset.ties_density},
            "dare_ties": {"density": mset.dare_density, "seed": seed}, "fisher": {},
            "regmean": {"alpha": float(alpha)}, "regmean_sequential": {"alpha": float(alpha)}}


#: a baseline's setting chosen on the calibration texts: (results key, record key, the grid's setting name)
TUNED_BASELINES = {"task_arithmetic": ("task_arithmetic_tuning", "scaling", "scalings"),
                   "regmean": ("regmean_tuning", "alpha", "alphas"),
                   "regmean_sequential": ("regmean_sequential_tuning", "alpha", "alphas")}
#: tuned baselines fitted to the calibration texts: their setting is scored on texts the fit did not
#: see (``LmMergeSettings.tuning_folds``); task arithmetic is data-free, so its calibration score is
#: already a held-out one
FITTED_BASELINES = frozenset({"regmean", "regmean_sequential"})


def _extra_runs(mset: LmMergeSettings, best_scaling: float, seed: int, linear_layers: Sequence[str],
                regmean_alpha: float | None = None) -> list[tuple[str, dict[str, Any], list[str], str, str]]:
    """``(label, run-layer method, layers, metric, kind)`` of each of ``mset.extra_runs``."""
    params = {**baseline_params(mset, seed, regmean_alpha), "task_arithmetic": {"scaling": float(best_scaling)}}
    out = []
    if "qp_atoms" in mset.extra_runs:
        a = mset.atoms
        rec = mset.run_settings(*mset.recommended.split(":", 1))
        method = {"name": "qp", "mode": "trust_region", "solver": mset.solver, "parametrisation": "rows+baselines",
                  "baselines": [{"name": n, "params": params[n]} for n in a["baselines"]],
                  "constraints": list(rec.get("constraints", [])), "start": {"name": a.get("start", "soup")},
                  "mode_options": dict(rec.get("mode_options", AUTO_MODE_OPTIONS))}
        out.append(("qp_atoms", method, select_layers(linear_layers, a.get("layers", "all")), a["metric"], "qp"))
    if "output_space" in mset.extra_runs:
        o = mset.output_space
        method = {"name": "output_space", "params": dict(o.get("params", {}))}
        out.append(("output_space", method, select_layers(linear_layers, o.get("layers", "all")), o["metric"],
                    "output_space"))
    return out


def _log(progress: bool, msg: str) -> None:
    if progress:
        from tqdm.auto import tqdm  # progress output only

        tqdm.write(msg)


def load_domains(names: Sequence[str]) -> list[Corpus]:
    """The registered domains' corpora, in order; a domain whose texts are not on this machine is a
    :class:`ValidationError` naming it, with the ways to give texts of one's own."""
    out = []
    for n in names:
        if n not in DOMAINS:
            raise unknown("domain", n, sorted(DOMAINS))
        try:
            corpus = DOMAINS[n]()
        except ValidationError as exc:  # (stop 60 review: the built-ins' hint, "pass root=", is a Python argument)
            raise ValidationError(f"domain {n!r}: {exc}; or use texts of your own instead: --domain-file NAME=FILE "
                                  f"(one text per line), or from Python corpora=[...] or register_domain(NAME, "
                                  f"loader)") from None
        out.append(corpus if corpus.name == n else replace(corpus, name=n))  # results name the domain as asked
    return out


def check_base_folder(folder: str | os.PathLike[str]) -> Path:
    """``folder`` as the experiment's base (resolved): a Hugging Face folder of a causal language model
    (or of an architecture a user registered), refused otherwise before any text is read or model
    trained (stop 60 review: a BERT base was refused as missing WordNet data)."""
    path = Path(folder).expanduser().resolve()
    config = read_config(path)
    if config is None:
        raise ValidationError(f"base folder {path}: not a Hugging Face model folder (no config.json there)")
    if not isinstance(config, dict):  # (a QA review, stop 73: a list raised AttributeError)
        raise ValidationError(f"base folder {path}: its config.json holds a {type(config).__name__}, not an object "
                              f"of settings")
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValidationError(f"base folder {path}: config.json's 'architectures' must be a list of class names, "
                              f"got {archs!r}")
    if not isinstance(config.get("model_type", ""), str):
        raise ValidationError(f"base folder {path}: config.json's 'model_type' must be a string, got "
                              f"{config.get('model_type')!r}")
    if archs and archs[0] in ARCHITECTURES:
        return path
    why = causal_lm_obstacle(config)
    if why is not None:
        raise ValidationError(f"base folder {path}: the language-model experiment fine-tunes and merges a causal "
                              f"language model, and this one is not: {why}")
    return path


def run_lm_experiment(out_dir: str | os.PathLike[str], *, quick: bool = False, seed: int = 0,
                      domains: Sequence[str] | None = None, corpora: Sequence[Corpus] | None = None,
                      config: LmConfig | None = None, cache: str | os.PathLike[str] | None = None,
                      base_folder: str | os.PathLike[str] | None = None, device: str = "cpu",
                      threads: int | None = None, figures: bool = True, progress: bool = True,
                      overwrite: bool = False, multitask: bool | None = None,
                      finetune_modules: Sequence[str] | None = None, command: str | None = None) -> dict[str, Any]:
    """Run the experiment (see the module docstring) and write ``out_dir``; returns the results.

    ``corpora`` (any :class:`Corpus` list) replaces ``domains`` (registered names, default
    :data:`DEFAULT_DOMAINS`); ``base_folder`` replaces SmolLM2 (any Hugging Face causal LM folder
    with a tokenizer); ``cache``: where the base and the fine-tunes are kept (default
    :func:`default_cache`); ``device``: ``cpu``, ``cuda`` (CPU when CUDA is missing, said in the
    results) or ``auto``; ``threads``: torch CPU threads (``None``: min(2, CPUs)); ``multitask``:
    overrides ``LmConfig.multitask`` (the reference fine-tuned on every domain) when given;
    ``finetune_modules`` overrides ``LmConfig.finetune_modules`` (which modules of the last blocks
    the fine-tunes train) when given. ``command``: the command line that started the run (the
    CLI passes it; the report prints it, else says that the run came from Python)."""
    import torch  # optional heavy dependency (experiment extra)

    from ..run.pipeline import resolve_device  # deferred: the pipeline loads every registry
    from .mnist import prepare_out_dir  # deferred: the MNIST module imports torch at its top

    config = config or (LmConfig.quick() if quick else LmConfig.full())
    if multitask is not None:
        config = replace(config, multitask=bool(multitask))
    if finetune_modules is not None:  # (LmConfig takes one module as a string, or several)
        config = replace(config, finetune_modules=finetune_modules)
    if seed < 0:
        raise ValidationError(f"seed must be >= 0, got {seed}")
    if corpora is not None:
        corpora = list(corpora)
        for c in corpora:
            if not isinstance(c, Corpus):
                raise ValidationError(f"corpora: each entry must be a Corpus, got {type(c).__name__}")
            check_corpus_name(c.name)
    # relative paths are the caller's (the run layer's configs are rooted in a temporary work folder)
    cache_dir = check_writable_folder(Path(cache).expanduser() if cache is not None else default_cache(),
                                      "the cache folder (--cache)")
    if base_folder is not None:
        base_folder = check_base_folder(base_folder)
    # never write over the cache (fine-tunes, the base), the base folder or a domain's text file
    prepare_out_dir(out_dir, overwrite=overwrite,
                    inputs=[cache_dir, *([base_folder] if base_folder is not None else []),
                            *corpus_files(corpora or [])])
    dev, device_note = resolve_device(device)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads or min(2, os.cpu_count() or 1))
    try:  # (a killed run's work folder is removed by the next run in the same place)
        # the work folder in the output's nearest existing folder (its missing parents are made by the final
        # atomic write only: `--out new/deeper/run` failed at the start, a QA review, stop 73)
        near = nearest_existing(Path(out_dir).expanduser().resolve().parent)
        with work_folder(".lm-work-", near) as work, library_bars(progress):
            results = _run(config, Path(out_dir), work, cache_dir, seed, domains, corpora, base_folder, dev,
                           device_note, quick, progress)
            results = {**results, "command": command}
            with atomic_folder(out_dir, overwrite=overwrite) as staging:
                results["figures"] = write_lm_outputs(results, staging, figures=figures)
                write_json_atomic(staging / "results.json", to_jsonable(results))
        return results
    finally:
        torch.set_num_threads(old_threads)


def _takes_option(entry: Any, name: str) -> bool:
    """Whether a merge mode entry's ``mode_options`` model has the field ``name``."""
    return entry.options is not None and name in entry.options.model_fields


def _within_context(config: LmConfig, base: Path, notes: list[str], say: Callable[[str], None]) -> LmConfig:
    """``config`` with its token lengths (fine-tuning, evaluation, calibration) cut to the base's
    context where that is shorter (positions beyond it index past the position embedding), and a note
    saying so (``mergeqp merge`` truncates its calibration prompts alike)."""
    found = context_length(read_config(base) or {})
    lengths = (config.finetune_max_length, config.eval_max_length, config.merge.calibration_max_length)
    if found is None or max(lengths) <= found[1]:
        return config
    key, positions = found
    if positions < 2:
        raise ValidationError(f"the base's context ({key} {positions} in {base / 'config.json'}) holds fewer than "
                              f"2 tokens: there is no next token to predict")
    note = (f"the base's context ({key} {positions}) is shorter than the experiment's texts (fine-tuning "
            f"{lengths[0]}, evaluation {lengths[1]}, calibration {lengths[2]} tokens): every text is cut to "
            f"{positions} tokens")
    notes.append(note)
    say(note)
    return replace(config, finetune_max_length=min(lengths[0], positions), eval_max_length=min(lengths[1], positions),
                   merge=replace(config.merge, calibration_max_length=min(lengths[2], positions)))


def _check_auto_folds(config: LmConfig) -> None:
    """A QP run with ``start: auto`` cross-validates over each domain's calibration batches: with
    folds, two or more per domain are needed (the run layer's rule, checked before any work)."""
    from ..run.auto import MIN_FOLD_BATCHES, parse_auto_params, too_few_batches  # deferred: the run layer loads every registry

    mset = config.merge
    for mode, metric in mset.qp_runs():
        start = mset.run_settings(mode, metric).get("start")
        spec = {"name": start} if isinstance(start, str) else dict(start or {})
        if spec.get("name") != "auto":
            continue
        folds = parse_auto_params(spec.get("params") or {}, f"run {mode}:{metric}: start").folds
        batches = too_few_batches(folds, config.calibration_texts, mset.calibration_batch_size)
        if batches is not None:
            raise ValidationError(
                f"run {mode}:{metric}: start auto with {folds} folds needs {MIN_FOLD_BATCHES} or more calibration "
                f"batches per domain, but calibration_texts {config.calibration_texts} in batches of "
                f"{mset.calibration_batch_size} make {batches}; raise calibration_texts to at least "
                f"{MIN_FOLD_BATCHES * mset.calibration_batch_size} or lower calibration_batch_size")


def _check_tuning_folds(config: LmConfig) -> None:
    """RegMean's alpha chosen by cross-validation over each domain's calibration texts needs two or more
    of them (something to fit on, something to score), checked before any work."""
    mset = config.merge
    if (any(b in FITTED_BASELINES for b in mset.baselines) and len(mset.regmean_alphas) > 1
            and mset.tuning_folds > 1 and config.calibration_texts < 2):
        raise ValidationError(
            f"RegMean's alpha is chosen among {list(mset.regmean_alphas)} by {mset.tuning_folds}-fold cross-validation "
            f"over each domain's calibration texts, which needs two or more (calibration_texts is "
            f"{config.calibration_texts}); raise calibration_texts, give one alpha, or set tuning_folds=1 (scored on "
            f"the texts each RegMean was fitted to)")


def _finetune_record(folder: Path, res: Any) -> dict[str, Any]:
    """What the results say of one fine-tune (a :class:`FinetuneResult`), with why it ran the whole model
    at every step where its record says so (``full_passes``; records before stop 76 do not)."""
    try:
        full_passes = json.loads((folder / FINETUNE_RECORD).read_text()).get("full_passes")
    except (OSError, ValueError, AttributeError):
        full_passes = None
    return {"folder": str(folder), "cached": res.cached, "seconds": res.seconds,
            "loss_first": float(np.mean(res.losses[:5])), "loss_last": float(np.mean(res.losses[-5:])),
            "steps": len(res.losses), "key": res.key, "full_passes": full_passes}


def _run(config: LmConfig, out_dir: Path, work: Path, cache_dir: Path, seed: int, domain_names: Sequence[str] | None,
         corpora: Sequence[Corpus] | None, base_folder: Any, device: str, device_note: str | None, quick: bool,
         progress: bool) -> dict[str, Any]:
    import torch  # optional heavy dependency (experiment extra)
    from transformers import AutoModelForCausalLM

    say = lambda msg: _log(progress, msg)  # noqa: E731
    t_start, cpu_start = time.perf_counter(), time.process_time()
    torch.manual_seed(seed)
    timings: dict[str, float] = {}
    notes = [device_note] if device_note else []

    # 1. texts
    t = time.perf_counter()
    if corpora is None:
        corpora = load_domains(domain_names or DEFAULT_DOMAINS)
    splits = split_domains(corpora, config, seed)
    names = [s.name for s in splits]
    if config.multitask and MULTITASK in names:
        raise ValidationError(f"a domain is named {MULTITASK!r}, the name of the reference fine-tuned on every "
                              f"domain; rename the domain, or pass --no-multitask (LmConfig.multitask=False)")
    _check_auto_folds(config)  # before the fine-tunes (it stopped the run after them and the baselines)
    _check_tuning_folds(config)
    timings["data"] = time.perf_counter() - t
    say(f"domains {', '.join(names)}: train/calibration/test = {config.train_texts}/{config.calibration_texts}/"
        f"{config.test_texts} texts each")

    # 2. base and fine-tunes
    t = time.perf_counter()
    base = Path(base_folder).expanduser() if base_folder is not None else smollm2_folder(cache_dir, log=say)
    layout = block_layout(base)
    tokenizer = load_tokenizer_of(base)
    check_vocabulary(base, tokenizer)
    config = _within_context(config, base, notes, say)
    if config.finetune_blocks > layout.blocks:
        raise ValidationError(f"finetune_blocks {config.finetune_blocks} exceeds the model's {layout.blocks} blocks")
    patterns = layout.patterns(config.finetune_modules, config.finetune_blocks)
    settings = FinetuneSettings(train_patterns=patterns,
                                steps=config.finetune_steps, lr=config.finetune_lr, batch_size=config.finetune_batch,
                                max_length=config.finetune_max_length, seed=seed)
    finetunes: list[tuple[str, Path]] = []
    ft_records: dict[str, Any] = {}
    trained: tuple[str, ...] = ()
    def cached_finetune(name: str, texts: Sequence[str], s_settings: FinetuneSettings) -> tuple[Path, Any]:
        key = finetune_key(base, texts, s_settings)
        folder = cache_dir / "lm-finetunes" / f"{base.name}-{name}-{key[:12]}"
        res = finetune_causal_lm(base, texts, folder, s_settings, device=device, progress=progress, log=say)
        ft_records[name] = _finetune_record(folder, res)
        return folder, res

    for i, s in enumerate(splits):
        folder, res = cached_finetune(s.name, s.train, replace(settings, seed=seed * 1000 + i))
        finetunes.append((s.name, folder))
        trained = res.trained
    if config.multitask:  # one model by the same recipe on every domain's train texts, each text once
        cached_finetune(MULTITASK, [x for s in splits for x in s.train],
                        replace(settings, steps=config.finetune_steps * len(splits), seed=seed * 1000 + MULTITASK_SEED))
    timings["finetune"] = time.perf_counter() - t
    linear_layers = [n[: -len(".weight")] for n in trained if n.endswith(".weight")]

    # 3. evaluators (held-out test texts, calibration texts) on the base model
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).to(device).eval()
    first = split_block(model, trained)
    if first is None:
        raise ValidationError("the fine-tuned tensors are not all inside decoder blocks; this experiment "
                              "evaluates models that differ from the base only in their upper blocks")
    kw = {"max_length": config.eval_max_length, "batch_size": config.eval_batch, "device": device,
          "names": file_names(model)}
    test_eval = UpperEvaluator(model, tokenizer, first, {s.name: s.test for s in splits}, **kw)
    calib_eval = UpperEvaluator(model, tokenizer, first, {s.name: s.calibration for s in splits},
                                base_state=test_eval.base_state, **kw)
    references = {name: test_eval.tensors_of(read_folder_state(folder)) for name, folder in finetunes}
    timings["evaluation_setup"] = time.perf_counter() - t
    notes.extend(n for n in (test_eval.note, calib_eval.note) if n and n not in notes)

    # calibration prompt files for the run layer
    cal_files = []
    for s in splits:
        f = work / f"calibration_{s.name}.jsonl"
        f.write_text("".join(json.dumps({"text": x}) + "\n" for x in s.calibration))
        cal_files.append(f)
    ctx = _Context(base, finetunes, cal_files, linear_layers, work, device, seed, config.merge,
                   test_eval.tensors_of, say, progress)
    mset = config.merge
    models: dict[str, ModelTensors | None] = {"base": None}
    models.update({f"finetune:{name}": references[name] for name, _ in finetunes})
    records: dict[str, dict[str, Any]] = {"base": {"kind": "reference"}}
    records.update({f"finetune:{name}": {"kind": "reference"} for name, _ in finetunes})
    if config.multitask:
        models[MULTITASK] = test_eval.tensors_of(read_folder_state(Path(ft_records[MULTITASK]["folder"])))
        records[MULTITASK] = {"kind": "reference"}

    # 4. task arithmetic: the scaling chosen by the mean calibration cross-entropy
    t = time.perf_counter()
    tunings: dict[str, dict[str, Any]] = {}
    tuned_calib: dict[str, dict[str, Any]] = {}  # a tuned baseline's calibration scores (its choice's)

    def tune(label: str, grid: Sequence[float], params_of: Any) -> float:
        """A baseline's setting chosen among ``grid`` by the mean calibration cross-entropy (ties: the
        smaller); its model and record are the chosen setting's. A baseline fitted to the calibration
        texts (RegMean) is scored on texts its fit did not see (``mset.tuning_folds``-fold) and then
        fitted on all of them at the chosen setting; a data-free one (task arithmetic) on every text."""
        key, setting, plural = TUNED_BASELINES[label]
        folds = mset.tuning_folds if label in FITTED_BASELINES and len(grid) > 1 else 1  # (one value: no choice)
        if folds > 1:
            ce, held = cross_validated_ce(label, grid, params_of, folds)
            best = min(grid, key=lambda v: (ce[v], v))
            merged, rec = run_layer_merge(ctx, label, {"name": label, "params": params_of(best)}, linear_layers)
            scores = calib_eval.evaluate({f"{best:g}": merged}, references)
            criterion = (f"mean cross-entropy of held-out calibration texts, {len(held)}-fold (each fold of "
                         f"every domain's calibration texts scored by the fit on the others)")
        else:
            tried, recs = {}, {}
            for value in grid:
                tried[value], recs[value] = run_layer_merge(ctx, f"{label}_{value:g}",
                                                            {"name": label, "params": params_of(value)}, linear_layers)
            scores = calib_eval.evaluate({f"{v:g}": m for v, m in tried.items()}, references)
            ce = {v: float(np.mean([scores[f"{v:g}"][d]["ce"] for d in names])) for v in grid}
            best = min(grid, key=lambda v: (ce[v], v))
            merged, rec = tried[best], recs[best]
            criterion, held = "mean calibration cross-entropy", None
        models[label] = merged
        records[label] = {"kind": "baseline", **rec, setting: best}
        tuned_calib[label] = scores[f"{best:g}"]
        tunings[key] = {plural: {f"{v:g}": ce[v] for v in grid}, "chosen": best, "criterion": criterion,
                        **({"held_out_texts": held} if held is not None else {})}
        say(f"{label.replace('_', ' ')} {setting} {best:g} ({criterion}: "
            + ", ".join(f"{v:g}: {ce[v]:.4f}" for v in grid) + ")")
        return best

    def cross_validated_ce(label: str, grid: Sequence[float], params_of: Any,
                           folds: int) -> tuple[dict[float, float], list[dict[str, int]]]:
        """Each setting's mean over domains of the cross-entropy per token of every calibration text,
        each text scored by the merge fitted on the other folds of the calibration texts (contiguous
        folds per domain, the fit's prompt files written to the work folder); and per fold the
        held-out texts of each domain."""
        k = min(folds, config.calibration_texts)  # fewer texts than folds: a fold per text (two or more: checked)
        per_domain = [contiguous_folds(len(s.calibration), k) for s in splits]
        nll = {v: {d: 0.0 for d in names} for v in grid}
        predicted = {v: {d: 0 for d in names} for v in grid}
        held_counts = []
        for i in range(k):
            files = []
            for s, parts in zip(splits, per_domain):
                f = work / f"calibration_{s.name}_fold{i}.jsonl"
                f.write_text("".join(json.dumps({"text": s.calibration[j]}) + "\n" for j in parts[i][0]))
                files.append(f)
            held = {s.name: [s.calibration[j] for j in parts[i][1]] for s, parts in zip(splits, per_domain)}
            held_counts.append({d: len(t) for d, t in held.items()})
            fold_eval = UpperEvaluator(model, tokenizer, first, held, base_state=test_eval.base_state, **kw)
            fold_ctx = replace(ctx, calibration_files=files)
            tried = {f"{v:g}": run_layer_merge(fold_ctx, f"{label}_{v:g} (fold {i + 1} of {k})",
                                               {"name": label, "params": params_of(v)}, linear_layers)[0]
                     for v in grid}
            scores = fold_eval.evaluate(tried, references, per_text=True)
            for v in grid:
                for d in names:
                    nll[v][d] += float(np.sum(scores[f"{v:g}"][d]["text_nll"]))
                    predicted[v][d] += int(np.sum(scores[f"{v:g}"][d]["text_predicted"]))
        ce = {v: float(np.mean([nll[v][d] / max(predicted[v][d], 1) for d in names])) for v in grid}
        return ce, held_counts

    best_scaling = tune("task_arithmetic", mset.ta_scalings, lambda s: {"scaling": float(s)})
    timings["task_arithmetic_tuning"] = time.perf_counter() - t

    # 5. baselines through the run layer (RegMean's alpha chosen as task arithmetic's scaling)
    t = time.perf_counter()
    params = baseline_params(mset, seed)
    for label in mset.baselines:
        if label in FITTED_BASELINES:  # RegMean's alpha chosen (one alpha: the grid of one, as in the text experiment)
            alpha = tune(label, mset.regmean_alphas, lambda a: {"alpha": float(a)})
            params[label] = {"alpha": float(alpha)}
            continue
        method = {"name": label, **({"params": params[label]} if params[label] else {})}
        models[label], rec = run_layer_merge(ctx, label, method, linear_layers)
        records[label] = {"kind": "baseline", **rec}
    timings["baselines"] = time.perf_counter() - t

    # 6. QP runs (mode x metric)
    t = time.perf_counter()
    for mode, metric in mset.qp_runs():
        label = f"qp_{mode}_{metric}"
        extra = mset.run_settings(mode, metric)
        selector = extra.pop("layers", "last" if mode == "single" else "all")
        start = extra.pop("start", None)
        method: dict[str, Any] = {"name": "qp", "mode": mode, "solver": mset.solver, **extra}
        entry = MERGE_MODES[mode]  # what the mode entry declares, not its name (a user's mode runs alike)
        if start is not None:
            method["start"] = {"name": start} if isinstance(start, str) else dict(start)
        elif entry.uses_start and entry.start_required:  # (hybrid) the tuned task arithmetic
            method["start"] = {"name": "task_arithmetic", "params": {"scaling": float(best_scaling)}}
        if isinstance(entry, TrustRegionMode):
            method["mode_options"] = {**dict(mset.trust_region), **dict(extra.get("mode_options", {}))}
        if _takes_option(entry, "compare_sequential") and "compare_sequential" not in method:
            # (joint) the sequential QP runs on its own
            method["mode_options"] = {"compare_sequential": False, **dict(method.get("mode_options", {}))}
        layers = select_layers(linear_layers, selector)
        models[label], rec = run_layer_merge(ctx, label, method, layers, metric)
        records[label] = {"kind": "qp", "mode": mode, **rec}
    timings["qp"] = time.perf_counter() - t

    # 6b. baselines as feasible points of the trust region's QPs; the output-space merge
    t = time.perf_counter()
    for label, method, layers, metric, kind in _extra_runs(mset, best_scaling, seed, linear_layers,
                                                               params["regmean"]["alpha"]):
        try:  # reference rows: one this model cannot run is said, and the experiment goes on
            models[label], rec = run_layer_merge(ctx, label, method, layers, metric)
        except ValidationError as exc:
            notes.append(f"{label} was not run: {exc}")
            say(f"{label} was not run: {exc}")
            continue
        records[label] = {"kind": kind, **({"mode": method["mode"]} if kind == "qp" else {}), **rec}
    timings["extra"] = time.perf_counter() - t

    # 7. mergekit on the same folders
    t = time.perf_counter()
    command = mergekit_available()
    if command is None:
        notes.append("mergekit is not importable: its methods were not run")
    else:
        try:  # mergekit may not know this architecture: said, and the experiment goes on
            ran = run_mergekit(ctx, command, mset.mergekit, best_scaling)
        except ValidationError as exc:
            ran = {}
            notes.append(f"mergekit's methods were not run: {exc}")
            say(f"mergekit's methods were not run: {str(exc)[:300]}")
        for method_name, (tensors, rec) in ran.items():
            models[f"mergekit_{method_name}"] = tensors
            records[f"mergekit_{method_name}"] = {"kind": "mergekit", **rec}
    timings["mergekit"] = time.perf_counter() - t

    # 8. evaluation of every model
    t = time.perf_counter()
    # a model whose tensors equal an earlier one's to float rounding (mergekit's linear merge is the
    # soup, its task arithmetic ours) takes that one's numbers instead of a second evaluation
    unique: dict[str, ModelTensors | None] = {}
    for name, tensors in models.items():
        match = next(((other, diff) for other, o in unique.items() if (diff := same_model(tensors, o)) is not None),
                     None)
        if match is None:
            unique[name] = tensors
        else:
            records[name]["evaluated_as"] = {"model": match[0], "max_relative_difference": match[1]}
    say(f"evaluating {len(unique)} models on {len(names)} domains"
        + (f" ({len(models) - len(unique)} equal to another to float rounding)" if len(unique) < len(models) else ""))
    test = test_eval.evaluate(unique, references, per_text=True)
    # every test text's NLL and predicted tokens, per model and domain, in one order: the goal's
    # paired bootstrap intervals (lm_claims, uncertainty)
    per_text = {name: {d: {"nll": test[name][d].pop("text_nll"), "predicted": test[name][d].pop("text_predicted")}
                       for d in test[name]} for name in test}
    # a tuned baseline was scored on the calibration texts already (its setting's choice)
    calib = calib_eval.evaluate({k: v for k, v in unique.items() if k not in tuned_calib}, references)
    calib.update({k: v for k, v in tuned_calib.items() if k in unique})
    for name in models:
        if name not in unique:
            twin = records[name]["evaluated_as"]["model"]
            test[name], calib[name], per_text[name] = test[twin], calib[twin], per_text[twin]
    timings["evaluation"] = time.perf_counter() - t
    for name, tensors in models.items():
        records[name]["changed_outside_upper_blocks"] = sorted(tensors.other) if tensors is not None else []
        records[name]["test"] = test[name]
        records[name]["calibration"] = calib[name]
        records[name]["mean_test"] = {k: float(np.mean([test[name][d][k] for d in names])) for k in ("ce", "mse", "kl")}
        records[name]["mean_calibration_ce"] = float(np.mean([calib[name][d]["ce"] for d in names]))
    timings["total"] = time.perf_counter() - t_start
    timings["total_cpu"] = time.process_time() - cpu_start  # this process's CPU seconds, all threads

    results: dict[str, Any] = {
        "experiment": "lm",
        "mode": "quick" if quick else "full",
        "seed": seed,
        "config": asdict(config),
        "base": str(base),
        "device": device,
        "domains": {s.name: {"train": len(s.train), "calibration": len(s.calibration), "test": len(s.test)}
                    for s in splits},
        "finetuned_tensors": list(trained),
        "merged_layers": linear_layers,
        "finetunes": ft_records,
        **tunings,
        "methods": records,
        "per_text_test": per_text,
        "notes": notes,
        "timings": timings,
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "threads": torch.get_num_threads(), "machine": platform.machine()},
    }
    results["recommended"] = recommended_merge(results)
    results["goal"] = lm_goal(results)
    results["claims"] = evaluate_lm_claims(results)
    return results


__all__ = ["BASELINES", "DEFAULT_CACHE", "DEFAULT_DOMAINS", "DOMAINS", "DomainSplit", "LmConfig", "LmMergeSettings",
           "MERGEKIT_METHODS", "MODULE_OUTPUTS", "PeakRss", "RECOMMENDED_RUN", "check_base_folder", "default_cache",
           "load_domains", "merge_config", "mergekit_yaml", "register_domain", "run_lm_experiment", "select_layers", "split_domains",
           "with_overrides"]
