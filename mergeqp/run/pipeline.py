"""``mergeqp merge``: run a validated config end to end and write the merged Hugging Face folder.

Order of work (each step only after the previous one succeeded):

1. :func:`~mergeqp.run.plan.build_plan`: every check that needs no weights (paths, architectures,
   tokenizers, layer patterns, method / constraint / solver names); the output folder is checked
   too (it must not overlap an input, and must be empty unless ``overwrite``).
2. Baseline methods: the selected tensors are merged with :func:`mergeqp.merge_state_dicts`, read
   lazily from the checkpoints in chunks of ``chunk_bytes``. Methods that declare calibration
   statistics (Fisher, RegMean) first get them from each fine-tuned model on its calibration
   prompts (:mod:`mergeqp.merge.calibrated`); when
   every model has prompts (and ``evaluate`` is on) each fine-tuned model also gives its
   targets, and the base and the merged model are evaluated with the QP's metrics. A
   tensor-wise baseline without prompts loads no model.
3. QP methods: prompts are tokenised with the base tokenizer; each fine-tuned model is loaded in
   turn (one at a time) to compute its task's teacher-forced targets on the calibration and
   held-out prompts, then freed; the base model is loaded once as the working model; the residuals
   ``delta_k`` of a layer are read lazily from the checkpoints when the layer is solved.
4. The merged folder is written by streaming: merged tensors replace the base's, every other tensor
   is copied from the base checkpoint unchanged (same dtype) -- so the output differs from the base
   exactly at the merged layers. Config and tokenizer files are copied.
5. ``report.json`` and ``report.md`` (per layer: objective before / after, certificate, energy
   fraction, seconds; held-out teacher-forced MSE per task for the base and the merged model),
   from the typed :class:`~mergeqp.run.report.MergeReport`.

The merge mode (:mod:`mergeqp.merge.modes`) decides how the selected layers are solved, what
the plan says about it and the extra report fields; the parametrisation entry how each layer's
atoms are built. A layer whose certificate is missing or failed is never counted as certified.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .schema import MergeConfig, is_device_name, qp_candidate_block
from ..errors import Interrupted, MergeMethodError, MergeQPError, ValidationError, first_line, listing, named_failure
from ..plugins import imported_modules
from ..io.calibration import (
    is_tensor_file,
    load_tokenizer,
    read_labelled_prompts,
    read_prompts,
    read_tensor_inputs,
    split_holdout,
    tensor_batches,
    tensor_labels,
    tokenize_batches,
)
from ..io import verified
from ..io.checkpoint import Checkpoint, read_config
from ..io.atomic import check_free_space
from ..io.distributed import agree_everywhere, agree_on, current_group
from ..io.lazy_model import LazyModel, lazy_parameters, lazy_summary, load_lazy_model
from ..io.progress import library_bars
from ..io.memory import available_memory_bytes, check_site_memory, estimate_site_memory, memory_limit
from ..io.writer import WrittenModel, check_output_folder, check_tensor_finite, parse_size, save_hf_folder
from ..lm import (
    OutputSpec,
    TargetBatch,
    TargetsNeed,
    classification_metrics,
    head_log_likelihood,
    squared_error,
    teacher_forced_metrics,
    teacher_forced_targets,
)
from ..merge.baseline_residuals import statistics_baselines
from ..merge.calibrated import StatisticsCollector, needs_statistics, run_params, statistics_of
from ..merge.firstorder import TaskTargets, check_first_design, largest_design_batch
from ..merge.modes import get_merge_mode, run_mode
from ..merge.multilayer import HeldOutStart, MergeContext, WeightSource, calibration_objective
from ..merge.trust_region import holdout_count, no_holdout_error, split_tasks
from ..merge.outputbasis import check_jacobian_size
from ..merge.registry import merge_state_dicts
from ..merge.flags import heldout_regression_notes, zero_residual_notes
from ..merge.report import jsonable, report_files
from ..merge.sites import checkpoint_names, read_augmented, site_module, stored_tensors
from ..stats.parametrisation import get_parametrisation
from ..stats.prefix import frozen_prefix
from .architectures import architecture_class, every_block, lower_blocks, model_config
from .fused import fused_view, remember_source
from .checkpoints import ENCODER_DECODER_INPUTS, changed_keys, same_stored_value
from .plan import (
    MergePlan,
    build_plan,
    changed_outside,
    check_config_object,
    evaluates_baseline,
    keeps_base_outside,
    start_outside,
    statistics_method,
    without_unchanged,
)
from .auto import (
    QP_CANDIDATE,
    AutoStartParams,
    Candidate,
    CandidateSkipped,
    CandidateScore,
    StartSelection,
    batch_splits,
    candidate_where,
    held_out_fit,
    is_auto_start,
    parse_auto_params,
    select_start,
    statistics_candidates,
)
from .model_method import MethodOutcome, ModelMethod
from .model_methods import entry_call, model_method_of, parse_candidate, start_method, start_statistics
from .report import REPORT_KEYS, BaselineSummary, Evaluation, MergeReport, ModelEvaluation, WrittenOutput, uncertified
from .settings import DEFAULT_CHUNK_BYTES, qp_settings


#: the output folder a report names when ``run_merge(..., write=False)`` wrote nothing
IN_MEMORY = "(in memory)"


@dataclass(frozen=True)
class MergeResult:
    """What :func:`run_merge` produced: the plan, the typed ``summary`` (:class:`MergeReport`;
    :attr:`report` is its ``report.json`` mapping), the output folder and, for QP methods and
    evaluated baselines, the merged in-memory model."""

    plan: MergePlan
    summary: MergeReport
    out_dir: Path
    model: Any = None
    #: with ``run_merge(..., write=False)``: every tensor the merge computed (checkpoint name ->
    #: tensor, as it would have been written; the others are the base's); ``None`` when a folder was written
    tensors: dict[str, Any] | None = None

    @property
    def report(self) -> dict[str, Any]:
        """The ``report.json`` mapping (:meth:`MergeReport.to_json`)."""
        return self.summary.to_json()


def resolve_device(name: str) -> tuple[str, str | None]:
    """``(device, note)``: ``auto`` -> CUDA when available; ``cuda`` without CUDA -> CPU with a note;
    another name (the Python APIs take any string) is an error naming the valid ones."""
    import torch  # optional heavy dependency: the merge runs on torch

    if not is_device_name(name):
        raise ValidationError(f"unknown device {name!r}; valid: cpu, cuda, auto (or cuda:N)")
    if name == "auto":
        return ("cuda" if torch.cuda.is_available() else "cpu"), None
    if name.startswith("cuda") and not torch.cuda.is_available():
        return "cpu", f"device {name!r} requested but CUDA is not available: ran on CPU"
    return name, None


def load_model(ckpt: Checkpoint, base_folder: Path, dtype: Any, device: str) -> Any:
    """A model in eval mode from a Hugging Face folder, or the base architecture filled from a
    bare safetensors / torch state dict (tied weights may be absent from the file)."""
    cls = architecture_class((ckpt.config if ckpt.is_hf_folder else None) or _read_cfg(base_folder), str(base_folder))
    try:
        if ckpt.is_hf_folder:
            model = _from_pretrained(cls, ckpt.path, dtype)
        else:
            model = _from_pretrained(cls, base_folder, dtype)
            live = live_names(model)
            state = {live.get(k, k): v.to(dtype) if v.is_floating_point() else v
                     for k, v in ckpt.state_dict().items()}
            missing, unexpected = model.load_state_dict(state, strict=False)
            if unexpected:
                raise ValidationError(f"{ckpt.path}: tensors not in the architecture: {unexpected[:5]}")
            # tensors absent from the file must be tied to ones present (e.g. lm_head = embeddings)
            ident = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}
            present = {ident[k] for k in state if k in ident}
            untied = [k for k in missing if k in ident and ident[k] not in present]
            if untied:
                raise ValidationError(f"{ckpt.path} lacks tensors {untied[:5]} of the architecture")
    except ValidationError:
        raise
    except Exception as exc:  # noqa: BLE001 - a broken checkpoint: report which
        raise ValidationError(f"cannot load model {ckpt.path}: {type(exc).__name__}: {exc}") from None
    def finite() -> None:  # NaN / inf named before any statistics
        for name, tensor in model.state_dict().items():
            check_tensor_finite(name, tensor, f"checkpoint {ckpt.path}")

    verified.once(("finite model", verified.signature(ckpt.path),  # once per process for unchanged files
                   None if ckpt.is_hf_folder else verified.signature(base_folder), str(dtype)), finite)
    model.to(device)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    remember_source(model, ckpt)
    return model


def load_lazy(ckpt: Checkpoint, base_folder: Path, dtype: Any, device: str,
              blocks: Callable[[Any], Sequence[Any]]) -> LazyModel:
    """A model like :func:`load_model`'s whose blocks ``blocks(model)`` stay on disk until they
    run (:mod:`mergeqp.io.lazy_model`): only the rest is read now."""
    config_dict = (ckpt.config if ckpt.is_hf_folder else None) or _read_cfg(base_folder)
    folder = ckpt.path if ckpt.is_hf_folder else base_folder
    cls = architecture_class(config_dict, str(folder))
    config = model_config(folder, config_dict)

    def build() -> Any:  # eager attention, as _from_pretrained
        make = cls.from_config if cls.__name__ == "AutoModel" else cls._from_config
        return _eager(lambda **kw: make(config, dtype=dtype, **kw))

    try:
        lazy = load_lazy_model(build, ckpt, checkpoint_names, dtype, device, blocks)
    except ValidationError:
        raise
    except Exception as exc:  # noqa: BLE001 - a broken checkpoint: report which
        raise ValidationError(f"cannot load model {ckpt.path} lazily: {type(exc).__name__}: {exc}") from None
    for name, tensor in lazy.model.state_dict().items():  # NaN / inf of what is resident, named
        if not tensor.is_meta:
            check_tensor_finite(name, tensor, f"checkpoint {ckpt.path}")
    return lazy


def live_names(model: Any) -> dict[str, str]:
    """Checkpoint name -> live state-dict name (the inverse of ``sites.checkpoint_names``)."""
    return {stored: live for live, stored in checkpoint_names(model).items()}


def _eager(make: Callable[..., Any]) -> Any:
    """``make(attn_implementation="eager")`` where the model supports choosing its attention, else
    ``make()``: the fused SDPA kernels have no forward-mode derivative, which the statistics need
    (``torch.func.jvp``)."""
    try:
        return make(attn_implementation="eager")
    except (ValueError, TypeError) as exc:
        if "attn_implementation" not in str(exc) and "eager" not in str(exc):
            raise
        return make()


def _from_pretrained(cls: Any, folder: Path, dtype: Any) -> Any:
    """``from_pretrained`` with eager attention where the model supports choosing it (:func:`_eager`)."""
    return _eager(lambda **kw: cls.from_pretrained(str(folder), dtype=dtype, **kw))


def _read_cfg(folder: Path) -> dict[str, Any] | None:
    return read_config(folder)


# ---------------------------------------------------------------------- calibration data
@dataclass(frozen=True)
class TaskData:
    name: str
    weight: float
    calibration: list[TargetBatch]
    heldout: list[TargetBatch]
    #: the task's classifier head (:class:`mergeqp.lm.ClassifierHead`; ``None`` unless the config names one)
    head: Any = None


def _batches(cfg: MergeConfig, index: int, tokenizer: Any, max_length: int) -> tuple[list[Any], list[Any]]:
    """Calibration and held-out batches of model ``index``; prompts truncated to ``max_length``
    tokens (the plan's: at most the model's context)."""
    entry = cfg.models[index]
    src = entry.prompts()
    assert src is not None
    path = cfg.resolve(src.path)
    holdout = cfg.holdout_for(index) if cfg.evaluate else 0
    size = cfg.calibration.batch_size
    labelled = entry.head is not None and src.label_field is not None  # a classification objective
    if is_tensor_file(path):
        data = read_tensor_inputs(path)
        labels = tensor_labels(data, src.label_field, str(path)) if labelled else None
        n = int(next(iter(data.values())).shape[0])
        if src.max_prompts is not None:
            n = min(n, src.max_prompts)
        calib, held = split_holdout(list(range(n)), holdout, cfg.seed + index)
        return tensor_batches(data, calib, size, labels), tensor_batches(data, held, size, labels)
    L = max_length
    if labelled:
        texts, labels = read_labelled_prompts(path, src.field, src.label_field, src.max_prompts)
        calib, held = split_holdout(list(zip(texts, labels)), holdout, cfg.seed + index)

        def tokenized(pairs: list[tuple[str, int]]) -> list[Any]:
            return tokenize_batches(tokenizer, [x for x, _ in pairs], L, size, [y for _, y in pairs])

        return tokenized(calib), (tokenized(held) if held else [])
    prompts = read_prompts(path, src.field, src.max_prompts)
    calib, held = split_holdout(prompts, holdout, cfg.seed + index)
    return tokenize_batches(tokenizer, calib, L, size), (tokenize_batches(tokenizer, held, L, size) if held else [])


def _collect_if_held(alive: weakref.ref) -> None:
    """Collect a dropped model that a reference cycle keeps alive (``alive()`` not ``None``); not
    unconditionally: a full collection cost ~0.3 s in a large process."""
    if alive() is not None:
        gc.collect()


def _out_of_memory(exc: BaseException) -> bool:
    """A failed allocation (CPU or device), not a model rejecting its inputs."""
    import torch

    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("tried to allocate" in text or "DefaultCPUAllocator" in text
                                              or "out of memory" in text)


#: memory kept free beside the targets (the model's activations on a batch, the process's rest)
TARGETS_MARGIN_BYTES = 256 * 2**20


def _targets_memory_check(name: str, part: str, cfg: MergeConfig, plan: MergePlan) -> Callable[[TargetsNeed], None]:
    """A ``check`` for :func:`teacher_forced_targets`: refuses (exit 2, before they are allocated)
    targets that do not fit in the memory this machine has available (``MemAvailable``), instead
    of the process being killed by the operating system with no message."""
    def check(need: TargetsNeed) -> None:
        free = available_memory_bytes()
        nbytes = need.nbytes
        if free is None or nbytes + TARGETS_MARGIN_BYTES <= free:
            return
        out = cfg.output
        restrict = ("output.restrict: topk or projection with a small k (e.g. 64)" if out.restrict == "none"
                    else f"a smaller output.k (now {out.k})")
        fewer = "" if need.kept_as_hidden else f"compare fewer outputs ({restrict}), or "
        raise ValidationError(
            f"models[{name}]: the fine-tune's targets on its {part} prompts need about {nbytes / 1e9:.3g} GB more "
            f"({need.what}) and {TARGETS_MARGIN_BYTES / 1e9:.2g} GB beside them for the model's activations, more than "
            f"the {free / 1e9:.3g} GB of memory available; {fewer}lower calibration.max_length ({plan.max_length}) "
            f"or the number of prompts (models[{name}].calibration.max_prompts)")
    return check


def prepare_tasks(plan: MergePlan, spec: OutputSpec, eval_spec: OutputSpec, dtype: Any, device: str,
                  log: Callable[[str], None], *, targets: bool = True,
                  visit: Callable[[int, str, Any, list[Any]], None] | None = None,
                  lazy: list[dict[str, Any]] | None = None, notes: list[str] | None = None) -> list[TaskData]:
    """Batches and teacher-forced targets per task; each fine-tuned model is loaded, used, freed.

    ``targets=False`` skips the targets (the tasks then hold no batches); ``visit(index, name,
    model, calibration_batches)`` is called while each fine-tuned model is loaded (Fisher /
    RegMean statistics), so that no model is loaded twice. ``lazy``: each model is loaded with
    every block on disk until it runs (:func:`load_lazy`) and its :func:`lazy_summary` appended to
    this list (``None``: loaded whole). ``notes``: the report's notes (``calibration.balance``
    adds the weights it gave)."""
    cfg = plan.config
    tok = load_tokenizer(plan.tokenizer_folder) if plan.tokenizer_folder else None
    base_folder = cfg.resolve(cfg.base)
    tasks: list[TaskData] = []
    counts: list[int] = []
    for i, (name, entry, ck) in enumerate(zip(cfg.model_names(), cfg.models, plan.finetuned)):
        try:
            calib, held = _batches(cfg, i, tok, plan.max_length)
        except ValidationError as exc:
            src = entry.prompts()
            raise ValidationError(f"models[{name}].calibration" + (f" ({src.path})" if src is not None else "")
                                  + f": {exc}") from None
        t = time.perf_counter()
        loaded = load_lazy(ck, base_folder, dtype, device, every_block) if lazy is not None else None
        model = loaded.model if loaded is not None else load_model(ck, base_folder, dtype, device)
        head = plan.heads[i] if plan.heads else None
        try:
            calib_targets = (teacher_forced_targets(model, calib, spec, device, head,
                                                    check=_targets_memory_check(name, "calibration", cfg, plan))
                             if targets else [])
            held_targets = (teacher_forced_targets(model, held, eval_spec, device,
                                                   check=_targets_memory_check(name, "held-out", cfg, plan))
                            if held and targets else [])
            if visit is not None:
                visit(i, name, model, calib)
        except MergeQPError:
            raise
        except Exception as exc:  # the model rejects these inputs: one message, no traceback
            first = first_line(exc)
            if _out_of_memory(exc):
                raise ValidationError(
                    f"models[{name}]: out of memory running the model on its calibration inputs "
                    f"({type(exc).__name__}: {first}); lower calibration.batch_size ({cfg.calibration.batch_size}) "
                    f"or calibration.max_length ({plan.max_length})") from exc
            raise ValidationError(
                f"models[{name}]: the model failed on its calibration inputs ({type(exc).__name__}: "
                f"{first}); {_failure_hint(first, model, cfg.dtype)}"
            ) from exc
        if lazy is not None and loaded is not None:
            lazy.append(lazy_summary([loaded]))
        alive = weakref.ref(model)
        del model, loaded
        _collect_if_held(alive)  # before the next model loads
        if targets:
            log(f"targets for {name}: {len(calib)} calibration + {len(held)} held-out batches "
                f"({time.perf_counter() - t:.1f} s)")
        tasks.append(TaskData(name, entry.weight, calib_targets, held_targets, head))
        counts.append(sum(tb.count for tb in calib_targets))
    empty = [t.name for t, c in zip(tasks, counts) if c <= 0]
    if targets and empty and len(empty) == len(tasks):
        raise ValidationError(f"no task has a compared position in its calibration prompts (every prompt a single "
                              f"token under output.metric: {cfg.output.metric}?): the objective would be 0 and "
                              f"nothing fitted; give longer prompts")
    if targets and empty and cfg.calibration.balance != "tokens":  # (balance: tokens refuses them below)
        note = (f"task(s) {empty} have no compared position in their calibration prompts (every prompt a single "
                f"token under output.metric: {cfg.output.metric}?): they add nothing to the objective")
        log(note)
        if notes is not None:
            notes.append(note)
    if cfg.calibration.balance == "tokens" and targets:  # without targets there is no objective to weigh
        tasks = balanced(tasks, counts)
        note = ("calibration.balance tokens: each task's weight scaled by the mean over tasks of their compared "
                "positions over its own: " + ", ".join(f"{t.name} {c} positions -> weight {t.weight:.4g}"
                                                       for t, c in zip(tasks, counts)))
        log(note)
        if notes is not None:
            notes.append(note)
    return tasks


def balanced(tasks: Sequence[TaskData], counts: Sequence[int]) -> list[TaskData]:
    """``calibration.balance: tokens``: each task's weight times ``mean(counts) / count`` (``count``:
    its calibration targets' compared positions, :attr:`~mergeqp.lm.TargetBatch.count`: real tokens,
    labelled next tokens for ``cross_entropy``, samples for one output per sample), so that the
    objective weighs every task by its mean per position."""
    if any(c <= 0 for c in counts):
        empty = [t.name for t, c in zip(tasks, counts) if c <= 0]
        raise ValidationError(f"calibration.balance: tokens: task(s) {empty} have no compared position in their "
                              f"calibration prompts (every prompt a single token?)")
    mean = sum(counts) / len(counts)
    return [dataclasses.replace(t, weight=t.weight * mean / c) for t, c in zip(tasks, counts)]


def heldout_metrics(model: Any, tasks: Sequence[TaskData], eval_spec: OutputSpec, device: str,
                    next_token: bool = True) -> dict[str, Any]:
    """On each task's held-out prompts: ``heldout_mse`` (teacher-forced MSE per logit of real
    tokens) and, where the output is logits, ``heldout_kl`` (mean KL from the fine-tune's
    distribution per real token, nats) and, for a causal language model (``next_token``),
    ``heldout_cross_entropy`` (next-token, nats), each ``{task: value}``, whatever the objective's
    metric; for a task with a classifier head and labelled prompts, ``heldout_accuracy`` and
    ``heldout_cross_entropy`` of its head instead (per prompt, nats)."""
    measured = {t.name: teacher_forced_metrics(model, t.heldout, eval_spec, device) for t in tasks if t.heldout}
    out: dict[str, Any] = {"heldout_mse": {name: m.mse for name, m in measured.items()}}
    kinds = (("heldout_kl", "kl"), ("heldout_cross_entropy", "cross_entropy"))
    for key, attr in kinds if next_token else kinds[:1]:
        values = {name: getattr(m, attr) for name, m in measured.items() if getattr(m, attr) is not None}
        if values:
            out[key] = values
    classified = {t.name: classification_metrics(model, t.heldout, t.head, eval_spec, device)
                  for t in tasks if t.heldout and t.head is not None}
    classified = {name: v for name, v in classified.items() if v is not None}
    if classified:  # classifiers: each task's head on its held-out labelled prompts
        out["heldout_accuracy"] = {name: v[0] for name, v in classified.items()}
        out["heldout_cross_entropy"] = {name: v[1] for name, v in classified.items()}
    return out


def evaluate(model: Any, tasks: Sequence[TaskData], spec: OutputSpec, eval_spec: OutputSpec,
             device: str, next_token: bool = True) -> dict[str, Any]:
    """The report's evaluation of one model: the calibration objective ``sum_t w_t sum_j
    ||h_j - y_j||^2`` (compared output, as the QP's) and the held-out metrics per task
    (:func:`heldout_metrics`)."""
    objective = sum(t.weight * squared_error(model, t.calibration, spec, device)[0] for t in tasks)
    return {"calibration_objective": objective, **heldout_metrics(model, tasks, eval_spec, device, next_token)}


def statistics_collector(plan: MergePlan, name: str, params: dict[str, Any], keys: Sequence[str],
                         log: Callable[[str], None]) -> StatisticsCollector:
    """A :class:`~mergeqp.merge.calibrated.StatisticsCollector` of the method ``name`` (one that
    declares calibration statistics) for the checkpoint ``keys``."""
    cfg = plan.config
    heads = {}
    if plan.heads and any(h is not None for h in plan.heads):  # classifiers: their heads read the pooled output
        spec = OutputSpec(cfg.output.field, pool=cfg.output.pool)
        heads = {n: head_log_likelihood(h, spec) for n, h in zip(cfg.model_names(), plan.heads) if h is not None}
    return StatisticsCollector(name, params, plan.skeleton, keys, len(cfg.models), cfg.calibration.batch_size, log,
                               heads)


# ---------------------------------------------------------------------- baselines
def baseline_merge(plan: MergePlan, name: str, params: dict[str, Any], keys: Sequence[str],
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES, unchanged: list[bool] | None = None) -> dict[str, Any]:
    """``{key: merged tensor}`` for ``keys`` with :func:`mergeqp.merge_state_dicts`, read lazily in
    chunks of at most ``chunk_bytes`` (of base tensors), in the dtype they will be written in
    (:meth:`~mergeqp.run.plan.MergePlan.written_dtype`, else the base's). Non-floating tensors are
    copied from the base. ``unchanged`` (one flag per fine-tune, true on entry): cleared for each
    fine-tune that holds some floating tensor of ``keys`` other than the base's."""
    out: dict[str, Any] = {}
    chunk: list[str] = []
    size = 0

    def flush() -> None:
        nonlocal chunk, size
        if not chunk:
            return
        base_sd = plan.base.get_many(chunk)
        floats = [k for k in chunk if base_sd[k].is_floating_point()]
        for k in chunk:
            if k not in floats:
                out[k] = base_sd[k]
        if floats:
            ft_sds = [ft.get_many(floats) for ft in plan.finetuned]

            @functools.cache
            def holds_base(i: int, k: str) -> bool:  # (each pair compared once for both uses below)
                return same_stored_value(base_sd[k], ft_sds[i][k])

            if unchanged is not None:
                for i in range(len(ft_sds)):
                    unchanged[i] = unchanged[i] and all(holds_base(i, k) for k in floats)
            # a tensor every fine-tune holds as the base's, saved in another dtype, is the base's: merging
            # the rounding would put noise into the start (and unfold the head: a review's 9 -> 19 s)
            kept = [k for k in floats if any(sd[k].dtype != base_sd[k].dtype for sd in ft_sds)
                    and all(holds_base(i, k) for i in range(len(ft_sds)))]
            for k in kept:
                out[k] = base_sd[k]
            floats = [k for k in floats if k not in kept]
        if floats:
            merged = merge_state_dicts(name, {k: base_sd[k] for k in floats}, [{k: sd[k] for k in floats} for sd in ft_sds],
                                       out_dtype=plan.written_dtype(), **{"progress": False, **params})
            for k in floats:
                if k not in merged:
                    raise ValidationError(f"baseline {name!r} returned no tensor {k!r}")
                out[k] = merged[k].to(plan.written_dtype() or base_sd[k].dtype)
        chunk, size = [], 0

    for key in keys:
        nbytes = plan.base.info(key).nbytes
        if chunk and size + nbytes > chunk_bytes:
            flush()
        chunk.append(key)
        size += nbytes
    flush()
    return out


# ---------------------------------------------------------------------- main entry
def _protected(cfg: MergeConfig) -> list[Path]:
    return cfg.protected_paths()


def run_merge(cfg: MergeConfig, out_dir: str | Path | None, *, overwrite: bool = False, progress: bool = True,
              log: Callable[[str], None] | None = None, plan: MergePlan | None = None,
              write: bool = True) -> MergeResult:
    """Merge per ``cfg`` into ``out_dir`` (see the module docstring). Returns the plan, the typed
    report and, for QP methods, the merged model (in memory, on the configured device).

    ``write=False`` merges in memory only (for sweeps from Python that evaluate each merge
    themselves): nothing is written, ``out_dir`` may be ``None``, and the result's ``tensors`` holds
    every tensor the merge computed, exactly as the folder would have held them (every other tensor
    is the base's); the report's output folder reads ``(in memory)``."""
    import torch  # optional heavy dependency: the merge runs on torch

    say = log or (lambda msg: None)
    t_start = time.perf_counter()
    check_config_object(cfg, "run_merge")
    if out_dir is None and write:
        raise ValidationError("run_merge: an output folder is needed unless write=False")
    plan = plan or build_plan(cfg)
    out = Path(out_dir if out_dir is not None else IN_MEMORY).expanduser()
    if write:  # under torchrun rank 0 checks (it alone writes) and every rank hears its verdict here
        agree_on(current_group(), lambda: (check_output_folder(out, _protected(cfg), overwrite=overwrite),
                                           check_free_space(out, plan.base.total_bytes, "the merged model")))
    reduced = without_unchanged(plan)  # (the same on every rank: the same files)
    if reduced is not plan:
        say(f"note: {reduced.notes[-1]}")
    plan, cfg = reduced, reduced.config
    device, device_note = resolve_device(cfg.device)
    notes = list(plan.notes) + ([device_note] if device_note else [])
    # a fine-tune's changes outside the selection: not merged, or merged by the start alone: said
    outside = changed_outside(plan) if keeps_base_outside(plan) else start_outside(plan)
    notes.extend(outside)
    for note in outside:
        say(f"note: {note}")
    dtype = getattr(torch, cfg.dtype)
    torch.manual_seed(cfg.seed)
    run = _Run(plan, out, overwrite, device, dtype, notes, say, progress, t_start, write)
    # every site's statistics and solve are checked against the memory limit
    with memory_limit(cfg.max_memory_bytes()), library_bars(progress):
        model_method = model_method_of(cfg)
        if model_method is not None:
            return run.model_method(model_method)
        if cfg.method.is_qp:  # (under torchrun a refusal of any rank, from the memory it sees, stops every rank)
            agree_everywhere(current_group(), lambda: check_groups_fit(plan))
            return run.qp()
        return run.baseline()


def check_groups_fit(plan: MergePlan) -> None:
    """Refuse (exit 2) a QP whose statistics and solve alone (``n_tasks`` sums of ``n x n`` float64
    and the solver's copies of one: exact sizes, known from the plan) exceed the memory available or
    ``max_memory``: the check each QP makes before its sums are allocated
    (:func:`mergeqp.merge.firstorder.collect_first_order`), made before any weight is loaded,
    instead of after the start candidates, targets and earlier QPs have taken their minutes."""
    n_tasks = len(plan.config.models)
    for group in plan.groups:
        check_site_memory(estimate_site_memory(", ".join(group.sites), group.n_variables, n_tasks))


@dataclass
class _Run:
    """One merge in progress: what every step shares."""

    plan: MergePlan
    out: Path
    overwrite: bool
    device: str
    dtype: Any
    notes: list[str]
    say: Callable[[str], None]
    progress: bool
    t_start: float
    write: bool = True

    def __post_init__(self) -> None:
        cfg = self.plan.config
        self.cfg = cfg
        self.spec = self.plan.output_spec()
        self.eval_spec = self.plan.heldout_spec()
        self.next_token = self.plan.not_causal is None  # next-token cross-entropy means something

    def _finish(self, overrides: dict[str, Any], report_fields: dict[str, Any], model: Any,
                sections: Callable[[dict[str, Any]], Sequence[str]] | None = None) -> MergeResult:
        """Write the merged folder with its ``report.json`` / ``report.md`` inside, atomically (the
        folder appears complete with its report, or not at all), and return the result. ``sections``:
        a model method's own Markdown sections of the JSON-able report (the QP's come from its merge
        mode and parametrisation)."""
        cfg = self.cfg
        evaluation = report_fields.get("evaluation")
        if evaluation is not None:
            self.notes.extend(n for n in heldout_regression_notes(evaluation.to_json(), cfg.output.metric)
                              if n not in self.notes)
        made: list[MergeReport] = []

        def report_of(written: Any) -> dict[str, str]:
            report = MergeReport(plan=self.plan.to_json(), device=self.device, notes=tuple(self.notes),
                                 imports=tuple(imported_modules()),
                                 output=WrittenOutput.of(written), seconds=time.perf_counter() - self.t_start,
                                 **report_fields)
            made.append(report)
            if not cfg.method.is_qp:
                return report_files(report.to_json(), method_sections=sections)
            return report_files(report.to_json(), get_merge_mode(cfg.method.mode).report_markdown,
                                get_parametrisation(cfg.method.parametrisation).report_markdown)

        if not self.write:  # in memory only: the report says nothing was written
            report_of(WrittenModel(Path(IN_MEMORY), (), 0, 0, (), None))
            return MergeResult(self.plan, made[-1], self.out, model, tensors=_as_written(overrides, cfg.output_dtype))
        # rank 0 writes (a non-finite tensor in the output dtype, a full disk): every rank hears of it here
        agree_on(current_group(), lambda: save_hf_folder(
            self.out, _stream(self.plan, overrides), source_folder=cfg.resolve(cfg.base),
            tokenizer_folder=self.plan.tokenizer_folder, max_shard_bytes=parse_size(cfg.max_shard_size),
            protected=_protected(cfg), overwrite=self.overwrite, dtype=cfg.output_dtype, extra_files=report_of))
        if not current_group().is_writer():  # another rank of a torchrun launch: the same report, nothing written
            report_of(WrittenModel(self.out, (), 0, 0, (), None))
        return MergeResult(self.plan, made[-1], self.out, model)

    # ------------------------------------------------------------------ QP
    def _load_base(self) -> tuple[Any, LazyModel | None]:
        """The base model to merge into, and with ``lazy: true`` its :class:`LazyModel` (the blocks
        below every site stay on disk: only the linearised path is resident), else ``None``."""
        plan, cfg = self.plan, self.cfg
        if cfg.lazy:
            lazy = load_lazy(plan.base, cfg.resolve(cfg.base), self.dtype, self.device, lower_blocks(plan.sites))
            return lazy.model, lazy
        return load_model(plan.base, cfg.resolve(cfg.base), self.dtype, self.device), None

    def _check_first_design(self) -> None:
        """:meth:`_check_first_design_here` on every rank, a refusal of any stopping every rank at this
        step (rank 0 printing it; before, one rank's refusal was printed nowhere)."""
        agree_everywhere(current_group(), self._check_first_design_here)

    def _check_first_design_here(self) -> None:
        """The statistics' check of their largest batch's design (:func:`check_first_design`), made
        before the fine-tunes' targets and any start selection (minutes on a language model): the
        base model stands in for the first fine-tune (the compared outputs have the same shape) on
        the first task's largest calibration batch (:func:`largest_design_batch`), and is freed. A batch
        that cannot be read here is left to the run, which names it. A later task's larger batch is
        checked by the statistics themselves, before its design is built."""
        plan, cfg = self.plan, self.cfg
        if not str(self.device).startswith("cpu") or not plan.tasks or not cfg.models[0].prompts():
            return
        try:
            tok = load_tokenizer(plan.tokenizer_folder) if plan.tokenizer_folder else None
            calib, _ = _batches(cfg, 0, tok, plan.max_length)
        except MergeQPError:
            return
        if not calib:
            return
        model = self._load_base()[0]
        head = plan.heads[0] if plan.heads else None
        try:
            largest = largest_design_batch(calib, self.spec)  # of task 0
            stand_in = teacher_forced_targets(model, [largest], self.spec, self.device, head)
        except Exception:  # noqa: BLE001 - the model and its inputs: the run names what fails, with the model
            return
        by_name = {site.name: site for site in plan.sites}
        alive = weakref.ref(model)
        try:
            check_first_design(model, [([by_name[s] for s in g.sites], g.n_variables) for g in plan.groups],
                               [TaskTargets(cfg.model_names()[0], 1.0, stand_in)], self.spec, self.device)
        finally:
            del model, stand_in
            _collect_if_held(alive)  # before the fine-tunes load

    def _held_out_start(self, model: Any, name: str, fit: dict[str, Any], full: dict[str, Any],
                        holdout: float) -> HeldOutStart:
        """The start ``name`` (fitted to calibration data) as the trust region's early stopping
        needs it: ``fit`` its tensors fitted without the mode's held-out batches, ``full`` on every
        batch (what ``model`` holds now)."""
        self.notes.append(f"start {name}: the trust region's early stopping ran from {name} fitted without its "
                          f"held-out batches (the last {holdout:g} of each task's), the refit from {name} fitted "
                          f"on every batch")
        return HeldOutStart(name, lambda: _load_into(model, fit), lambda: _load_into(model, full))

    def qp(self) -> MergeResult:
        plan, cfg, device, say = self.plan, self.cfg, self.device, self.say
        m = cfg.method
        self._check_first_design()
        collector = held_collector = None
        start_holdout = 0.0
        if statistics_method(cfg) is not None:  # a hybrid start with statistics: those of every tensor
            assert m.start is not None
            collector = statistics_collector(plan, m.start.name, m.start.params, plan.float_keys(), say)
            # a mode that holds batches out from its start (trust region with refit): the start is
            # also fitted without them, as start: auto's winner is (before stop 54 early stopping
            # scored a RegMean / Fisher start on batches that start had been fitted to)
            start_holdout = get_merge_mode(m.mode).start_holdout(m.mode_options)
            if start_holdout > 0:
                held_collector = statistics_collector(plan, m.start.name, m.start.params, plan.float_keys(), say)
        auto = _AutoStart(self, parse_auto_params(m.start.params)) if is_auto_start(m.start) else None
        # rows+baselines atoms of baselines with calibration statistics: collected on the sites' tensors
        site_keys = plan.site_keys()
        atom_collectors = [statistics_collector(plan, n, p, site_keys, say)
                           for n, p in statistics_baselines(m.baseline_choices)]
        # the batches on which the mode chooses (the trust region's early stopping) are not seen by the atoms
        atom_holdout = get_merge_mode(m.mode).selection_holdout(m.mode_options) if atom_collectors else 0.0
        atom_visitors = [_fit_part(c, atom_holdout) for c in atom_collectors]
        start_visitor = (auto.visit if auto is not None else
                         _with_fit_part(collector, held_collector, start_holdout) if held_collector is not None
                         else collector)
        visitors = [v for v in (start_visitor, *atom_visitors) if v is not None]
        lazy_models = self._lazy_fine_tunes([*atom_collectors, *(c for c in (collector, held_collector) if c is not None),
                                             *(auto.all_collectors() if auto is not None else [])])
        tasks = prepare_tasks(plan, self.spec, self.eval_spec, self.dtype, device, say, visit=_visit_all(visitors),
                              lazy=lazy_models, notes=self.notes)
        if get_parametrisation(m.parametrisation).needs_output_jacobian(m.parametrisation_options()):
            c = max(tb.sample_size for t in tasks for tb in t.calibration)
            for site in plan.sites:  # before any model is linearised
                check_jacobian_size(site.name, c, site.r, parse_size(m.basis_max_size))
        model, base_lazy = self._load_base()
        task_targets = [TaskTargets(t.name, t.weight, t.calibration) for t in tasks]
        settings = qp_settings(cfg, device)
        if atom_collectors:
            t = time.perf_counter()
            merges = {c.name: c.merge(plan, site_keys, DEFAULT_CHUNK_BYTES) for c in atom_collectors}
            settings = dataclasses.replace(settings, baseline_merges=merges)
            which = (f"the calibration batches but the last {atom_holdout:g} of each task's, which the "
                     f"{m.mode} mode holds out to choose on (so that its choice sees them unseen)"
                     if atom_holdout > 0 else "every calibration prompt")
            self.notes.append(
                f"rows+baselines: the atoms of {', '.join(merges)} are their merges of the merge layers with statistics "
                f"of {which} (held-out evaluation prompts excluded; {time.perf_counter() - t:.1f} s to merge)")
            for c in atom_collectors:
                self.notes.extend(n for n in c.notes if n not in self.notes)
        weights = WeightSource(plan.base, plan.finetuned)
        ctx = MergeContext(model, weights, task_targets, self.spec, settings, device, cfg.model_names(),
                           self.progress, say)

        def evaluate_model(live: Any) -> dict[str, Any]:
            """The QP's calibration objective and the held-out metrics of a live model."""
            return {"calibration_objective": calibration_objective(dataclasses.replace(ctx, model=live)),
                    **heldout_metrics(live, tasks, self.eval_spec, device, self.next_token)}

        # the blocks below every merge site are computed once per batch for the whole run
        with frozen_prefix(model, [site_module(model, site) for site in plan.sites]) as prefix:
            before = evaluate_model(model)  # the model as the mode's run begins: the base, or the start below
            base_eval = ModelEvaluation(**before)
            start_eval = None
            start_overrides: dict[str, Any] = {}
            mode = get_merge_mode(m.mode)
            selection = None
            if auto is not None:  # the start chosen among candidates on held-out calibration batches
                t = time.perf_counter()
                selection = auto.select(ctx)
                start_overrides = selection.overrides
                ctx = dataclasses.replace(ctx, held_out_start=auto.held_out_start(ctx, selection))
                before = evaluate_model(model)
                start_eval = ModelEvaluation(**before, method=selection.chosen.name,
                                             params=run_params(selection.chosen.name, selection.chosen.params),
                                             seconds=time.perf_counter() - t)
                self.notes.extend(n for n in auto.notes if n not in self.notes)
            elif mode.uses_start and m.start is not None:  # a mode whose start is optional starts from the base
                t = time.perf_counter()
                floats = plan.float_keys()
                if collector is not None:
                    start_overrides = collector.merge(plan, floats, DEFAULT_CHUNK_BYTES)
                else:
                    start_overrides = baseline_merge(plan, m.start.name, m.start.params, floats)
                _load_into(model, start_overrides)
                if held_collector is not None:
                    ctx = dataclasses.replace(ctx, held_out_start=self._held_out_start(
                        model, m.start.name, held_collector.merge(plan, floats, DEFAULT_CHUNK_BYTES),
                        start_overrides, start_holdout))
                before = evaluate_model(model)
                start_eval = ModelEvaluation(**before, method=m.start.name, params=run_params(m.start.name, m.start.params),
                                             seconds=time.perf_counter() - t,
                                             statistics=collector.summary() if collector is not None else None)
                if collector is not None:
                    self.notes.extend(n for n in collector.notes if n not in self.notes)
            prepared = mode.prepare(ctx)
            records = run_mode(ctx, m.mode, plan.sites)
            start_name = selection.chosen.label if selection is not None else (m.start.name if m.start else None)
            mode_notes = mode.notes(records, m.constraints, start_name)
            # a start-based mode's notes explain the records; the others' follow the certificate note
            self.notes.extend(mode_notes if mode.uses_start else [])
            failed = uncertified(records)  # a missing or failed certificate is never certified
            if failed:
                why = "; ".join(dict.fromkeys(str(x) for r in records for x in r.certificate.get("reasons", [])))
                self.notes.append(f"QP solution NOT certified at {failed}: {why or 'see the certificates'}")
            self.notes.extend([] if mode.uses_start else mode_notes)
            for r in records:
                if r.residual_norms:
                    self.notes.extend(n for n in zero_residual_notes(r.layer, r.residual_norms, cfg.model_names())
                                      if n not in self.notes)
            for why in dict.fromkeys(r.head_not_folded for r in records if r.head_not_folded):
                self.notes.append(f"output.fold_head: auto compared the vocabulary-size logits (statistics cost more "
                                  f"time and memory): the head was not folded into the final hidden state because "
                                  f"{why}")
            merged = evaluate_model(model)
            mode_fields = mode.report_fields(ctx, plan.sites, records, prepared, merged, evaluate_model, before)
            if selection is not None:
                mode_fields = {"start_selection": selection.to_json(), **mode_fields}
        if prefix is not None and prefix.note:
            self.notes.append(prefix.note)
        if cfg.lazy:
            self.notes.append(_lazy_note(lazy_summary([base_lazy]), lazy_models or []))
        del prepared
        overrides = dict(start_overrides)
        for site in plan.sites:
            # stored in the base checkpoint's dtype, unless output_dtype says otherwise (the writer casts)
            like = None if cfg.output_dtype else {k: plan.base.get(k) for k in site.keys}
            overrides.update(stored_tensors(site, read_augmented(model, site), like))
        evaluation = Evaluation(base=base_eval, start=start_eval, merged=ModelEvaluation(**merged))
        return self._finish(overrides, {"layers": tuple(records), "evaluation": evaluation,
                                        "mode_fields": mode_fields}, model)

    def _lazy_fine_tunes(self, collectors: Sequence[StatisticsCollector]) -> list[dict[str, Any]] | None:
        """With ``lazy: true``, a list for :func:`prepare_tasks` to load the fine-tunes with every
        block on disk; ``None`` (loaded whole) without it, or when a statistics collector needs
        gradients of every weight (Fisher), which a note says."""
        if not self.cfg.lazy:
            return None
        heavy = sorted({c.name for c in collectors if not c.spec.forward_only})
        if heavy:
            self.notes.append(f"lazy: the fine-tuned models were loaded whole: the {', '.join(heavy)} "
                              "statistics need gradients of every weight")
            return None
        return []

    # ------------------------------------------------------------------ baselines
    def baseline(self) -> MergeResult:
        """A baseline method: statistics (a method that declares them) and targets (evaluation)
        while each fine-tuned model is loaded, the merge of the selected tensors, the evaluation
        of the base and the merged model, the folder and the report."""
        plan, cfg, device, say = self.plan, self.cfg, self.device, self.say
        name, params = cfg.method.name, cfg.method.params
        keys = plan.merged_keys()
        collector = statistics_collector(plan, name, params, keys, say) if needs_statistics(name) else None
        evaluated = evaluates_baseline(cfg)
        tasks: list[TaskData] = []
        t = time.perf_counter()
        if collector is not None or evaluated:
            tasks = prepare_tasks(plan, self.spec, self.eval_spec, self.dtype, device, say, targets=evaluated,
                                  visit=collector, notes=self.notes)
        t_stats = time.perf_counter() - t
        t = time.perf_counter()
        if collector is not None:
            merged = collector.merge(plan, keys, DEFAULT_CHUNK_BYTES)
        else:
            unchanged = [True] * len(plan.finetuned)
            merged = baseline_merge(plan, name, params, keys, unchanged=unchanged)
            same = [n for n, u in zip(cfg.model_names(), unchanged) if u]
            if same:  # (the QP says so of a zero residual; a baseline counted it silently: stop 56 review)
                self.notes.append(
                    f"{listing([repr(n) for n in same], 3)} hold{'s' if len(same) == 1 else ''} the base's values in "
                    f"every merged tensor (a zero task vector, or the base saved in another dtype): {name} still "
                    f"counts {'it' if len(same) == 1 else 'them'} as a model (a soup is pulled toward the base); "
                    f"leave {'it' if len(same) == 1 else 'them'} out if that is not meant")
        summary = BaselineSummary(name, run_params(name, params), len(merged), time.perf_counter() - t + t_stats,
                                  collector.summary() if collector is not None else None)
        if collector is not None:
            self.notes.extend(n for n in collector.notes if n not in self.notes)
        model = None
        evaluation = None
        if evaluated:
            model = load_model(plan.base, cfg.resolve(cfg.base), self.dtype, device)
            base_eval = ModelEvaluation(**evaluate(model, tasks, self.spec, self.eval_spec, device, self.next_token))
            _load_into(model, merged)
            merged_eval = ModelEvaluation(**evaluate(model, tasks, self.spec, self.eval_spec, device, self.next_token), method=name)
            evaluation = Evaluation(base=base_eval, merged=merged_eval)
        return self._finish(merged, {"baseline": summary, "evaluation": evaluation}, model)


    # ------------------------------------------------------------------ model methods
    def model_method(self, method: ModelMethod) -> MergeResult:
        """A model method (:mod:`.model_methods`, e.g. ``output_space``): it runs with this run as its
        :class:`~.model_method.RunContext`; its merged tensors are written with the report (its
        parameters, seconds, evaluation and report fields)."""
        cfg = self.cfg
        params = entry_call(method, "parse", method.parse, cfg.method.params, "method")
        with named_failure(f"model method {method.name!r}", MergeMethodError):
            outcome = method.run(self, params)
        merged = self._checked_tensors(method.name, outcome)
        extra = _checked_report_fields(method.name, outcome.report_fields)
        summary = BaselineSummary(cfg.method.name, dict(outcome.params), len(merged), outcome.seconds,
                                  kind="model method")
        fields: dict[str, Any] = {"baseline": summary, "evaluation": outcome.evaluation}
        if extra:
            fields["mode_fields"] = extra
        return self._finish(merged, fields, outcome.model,
                            None if method.report_markdown is None else _method_sections(method))

    def _checked_tensors(self, name: str, outcome: Any) -> dict[str, Any]:
        """What a (user's) model method hands back, checked before anything is written: a
        :class:`MethodOutcome` whose ``merged`` sets at least one tensor, each a floating-point tensor
        of one of the selected layers' checkpoint keys with the base's shape; cast to the base
        tensor's dtype unless ``output_dtype`` says otherwise (the writer casts then)."""
        def bad(why: str) -> MergeMethodError:
            return MergeMethodError(f"model method {name!r} {why}")

        if not isinstance(outcome, MethodOutcome):
            raise bad(f"returned {type(outcome).__name__}, not a MethodOutcome")
        if not isinstance(outcome.merged, Mapping):
            raise bad(f"returned merged as {type(outcome.merged).__name__}, not a dict of tensors by checkpoint key")
        if not outcome.merged:
            raise bad("returned no merged tensor (MethodOutcome.merged is empty): the output would be the base model")
        return checked_merge(self.plan, self.cfg.output_dtype, outcome.merged, self.plan.merged_keys(), bad,
                             "the selected layers ('layers' selects the tensors a merge may set)")

    # the RunContext of a model method
    def prepare_tasks(self, visit: Any = None) -> list[TaskData]:
        return prepare_tasks(self.plan, self.spec, self.eval_spec, self.dtype, self.device, self.say, visit=visit,
                             notes=self.notes)

    def statistics_collector(self, name: str, params: dict[str, Any], keys: Sequence[str]) -> StatisticsCollector:
        return statistics_collector(self.plan, name, params, keys, self.say)

    def collected_merge(self, collector: StatisticsCollector, keys: Sequence[str]) -> dict[str, Any]:
        merged = collector.merge(self.plan, keys, DEFAULT_CHUNK_BYTES)
        self.notes.extend(n for n in collector.notes if n not in self.notes)
        return merged

    def baseline_merge(self, name: str, params: dict[str, Any], keys: Sequence[str]) -> dict[str, Any]:
        return baseline_merge(self.plan, name, params, keys)

    def load_base_model(self) -> Any:
        return load_model(self.plan.base, self.cfg.resolve(self.cfg.base), self.dtype, self.device)

    def load(self, model: Any, tensors: Mapping[str, Any]) -> None:
        _load_into(model, dict(tensors))

    def evaluate(self, model: Any, tasks: Sequence[TaskData], **described: Any) -> ModelEvaluation:
        return ModelEvaluation(**evaluate(model, tasks, self.spec, self.eval_spec, self.device, self.next_token),
                               **described)


def _method_sections(method: ModelMethod) -> Callable[[dict[str, Any]], list[str]]:
    """A model method's ``report_markdown``, checked: a failure, or anything but a list of strings, is
    one line naming the method (exit 2; nothing is written: the folder appears with its report or not
    at all)."""
    def sections(report: dict[str, Any]) -> list[str]:
        with named_failure(f"model method {method.name!r}: report_markdown(report)", MergeMethodError):
            out = method.report_markdown(report)  # type: ignore[misc]
        if isinstance(out, str) or not isinstance(out, Sequence) or not all(isinstance(x, str) for x in out):
            raise MergeMethodError(f"model method {method.name!r}: report_markdown(report) returned "
                                   f"{type(out).__name__}, not a list of Markdown sections (strings)")
        return list(out)

    return sections


def _checked_report_fields(name: str, fields: Any) -> dict[str, Any]:
    """A model method's extra ``report.json`` fields: a dict of JSON-able values whose names are not
    the report's own (:data:`~.report.REPORT_KEYS`); else a :class:`MergeMethodError` naming the
    field, before anything is written."""
    if fields is None:
        return {}
    if not isinstance(fields, Mapping):
        raise MergeMethodError(f"model method {name!r}: report_fields must be a dict of field -> JSON value, got "
                               f"{type(fields).__name__}")
    out = {}
    for key, value in fields.items():
        if not isinstance(key, str) or key in REPORT_KEYS:
            raise MergeMethodError(f"model method {name!r}: report field {key!r} is "
                                   + ("one of the report's own (" + ", ".join(sorted(REPORT_KEYS)) + ")"
                                      if isinstance(key, str) else "not a string") + "; name it otherwise")
        try:
            json.dumps(jsonable(value))
        except (TypeError, ValueError) as exc:
            raise MergeMethodError(f"model method {name!r}: report field {key!r} is not JSON-able: "
                                   f"{first_line(exc)}") from None
        out[key] = value
    return out


def checked_merge(plan: MergePlan, output_dtype: Any, merged: Mapping[str, Any], allowed: Sequence[str],
                  bad: Callable[[str], MergeQPError], scope: str, cast: bool = True,
                  live: Any = None) -> dict[str, Any]:
    """``merged`` (a user's entry's ``{checkpoint key: tensor}``) checked: each key one of ``allowed``
    (``scope`` says which those are), each value a tensor with the base's shape, floating point where
    the base's is, dense; with ``cast``, cast to the base tensor's dtype unless ``output_dtype`` is set;
    without, kept in their dtype (a start candidate's tensors: loading them casts, and so does the
    writer) and copied where they share memory with the module ``live`` (its parameters or buffers).
    ``bad(why)`` is the error naming the entry."""
    import torch  # optional heavy dependency: the merge runs on torch

    allowed_set = set(allowed)
    base = plan.base
    shared = set() if live is None else {t.untyped_storage().data_ptr()
                                         for t in (*live.parameters(), *live.buffers()) if not t.is_meta}
    out: dict[str, Any] = {}
    for key, tensor in merged.items():
        if key not in allowed_set:
            where = f"a tensor outside {scope}" if key in base.names() else "not a tensor of the base checkpoint"
            raise bad(f"returned {key!r}: {where}; the tensors it may set: {listing(sorted(allowed_set), 6)}")
        if not isinstance(tensor, torch.Tensor):
            raise bad(f"returned {type(tensor).__name__} for {key!r}, not a tensor")
        if tensor.is_meta or tensor.layout != torch.strided:
            raise bad(f"returned {key!r} as a {'meta' if tensor.is_meta else str(tensor.layout)} tensor, not one "
                      f"holding values (a dense tensor)")
        info = base.info(key)
        if tuple(tensor.shape) != tuple(info.shape):
            raise bad(f"returned {key!r} of shape {tuple(tensor.shape)}, the base's is {tuple(info.shape)}")
        like = getattr(torch, info.dtype, None)
        base_float = isinstance(like, torch.dtype) and like.is_floating_point
        if base_float and not tensor.is_floating_point():
            raise bad(f"returned {key!r} as {tensor.dtype}, not a floating-point tensor")
        if not base_float and tensor.dtype != like:  # (an integer buffer: the base's own, as it is)
            raise bad(f"returned {key!r} as {tensor.dtype}, the base stores it as {info.dtype}")
        if not cast:  # a tensor that shares memory with the live model (its own parameters) would change
            # under the candidates fitted and scored after it: copied (stop 58 review: the winner's stored
            # tensors became another candidate's, 5,780 against the 377 it was scored at)
            aliased = tensor.untyped_storage().data_ptr() in shared
            out[key] = tensor.detach().clone() if aliased else tensor.detach()
            continue
        keep = output_dtype is not None or not base_float
        out[key] = tensor.detach() if keep else tensor.detach().to(like)
    return out


class _AutoStart:
    """``start: auto`` in a run (:mod:`.auto`). Per statistics-based candidate one collector per
    split (fed each task's fit batches of that split while its fine-tune is loaded) and, with
    k folds, one on every batch for the refit; statistics that pool (RegMean's Grams, Fisher) are
    collected once per batch and pooled per split, so k folds cost one pass over the data. Then
    every candidate scored (a data-free one merged once and scored on every held-out batch; the
    others fitted per split) and the lowest loaded: its one fit, or with k folds its refit on every
    batch."""

    def __init__(self, run: _Run, params: AutoStartParams):
        self.run = run
        self.params = params
        # a tensor equal in the base and every fine-tune is the base's in every candidate: only
        # the others are merged (and RegMean's statistics are collected for their layers only)
        self.floats = changed_keys(run.plan.base, run.plan.finetuned, run.plan.float_keys())
        # every tensor a candidate's fit may leave changed in the live model: the merged ones and
        # the selected sites' (output_space and the QP candidates write every site they solve)
        self.reset_keys = list(dict.fromkeys([*self.floats, *(k for site in run.plan.sites for k in site.keys)]))
        m = run.cfg.method
        # the batches the mode holds out from its start (trust region with refit): a data-dependent
        # winner is also fitted without them, for the mode's early stopping
        self.mode_holdout = get_merge_mode(m.mode).start_holdout(m.mode_options)
        fits, self.held_out_index = held_out_fit(params, self.mode_holdout)
        # what the plan says the run skips (lazy: true's default Fisher, a model method that fits outputs
        # under a data metric or whose entry's skip gives a reason): skipped before any statistics
        self.skipped = dict(run.plan.start_skips)  # (a copy: candidates skipped at run time join it)
        self.collectors = {c.key: [statistics_collector(run.plan, c.name, c.params, self.floats, run.say)
                                   for _ in range(fits)]
                           for c in statistics_candidates(params, statistics_of, self.skipped, start_statistics)}
        self.notes: list[str] = []

    def load(self, model: Any, tensors: dict[str, Any]) -> None:
        """Load a candidate's ``tensors`` into ``model`` with every other tensor a candidate may
        change (:attr:`reset_keys`) at the base's value: each fit and each score starts from the
        same model whatever ran before it. Loading ``tensors`` alone left what an earlier candidate
        or fold had fitted at the sites they do not cover (an output_space fit rewrote selected
        layers no fine-tune changed): a data-free soup scored 23.0 first and 8.7 after output_space,
        and later folds were scored on weights fitted to their own held-out batches."""
        base = self.run.plan.base
        _load_into(model, {**{k: base.get(k) for k in self.reset_keys if k not in tensors}, **tensors})

    def all_collectors(self) -> list[StatisticsCollector]:
        """Every statistics collector of the candidates (all splits)."""
        return [c for per_split in self.collectors.values() for c in per_split]

    def visit(self, index: int, name: str, model: Any, batches: list[Any]) -> None:
        if self.params.folds > 1 and len(batches) < 2:
            raise ValidationError(f"start: auto with {self.params.folds} folds: task {name!r} has "
                                  f"{len(batches)} calibration batch(es), at least 2 are needed (more prompts, a "
                                  f"smaller calibration.batch_size or calibration.holdout, or folds: 1)")
        n = len(batches)
        fits = [fit for fit, _ in batch_splits(n, self.params)]
        if self.params.folds > 1:
            fits.append(list(range(n)))
        if self.held_out_index is not None and self.held_out_index == len(fits):
            fits.append(list(range(n - holdout_count(n, self.mode_holdout))))
        for key, per_split in list(self.collectors.items()):
            try:
                _collect_fits(per_split, fits, index, name, model, batches)
            except Interrupted:
                raise
            except MergeQPError as exc:
                # statistics this model cannot give (Fisher's need logits): the candidate is skipped,
                # like one that cannot run here, and the others go on
                self.skipped[key] = f"its statistics could not be collected on {name!r}: {exc}"
                del self.collectors[key]
                self.run.say(f"start auto: {per_split[0].name} statistics skipped: {exc}")


    def _splits(self, tasks: Sequence[TaskTargets]) -> list[tuple[list[TaskTargets], list[TaskTargets]]]:
        """``(fit tasks, held-out tasks)`` per split (tasks without a batch there left out)."""
        per_task = [batch_splits(len(t.batches), self.params) for t in tasks]
        out = []
        for s in range(len(per_task[0])):
            fit = [dataclasses.replace(t, batches=[t.batches[j] for j in p[s][0]]) for t, p in zip(tasks, per_task)]
            held = [dataclasses.replace(t, batches=[t.batches[j] for j in p[s][1]]) for t, p in zip(tasks, per_task)]
            out.append(([t for t in fit if t.batches], [t for t in held if t.batches]))
        if not any(held for _, held in out):
            raise no_holdout_error("start: auto holdout", self.params.holdout)
        return out

    def select(self, ctx: MergeContext) -> StartSelection:
        run = self.run
        splits = self._splits(ctx.tasks)

        def score(tasks: Sequence[TaskTargets]) -> float:
            return calibration_objective(dataclasses.replace(ctx, tasks=tasks)) if tasks else 0.0

        fitted = functools.partial(self._fitted, ctx)

        def evaluate(cand: Candidate) -> CandidateScore:
            if cand.key in self.skipped:
                raise CandidateSkipped(self.skipped[cand.key])
            if not self._needs_data(cand):
                tensors = baseline_merge(run.plan, cand.name, cand.params, self.floats)
                self.load(ctx.model, tensors)
                return sum(score(held) for _, held in splits), lambda: tensors
            total, last = 0.0, {}
            for s, (fit, held) in enumerate(splits):
                if held:
                    last = fitted(cand, s, fit)
                    self.load(ctx.model, last)
                    total += score(held)
            if self.params.folds > 1:
                return total, lambda: fitted(cand, self.params.folds, ctx.tasks)
            return total, lambda: last

        return select_start(self.params, evaluate, lambda tensors: self.load(ctx.model, tensors), run.say)

    def _needs_data(self, cand: Candidate) -> bool:
        return cand.name == QP_CANDIDATE or start_method(cand.name) is not None or cand.key in self.collectors

    def _fitted(self, ctx: MergeContext, cand: Candidate, split: int, fit: Sequence[TaskTargets]) -> dict[str, Any]:
        """``cand``'s tensors fitted on the ``fit`` batches (``split``: the index of its statistics' fit)."""
        entry = start_method(cand.name)
        if entry is not None:  # a model method: its entry's fit (output_space's, a user's)
            assert entry.start is not None
            fitting = _CandidateFit(self, ctx, split)
            what = f"start auto: candidate {cand.label}: model method {entry.name!r}: start.fit"
            with named_failure(what, MergeMethodError):  # (CandidateSkipped, an error of ours, passes as it is)
                tensors = entry.start.fit(fitting, parse_candidate(entry, cand), fit)
            if not isinstance(tensors, Mapping):
                raise MergeMethodError(f"{what} returned {type(tensors).__name__}, not a dict of tensors by "
                                       f"checkpoint key")
            # the tensors a candidate may change (the others stay the base's in every candidate's scoring)
            return checked_merge(self.run.plan, self.run.cfg.output_dtype, tensors, self.reset_keys,
                                 lambda why: MergeMethodError(f"{what} {why}"),
                                 "the tensors some fine-tune changed and the selected layers", cast=False,
                                 live=ctx.model)
        if cand.name == QP_CANDIDATE:
            return self.qp(ctx, cand, fit)
        collector = self.collectors[cand.key][split]
        merged = collector.merge(self.run.plan, self.floats, DEFAULT_CHUNK_BYTES)
        self.notes.extend(n for n in collector.notes if n not in self.notes)
        return merged

    def held_out_start(self, ctx: MergeContext, selection: StartSelection) -> HeldOutStart | None:
        """The chosen start as :class:`~mergeqp.merge.multilayer.HeldOutStart` where it was fitted to
        calibration data and the mode holds batches out from its start (``None`` otherwise): its fit
        without those batches, and its fit on every batch (the tensors the model holds now)."""
        chosen = next(c for c in self.params.candidates if c.label == selection.chosen.label)
        if self.held_out_index is None or not self._needs_data(chosen):
            return None
        fit, _ = split_tasks(ctx.tasks, self.mode_holdout)
        tensors = self._fitted(ctx, chosen, self.held_out_index, fit)
        self.load(ctx.model, selection.overrides)
        self.notes.append(f"start auto: the trust region's early stopping ran from {chosen.label} fitted without "
                          f"its held-out batches (the last {self.mode_holdout:g} of each task's); the result from "
                          f"{chosen.label} fitted on every batch")
        return HeldOutStart(chosen.label, lambda: self.load(ctx.model, tensors),
                            lambda: self.load(ctx.model, selection.overrides))

    def qp(self, ctx: MergeContext, cand: Candidate, fit: Sequence[TaskTargets]) -> dict[str, Any]:
        """A ``{name: qp, params: {...}}`` candidate: its QP mode run from the base on the fit
        batches at the selected layers; every other tensor stays the base's."""
        run = self.run
        where = candidate_where(cand.label)
        block = qp_candidate_block(dict(cand.params), where)
        settings = qp_settings(run.cfg.model_copy(update={"method": block}), run.device)
        tensors = {k: run.plan.base.get(k) for k in self.floats}
        self.load(ctx.model, tensors)
        records = run_mode(dataclasses.replace(ctx, tasks=fit, settings=settings), block.mode, run.plan.sites)
        failed = uncertified(records)
        if failed:
            self.notes.append(f"start auto: candidate {cand.label}'s QP not certified at {failed}")
        for site in run.plan.sites:
            like = {k: run.plan.base.get(k) for k in site.keys}
            tensors.update(stored_tensors(site, read_augmented(ctx.model, site), like))
        return tensors


@dataclasses.dataclass
class _CandidateFit:
    """:class:`~.model_method.CandidateContext` of one fit of a model-method candidate (split ``split``
    of ``start: auto``'s batches)."""

    auto: _AutoStart
    ctx: MergeContext
    split: int

    @property
    def model(self) -> Any:
        return self.ctx.model

    @property
    def plan(self) -> Any:
        return self.auto.run.plan

    @property
    def spec(self) -> Any:
        return self.auto.run.spec

    @property
    def device(self) -> str:
        return self.auto.run.device

    @property
    def floats(self) -> list[str]:
        return self.auto.floats

    @property
    def notes(self) -> list[str]:
        return self.auto.notes

    @property
    def say(self) -> Callable[[str], None]:
        return self.auto.run.say

    def merge(self, name: str, params: Mapping[str, Any], label: str | None = None) -> dict[str, Any]:
        key = Candidate(name=name, params=dict(params)).key
        if key in self.auto.skipped:
            raise CandidateSkipped(f"its reference {label or name}: {self.auto.skipped[key]}")
        if key in self.auto.collectors:
            return self.auto.collectors[key][self.split].merge(self.plan, self.floats, DEFAULT_CHUNK_BYTES)
        if statistics_of(name) is not None:
            raise ValidationError(f"start auto: the statistics of {name} {dict(params)} were not collected: name them "
                                  f"in the model method's start.statistics")
        return baseline_merge(self.plan, name, dict(params), self.floats)

    def load(self, tensors: Mapping[str, Any]) -> None:
        self.auto.load(self.ctx.model, dict(tensors))

    def changed_sites(self) -> list[Any]:
        changed = set(self.floats)
        return [site for site in self.plan.sites if any(k in changed for k in site.keys)]


def _lazy_note(base: dict[str, Any], finetunes: Sequence[dict[str, Any]]) -> str:
    """The report note of a lazy merge (:func:`~mergeqp.io.lazy_model.lazy_summary` of the base and
    of each fine-tune)."""
    mib = 2 ** 20
    note = (f"lazy: {base['lazy_blocks']} block(s) below the merge sites stayed on disk ({base['lazy_bytes'] / mib:.1f} "
            f"MiB; {base['resident_bytes'] / mib:.1f} MiB resident), read {base['block_loads']} time(s)")
    if finetunes:
        note += (f"; each fine-tuned model ran with all {finetunes[0]['lazy_blocks']} blocks on disk "
                 f"({max(f['resident_bytes'] for f in finetunes) / mib:.1f} MiB resident)")
    return note


def _collect_fits(per_split: Sequence[StatisticsCollector], fits: Sequence[Sequence[int]], index: int, name: str,
                  model: Any, batches: list[Any]) -> None:
    """One method's statistics of one fine-tune for every fit (``per_split[i]`` on the batches
    ``fits[i]``; each batch computed once and pooled per fit where the statistics pool)."""
    first = per_split[0]
    if first.poolable:
        parts = first.batch_parts(name, model, batches)
        for collector, fit in zip(per_split, fits):
            collector.pool(index, name, [parts[j] for j in fit])
            collector.notes.extend(n for n in first.notes if n not in collector.notes)
        return
    for collector, fit in zip(per_split, fits):
        collector(index, name, model, [batches[j] for j in fit])


def _with_fit_part(full: StatisticsCollector, part: StatisticsCollector, holdout: float
                   ) -> Callable[[int, str, Any, list[Any]], None]:
    """One visitor filling ``full`` with each task's calibration batches and ``part`` with them but
    the last :func:`holdout_count` (``holdout``), each batch's statistics computed once where they pool."""

    def visit(index: int, name: str, model: Any, batches: list[Any]) -> None:
        keep = len(batches) - holdout_count(len(batches), holdout)
        _collect_fits([full, part], [list(range(len(batches))), list(range(keep))], index, name, model, batches)
    return visit


def _fit_part(visit: Callable[[int, str, Any, list[Any]], None], holdout: float
              ) -> Callable[[int, str, Any, list[Any]], None]:
    """``visit`` fed each task's calibration batches but the last :func:`holdout_count` (``holdout``:
    the fraction a mode holds out to choose on; 0: every batch)."""
    if holdout <= 0:
        return visit

    def fit_only(index: int, name: str, model: Any, batches: list[Any]) -> None:
        visit(index, name, model, batches[:len(batches) - holdout_count(len(batches), holdout)])
    return fit_only


def _visit_all(visitors: Sequence[Callable[[int, str, Any, list[Any]], None]]
               ) -> Callable[[int, str, Any, list[Any]], None] | None:
    """One ``prepare_tasks`` visitor that calls each of ``visitors`` in turn (``None`` for none)."""
    if not visitors:
        return None
    if len(visitors) == 1:
        return visitors[0]

    def visit(index: int, name: str, model: Any, batches: list[Any]) -> None:
        for v in visitors:
            v(index, name, model, batches)
    return visit


def _failure_hint(message: str, model: Any, dtype: str | None) -> str:
    """What to check when the model failed on its calibration inputs with ``message``: the config's
    dtype where the model's kernels refused it (Mixtral's grouped expert products take no float64),
    an encoder-decoder model that needs decoder inputs (T5: mergeqp feeds the prompts as
    ``input_ids`` only; BART derives its decoder's inputs from them), else the inputs."""
    config = getattr(model, "config", None)
    if dtype == "float64" and any(w in message for w in ("Double", "double", "float64")):
        return ("a kernel of this model does not take float64 (the config's dtype: float64): set dtype: float32 "
                "(or bfloat16)")
    if getattr(config, "is_encoder_decoder", False) and "input_ids" in message:
        return (f"{getattr(config, 'model_type', 'this')} is an encoder-decoder model whose decoder needs inputs of "
                f"its own; {ENCODER_DECODER_INPUTS}")
    return "check the prompts / input tensors (names, shapes, dtype) against the model"


def _load_into(model: Any, tensors: dict[str, Any]) -> None:
    """Copy checkpoint-named ``tensors`` into the live model (renamed as ``transformers`` does)."""
    import torch  # optional heavy dependency: the merge runs on torch

    state = model.state_dict()
    live = live_names(model)
    lazy = lazy_parameters(model)  # blocks kept on disk take the tensors as overrides
    with torch.no_grad():
        for k, v in tensors.items():
            name = live.get(k, k)
            if name in lazy:
                block, path = lazy[name]
                block.override(path, v)
                continue
            target = state.get(name)
            if target is None:
                target = fused_view(model, k, state)  # a mixture-of-experts weight stacked into one parameter
            if target is None:
                raise ValidationError(f"merged tensor {k!r} is not a parameter of the loaded model")
            target.copy_(v.to(dtype=target.dtype))


def _as_written(overrides: Mapping[str, Any], output_dtype: str | None) -> dict[str, Any]:
    """The merged tensors as :func:`save_hf_folder` would write them: floating tensors cast to
    ``output_dtype`` (when set), detached CPU copies, NaN / inf refused with the tensor's name."""
    import torch  # optional heavy dependency: the merge runs on torch

    cast = getattr(torch, output_dtype) if output_dtype else None
    out = {}
    for name, tensor in overrides.items():
        t = tensor.detach()
        if cast is not None and t.is_floating_point():
            t = t.to(cast)
        t = t.to("cpu").contiguous().clone()
        check_tensor_finite(name, t, "the merged model")
        out[name] = t
    return out


def _stream(plan: MergePlan, overrides: dict[str, Any]):
    """``(name, tensor)`` in the base checkpoint's order: merged tensors, else the base's (read
    without a memory map, so writing a large model does not map its whole file into memory)."""
    for name in plan.base.names():
        tensor = overrides.get(name)
        yield name, (tensor if tensor is not None else plan.base.read(name))


__all__ = ["MergeResult", "baseline_merge", "load_model", "prepare_tasks", "resolve_device", "run_merge",
           "statistics_collector"]
