"""Streaming collection of :class:`CalibrationStats` from models and calibration data.

One pass over each task's calibration batches: the base model is linearised at the merge
layer (:func:`linearise_batch`), the task's target is computed (its fine-tuned model's output
by default, or encoded labels), and float64 accumulators are updated. Memory is
``O(n^2 + c^2 + r m1 + m1^2 + c T r)`` per task whatever the number of samples (``n`` = atoms
of each requested parametrisation), unless ``keep_samples=True`` (then ``O(N (c T r + T m1))``
more, estimated and bounded by ``max_sample_bytes``).

When the compared output is longer than ``T * r`` (e.g. many logits), each sample's Jacobian is
first reduced by a thin QR, ``L_j = Q_j R_j``: ``||A_j d + b_j||^2 = ||R_j F_j d + Q_j'b_j||^2 +
const``, so the Hessian costs ``T r`` rather than ``c`` rows per sample (exact).
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from ..errors import BadDataError, ValidationError, check_integer
from ..io.distributed import Ranks, current_group
from ..io.memory import COLLECT_ADVICE, SiteMemory, check_site_memory, design_bytes, memory_limit
from ..problem import as_names
from .calibration import CalibrationStats, CollectedProblem, SampleChunk
from .data import batch_len, checked_call, count_batches, iterate_batches, split_batch, to_device
from .gauss_newton import GaussNewtonSums
from .hooks import (
    augmented_weight,
    check_same_architecture,
    check_untied,
    differing_tensors,
    hooked_layers,
    resolve_linear,
)
from .linearise import (
    LinearisedBatch,
    flatten_output,
    linearise_batch,
    resolve_output_fn,
)
from .parametrisation import Parametrisation, as_parametrisation, checked_design, checked_n_atoms

TARGET_KINDS = ("finetuned", "labels")
DEFAULT_MAX_SAMPLE_BYTES = 2 * 2**30
DEFAULT_MAX_JACOBIAN_BYTES = 2 * 2**30
DEFAULT_MAX_GRAM_DIM = 8192


def collect_statistics(
    base_model: Any,
    finetuned_models: Sequence[Any] | Mapping[str, Any],
    layer: str,
    calibration: Sequence[Any],
    targets: str | Callable[..., Any] = "finetuned",
    output_fn: Callable[..., Any] | None = None,
    *,
    parametrisations: Sequence[Any] = ("rows", "scalar"),
    keep_samples: bool = False,
    label_encoding: Callable[..., Any] | None = None,
    reference_model: Any = None,
    model_names: Sequence[str] | None = None,
    task_names: Sequence[str] | None = None,
    batch_size: int = 64,
    jacobian_mode: str = "auto",
    chunk_size: int | None = 32,
    vectorize: bool = True,
    max_sample_bytes: float = DEFAULT_MAX_SAMPLE_BYTES,
    max_jacobian_bytes: float = DEFAULT_MAX_JACOBIAN_BYTES,
    max_gram_dim: int = DEFAULT_MAX_GRAM_DIM,
    max_memory: int | None = None,
    progress: bool = True,
) -> CalibrationStats:
    """Collect the merge QP's statistics at ``layer`` (an ``nn.Linear``, bias included).

    Parameters
    ----------
    base_model, finetuned_models:
        ``nn.Module`` s of one architecture; ``finetuned_models`` is a list (or a mapping name
        -> model) of K models. Residual updates ``delta_k`` are taken at ``layer``. Nothing is
        modified (models are put in eval mode during collection and restored after).
    calibration:
        K calibration sets, one per fine-tuned model in the same order; each an iterable of
        batches (tensor, ``(inputs, labels)`` or mapping; see :mod:`.data`) or one tensor of
        inputs cut into ``batch_size`` batches.
    targets:
        ``"finetuned"`` (default, the paper): the task's fine-tuned model's compared output;
        ``"labels"``: the batch labels, encoded by ``label_encoding(labels, task)`` (default:
        integer class labels one-hot over the ``c`` outputs, else the labels reshaped to
        ``(B, c)``); or a callable ``targets(inputs, labels, task) -> (B, ...)`` tensor.
    output_fn:
        selects the compared output from a model output: ``f(output)`` or ``f(output, task)``
        (e.g. logits, a projection, or a task-specific head). Default: the output tensor, its
        ``.logits``, or its first element; flattened to ``(B, c)``.
    parametrisations:
        parametrisations whose per-task ``H_t, g_t`` are streamed (names, bases or arrays).
        Others can be built later from kept samples, or (shared Jacobian, ``T = 1``) from
        sufficient statistics.
    keep_samples:
        keep per-sample ``z_j, L_j, b_j`` in float64 (any parametrisation and per-sample
        diagnostics later); memory grows with N and is capped by ``max_sample_bytes``.
    reference_model:
        measure residual updates from this model's layer instead of the base's (the base is
        then only the linearisation point, e.g. a partially merged model).
    jacobian_mode, chunk_size, vectorize:
        see :func:`~mergeqp.stats.linearise.linearise_batch`.
    max_gram_dim:
        the input Gram ``sum z z'`` is kept only when ``m + 1 <= max_gram_dim``.
    max_memory:
        bytes the statistics may take (sums, kept samples, one batch's Jacobian and design;
        :mod:`mergeqp.io.memory`); the layer is refused before its sums are allocated when the
        estimate exceeds it or the machine's available memory. ``None``: the enclosing
        :func:`~mergeqp.io.memory.memory_limit`, if any, and the available memory.

    Under ``torchrun`` (an initialised ``torch.distributed`` group, :mod:`mergeqp.io.distributed`)
    each rank handles every ``world_size``-th batch and the sums are all-reduced: every rank
    returns the statistics of all the data, equal to one process's up to float64 rounding.
    """
    import torch  # deferred: torch is heavy

    t_start = time.perf_counter()
    names_given = model_names
    if isinstance(finetuned_models, Mapping):
        if names_given is None:
            names_given = [str(k) for k in finetuned_models]
        finetuned_models = list(finetuned_models.values())
    finetuned_models = list(finetuned_models)
    K = len(finetuned_models)
    if K == 0:
        raise ValidationError("finetuned_models is empty: give at least one fine-tuned model")
    names = as_names(names_given, K, "model", "model_names")
    tasks = as_names(task_names if task_names is not None else names, K, "task", "task_names")
    if isinstance(calibration, (str, bytes)) or not isinstance(calibration, Sequence):
        raise ValidationError(
            f"calibration must be a list of K = {K} calibration sets (one per fine-tuned model), "
            f"got {type(calibration).__name__}"
        )
    if len(calibration) != K:
        raise ValidationError(
            f"calibration has {len(calibration)} set(s) but there are {K} fine-tuned models; "
            f"give one calibration set per model, in the same order"
        )
    check_integer("batch_size", batch_size)
    for who, m in [("base_model", base_model), *((f"fine-tuned model {n!r}", m) for n, m in zip(names, finetuned_models)),
                   *([("reference_model", reference_model)] if reference_model is not None else [])]:
        if not isinstance(m, torch.nn.Module):
            raise ValidationError(
                f"{who} is a {type(m).__name__}, not an nn.Module: the statistics run the models (load a state "
                f"dict into a copy of the architecture first: model.load_state_dict(state_dict))")
    if not callable(targets) and targets not in TARGET_KINDS:
        raise ValidationError(
            f"targets must be one of {TARGET_KINDS} or a callable, got {targets!r}"
        )
    check_same_architecture(base_model, list(zip(names, finetuned_models)))
    if reference_model is not None:
        check_same_architecture(base_model, [("reference_model", reference_model)])
    base_layer = resolve_linear(base_model, layer, "base model")
    check_untied(base_model, layer)
    base_weight = augmented_weight(base_layer)
    ref_weight = (augmented_weight(resolve_linear(reference_model, layer, "reference model"))
                  if reference_model is not None else None)
    anchor = base_weight if ref_weight is None else ref_weight
    deltas = np.stack([
        augmented_weight(resolve_linear(m, layer, f"fine-tuned model {n!r}")) - anchor
        for n, m in zip(names, finetuned_models)
    ])
    for n, delta, m in zip(names, deltas, finetuned_models):  # (labels as targets never run the fine-tunes)
        if not np.all(np.isfinite(delta)):
            raise BadDataError(f"the weights of layer {layer!r} in fine-tuned model {n!r} contain NaN or inf "
                               f"(its tensor {_nonfinite_tensor(m)!r} holds NaN or inf)")
    if not np.all(np.isfinite(anchor)):
        raise BadDataError(f"the weights of layer {layer!r} in the "
                           f"{'base' if ref_weight is None else 'reference'} model contain NaN or inf")
    has_bias = base_layer.bias is not None
    params = _resolve_params(parametrisations, deltas.shape[1], deltas.shape[2])
    out_fn = resolve_output_fn(output_fn)
    device = base_layer.weight.device
    totals = [count_batches(s, batch_size) for s in calibration]
    total = sum(totals) if all(t is not None for t in totals) else None
    acc = _Accumulator(
        deltas=torch.from_numpy(deltas).to(device), has_bias=has_bias, params=params,
        keep_samples=keep_samples, max_sample_bytes=max_sample_bytes,
        max_gram_dim=max_gram_dim, shared_tol=_shared_tol(base_layer.weight.dtype), layer=layer,
        expected_samples=total * batch_size if total else None,
    )
    limit = memory_limit(max_memory) if max_memory is not None else contextlib.nullcontext()
    group = current_group()  # under torchrun: this rank's share of the batches, sums reduced below

    bar = tqdm(total=None if total is None else len(range(group.rank, total, group.world_size)),
               desc=f"collect {layer}", unit="batch", disable=not progress or not group.is_writer())
    checked = [False] * K  # the first batch of each task also checks sample independence
    # under torchrun an error of this rank's own batch (bad data, a model that raises) stops its batches
    # and is raised on every rank before the reduction (the others would otherwise wait for it there)
    failed: Exception | None = None

    def add_batch(hook: Any, t: int, i: int, batch: Any, mine: bool, index: int) -> bool:
        """Linearise at batch ``i`` of task ``t`` and add it when it is this rank's (``mine``; then
        ``True`` unless it is empty), else only take the reference sample from it (another rank's
        first batch)."""
        where = f"task {tasks[t]!r} batch {i}"
        inputs, labels = split_batch(batch, where)
        inputs = to_device(inputs, device)
        B = batch_len(inputs, where)
        if B == 0:
            return False
        lin = linearise_batch(
            base_model, hook, inputs, out_fn, t, mode=jacobian_mode,
            chunk_size=chunk_size, vectorize=vectorize, where=where,
            max_jacobian_bytes=max_jacobian_bytes, check_independence=mine and not checked[t],
        )
        _check_finite(lin.output, f"{where}: the base model's compared output", base_model)
        _check_finite(lin.jacobian, f"{where}: the Jacobian at the merge layer")
        if not mine:  # another rank's first batch: only its first sample, the reference
            acc.set_reference(lin.jacobian, index - 1)
            return False
        checked[t] = checked[t] or B > 1  # a batch of one cannot show interaction
        y = _targets(targets, finetuned_models[t], names[t], inputs, labels, out_fn, t,
                     B, int(lin.output.shape[1]), label_encoding, where)
        acc.add(t, lin, y.to(device=device, dtype=torch.float64), where,
                expected=total * B if total else None, index=index - 1)
        return True

    try:
        index = 0  # batches over every task in order; rank `index mod world_size` handles batch `index`
        with hooked_layers(base_model, [base_layer], also_eval=finetuned_models) as (hook,), limit:
            for t, source in enumerate(calibration):
                for i, batch in enumerate(iterate_batches(source, batch_size, f"task {tasks[t]!r}")):
                    mine = group.owns(index)
                    index += 1
                    if failed is not None or (not mine and acc.c is not None):
                        continue
                    added, failed = group.held(lambda: add_batch(hook, t, i, batch, mine, index))
                    if added:
                        bar.update(1)
    finally:
        bar.close()
    group.raise_first(failed)
    acc.reduce(group)
    for t, n in enumerate(acc.counts):
        if n == 0:
            raise ValidationError(
                f"the calibration set of task {tasks[t]!r} (model {names[t]!r}) is empty"
            )
    meta = {
        "targets": targets if isinstance(targets, str) else getattr(targets, "__name__", "callable"),
        "model_dtype": str(base_layer.weight.dtype).replace("torch.", ""),
        "statistics_dtype": "float64",
        "weight_shape": [int(base_layer.weight.shape[0]), int(base_layer.weight.shape[1])],
        "jacobian_mode": jacobian_mode,
        "seconds": time.perf_counter() - t_start,
        "tensors_differing_outside_layer": {
            n: differing_tensors(base_model, m, layer) for n, m in zip(names, finetuned_models)
        },
        "reference": "reference_model" if reference_model is not None else "base_model",
        # how many processes shared the batches (under torchrun; the sums are the same to rounding)
        "processes": int(group.world_size),
    }
    return acc.finish(layer=layer, names=names, tasks=tasks, base_weight=base_weight,
                      ref_weight=ref_weight, deltas=deltas, metadata=meta)


def estimate_statistics_bytes(
    r: int, m: int, K: int, c: int, *, T: int = 1, has_bias: bool = True,
    parametrisations: Sequence[Any] = ("rows", "scalar"), n_samples: int = 0,
    keep_samples: bool = False, max_gram_dim: int = DEFAULT_MAX_GRAM_DIM,
) -> dict[str, int]:
    """Bytes the statistics will hold (float64), before collecting: ``{"statistics": ...,
    "samples": ..., "total": ...}``. Only ``samples`` grows with ``n_samples``.

    ``r, m``: the layer's output / input features; ``c``: compared outputs per sample;
    ``T``: positions per sample; parametrisations as for :func:`collect_statistics`.
    """
    m1 = m + int(has_bias)
    params = _resolve_params(parametrisations, r, m1)
    floats = K * r * m1 + r * m1  # deltas, base weight
    floats += K * (c * c + 1 + r * m1 + c * T * r)  # S_t, c_t, cross_t, Jacobian sums
    floats += K * m1 * m1 if (T == 1 and m1 <= max_gram_dim) else 0
    for p in params:
        n = K * p.n_atoms(r, m1)
        floats += K * (n * n + n)
    stats_bytes = 8 * floats + 8 * K  # + sample counts (int64)
    sample_bytes = 8 * n_samples * (T * m1 + c * T * r + c) if keep_samples else 0
    return {"statistics": stats_bytes, "samples": sample_bytes, "total": stats_bytes + sample_bytes}


def _resolve_params(specs: Sequence[Any], r: int, m1: int) -> list[Parametrisation]:
    if isinstance(specs, (str, bytes)) or not isinstance(specs, Sequence):
        specs = [specs]
    out: dict[str, Parametrisation] = {}
    for spec in specs:
        param = as_parametrisation(spec)
        param.check(r, m1)
        checked_n_atoms(param, r, m1)
        out[param.key] = param
    return list(out.values())


def _shared_tol(dtype: Any) -> float:
    import torch  # deferred: torch is heavy

    return 100.0 * float(torch.finfo(dtype).eps) if dtype.is_floating_point else 1e-6


def _check_finite(x: Any, what: str, model: Any = None) -> None:
    """:class:`BadDataError` when ``x`` holds NaN / inf; with the ``model`` that produced it, the
    message also names the first of its tensors that is not finite (if one is)."""
    import torch  # deferred: torch is heavy

    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        tensor = _nonfinite_tensor(model) if model is not None else None
        culprit = f" (its tensor {tensor!r} holds NaN or inf)" if tensor is not None else ""
        raise BadDataError(f"{what} contains {bad} NaN/inf value(s){culprit}")


def _nonfinite_tensor(model: Any) -> str | None:
    """The name of the first floating parameter or buffer of ``model`` holding NaN / inf."""
    import torch  # deferred: torch is heavy

    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name
    return None


def _targets(targets: Any, model: Any, name: str, inputs: Any, labels: Any,
             out_fn: Callable[[Any, int], Any], task: int, B: int, c: int,
             label_encoding: Callable[..., Any] | None, where: str) -> Any:
    import torch  # deferred: torch is heavy

    if callable(targets):
        y = flatten_output(targets(inputs, labels, task), B, f"{where}: targets()")
    elif targets == "finetuned":
        dev = next((p.device for p in model.parameters()), None)
        with torch.no_grad():
            out = checked_call(model, to_device(inputs, dev) if dev is not None else inputs, where,
                               f"fine-tuned model {name!r}")
            y = flatten_output(out_fn(out, task), B, f"{where}: fine-tuned model {name!r}")
        _check_finite(y, f"{where}: the output of fine-tuned model {name!r}", model)
    else:
        if labels is None:
            raise ValidationError(
                f"{where}: targets='labels' but the batch has no labels; give batches as "
                f"(inputs, labels) or a mapping with 'labels'"
            )
        y = _encode_labels(labels, task, B, c, label_encoding, where)
    if y.shape != (B, c):
        raise ValidationError(
            f"{where}: targets have {y.shape[1]} values per sample but the compared output has {c}"
        )
    _check_finite(y, f"{where}: the targets")
    return y.detach()


def _encode_labels(labels: Any, task: int, B: int, c: int,
                   label_encoding: Callable[..., Any] | None, where: str) -> Any:
    import torch  # deferred: torch is heavy

    labels = torch.as_tensor(labels)
    if label_encoding is not None:
        try:
            y = label_encoding(labels, task)
        except TypeError:
            y = label_encoding(labels)
        return flatten_output(torch.as_tensor(y), B, f"{where}: label_encoding()")
    if not labels.is_floating_point() and labels.shape == (B,):
        if int(labels.min()) < 0 or int(labels.max()) >= c:
            raise ValidationError(
                f"{where}: class labels range over [{int(labels.min())}, {int(labels.max())}] "
                f"but there are {c} outputs; pass label_encoding=..."
            )
        return torch.nn.functional.one_hot(labels.long(), c).to(torch.float64)
    if not labels.is_floating_point() and labels.ndim > 1:
        raise ValidationError(
            f"{where}: integer labels of shape {tuple(labels.shape)} are neither class indices "
            f"(shape ({B},)) nor target outputs; pass label_encoding=... to turn them into the "
            f"compared output's values (e.g. one-hot logits per token), or float targets"
        )
    return flatten_output(labels.to(torch.float64), B, f"{where}: labels")


class _Accumulator:
    """Float64 running sums on the model's device (see :class:`CalibrationStats`)."""

    def __init__(self, deltas: Any, has_bias: bool, params: list[Parametrisation],
                 keep_samples: bool, max_sample_bytes: float, max_gram_dim: int,
                 shared_tol: float, layer: str = "", expected_samples: int | None = None) -> None:
        import torch  # deferred: torch is heavy

        self.D = deltas.to(dtype=torch.float64)
        self.K, self.r, self.m1 = (int(s) for s in deltas.shape)
        self.has_bias = has_bias
        self.params = params
        self.keep = keep_samples
        self.max_sample_bytes = max_sample_bytes
        self.max_gram_dim = max_gram_dim
        self.shared_tol = shared_tol
        self.layer = layer
        self.expected_samples = expected_samples
        self.counts = [0] * self.K
        self.c: int | None = None
        self.T: int | None = None
        self.T_varies = False
        self.first_L: Any = None
        self.variation = 0.0
        self.samples: list[SampleChunk] = []
        self.samples_at: list[tuple[int, SampleChunk]] = []  # (batch index, chunk): for the gather
        self.sample_bytes = 0
        self.state: dict[str, Any] = {}
        self.sums: dict[str, GaussNewtonSums] = {}

    def _init(self, c: int, T: int, B: int) -> None:
        import torch  # deferred: torch is heavy

        z = {"dtype": torch.float64, "device": self.D.device}
        K, r, m1 = self.K, self.r, self.m1
        check_site_memory(self.memory(c, T, B), advice=COLLECT_ADVICE)  # before the sums are allocated
        self.c, self.T = c, T
        self.state = {
            "c": torch.zeros(K, **z),
            "S": torch.zeros(K, c, c, **z),
            "cross": torch.zeros(K, r, m1, **z),
            "jac": torch.zeros(K, c, T, r, **z),
            "gram": torch.zeros(K, m1, m1, **z) if (T == 1 and m1 <= self.max_gram_dim) else None,
        }
        self.sums = {p.key: GaussNewtonSums(K, K * p.n_atoms(r, m1), self.D.device)
                     for p in self.params}

    def memory(self, c: int, T: int, B: int) -> SiteMemory:
        """The memory model of this layer's statistics (:mod:`mergeqp.io.memory`): the sums
        (:func:`estimate_statistics_bytes`, with the kept samples projected to ``expected``
        samples), one batch's float64 Jacobian and the largest parametrisation's design."""
        n = max((self.K * p.n_atoms(self.r, self.m1) for p in self.params), default=0)
        est = estimate_statistics_bytes(
            self.r, self.m1 - int(self.has_bias), self.K, c, T=T, has_bias=self.has_bias, parametrisations=self.params,
            n_samples=self.expected_samples or 0, keep_samples=self.keep, max_gram_dim=self.max_gram_dim)
        batch = 8 * B * c * T * self.r + (design_bytes(B, min(c, T * self.r), n, 8) + 16 * n * n if n else 0)
        return SiteMemory(self.layer, n, est["total"], batch, 0)

    def set_reference(self, jacobian: Any, index: int) -> None:
        """Take the first sample of batch ``index`` (``jacobian``: ``(B, c, T, r)``), a batch
        another rank adds, as the reference of the shared-Jacobian check and the shapes of the
        sums: every rank then measures the variation from the same sample, as one process does."""
        import torch  # deferred: torch is heavy

        L = jacobian.to(torch.float64)
        self._init(int(L.shape[1]), int(L.shape[2]), int(L.shape[0]))
        self.first_L = L[0].clone()

    def reduce(self, group: Ranks) -> None:
        """Make every rank's partial sums the totals over all ranks (no-op for one process):
        sums and counts are added, the shared-Jacobian variation and the varying-positions flag
        are maxima, kept samples are gathered in batch order. Shapes come from the reference
        batch, which every rank saw (:meth:`set_reference`)."""
        import torch  # deferred: torch is heavy

        if not group.distributed:
            return
        flags = group.reduce_floats([float(self.T_varies), self.variation], op="max")
        if flags[0] and not self.T_varies:
            self.T_varies = True
            self.state["jac"] = None
            self.state["gram"] = None
        self.variation = float("inf") if self.T_varies else flags[1]
        counts = torch.tensor(self.counts, dtype=torch.int64)
        group.all_reduce_sum([counts, *self.state.values(), *(x for p in self.sums.values() for x in (p.H, p.g))])
        self.counts = [int(n) for n in counts.tolist()]
        if self.keep:
            indexed = sorted((pair for part in group.gather(self.samples_at) for pair in part), key=lambda p: p[0])
            self.samples = [chunk for _, chunk in indexed]
            self.sample_bytes = sum(chunk.nbytes for chunk in self.samples)

    def add(self, t: int, lin: LinearisedBatch, y: Any, where: str, expected: int | None,
            index: int = 0) -> None:
        """Add one batch of task ``t`` (``index``: its place among every task's batches, in
        order); ``expected`` estimates the total number of samples."""
        import torch  # deferred: torch is heavy

        f64 = torch.float64
        L = lin.jacobian.to(f64)
        B, c, T, r = (int(s) for s in L.shape)
        Z = lin.layer_input.to(f64)
        if Z.shape[-1] + int(self.has_bias) != self.m1:
            raise ValidationError(
                f"{where}: the layer input has {Z.shape[-1]} features; expected {self.m1 - int(self.has_bias)}"
            )
        if self.has_bias:
            Z = torch.cat([Z, torch.ones(B, T, 1, dtype=f64, device=Z.device)], dim=2)
        b = lin.output.to(f64) - y
        if self.c is None:
            self._init(c, T, B)
        elif c != self.c:
            raise ValidationError(
                f"{where}: the compared output has {c} values per sample, but earlier batches had "
                f"{self.c}; the output_fn must give the same length for every task"
            )
        elif T != self.T and not self.T_varies:
            self.T_varies = True
            self.state["jac"] = None
            self.state["gram"] = None
        s = self.state
        s["c"][t] += (b * b).sum()
        s["S"][t] += b.T @ b
        beta = torch.einsum("bctr,bc->btr", L, b)
        s["cross"][t] += torch.einsum("btr,btm->rm", beta, Z)
        if s["jac"] is not None:
            s["jac"][t] += L.sum(0)
        if s["gram"] is not None:
            Z1 = Z[:, 0, :]
            s["gram"][t] += Z1.T @ Z1
        self._track_sharing(L)
        if self.params:
            if c > T * r:  # exact reduction: only range(L_j) matters for H and g
                Qf, Rf = torch.linalg.qr(L.reshape(B, c, T * r))
                L_red = Rf.reshape(B, T * r, T, r)
                b_red = torch.einsum("bck,bc->bk", Qf, b)
            else:
                L_red, b_red = L, b
            R = torch.einsum("btm,krm->bktr", Z, self.D)
            for p in self.params:
                self.sums[p.key].add_design(t, checked_design(p, L_red, R, Z, self.D), b_red)
        self.counts[t] += B
        if self.keep:
            chunk = SampleChunk(task=t, layer_input=Z.cpu().numpy(), jacobian=L.cpu().numpy(),
                                residual=b.cpu().numpy())
            self.sample_bytes += chunk.nbytes
            projected = self.sample_bytes
            if expected:
                projected = max(projected, chunk.nbytes * math.ceil(expected / B))
            if projected > self.max_sample_bytes:
                raise ValidationError(
                    f"{where}: keeping per-sample data needs about {projected / 2**20:.0f} MiB "
                    f"({chunk.nbytes / B / 1024:.1f} KiB per sample), above max_sample_bytes = "
                    f"{self.max_sample_bytes / 2**20:.0f} MiB; collect without keep_samples "
                    f"(listing the parametrisations you need) or raise the limit"
                )
            self.samples.append(chunk)
            self.samples_at.append((index, chunk))

    def _track_sharing(self, L: Any) -> None:
        if self.T_varies:
            self.variation = float("inf")
            return
        if self.first_L is None:
            self.first_L = L[0].clone()
        scale = float(self.first_L.abs().max())
        dev = float((L - self.first_L).abs().max())
        rel = dev / scale if scale > 0 else (0.0 if dev == 0 else float("inf"))
        self.variation = max(self.variation, rel)

    def finish(self, *, layer: str, names: tuple[str, ...], tasks: tuple[str, ...],
               base_weight: np.ndarray, ref_weight: np.ndarray | None, deltas: np.ndarray,
               metadata: dict[str, Any]) -> CalibrationStats:
        if self.c is None:
            raise ValidationError("calibration data is empty: no batch had any sample")
        s = self.state

        def np_(x: Any) -> np.ndarray | None:
            return None if x is None else x.cpu().numpy()

        collected = {
            p.key: CollectedProblem(p, np_(self.sums[p.key].H), np_(self.sums[p.key].g))
            for p in self.params
        }
        shared = (not self.T_varies) and self.variation <= self.shared_tol
        if self.T_varies:
            warnings.warn("the merge layer's number of positions varied between batches; the "
                          "mean Jacobian is not kept", RuntimeWarning, stacklevel=3)
        return CalibrationStats(
            layer=layer, model_names=names, task_names=tasks, has_bias=self.has_bias,
            deltas=deltas, base_weight=base_weight, task_counts=np.array(self.counts),
            task_c=np_(s["c"]), task_S=np_(s["S"]), task_cross=np_(s["cross"]),
            task_jacobian_sum=np_(s["jac"]), task_gram=np_(s["gram"]),
            jacobian_shared=bool(shared), jacobian_variation=float(self.variation),
            positions=None if self.T_varies else self.T, collected=collected,
            samples=tuple(self.samples) if self.keep else None,
            reference_weight=ref_weight, metadata=metadata,
        )
