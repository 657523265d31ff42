"""``mergeqp merge``: run a validated config end to end and write the merged Hugging Face folder.

Order of work (each step only after the previous one succeeded):

1. :func:`~mergeqp.merge.plan.build_plan`: every check that needs no weights (paths, architectures,
   tokenizers, layer patterns, method / constraint / solver names); the output folder is checked
   too (it must not overlap an input, and must be empty unless ``overwrite``).
2. Baseline methods: the selected tensors are merged with :func:`mergeqp.merge_state_dicts`, read
   lazily from the checkpoints in chunks of ``chunk_bytes``. Fisher and RegMean first get their
   statistics from each fine-tuned model on its calibration prompts (:mod:`.calibrated`); when
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
   fraction, seconds; held-out teacher-forced MSE per task for the base and the merged model).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import MergeConfig
from ..errors import MergeQPError, ValidationError
from ..io.calibration import (
    is_tensor_file,
    load_tokenizer,
    read_prompts,
    read_tensor_inputs,
    split_holdout,
    tensor_batches,
    tokenize_batches,
)
from ..io.checkpoint import Checkpoint
from ..io.writer import check_output_folder, parse_size, save_hf_folder
from ..lm import OutputSpec, TargetBatch, teacher_forced_mse, teacher_forced_targets
from .calibrated import StatisticsCollector, needs_statistics
from .firstorder import TaskTargets
from .multilayer import (
    MergeContext,
    QPSettings,
    WeightSource,
    calibration_objective,
    run_mode,
)
from .plan import (
    MergePlan,
    architecture_class,
    build_plan,
    evaluates_baseline,
    statistics_method,
)
from .sites import checkpoint_names, read_augmented, stored_tensors

DEFAULT_CHUNK_BYTES = 512 * 2**20


@dataclass
class MergeResult:
    """What :func:`run_merge` produced: the plan, the report dict, the output folder and, for QP
    methods and evaluated baselines, the merged in-memory model."""

    plan: MergePlan
    report: dict[str, Any]
    out_dir: Path
    model: Any = None


def resolve_device(name: str) -> tuple[str, str | None]:
    """``(device, note)``: ``auto`` -> CUDA when available; ``cuda`` without CUDA -> CPU with a note."""
    import torch

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
    model.to(device)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def live_names(model: Any) -> dict[str, str]:
    """Checkpoint name -> live state-dict name (the inverse of ``sites.checkpoint_names``)."""
    return {stored: live for live, stored in checkpoint_names(model).items()}


def _from_pretrained(cls: Any, folder: Path, dtype: Any) -> Any:
    """``from_pretrained`` with eager attention where the model supports choosing it: the fused
    SDPA kernels have no forward-mode derivative, which the statistics need (``torch.func.jvp``)."""
    try:
        return cls.from_pretrained(str(folder), dtype=dtype, attn_implementation="eager")
    except (ValueError, TypeError) as exc:
        if "attn_implementation" not in str(exc) and "eager" not in str(exc):
            raise
        return cls.from_pretrained(str(folder), dtype=dtype)


def _read_cfg(folder: Path) -> dict[str, Any] | None:
    from ..io.checkpoint import read_config

    return read_config(folder)


# ---------------------------------------------------------------------- calibration data
@dataclass(frozen=True)
class TaskData:
    name: str
    weight: float
    calibration: list[TargetBatch]
    heldout: list[TargetBatch]


def _batches(cfg: MergeConfig, index: int, tokenizer: Any) -> tuple[list[Any], list[Any]]:
    entry = cfg.models[index]
    src = entry.prompts()
    assert src is not None
    path = cfg.resolve(src.path)
    holdout = cfg.holdout_for(index) if cfg.evaluate else 0
    size = cfg.calibration.batch_size
    if is_tensor_file(path):
        data = read_tensor_inputs(path)
        n = int(next(iter(data.values())).shape[0])
        if src.max_prompts is not None:
            n = min(n, src.max_prompts)
        calib, held = split_holdout(list(range(n)), holdout, cfg.seed + index)
        return tensor_batches(data, calib, size), tensor_batches(data, held, size)
    prompts = read_prompts(path, src.field, src.max_prompts)
    calib, held = split_holdout(prompts, holdout, cfg.seed + index)
    L = cfg.calibration.max_length
    return tokenize_batches(tokenizer, calib, L, size), (tokenize_batches(tokenizer, held, L, size) if held else [])


def prepare_tasks(plan: MergePlan, spec: OutputSpec, eval_spec: OutputSpec, dtype: Any, device: str,
                  log: Callable[[str], None], *, targets: bool = True,
                  visit: Callable[[int, str, Any, list[Any]], None] | None = None) -> list[TaskData]:
    """Batches and teacher-forced targets per task; each fine-tuned model is loaded, used, freed.

    ``targets=False`` skips the targets (the tasks then hold no batches); ``visit(index, name,
    model, calibration_batches)`` is called while each fine-tuned model is loaded (Fisher /
    RegMean statistics), so that no model is loaded twice."""
    import gc

    cfg = plan.config
    tok = load_tokenizer(plan.tokenizer_folder) if plan.tokenizer_folder else None
    base_folder = cfg.resolve(cfg.base)
    tasks = []
    for i, (name, entry, ck) in enumerate(zip(cfg.model_names(), cfg.models, plan.finetuned)):
        calib, held = _batches(cfg, i, tok)
        t = time.perf_counter()
        model = load_model(ck, base_folder, dtype, device)
        try:
            calib_targets = teacher_forced_targets(model, calib, spec, device) if targets else []
            held_targets = teacher_forced_targets(model, held, eval_spec, device) if held and targets else []
            if visit is not None:
                visit(i, name, model, calib)
        except MergeQPError:
            raise
        except Exception as exc:  # the model rejects these inputs: one message, no traceback
            first = (str(exc).splitlines() or [""])[0][:300]
            raise ValidationError(
                f"models[{name}]: the model failed on its calibration inputs ({type(exc).__name__}: "
                f"{first}); check the prompts / input tensors (names, shapes, dtype) against the model"
            ) from exc
        del model
        gc.collect()
        if targets:
            log(f"targets for {name}: {len(calib)} calibration + {len(held)} held-out batches "
                f"({time.perf_counter() - t:.1f} s)")
        tasks.append(TaskData(name, entry.weight, calib_targets, held_targets))
    return tasks


def heldout_mse(model: Any, tasks: Sequence[TaskData], eval_spec: OutputSpec, device: str) -> dict[str, float]:
    """Teacher-forced MSE per logit of real tokens on each task's held-out prompts."""
    return {t.name: teacher_forced_mse(model, t.heldout, eval_spec, device) for t in tasks if t.heldout}


def evaluate(model: Any, tasks: Sequence[TaskData], spec: OutputSpec, eval_spec: OutputSpec,
             device: str) -> dict[str, Any]:
    """The report's evaluation of one model: the calibration objective ``sum_t w_t sum_j
    ||h_j - y_j||^2`` (compared output, as the QP's) and the held-out MSE per task."""
    from ..lm import squared_error

    objective = sum(t.weight * squared_error(model, t.calibration, spec, device)[0] for t in tasks)
    return {"calibration_objective": objective, "heldout_mse": heldout_mse(model, tasks, eval_spec, device)}


def statistics_collector(plan: MergePlan, name: str, params: dict[str, Any], keys: Sequence[str],
                         log: Callable[[str], None]) -> StatisticsCollector:
    """A Fisher / RegMean :class:`~.calibrated.StatisticsCollector` for the checkpoint ``keys``."""
    cfg = plan.config
    return StatisticsCollector(name, params, plan.skeleton, keys, len(cfg.models), cfg.calibration.batch_size, log)


# ---------------------------------------------------------------------- baselines
def baseline_merge(plan: MergePlan, name: str, params: dict[str, Any], keys: Sequence[str],
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> dict[str, Any]:
    """``{key: merged tensor}`` for ``keys`` with :func:`mergeqp.merge_state_dicts`, read lazily in
    chunks of at most ``chunk_bytes`` (of base tensors). Non-floating tensors are copied from the
    base."""
    from . import merge_state_dicts  # type: ignore[attr-defined]

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
            merged = merge_state_dicts(name, {k: base_sd[k] for k in floats}, ft_sds,
                                       **{"progress": False, **params})
            for k in floats:
                if k not in merged:
                    raise ValidationError(f"baseline {name!r} returned no tensor {k!r}")
                out[k] = merged[k].to(base_sd[k].dtype)
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
    return [p for _, p in cfg.input_paths()]


def run_merge(cfg: MergeConfig, out_dir: str | Path, *, overwrite: bool = False, progress: bool = True,
              log: Callable[[str], None] | None = None, plan: MergePlan | None = None) -> MergeResult:
    """Merge per ``cfg`` into ``out_dir`` (see the module docstring). Returns the plan, the report
    and, for QP methods, the merged model (in memory, on the configured device)."""
    import torch

    say = log or (lambda msg: None)
    t_start = time.perf_counter()
    plan = plan or build_plan(cfg)
    out = Path(out_dir).expanduser()
    check_output_folder(out, _protected(cfg), overwrite=overwrite)
    device, device_note = resolve_device(cfg.device)
    notes = list(plan.notes) + ([device_note] if device_note else [])
    dtype = getattr(torch, cfg.dtype)
    torch.manual_seed(cfg.seed)
    base_folder = cfg.resolve(cfg.base)
    write_kwargs: dict[str, Any] = {
        "source_folder": base_folder, "tokenizer_folder": plan.tokenizer_folder,
        "max_shard_bytes": parse_size(cfg.max_shard_size), "protected": _protected(cfg),
        "overwrite": overwrite, "dtype": cfg.output_dtype,
    }
    report: dict[str, Any] = {"plan": plan.to_json(), "device": device, "notes": notes}

    spec = OutputSpec(cfg.output.field, cfg.output.restrict, cfg.output.k, cfg.seed)
    eval_spec = OutputSpec(cfg.output.field, "none")
    if not cfg.method.is_qp:
        return _run_baseline(plan, out, report, write_kwargs, spec, eval_spec, dtype, device, say, t_start)

    collector = None
    if statistics_method(cfg) is not None:  # a Fisher / RegMean hybrid start: statistics of every tensor
        assert cfg.method.start is not None
        collector = statistics_collector(plan, cfg.method.start.name, cfg.method.start.params,
                                         _float_keys(plan), say)
    tasks = prepare_tasks(plan, spec, eval_spec, dtype, device, say, visit=collector)
    if cfg.method.parametrisation == "basis" and cfg.method.basis == "optimal":
        from .outputbasis import check_jacobian_size

        c = max(int(tb.target[0].numel()) for t in tasks for tb in t.calibration)
        for site in plan.sites:  # before any model is linearised
            check_jacobian_size(site.name, c, site.r, parse_size(cfg.method.basis_max_size))
    model = load_model(plan.base, base_folder, dtype, device)
    task_targets = [TaskTargets(t.name, t.weight, t.calibration) for t in tasks]
    settings = QPSettings(
        parametrisation=cfg.method.parametrisation, basis=cfg.method.basis, rank=cfg.method.rank,
        constraints=tuple(cfg.method.constraints), solver=cfg.method.solver,
        solver_options=_solver_options(cfg, device), regularisation=cfg.method.regularisation,
        reference=cfg.method.reference, chunk_size=cfg.method.chunk_size, seed=cfg.seed,
        basis_max_bytes=parse_size(cfg.method.basis_max_size),
    )
    weights = WeightSource(plan.base, plan.finetuned)
    ctx = MergeContext(model, weights, task_targets, spec, settings, device, cfg.model_names(), progress, say)
    evaluation: dict[str, Any] = {"base": {"calibration_objective": calibration_objective(ctx),
                                           "heldout_mse": heldout_mse(model, tasks, eval_spec, device)}}
    start_overrides: dict[str, Any] = {}
    if cfg.method.mode == "hybrid":
        assert cfg.method.start is not None
        t = time.perf_counter()
        floats = _float_keys(plan)
        if collector is not None:
            start_overrides = collector.merge(plan, floats, DEFAULT_CHUNK_BYTES)
        else:
            start_overrides = baseline_merge(plan, cfg.method.start.name, cfg.method.start.params, floats)
        _load_into(model, start_overrides)
        evaluation["start"] = {"method": cfg.method.start.name, "params": cfg.method.start.params,
                               "calibration_objective": calibration_objective(ctx),
                               "heldout_mse": heldout_mse(model, tasks, eval_spec, device),
                               "seconds": time.perf_counter() - t}
        if collector is not None:
            evaluation["start"]["statistics"] = collector.summary()
            notes.extend(n for n in collector.notes if n not in notes)
    comparison_model = copy.deepcopy(model) if cfg.method.mode == "joint" and cfg.method.compare_sequential else None

    records = run_mode(ctx, cfg.method.mode, plan.sites)
    if cfg.method.mode == "hybrid":
        worse = [r.layer for r in records if r.objective_after_exact > r.objective_before]
        if worse:
            notes.append(
                f"hybrid: the QP step raised the exact calibration objective at {worse}: the QP's merged weight "
                f"is W_base + sum_a d_a B_a, and the {cfg.method.start.name} weight of a layer is a feasible point "  # type: ignore[union-attr]
                f"only when it has that form (task arithmetic / soup with rows or scalar, not TIES, DARE, "
                f"Fisher or RegMean); the linearisation error can do it too")
    uncertified = [r.layer for r in records if not r.certificate.get("certified", True)]
    if uncertified:
        why = "; ".join(dict.fromkeys(str(x) for r in records for x in r.certificate.get("reasons", [])))
        notes.append(f"QP solution NOT certified at {uncertified}: {why or 'see the certificates'}")
    if cfg.method.mode != "hybrid":
        worse = [r.layer for r in records
                 if r.objective_after > r.objective_before + 1e-9 * abs(r.objective_before)]
        if worse:
            notes.append(
                f"the QP objective rose at {worse}: the starting point (the current weights, d = 0) "
                f"is not in the constraint set {cfg.method.constraints}, so its optimum can lie above "
                f"it (an L1 ball or simplex away from 0), or the solve was not certified")
    evaluation["merged"] = {"calibration_objective": calibration_objective(ctx),
                            "heldout_mse": heldout_mse(model, tasks, eval_spec, device)}
    if comparison_model is not None:
        t = time.perf_counter()
        seq_ctx = MergeContext(comparison_model, weights, task_targets, spec, settings, device,
                               cfg.model_names(), progress, say)
        seq_records = run_mode(seq_ctx, "sequential", plan.sites)
        report["joint_vs_sequential"] = {
            "joint": {"calibration_objective": evaluation["merged"]["calibration_objective"],
                      "heldout_mse": evaluation["merged"]["heldout_mse"],
                      "qp_objective": records[0].objective_after,
                      "seconds": records[0].seconds},
            "sequential": {"calibration_objective": calibration_objective(seq_ctx),
                           "heldout_mse": heldout_mse(comparison_model, tasks, eval_spec, device),
                           "layers": [r.to_json() for r in seq_records],
                           "seconds": time.perf_counter() - t},
        }
        del comparison_model

    overrides = dict(start_overrides)
    for site in plan.sites:
        # stored in the base checkpoint's dtype, unless output_dtype says otherwise (the writer casts)
        like = None if cfg.output_dtype else {k: plan.base.get(k) for k in site.keys}
        overrides.update(stored_tensors(site, read_augmented(model, site), like))
    written = save_hf_folder(out, _stream(plan, overrides), **write_kwargs)
    report["layers"] = [r.to_json() for r in records]
    report["evaluation"] = evaluation
    report["output"] = _written_json(written)
    report["seconds"] = time.perf_counter() - t_start
    _write_reports(out, report)
    return MergeResult(plan, report, out, model)


def _run_baseline(plan: MergePlan, out: Path, report: dict[str, Any], write_kwargs: dict[str, Any],
                  spec: OutputSpec, eval_spec: OutputSpec, dtype: Any, device: str,
                  say: Callable[[str], None], t_start: float) -> MergeResult:
    """A baseline method: statistics (Fisher / RegMean) and targets (evaluation) while each
    fine-tuned model is loaded, the merge of the selected tensors, the evaluation of the base and
    the merged model, the folder and the report."""
    import gc

    cfg = plan.config
    name, params = cfg.method.name, cfg.method.params
    keys = plan.merged_keys()
    collector = statistics_collector(plan, name, params, keys, say) if needs_statistics(name) else None
    evaluated = evaluates_baseline(cfg)
    tasks: list[TaskData] = []
    t = time.perf_counter()
    if collector is not None or evaluated:
        tasks = prepare_tasks(plan, spec, eval_spec, dtype, device, say, targets=evaluated, visit=collector)
    t_stats = time.perf_counter() - t
    t = time.perf_counter()
    if collector is not None:
        merged = collector.merge(plan, keys, DEFAULT_CHUNK_BYTES)
    else:
        merged = baseline_merge(plan, name, params, keys)
    report["baseline"] = {"method": name, "params": params, "tensors": len(merged),
                          "seconds": time.perf_counter() - t + t_stats}
    if collector is not None:
        report["baseline"]["statistics"] = collector.summary()
        report["notes"].extend(n for n in collector.notes if n not in report["notes"])
    model = None
    if evaluated:
        model = load_model(plan.base, cfg.resolve(cfg.base), dtype, device)
        evaluation = {"base": evaluate(model, tasks, spec, eval_spec, device)}
        _load_into(model, merged)
        evaluation["merged"] = {"method": name, **evaluate(model, tasks, spec, eval_spec, device)}
        report["evaluation"] = evaluation
    written = save_hf_folder(out, _stream(plan, merged), **write_kwargs)
    report["output"] = _written_json(written)
    report["seconds"] = time.perf_counter() - t_start
    _write_reports(out, report)
    del merged
    gc.collect()
    return MergeResult(plan, report, out, model)


def _float_keys(plan: MergePlan) -> list[str]:
    return [k for k in plan.base.names() if plan.base.info(k).dtype.startswith(("float", "bfloat"))]


def _solver_options(cfg: MergeConfig, device: str) -> dict[str, Any]:
    opts = dict(cfg.method.solver_options)
    if cfg.method.solver.startswith("torch") and "device" not in opts:
        opts["device"] = device
    return opts


def _load_into(model: Any, tensors: dict[str, Any]) -> None:
    """Copy checkpoint-named ``tensors`` into the live model (renamed as ``transformers`` does)."""
    import torch

    state = model.state_dict()
    live = live_names(model)
    with torch.no_grad():
        for k, v in tensors.items():
            name = live.get(k, k)
            if name not in state:
                raise ValidationError(f"merged tensor {k!r} is not a parameter of the loaded model")
            state[name].copy_(v.to(dtype=state[name].dtype))


def _stream(plan: MergePlan, overrides: dict[str, Any]):
    """``(name, tensor)`` in the base checkpoint's order: merged tensors, else the base's."""
    for name in plan.base.names():
        tensor = overrides.get(name)
        yield name, (tensor if tensor is not None else plan.base.get(name))


def _written_json(w: Any) -> dict[str, Any]:
    return {"folder": str(w.folder), "weight_files": list(w.weight_files), "bytes": w.total_bytes,
            "tensors": w.n_tensors, "copied": list(w.copied), "index": w.index}


def _write_reports(out: Path, report: dict[str, Any]) -> None:
    from .report import write_json, write_markdown

    write_json(out / "report.json", report)
    write_markdown(out / "report.md", report)


__all__ = ["MergeResult", "baseline_merge", "load_model", "prepare_tasks", "resolve_device", "run_merge"]
