"""Fisher and RegMean in ``mergeqp merge``: their calibration statistics from the config's prompts.

The two baselines that are not tensor-wise (``fisher``, ``regmean``; see ``docs/baselines.md``)
need statistics of each fine-tuned model on its own task's data. ``mergeqp merge`` gets them from
the same calibration prompts as the QP (tokenised with the base tokenizer, the held-out prompts
left out), while each fine-tuned model is loaded anyway for its teacher-forced targets (one model
at a time, :func:`mergeqp.run.pipeline.prepare_tasks` calls the :class:`StatisticsCollector`):

- ``regmean``: :func:`mergeqp.merge.compute_grams` of the selected linear layers only, on the
  real tokens (padding removed, :func:`mergeqp.io.calibration.unpadded_inputs`): every real
  token is a row of ``X_k``, ``G_k = X_k'X_k / N_k``. Other selected tensors follow the method's
  rule (the weighted average of the fine-tuned tensors).
- ``fisher``: :func:`mergeqp.merge.compute_fisher` over the selected tensors only; one example =
  one prompt; its log-likelihood is the sum over the prompt's real tokens of
  ``log p(y_t | prompt)`` teacher forced, with ``y_t`` the fine-tuned model's own argmax
  prediction at position ``t`` (``argmax`` labels). Why not the prompt's next tokens (the
  empirical Fisher)? (1) The argmax works for every model the pipeline merges: causal LMs,
  masked LMs fed unmasked text (whose "label" at a position would be the input token itself)
  and classifiers (ViT) calibrated on unlabelled inputs; (2) it is the mode of the model's own
  predictive distribution, the distribution Matena & Raffel's Fisher takes its expectation over,
  whereas the empirical Fisher weights directions by how badly the model fits the data
  (Kunstner et al., 2019); (3) it measures what the merge has to preserve here -- the
  fine-tuned model's own outputs, the same targets the QP and the evaluation use.

Which methods take statistics, and which, is a capability of the registered method
(``MergeMethod.statistics``, a :class:`~mergeqp.merge.method.CalibrationStatistics`; the two
built in are in :mod:`.calibration_statistics`), so a user's method can declare its own.

The merge itself is :func:`mergeqp.merge_state_dicts` with the precomputed ``fishers=`` /
``grams=`` (RegMean also gets the ``meta``-device architecture, which tells it which tensors
are linear layers and how they are stored), run on the selected tensors in chunks that never
split a module's weight from its bias. ``normalize_fisher`` is applied over all selected
tensors before chunking, so the result does not depend on the chunk size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, MergeQPError, ValidationError, did_you_mean
from ..io.calibration import unpadded_inputs
from .method import CalibrationStatistics, MergeMethod
from .registry import MERGE_METHODS, get_merge_method, merge_state_dicts
from .sites import checkpoint_names, model_sites


def statistics_of(name: str) -> CalibrationStatistics | None:
    """The calibration statistics the registered method ``name`` takes from the pipeline, or ``None``
    (also for an unknown name: the method check reports those)."""
    method = MERGE_METHODS.get(name)
    return None if method is None else method.statistics


def needs_statistics(name: str) -> bool:
    """Whether the method ``name`` gets calibration statistics from the pipeline."""
    return statistics_of(name) is not None


def statistics_methods() -> list[str]:
    """Names of the registered methods that take calibration statistics."""
    return [n for n, m in MERGE_METHODS.items() if m.statistics is not None]


def check_params(name: str, params: Mapping[str, Any], where: str) -> None:
    """Validate the parameter block of a method with calibration statistics from a config (the
    pipeline supplies the model, the calibration data and the statistics; everything else is
    the method's own)."""
    method = get_merge_method(name)
    spec = _spec(method)
    supplied = [k for k in params if k in spec.supplied]
    if supplied:
        raise ConfigError(
            f"{where}.params: {', '.join(repr(k) for k in supplied)} cannot be set in a config: mergeqp merge "
            f"computes the {spec.what} from each model's calibration prompts (give 'calibration' per model)"
        )
    valid = config_params(name)
    unknown = [k for k in params if k not in valid and k not in spec.supplied]
    if unknown:
        hint = did_you_mean(unknown[0], valid)
        raise ConfigError(f"{where}.params: unknown parameter {unknown[0]!r} of {name!r}{hint}; valid: "
                          f"{', '.join(valid)}")
    try:
        _parse_with_placeholders(method, params)
    except MergeQPError as exc:
        raise ConfigError(f"{where}.params: {exc}") from None


def _parse_with_placeholders(method: MergeMethod, params: Mapping[str, Any], model: Any = None) -> Any:
    """``method.parse`` of a config's ``params``, with stand-ins for the model (``model``, else any
    object) and calibration data that the pipeline supplies to a method with statistics (a config
    cannot give them)."""
    supplied = method.statistics.supplied if method.statistics is not None else ()
    stand_ins = {"model": object() if model is None else model, "calibration": []}
    return method.parse({**params, **{k: v for k, v in stand_ins.items() if k in supplied}})


def config_params(name: str) -> list[str]:
    """The parameters of ``name`` a config may set (the method's own, minus what the pipeline
    supplies and the tensor selection, which is the config's ``layers``)."""
    method = get_merge_method(name)
    return [p for p in method.valid_params() if p not in _not_in_configs(method, _spec(method))]


def _not_in_configs(method: MergeMethod, spec: CalibrationStatistics | None) -> set[str]:
    """Parameters of ``method`` a config does not set: the tensor selection (the config's
    ``layers``), the progress switch and what the pipeline supplies for statistics (``spec``)."""
    return {"include", "exclude", "progress"} | (set(spec.supplied) if spec is not None else set())


def run_params(name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """A baseline's parameters as the run takes them: each one a config may set, as the method
    parsed it (the defaults included; JSON values), for a report's record (a bare ``method: ties``
    was reported with ``{}``, which said nothing of the density and scaling that ran; stop 56
    review). ``params`` itself for a name that is not a merge method (a model method's own)."""
    if name not in MERGE_METHODS:
        return dict(params)
    method = get_merge_method(name)
    try:  # (the placeholders are among what the pipeline supplies, so left out with it)
        return _parse_with_placeholders(method, params).model_dump(
            mode="json", exclude=_not_in_configs(method, method.statistics))
    except Exception:  # noqa: BLE001 - a user method's own parameters that do not dump: the config's, as given
        return dict(params)


def _spec(method: MergeMethod) -> CalibrationStatistics:
    if method.statistics is None:
        raise ValidationError(f"merge method {method.name!r} takes no calibration statistics from the pipeline")
    return method.statistics


def live_names(skeleton: Any) -> dict[str, str]:
    """Checkpoint name -> live state-dict name of the architecture (``transformers`` renames some)."""
    return {stored: live for live, stored in checkpoint_names(skeleton).items()}


def module_chunks(keys: Sequence[str], nbytes: Callable[[str], int], chunk_bytes: int) -> list[list[str]]:
    """``keys`` cut into chunks of at most ``chunk_bytes`` (a chunk always holds at least one
    module), never separating tensors of one module (``x.weight`` and ``x.bias``)."""
    modules: dict[str, list[str]] = {}
    for k in keys:
        modules.setdefault(k.rsplit(".", 1)[0], []).append(k)
    chunks: list[list[str]] = []
    current: list[str] = []
    size = 0
    for group in modules.values():
        g = sum(nbytes(k) for k in group)
        if current and size + g > chunk_bytes:
            chunks.append(current)
            current, size = [], 0
        current.extend(group)
        size += g
    if current:
        chunks.append(current)
    return chunks


@dataclass(frozen=True)
class BatchStatistics:
    """One batch's statistics (:meth:`StatisticsCollector.batch_parts`) and what it held."""

    statistics: dict[str, Any]
    examples: int
    tokens: int
    seconds: float


def pool_statistics(parts: Sequence[Mapping[str, Any]], count_key: Callable[[str], str]) -> dict[str, Any]:
    """The statistics of the union of disjoint batch sets from each set's: every statistic ``k`` is a
    mean over units whose number is the entry ``count_key(k)`` (see
    :class:`~mergeqp.merge.method.CalibrationStatistics`), so the pooled one is ``sum_j c_j s_j /
    sum_j c_j`` and the pooled count ``sum_j c_j``. A statistic missing from a part (no unit of it
    there) is pooled over the parts that have it."""
    if not parts:
        raise ValidationError("pool_statistics: no statistics to pool")
    counts = {count_key(k) for part in parts for k in part if count_key(k) != k and count_key(k) in part}
    sums: dict[str, Any] = {}
    units: dict[str, Any] = {}
    for j, part in enumerate(parts):
        for k, value in part.items():
            if k in counts:
                continue
            ck = count_key(k)
            if ck not in part:
                raise ValidationError(f"pool_statistics: part {j}: statistic {k!r} has no count entry {ck!r}")
            c = part[ck]
            sums[k] = sums[k] + c * value if k in sums else c * value
            units[k] = units[k] + c if k in units else c
    out: dict[str, Any] = {k: total / units[k] for k, total in sums.items()}
    for ck in counts:
        out[ck] = sum(part[ck] for part in parts if ck in part)
    return out


class StatisticsCollector:
    """Collects the calibration statistics of method ``name`` (its ``statistics`` capability: Fisher,
    RegMean or a user's) from each fine-tuned model (called once per model, while it is loaded)
    for the checkpoint tensors ``keys``, then merges them.

    ``skeleton``: the architecture (``meta`` device is enough); ``params``: the method's
    parameters from the config; ``batch_size``: examples per statistics batch."""

    def __init__(self, name: str, params: Mapping[str, Any], skeleton: Any, keys: Sequence[str],
                 n_models: int, batch_size: int, log: Callable[[str], None] | None = None,
                 heads: Mapping[str, Callable[[Any, Any], Any]] | None = None):
        method = get_merge_method(name)
        self.spec = _spec(method)
        self.name = name
        self.params = dict(params)
        self.parsed = _parse_with_placeholders(method, self.params, skeleton)
        self.skeleton = skeleton
        self.keys = list(keys)
        self.batch_size = batch_size
        self.log = log or (lambda msg: None)
        self.live = live_names(skeleton)
        live_keys = {self.live.get(k, k) for k in self.keys}
        param_names = {n for n, _ in skeleton.named_parameters(remove_duplicate=False)}
        self.fisher_names = [n for n in (self.live.get(k, k) for k in self.keys) if n in param_names]
        self.layers = [s.name for s in model_sites(skeleton) if f"{s.name}.weight" in live_keys]
        self.statistics: list[dict[str, Any] | None] = [None] * n_models
        self.records: list[dict[str, Any]] = [{} for _ in range(n_models)]
        self.notes: list[str] = []
        #: per model name, the log-likelihood of its task's classifier (a head on the pooled
        #: output, :func:`mergeqp.lm.head_log_likelihood`) for statistics that score the model's
        #: predictions (Fisher) where the model itself outputs no logits
        self.heads: dict[str, Callable[[Any, Any], Any]] = dict(heads or {})

    # ------------------------------------------------------------------ collection
    def __call__(self, index: int, model_name: str, model: Any, batches: Sequence[Any]) -> None:
        """Statistics of fine-tuned model ``index`` (a live model on its device) on its task's
        calibration ``batches`` (:class:`mergeqp.io.calibration.Batch`)."""
        part, what = self._collect(model_name, model, batches)
        self.statistics[index] = part.statistics
        self.records[index] = {"model": model_name, "examples": part.examples, "tokens": part.tokens,
                               "seconds": part.seconds}
        self.log(f"{self.name} statistics for {model_name}: {what} on {part.examples} example(s) "
                 f"({part.seconds:.1f} s)")

    def _collect(self, model_name: str, model: Any, batches: Sequence[Any]) -> tuple[BatchStatistics, str]:
        """The method's statistics on ``batches`` (padding removed, float64 on the CPU), what they
        held, and the method's description of them."""
        import torch  # optional heavy dependency: only called with a loaded model

        t = time.perf_counter()
        inputs = unpadded_inputs(batches, self.batch_size)
        examples = sum(int(next(iter(b.values())).shape[0]) for b in inputs)
        tokens = sum(int(b["input_ids"].numel()) for b in inputs if "input_ids" in b)
        stats, what = self.spec.collect(self, model, inputs, model_name)
        stats = {k: v.detach().to("cpu", torch.float64) for k, v in stats.items()}
        return BatchStatistics(stats, examples, tokens, time.perf_counter() - t), what

    @property
    def poolable(self) -> bool:
        """Whether statistics of single batches pool into those of any set of them
        (``CalibrationStatistics.count_key``; :meth:`batch_parts`, :meth:`pool`)."""
        return self.spec.count_key is not None and (self.spec.pools is None or bool(self.spec.pools(self)))

    def batch_parts(self, model_name: str, model: Any, batches: Sequence[Any]) -> list[BatchStatistics]:
        """The statistics of each of ``batches`` alone (a :attr:`poolable` method), for :meth:`pool`:
        one pass over the data serves every subset of the batches (``method: auto``'s folds)."""
        if not self.poolable:
            raise ValidationError(f"{self.name}: its statistics do not pool (no count_key, or not with these "
                                  "parameters); collect each set of batches")
        parts = [self._collect(model_name, model, [batch])[0] for batch in batches]
        self.log(f"{self.name} statistics for {model_name}: {len(parts)} batch(es) of "
                 f"{sum(p.examples for p in parts)} example(s), each once, to pool per fit "
                 f"({sum(p.seconds for p in parts):.1f} s)")
        return parts

    def pool(self, index: int, model_name: str, parts: Sequence[BatchStatistics]) -> None:
        """Set fine-tuned model ``index``'s statistics to those of the union of ``parts``' batches
        (:func:`pool_statistics`), as :meth:`__call__` on those batches would collect them (to rounding)."""
        if self.spec.count_key is None:
            raise ValidationError(f"{self.name}: its statistics do not pool (no count_key)")
        self.statistics[index] = pool_statistics([p.statistics for p in parts], self.spec.count_key)
        examples = sum(p.examples for p in parts)
        seconds = sum(p.seconds for p in parts)
        self.records[index] = {"model": model_name, "examples": examples, "tokens": sum(p.tokens for p in parts),
                               "seconds": seconds, "pooled_batches": len(parts)}

    # ------------------------------------------------------------------ merge
    def merge(self, plan: Any, keys: Sequence[str], chunk_bytes: int) -> dict[str, Any]:
        """``{checkpoint key: merged tensor}`` (the written dtype: ``plan.written_dtype()``, else the
        base's) for ``keys``: the registered method's merge with the collected statistics, in
        module-aligned chunks."""
        missing = [i for i, s in enumerate(self.statistics) if s is None]
        if missing:
            raise ValidationError(f"{self.name}: no statistics for model(s) {missing}")
        stats: list[dict[str, Any]] = [s for s in self.statistics if s is not None]
        params = dict(self.params)
        if self.spec.prepare is not None:
            stats, params = self.spec.prepare(self, stats, params)
        out: dict[str, Any] = {}
        for chunk in module_chunks(list(keys), lambda k: plan.base.info(k).nbytes, chunk_bytes):
            base_sd = plan.base.get_many(chunk)
            floats = [k for k in chunk if base_sd[k].is_floating_point()]
            for k in chunk:
                if k not in floats:
                    out[k] = base_sd[k]
            if not floats:
                continue
            live = {k: self.live.get(k, k) for k in floats}
            base_live = {live[k]: base_sd[k] for k in floats}
            fts_live = [{live[k]: v for k, v in ft.get_many(floats).items()} for ft in plan.finetuned]
            extra = self.spec.merge_kwargs(self, stats, set(live.values()))
            written = plan.written_dtype()
            try:
                merged = merge_state_dicts(self.name, base_live, fts_live, out_dtype=written,
                                           **{"progress": False, **params, **extra})
            except MergeQPError as exc:
                raise type(exc)(f"{self.name} merge of {floats[0]!r}...: {exc}") from None
            for k in floats:
                out[k] = merged[live[k]].to(written or base_sd[k].dtype)
        return out

    def summary(self) -> dict[str, Any]:
        """What was collected (for the report)."""
        return {**self.spec.summary(self), "models": self.records, "notes": list(self.notes)}


__all__ = ["BatchStatistics", "StatisticsCollector", "check_params", "config_params", "module_chunks", "needs_statistics",
           "pool_statistics", "statistics_methods", "statistics_of"]
