"""The tasks of a merge: each model's calibration prompts as batches, each fine-tune's teacher-forced targets
(one model loaded at a time), token balancing, the held-out evaluation, and the baseline merges that
read calibration statistics."""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .schema import MergeConfig
from ..errors import MergeQPError, ValidationError, first_line
from ..io.calibration import (is_tensor_file, load_tokenizer, read_labelled_prompts, read_prompts, read_tensor_inputs,
                              split_holdout, tensor_batches, tensor_labels, tokenize_batches)
from ..io.lazy_model import lazy_summary
from ..io.memory import available_memory_bytes
from ..io.writer import check_tensor_finite
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
from ..merge.calibrated import StatisticsCollector
from ..merge.registry import merge_state_dicts
from .architectures import every_block
from .checkpoints import same_stored_value
from .merge_plan import MergePlan
from .settings import DEFAULT_CHUNK_BYTES
from . import models
from .models import collect_if_held, failure_hint, out_of_memory


# ---------------------------------------------------------------------- calibration data
@dataclass(frozen=True)
class TaskData:
    name: str
    weight: float
    calibration: list[TargetBatch]
    heldout: list[TargetBatch]
    #: the task's classifier head (:class:`mergeqp.lm.ClassifierHead`; ``None`` unless the config names one)
    head: Any = None


def calibration_batches(cfg: MergeConfig, index: int, tokenizer: Any, max_length: int) -> tuple[list[Any], list[Any]]:
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


def task_calibration_batches(plan: MergePlan) -> list[list[Any]]:
    """Each model's task's calibration batches (:class:`~mergeqp.io.calibration.Batch`, in the models'
    order) as :func:`prepare_tasks` makes them, without loading any model or computing targets."""
    tok = load_tokenizer(plan.tokenizer_folder) if plan.tokenizer_folder else None
    return [_model_batches(plan, i, tok)[0] for i in range(len(plan.config.models))]


def _model_batches(plan: MergePlan, index: int, tokenizer: Any) -> tuple[list[Any], list[Any]]:
    """:func:`calibration_batches` of model ``index``, an error naming the model's calibration entry."""
    cfg = plan.config
    try:
        return calibration_batches(cfg, index, tokenizer, plan.max_length)
    except ValidationError as exc:
        name, src = cfg.model_names()[index], cfg.models[index].prompts()
        raise ValidationError(f"models[{name}].calibration" + (f" ({src.path})" if src is not None else "")
                              + f": {exc}") from None


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
        calib, held = _model_batches(plan, i, tok)
        t = time.perf_counter()
        loaded = models.load_lazy(ck, base_folder, dtype, device, every_block) if lazy is not None else None
        model = loaded.model if loaded is not None else models.load_model(ck, base_folder, dtype, device)
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
            if out_of_memory(exc):
                raise ValidationError(
                    f"models[{name}]: out of memory running the model on its calibration inputs "
                    f"({type(exc).__name__}: {first}); lower calibration.batch_size ({cfg.calibration.batch_size}) "
                    f"or calibration.max_length ({plan.max_length})") from exc
            raise ValidationError(
                f"models[{name}]: the model failed on its calibration inputs ({type(exc).__name__}: "
                f"{first}); {failure_hint(first, model, cfg.dtype)}"
            ) from exc
        if lazy is not None and loaded is not None:
            lazy.append(lazy_summary([loaded]))
        alive = weakref.ref(model)
        del model, loaded
        collect_if_held(alive)  # before the next model loads
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
            # NaN / inf named with the checkpoint that holds them (merge_state_dicts sees unlabelled state
            # dicts: "finetuned[1]", a QA review of stop 68)
            for ckpt, sd in ((plan.base, base_sd), *zip(plan.finetuned, ft_sds)):
                for k in floats:
                    check_tensor_finite(k, sd[k], f"checkpoint {ckpt.path}")

            @functools.cache
            def holds_base(i: int, k: str) -> bool:  # (each pair compared once for both uses below)
                return same_stored_value(base_sd[k], ft_sds[i][k])

            if unchanged is not None:
                for i in range(len(ft_sds)):
                    unchanged[i] = unchanged[i] and all(holds_base(i, k) for k in floats)
            # a tensor every fine-tune holds as the base's (in any dtype) is the base's: merging it would put
            # rounding into the start (a soup of three equal tensors, 3 x a/3, is a up to 6e-8: an explicit
            # `start: soup` rewrote 12 unchanged tensors where `method: soup` left them, stop 74; in another
            # dtype it also unfolded the head: a review's 9 -> 19 s)
            kept = [k for k in floats if all(holds_base(i, k) for i in range(len(ft_sds)))]
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
