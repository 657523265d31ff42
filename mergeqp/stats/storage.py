"""The ``.npz`` file format of :class:`~mergeqp.stats.calibration.CalibrationStats` (arrays +
JSON metadata): :func:`save_stats` writes one, :func:`read_stats` reads its fields back
(:meth:`CalibrationStats.load` builds the statistics from them).

Layout (``allow_pickle=False`` throughout): ``meta`` is a JSON string (format tag, version,
layer, names, flags, the collected parametrisations and the free-form metadata); every array
field of the statistics is stored under its own name; each collected parametrisation ``i``
under ``collected{i}_H``, ``collected{i}_g`` (and ``collected{i}_Q`` for a basis); kept samples
as ``sample{i}_z``, ``sample{i}_jacobian``, ``sample{i}_residual`` with their tasks in
``sample_tasks``.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import numpy as np

from ..errors import BadDataError, MergeQPError, ValidationError
from ..io.atomic import save_npz_atomic
from ..jsonutil import to_jsonable
from .parametrisation import PARAMETRISATIONS, Basis, BasisParametrisation, as_parametrisation
from .records import CollectedProblem, SampleChunk

FORMAT = "mergeqp.stats"
VERSION = 1
ARRAY_FIELDS = ("deltas", "base_weight", "task_counts", "task_c", "task_S", "task_cross",
                "task_jacobian_sum", "task_gram", "reference_weight")


def save_stats(stats: Any, path: str, *, include_samples: bool = True) -> None:
    """Write ``stats`` (a :class:`~mergeqp.stats.calibration.CalibrationStats`) to ``path``
    (``.npz``)."""
    arrays: dict[str, np.ndarray] = {}
    for name in ARRAY_FIELDS:
        value = getattr(stats, name)
        if value is not None:
            arrays[name] = np.asarray(value)
    collected = []
    for i, (key, item) in enumerate(stats.collected.items()):
        entry: dict[str, Any] = {"key": key, "name": item.parametrisation.name, "index": i}
        arrays[f"collected{i}_H"] = item.H
        arrays[f"collected{i}_g"] = item.g
        if isinstance(item.parametrisation, BasisParametrisation):
            basis = item.parametrisation.basis
            arrays[f"collected{i}_Q"] = basis.Q
            entry["basis_name"] = basis.name
            entry["basis_info"] = dict(basis.info)
        collected.append(entry)
    n_chunks = 0
    if include_samples and stats.samples is not None:
        for i, chunk in enumerate(stats.samples):
            arrays[f"sample{i}_z"] = chunk.layer_input
            arrays[f"sample{i}_jacobian"] = chunk.jacobian
            arrays[f"sample{i}_residual"] = chunk.residual
        arrays["sample_tasks"] = np.array([ch.task for ch in stats.samples], dtype=np.int64)
        n_chunks = len(stats.samples)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "layer": stats.layer,
        "model_names": list(stats.model_names),
        "task_names": list(stats.task_names),
        "has_bias": bool(stats.has_bias),
        "jacobian_shared": bool(stats.jacobian_shared),
        "jacobian_variation": float(stats.jacobian_variation),
        "positions": stats.positions,
        "collected": collected,
        "samples": n_chunks if (include_samples and stats.samples is not None) else None,
        "metadata": dict(stats.metadata),
    }
    # numbers and arrays as JSON numbers and lists (numpy scalars were written as their text, arrays
    # as numpy's abbreviated print: stop 74); other objects as their text
    arrays["meta"] = np.array(json.dumps(to_jsonable(meta, nonfinite="keep", other="string")))
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ValidationError(f"cannot write {path}: directory {directory} does not exist")
    save_npz_atomic(path, arrays)


def _collected_parametrisation(name: str, path: str) -> Any:
    """The parametrisation a file's collected ``H, g`` were streamed for, by its registered
    ``name``; ``None`` (with a warning) for one whose atoms are built per layer and not stored (its
    sums cannot be used without them); a :class:`ValidationError` naming the file for a name not
    registered in this process (a user's entry: import its module first)."""
    if name not in PARAMETRISATIONS:
        raise ValidationError(f"{path}: statistics collected for the parametrisation {name!r}, which is not "
                              f"registered here: import the module that registers it first (mergeqp --import "
                              f"FILE.py ..., or import it in Python); registered: {', '.join(PARAMETRISATIONS)}")
    if PARAMETRISATIONS[name].built_per_layer:
        warnings.warn(f"{path}: the {name!r} statistics are left out: that parametrisation's atoms are built for "
                      f"each layer and the file does not hold them (collect it again, or keep samples)",
                      stacklevel=3)
        return None
    return as_parametrisation(name)


def read_stats(path: str) -> dict[str, Any]:
    """The fields (keyword arguments of ``CalibrationStats``) of a file written by
    :func:`save_stats`; raises :class:`ValidationError` for a missing or foreign file."""
    if not os.path.exists(path):
        raise ValidationError(f"statistics file not found: {path}")
    try:
        with open(path, "rb") as fh:
            head = fh.read(6)
    except OSError as exc:
        raise ValidationError(f"cannot read statistics file {path}: {exc.strerror or exc}") from None
    if not head.startswith((b"PK", b"\x93NUMPY")):  # neither a zip (.npz) nor a .npy file
        raise ValidationError(f"cannot read statistics file {path}: it is not a NumPy .npz archive (it starts with "
                              f"{head!r}; mergeqp collect writes statistics files)")
    try:
        data = np.load(path, allow_pickle=False)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is reported the same way
        reason = ("it holds pickled Python objects, which mergeqp never loads (a statistics file holds numeric "
                  "arrays only)" if "pickle" in str(exc) else str(exc))
        raise ValidationError(f"cannot read statistics file {path}: {reason}") from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise ValidationError(f"{path} is not a mergeqp statistics file (a single .npy array, not an .npz archive)")
    with data:
        if "meta" not in data.files:
            raise ValidationError(f"{path} is not a mergeqp statistics file (no 'meta' entry)")
        try:
            meta = json.loads(str(data["meta"]))
        except json.JSONDecodeError as exc:
            raise ValidationError(f"{path}: corrupt metadata ({exc})") from None
        if not isinstance(meta, dict):
            raise ValidationError(f"{path}: corrupt metadata (a JSON {type(meta).__name__}, not an object)")
        if meta.get("format") != FORMAT:
            raise ValidationError(f"{path} is not a mergeqp statistics file (format {meta.get('format')!r})")
        try:
            version = int(meta.get("version", 0))
        except (TypeError, ValueError, OverflowError):
            raise ValidationError(f"{path}: corrupt metadata (version {meta.get('version')!r} is not a whole "
                                  f"number)") from None
        if version > VERSION:
            raise ValidationError(f"{path} was written by a newer mergeqp (version {meta['version']})")
        try:
            fields = _fields(path, data, meta)
        except MergeQPError:
            raise
        except (KeyError, TypeError, AttributeError, ValueError, IndexError) as exc:
            raise ValidationError(f"{path}: damaged statistics file ({type(exc).__name__}: {exc})") from None
    _check_fields(path, fields)
    return fields


#: the array fields every statistics file holds (the others are optional)
REQUIRED_ARRAYS = ("deltas", "base_weight", "task_counts", "task_c", "task_S", "task_cross")


def _fields(path: str, data: Any, meta: dict[str, Any]) -> dict[str, Any]:
    """The statistics' fields from an open ``.npz`` and its parsed metadata."""
    missing = [name for name in REQUIRED_ARRAYS if name not in data.files]
    if missing:
        raise ValidationError(f"{path}: damaged statistics file: no array {missing[0]!r}")
    arrays = {name: (data[name] if name in data.files else None) for name in ARRAY_FIELDS}
    collected = {}
    for entry in meta["collected"]:
        i = entry["index"]
        if f"collected{i}_Q" in data.files:
            param = BasisParametrisation(Basis(data[f"collected{i}_Q"], name=entry.get("basis_name", "user"),
                                               info=entry.get("basis_info", {})))
        else:
            param = _collected_parametrisation(entry["name"], path)
            if param is None:
                continue
        collected[entry["key"]] = CollectedProblem(param, data[f"collected{i}_H"], data[f"collected{i}_g"])
    samples = None
    if meta.get("samples") is not None:
        tasks = data["sample_tasks"]
        samples = tuple(
            SampleChunk(task=int(tasks[i]), layer_input=data[f"sample{i}_z"],
                        jacobian=data[f"sample{i}_jacobian"], residual=data[f"sample{i}_residual"])
            for i in range(int(meta["samples"]))
        )
    return dict(
        layer=meta["layer"], model_names=tuple(meta["model_names"]),
        task_names=tuple(meta["task_names"]), has_bias=bool(meta["has_bias"]),
        jacobian_shared=bool(meta["jacobian_shared"]),
        jacobian_variation=float(meta["jacobian_variation"]),
        positions=meta["positions"], collected=collected, samples=samples,
        metadata=meta.get("metadata", {}), **arrays,
    )


def _check_fields(path: str, fields: dict[str, Any]) -> None:
    """Shapes that agree with each other, and finite numbers, in the arrays of a statistics file
    (a damaged or hand-edited file fails here, naming the array, not inside a later solve)."""
    K = len(fields["model_names"])
    deltas = np.asarray(fields["deltas"])
    if deltas.ndim != 3 or deltas.shape[0] != K:
        raise ValidationError(f"{path}: damaged statistics file: 'deltas' has shape {deltas.shape}, expected "
                              f"({K}, r, m1) for {K} models")
    _, r, m1 = deltas.shape
    S = np.asarray(fields["task_S"])
    c = S.shape[-1] if S.ndim == 3 else -1
    expected = {"base_weight": (r, m1), "task_counts": (K,), "task_c": (K,), "task_S": (K, c, c),
                "task_cross": (K, r, m1), "task_gram": (K, m1, m1), "reference_weight": (r, m1)}
    for name, shape in expected.items():
        value = fields.get(name)
        if value is not None and tuple(np.shape(value)) != shape:
            raise ValidationError(f"{path}: damaged statistics file: {name!r} has shape {tuple(np.shape(value))}, "
                                  f"expected {shape} (K = {K} models, r = {r}, m1 = {m1}, c = {c})")
    jac_sum = fields.get("task_jacobian_sum")
    if jac_sum is not None:
        shape = tuple(np.shape(jac_sum))
        if len(shape) != 4 or shape[:2] != (K, c) or shape[3] != r:
            raise ValidationError(f"{path}: damaged statistics file: 'task_jacobian_sum' has shape {shape}, expected "
                                  f"({K}, {c}, T, {r}) (K = {K} models, c = {c} outputs, T positions, r = {r} rows)")
    task_c = np.asarray(fields["task_c"])  # sums of squares: never negative (counts: checked with the problem)
    if task_c.dtype.kind in "fiu" and task_c.size and float(np.min(task_c)) < 0:
        raise BadDataError(f"{path}: damaged statistics file: 'task_c' holds a negative value "
                           f"({float(np.min(task_c)):.6g}); it is a sum of squares per task")
    checked: list[tuple[str, Any]] = [(n, fields[n]) for n in ARRAY_FIELDS if fields.get(n) is not None]
    for i, (key, problem) in enumerate(fields["collected"].items()):
        H, g = np.shape(problem.H), np.shape(problem.g)
        if len(g) != 2 or g[0] != K or H != (K, g[1], g[1]):
            raise ValidationError(f"{path}: damaged statistics file: collected problem {key!r} has H_t {H} and g_t "
                                  f"{g}, expected ({K}, n, n) and ({K}, n) for {K} models")
        checked += [(f"collected{i}_H ({key})", problem.H), (f"collected{i}_g ({key})", problem.g)]
    for i, chunk in enumerate(fields["samples"] or ()):
        z, jac, res = (np.shape(a) for a in (chunk.layer_input, chunk.jacobian, chunk.residual))
        B, T = (z[0], z[1]) if len(z) == 3 else (-1, -1)
        if len(z) != 3 or z[2] != m1 or jac != (B, c, T, r) or res != (B, c) or not 0 <= chunk.task < K:
            raise ValidationError(f"{path}: damaged statistics file: kept batch {i} (task {chunk.task}) has layer "
                                  f"inputs {z}, Jacobians {jac} and residuals {res}; expected (B, T, {m1}), "
                                  f"(B, {c}, T, {r}) and (B, {c}) of a task below {K}")
        checked += [(f"sample{i}_z", chunk.layer_input), (f"sample{i}_jacobian", chunk.jacobian),
                    (f"sample{i}_residual", chunk.residual)]
    for name, value in checked:
        value = np.asarray(value)
        if value.dtype.kind in "fc" and not np.all(np.isfinite(value)):
            raise BadDataError(f"{path}: array {name!r} of the statistics contains "
                               f"{int(np.size(value) - np.count_nonzero(np.isfinite(value)))} NaN/inf value(s)")
