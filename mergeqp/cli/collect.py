"""``mergeqp collect``: calibration statistics (and the merge QP) from checkpoints and data.

Models come from a Python factory (``package.module:function`` or ``path/to/file.py:function``,
called with ``--factory-kwargs`` as keyword arguments) into which the state dicts
(``.safetensors``, or ``.pt``/``.pth``/``.bin`` torch state dicts) are loaded strictly.
Calibration files hold one task each: ``.pt`` (a tensor of inputs, a tuple ``(inputs,
labels)``, or a dict with ``inputs``/``x`` and optional ``labels``/``y``) or ``.npz`` (arrays
``inputs``/``x`` and optional ``labels``/``y``, or a single array); further entries of a dict /
``.npz`` that the model's forward takes by name (a mask, ...) are passed to it as keywords, split
into the batches where their first dimension is the number of samples (:func:`load_calibration`).

Every argument is checked before any model or data is loaded (:func:`validate_args`); the
statistics and problem files may not be (or overwrite) an input, and are written atomically.
NaN or inf in a checkpoint or in calibration inputs stops the run with exit code 3.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import BadDataError, ConfigError, ValidationError, failure_text, unknown
from ..io.atomic import check_free_space, check_output_file
from ..io.checkpoint import torch_load
from ..io.distributed import Ranks, agree_exit_code, agree_on, launch_requested, launched
from ..io.writer import check_tensor_finite, parse_size

INPUT_KEYS = ("inputs", "x")
LABEL_KEYS = ("labels", "y")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "collect",
        help="collect calibration statistics of a merge layer and write the merge QP",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--factory", required=True,
                   help="model factory: package.module:function or path/to/file.py:function")
    p.add_argument("--factory-kwargs", default="{}", help="JSON object of keyword arguments")
    p.add_argument("--base", required=True, help="base model state dict (.safetensors/.pt)")
    p.add_argument("--finetuned", required=True, nargs="+", help="fine-tuned state dicts (K)")
    p.add_argument("--names", nargs="+", help="names of the fine-tuned models (default: file stems)")
    p.add_argument("--layer", required=True, help="name of the nn.Linear merge layer")
    p.add_argument("--calibration", required=True, nargs="+",
                   help="calibration data files, one per fine-tuned model, same order (.pt/.npz): a tensor of "
                        "inputs, or a dict / .npz with 'x' (or 'inputs'), optional 'labels' (or 'y'), and further "
                        "entries (a mask, ...) passed to the model as keywords where its forward takes them")
    p.add_argument("--targets", choices=("finetuned", "labels"), default="finetuned")
    p.add_argument("--output-fn", help="module:function selecting the compared output")
    p.add_argument("--parametrisation", nargs="+", default=["rows", "scalar"],
                   help="parametrisations to stream (rows, scalar, columns, or one registered with --import)")
    p.add_argument("--keep-samples", action="store_true",
                   help="keep per-sample data (any basis later; memory grows with samples)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--dtype", choices=("float32", "float64"),
                   help="convert the models to this dtype (default: as loaded)")
    p.add_argument("--device", default="cpu", help="torch device for the models: cpu, cuda, cuda:N or auto")
    p.add_argument("--jacobian-mode", choices=("auto", "reverse", "forward"), default="auto")
    p.add_argument("--out", required=True, help="statistics file to write (.npz)")
    p.add_argument("--problem", help="merge QP file to write (default: OUT stem + _problem.npz)")
    p.add_argument("--problem-parametrisation", default="rows",
                   help="parametrisation of the written QP (rows, scalar, columns, NAME:P basis, or one registered with --import)")
    p.add_argument("--task-weights", help="'mean' or comma-separated weights, one per task: they weigh the "
                                          "tasks in the problem file (--problem); the statistics file keeps each "
                                          "task's statistics unweighted (mergeqp sweep --task-weights weighs them)")
    p.add_argument("--max-memory",
                   help="cap on the statistics' memory, e.g. 8GB; the layer is refused before its sums are "
                        "allocated when the estimate exceeds it (or the available memory)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def streamable() -> list[str]:
    """The parametrisations ``collect`` streams by name: the built-in rows / scalar / columns and every
    registered entry not built per layer (a user's, through ``--import``; before stop 49 refused)."""
    from ..stats.parametrisation import PARAMETRISATIONS  # deferred, as the other stats imports here

    return [n for n, p in PARAMETRISATIONS.items() if not p.built_per_layer]


@dataclass(frozen=True)
class CollectArgs:
    """The checked arguments of ``mergeqp collect`` (everything but the models and data)."""

    factory_kwargs: dict[str, Any]
    device: str
    task_weights: Any
    problem_path: str
    max_memory: int | None = None
    #: ``P`` of a basis ``--problem-parametrisation NAME:P``, checked against the layer once it is known
    basis_size: int | None = None


def validate_args(args: argparse.Namespace) -> CollectArgs:
    """Check every argument before any model or data is loaded; raises :class:`ConfigError` /
    :class:`ValidationError` naming the option."""
    try:
        factory_kwargs = json.loads(args.factory_kwargs)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--factory-kwargs is not valid JSON: {exc}") from None
    if not isinstance(factory_kwargs, dict):
        raise ConfigError("--factory-kwargs must be a JSON object")
    if ":" not in args.factory:
        raise ConfigError(f"--factory must look like module:function or file.py:function, got {args.factory!r}")
    inputs = [args.base, *args.finetuned, *args.calibration]
    for path in inputs:
        if not os.path.exists(path):
            raise ValidationError(f"file not found: {path}")
        if os.path.isdir(path):
            raise ValidationError(f"{path} is a folder; give a checkpoint or calibration file")
    if len(args.calibration) != len(args.finetuned):
        raise ValidationError(
            f"--calibration has {len(args.calibration)} file(s) but --finetuned has "
            f"{len(args.finetuned)}; give one calibration file per fine-tuned model"
        )
    if args.names is not None:
        if len(args.names) != len(args.finetuned):
            raise ConfigError(f"--names has {len(args.names)} name(s) but --finetuned has {len(args.finetuned)}")
        if len(set(args.names)) != len(args.names):
            raise ConfigError(f"--names must be unique, got {args.names}")
    else:
        stems = [os.path.splitext(os.path.basename(f))[0] for f in args.finetuned]
        if len(set(stems)) != len(stems):
            raise ConfigError(f"--finetuned: the models are named by their file stems, and {stems} repeat one; "
                              f"give each a name with --names")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
    names = streamable()
    for name in args.parametrisation:
        if name not in names:
            raise ConfigError(f"--parametrisation: {unknown('parametrisation', name, names)}")
    basis_size = check_problem_parametrisation(args.problem_parametrisation)
    task_weights = parse_task_weights(args.task_weights, len(args.finetuned))
    device = check_device(args.device)
    max_memory = None
    if args.max_memory is not None:
        try:
            max_memory = parse_size(args.max_memory)
        except ValidationError as exc:
            raise ConfigError(f"--max-memory: {exc}") from None
    problem_path = args.problem or os.path.splitext(args.out)[0] + "_problem.npz"
    suffix = os.path.splitext(problem_path)[1]
    if suffix and suffix != ".npz":
        raise ConfigError(f"--problem {problem_path}: the problem is written as an .npz file (numpy's archive); "
                          f"got the suffix {suffix!r}")
    if not problem_path.endswith(".npz"):
        problem_path += ".npz"  # the file MergeQP.save_npz writes: the one to check
    protected = inputs + [s.rpartition(":")[0] for s in (args.factory, args.output_fn or "")
                          if s.rpartition(":")[0].endswith(".py")]
    check_output_file(args.out, "--out", protected)
    check_output_file(problem_path, "--problem", protected)
    if os.path.realpath(problem_path) == os.path.realpath(args.out):
        raise ConfigError(f"--out and --problem are the same file {args.out}; give two paths")
    return CollectArgs(factory_kwargs, device, task_weights, problem_path, max_memory, basis_size)


def estimate_output_bytes(rows: int, columns: int, n_models: int, parametrisations: list[str]) -> int:
    """A rough size (bytes) of the statistics and problem files for a merge layer with ``rows`` x
    ``columns`` (weight and bias) and ``n_models`` models: float64 ``H`` (n x n) and ``g`` per
    task and in total for each streamed parametrisation, once more for the problem file, plus
    the residuals. Per-sample data (``--keep-samples``) comes on top."""
    from ..stats.parametrisation import PARAMETRISATIONS  # deferred, as the other stats imports here

    n_tasks = n_models
    total = 0
    for name in parametrisations:
        entry = PARAMETRISATIONS.get(name)
        n = n_models * (entry.n_atoms(rows, columns) if entry is not None and not entry.built_per_layer else rows)
        total += 8 * (n * n + n) * (n_tasks + 2)
    return total + 2 * 8 * n_models * rows * columns


def check_problem_parametrisation(spec: str) -> int | None:
    """``rows`` / ``scalar`` / ``columns`` (or another registered parametrisation not built per layer)
    or a basis ``NAME:P[:SEED]`` with a registered NAME and integers P >= 1, SEED >= 0; returns P
    (``None`` for a named parametrisation), which :func:`_check_basis_size` compares with the layer's
    outputs once the layer is known."""
    if spec in streamable():
        return None
    from ..stats.bases import BASES  # deferred: the stats package imports torch

    parts = spec.split(":")
    if len(parts) not in (2, 3):
        raise unknown("parametrisation (--problem-parametrisation)", spec,
                      [*streamable(), *(f"{b}:P" for b in BASES)])
    if parts[0] not in BASES:
        raise unknown("basis name (--problem-parametrisation)", parts[0], BASES)
    try:
        numbers = [int(x) for x in parts[1:]]
    except ValueError:
        raise ConfigError(f"--problem-parametrisation {spec!r}: P (and SEED) must be integers") from None
    if numbers[0] < 1 or (len(numbers) == 2 and numbers[1] < 0):
        raise ConfigError(f"--problem-parametrisation {spec!r}: P must be >= 1 and SEED >= 0")
    return numbers[0]


def run(args: argparse.Namespace) -> int:
    """Collect (under ``torchrun``: each rank its share of the batches, the sums all-reduced;
    rank 0 writes and prints, every rank exits with the largest exit code)."""
    checked = validate_args(args)
    with launched(checked.device) as group:
        code, summary = _collect(args, checked, group)
        code = agree_exit_code(group, code)
    if group.is_writer():  # once every rank has agreed: a reader that stops early (`| head`) strands none
        print(summary)
    return code


def _collect(args: argparse.Namespace, checked: CollectArgs, group: Ranks) -> tuple[int, str]:
    """The collection; ``(exit code, the summary rank 0 prints)``."""
    import numpy as np
    import torch

    from ..stats import collect_statistics

    factory_kwargs, device, task_weights = checked.factory_kwargs, checked.device, checked.task_weights
    plain = streamable()
    streamed = list(args.parametrisation)
    keep_samples = args.keep_samples
    if args.problem_parametrisation in plain:
        if args.problem_parametrisation not in streamed:
            streamed.append(args.problem_parametrisation)
    elif not keep_samples:
        # a basis is built after collection from per-sample data (or from a shared Jacobian's
        # sufficient statistics, which are only known to suffice after collection)
        if group.is_writer():  # (under torchrun: once)
            print(f"note: --problem-parametrisation {args.problem_parametrisation} is a basis; "
                  f"keeping per-sample data (as with --keep-samples)")
        keep_samples = True
    factory = load_callable(args.factory, "--factory")
    output_fn = load_callable(args.output_fn, "--output-fn") if args.output_fn else None
    dtype = getattr(torch, args.dtype) if args.dtype else None
    base = build_model(factory, factory_kwargs, args.base, dtype, device)
    fts = [build_model(factory, factory_kwargs, f, dtype, device) for f in args.finetuned]
    layer = dict(base.named_modules()).get(args.layer)
    if isinstance(layer, torch.nn.Linear):  # else collect_statistics names the bad layer
        _check_basis_size(args.problem_parametrisation, checked.basis_size, int(layer.out_features))
        need = estimate_output_bytes(layer.out_features, layer.in_features + 1, len(fts), streamed)
        # rank 0 writes: its check is every rank's verdict (the others stop here too, with its code)
        agree_on(group, lambda: check_free_space(args.out, need, "the statistics and problem files"))
    names = args.names or [os.path.splitext(os.path.basename(f))[0] for f in args.finetuned]
    # floating inputs in the model's dtype (np.savez writes float64: a float32 model then failed with
    # "mat1 and mat2 must have the same dtype" unless --dtype was given; a review, stop 74)
    model_dtype = dtype or next((p.dtype for p in base.parameters() if p.is_floating_point()), None)
    accepts, first = forward_keywords(base)
    say = (lambda msg: None) if args.quiet or not group.is_writer() else (lambda msg: print(msg, file=sys.stderr))
    calibration = [load_calibration(f, args.batch_size, model_dtype, uses_labels=args.targets == "labels",
                                    accepts=accepts, log=say, input_name=first) for f in args.calibration]
    stats = collect_statistics(
        base, fts, args.layer, calibration, targets=args.targets, output_fn=output_fn,
        parametrisations=streamed, keep_samples=keep_samples,
        model_names=names, batch_size=args.batch_size, jacobian_mode=args.jacobian_mode,
        max_memory=checked.max_memory, progress=not args.quiet and group.is_writer(),
    )
    problem_path = checked.problem_path
    made = []

    def write() -> None:  # rank 0 alone (the same statistics are on every rank); its failure stops them all
        stats.save(args.out)  # first: a problem that cannot be built then keeps the collected statistics
        problem = stats.problem(args.problem_parametrisation, task_weights=task_weights)
        # the residuals (and parametrisation) let `mergeqp solve --constraint sign` build the
        # TIES-like sign-consensus set from the problem file alone
        extra = {}
        if args.problem_parametrisation in plain:
            extra = {"deltas": np.asarray(stats.deltas, dtype=np.float64),
                     "parametrisation": np.array(args.problem_parametrisation)}
        problem.save_npz(problem_path, extra=extra)
        made.append(problem)

    agree_on(group, write)
    if not group.is_writer():
        return 0, ""
    problem = made[0]
    weighted = "" if task_weights is None else f", tasks weighted {args.task_weights}: J(0) = {problem.c:.6g}"
    return 0, "\n".join([stats.summary(), f"collected in {stats.metadata['seconds']:.2f} s",
                          f"statistics -> {args.out}",
                          f"merge QP ({args.problem_parametrisation}, n = {problem.n}{weighted}) -> {problem_path}"])


def _check_basis_size(spec: str, p: int | None, r: int) -> None:
    """A ``--problem-parametrisation BASIS:P`` with ``P`` (:func:`check_problem_parametrisation`'s)
    above the layer's ``r`` outputs, refused once the layer is known, before the collection (it failed
    after it, and its statistics were lost: a review, stop 74)."""
    if p is not None and p > r:
        raise ConfigError(f"--problem-parametrisation {spec}: {p} basis directions, but the layer has r = {r} outputs "
                          f"(at most {r})")


def forward_keywords(model: Any) -> tuple[Callable[[str], bool], str | None]:
    """``(accepts, first)``: whether ``model``'s forward takes a keyword of that name (every name where
    it takes ``**kwargs`` or its signature cannot be read), and the name of its first parameter (the
    inputs' keyword when a batch passes further entries; ``None`` where it has none by name)."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return (lambda name: True), None
    named = [n for n, p in params.items() if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                         inspect.Parameter.KEYWORD_ONLY)]
    first = next((n for n, p in params.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD), None)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return (lambda name: True), first
    return (lambda name: name in named), first


def check_device(name: str) -> str:
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when available); a clear error for a
    device that torch lacks here (or a non-compute device such as ``meta``). Under a ``torchrun``
    launch on CUDA, ``cuda`` / ``auto`` is each rank's own GPU (``LOCAL_RANK``)."""
    from ..solvers.torch_solvers import torch_device

    if name in ("cuda", "auto") and launch_requested() > 1 and torch_device(name).type == "cuda":
        name = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    device = torch_device(name)
    if device.type not in ("cpu", "cuda", "mps", "xpu"):
        raise ValidationError(f"--device {name!r} cannot run the models; use cpu, cuda, cuda:N or auto")
    return str(device)


def parse_task_weights(spec: str | None, n_tasks: int | None = None) -> Any:
    """``None`` / ``"mean"`` as given, else one finite weight >= 0 per task (not all zero)."""
    if spec is None or spec == "mean":
        return spec
    try:
        weights = [float(v) for v in spec.split(",")]
    except ValueError:
        raise ConfigError(f"--task-weights must be 'mean' or comma-separated numbers, got {spec!r}") from None
    if n_tasks is not None and len(weights) != n_tasks:
        raise ConfigError(f"--task-weights has {len(weights)} weight(s) but there are {n_tasks} task(s) "
                          f"(one per --finetuned model)")
    if any(not math.isfinite(w) or w < 0 for w in weights) or not any(w > 0 for w in weights):
        raise ConfigError(f"--task-weights must be finite, >= 0 and not all zero, got {spec!r}")
    return weights


def load_callable(spec: str, option: str) -> Any:
    """``package.module:function`` or ``path/to/file.py:function`` -> the callable."""
    if ":" not in spec:
        raise ConfigError(f"{option} must look like module:function or file.py:function, got {spec!r}")
    target, _, name = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            if not os.path.exists(target):
                raise ConfigError(f"{option}: file not found: {target}")
            mod_name = "_mergeqp_user_" + os.path.splitext(os.path.basename(target))[0]
            spec_obj = importlib.util.spec_from_file_location(mod_name, target)
            assert spec_obj is not None and spec_obj.loader is not None
            module = importlib.util.module_from_spec(spec_obj)
            spec_obj.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - report any import failure of user code
        raise ConfigError(f"{option}: cannot import {target!r}: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"{option}: {target!r} has no callable {name!r}")
    return fn


def load_state_dict(path: str) -> dict[str, Any]:
    import torch

    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            sd = load_file(path)
        else:
            sd = torch_load(path, "checkpoint")
    except ValidationError:
        raise
    except Exception as exc:  # noqa: BLE001 - any unreadable checkpoint
        if os.path.isfile(path) and not os.access(path, os.R_OK):  # safetensors calls it "No such file"
            raise ValidationError(f"cannot read checkpoint {path}: permission denied") from None
        raise ValidationError(f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}") from None
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict):
        raise ValidationError(f"{path} does not hold a state dict (got {type(sd).__name__})")
    for name, value in sd.items():
        if isinstance(value, torch.Tensor):
            check_tensor_finite(name, value, f"checkpoint {path}")
    return sd


def build_model(factory: Any, kwargs: dict[str, Any], path: str, dtype: Any, device: str) -> Any:
    import torch

    try:
        model = factory(**kwargs)
    except Exception as exc:  # noqa: BLE001 - user code: named with where it raised (MERGEQP_TRACEBACK=1: its traceback)
        raise ConfigError(f"the model factory failed: {failure_text(exc)}") from exc
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"the model factory returned a {type(model).__name__}, not an nn.Module")
    sd = load_state_dict(path)
    expected = model.state_dict()
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    if missing or unexpected:  # counted and sampled (torch's own message lists every key)
        parts = [f"{len(v)} {what} (e.g. {', '.join(v[:3])})" for what, v in
                 (("missing", missing), ("unexpected", unexpected)) if v]
        raise ValidationError(f"checkpoint {path} does not fit the factory's model: {'; '.join(parts)}; the model's "
                              f"tensors are e.g. {', '.join(list(expected)[:3])}")
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as exc:
        detail = " ".join(str(exc).split())
        raise ValidationError(f"checkpoint {path} does not fit the factory's model: {detail[:500]}") from None
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device).eval()


def load_calibration(path: str, batch_size: int, dtype: Any, uses_labels: bool = True,
                     accepts: Callable[[str], bool] | None = None,
                     log: Callable[[str], None] | None = None, input_name: str | None = None) -> list[Any]:
    """One task's calibration file -> a list of batches: ``inputs``, ``(inputs, labels)``, or, where
    the file holds further entries the model's forward takes (``accepts(name)``; ``None``: every
    entry), ``{KEY: inputs, [labels,] **extras}``, ``KEY`` the forward's first parameter
    (``input_name``; else the file's own input key, ``x`` or ``inputs``), which calls the model with
    every entry as a keyword, as the Python API does (such
    entries were dropped without a word before stop 74, and the model ran without its mask). An extra
    whose first dimension is the number of samples is split into the batches with the inputs; any
    other (a broadcast ``position_ids (1, T)``) goes whole into each. Entries the forward does not take
    are left out, named through ``log``. ``uses_labels``: ``--targets labels``; without it a list ``[a,
    b]`` of two tensors of one shape is refused (read as inputs and labels, ``b`` was half the
    calibration lost)."""
    import numpy as np
    import torch

    raw: dict[str, Any] = {}
    key = INPUT_KEYS[1]
    if path.endswith(".npz"):
        try:
            with np.load(path, allow_pickle=False) as data:
                files = list(data.files)
                key = next((k for k in INPUT_KEYS if k in files), files[0] if len(files) == 1 else None)
                if key is None:
                    raise ValidationError(
                        f"{path}: expected an array named {' or '.join(INPUT_KEYS)} (arrays: {files})"
                    )
                inputs = torch.from_numpy(data[key])
                lkey = next((k for k in LABEL_KEYS if k in files), None)
                labels = torch.from_numpy(data[lkey]) if lkey else None
                raw = {k: data[k] for k in files if k not in (key, lkey)}
        except ValidationError:
            raise
        except Exception as exc:  # noqa: BLE001 - any unreadable file, one clear line
            raise ValidationError(f"cannot read calibration file {path}: {type(exc).__name__}: {exc}") from None
    else:
        obj = torch_load(path, "calibration file")
        labels = None
        if isinstance(obj, torch.Tensor):
            inputs = obj
        elif isinstance(obj, dict):
            key = next((k for k in INPUT_KEYS if k in obj), None)
            if key is None:
                raise ValidationError(f"{path}: expected a key {' or '.join(INPUT_KEYS)} (keys: {list(obj)})")
            inputs = obj[key]
            lkey = next((k for k in LABEL_KEYS if k in obj), None)
            labels = obj[lkey] if lkey is not None else None
            raw = {str(k): v for k, v in obj.items() if k not in (key, lkey)}
        elif isinstance(obj, (tuple, list)) and len(obj) == 2:
            inputs, labels = obj
            if (not uses_labels and isinstance(inputs, torch.Tensor) and isinstance(labels, torch.Tensor)
                    and labels.shape == inputs.shape and labels.dtype == inputs.dtype):
                raise ValidationError(
                    f"{path}: a pair of two tensors of one shape {tuple(inputs.shape)} is read as (inputs, labels), "
                    f"but --targets finetuned uses no labels: for two batches, save one tensor (torch.cat) or "
                    f"{{'x': inputs}}; for inputs and labels, use --targets labels")
        else:
            raise ValidationError(f"{path}: expected a tensor, (inputs, labels) or a dict, got {type(obj).__name__}")
    if not isinstance(inputs, torch.Tensor) or inputs.ndim == 0:
        raise ValidationError(f"{path}: the inputs must be a tensor with a sample dimension")
    if inputs.shape[0] == 0:
        raise ValidationError(f"{path}: the calibration inputs are empty (0 samples)")
    if inputs.is_floating_point() and not bool(torch.isfinite(inputs).all()):
        raise BadDataError(f"calibration file {path}: the inputs hold "
                           f"{int((~torch.isfinite(inputs)).sum())} non-finite value(s) (NaN or inf)")
    if labels is not None and len(labels) != inputs.shape[0]:
        raise ValidationError(f"{path}: {inputs.shape[0]} inputs but {len(labels)} labels")
    n = int(inputs.shape[0])
    numeric = {k for k, v in raw.items()
               if isinstance(v, torch.Tensor) or (isinstance(v, np.ndarray) and v.dtype.kind in "biuf")}
    taken = [k for k in raw if (accepts is None or accepts(k)) and k != input_name and k in numeric]
    if log is not None:
        for why, names in (("not a parameter of the model's forward",
                            [k for k in raw if k not in taken and k in numeric and k != input_name]),
                           ("not numbers", [k for k in raw if k not in numeric]),
                           (f"the inputs {key!r} are passed under that name", [k for k in raw if k == input_name])):
            if names:
                log(f"note: {path}: {', '.join(map(repr, names))} left out ({why})")
    extras: dict[str, Any] = {}
    for name in taken:
        value = raw[name]
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(value)
        if not isinstance(value, torch.Tensor):
            raise ValidationError(f"{path}: entry {name!r} is a {type(value).__name__}; an entry beside the inputs and "
                                  f"labels that the model's forward takes is passed as a keyword and must be a tensor")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise BadDataError(f"calibration file {path}: entry {name!r} holds non-finite value(s) (NaN or inf)")
        extras[name] = value
    if dtype is not None and inputs.is_floating_point():
        inputs = inputs.to(dtype)
    if dtype is not None:
        extras = {k: v.to(dtype) if v.is_floating_point() else v for k, v in extras.items()}
    batches = []
    for start in range(0, n, batch_size):
        x = inputs[start:start + batch_size]
        y = None if labels is None else labels[start:start + batch_size]
        if not extras:
            batches.append(x if y is None else (x, y))
            continue
        batch = {input_name or key: x, **({LABEL_KEYS[0]: y} if y is not None else {})}
        for name, value in extras.items():
            per_sample = value.ndim > 0 and int(value.shape[0]) == n
            batch[name] = value[start:start + batch_size] if per_sample else value
        batches.append(batch)
    return batches
