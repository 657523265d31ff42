"""The registry of model methods: ``method:`` names that ``mergeqp merge`` runs on the live models.

``MODEL_METHODS`` maps a name to its :class:`~.model_method.ModelMethod`; the built-in ones,
``output_space`` (:mod:`.output_space_method`) and ``regmean_sequential``
(:mod:`.regmean_sequential_method`), are registered explicitly below.
:func:`register_model_method` adds one (a user's too); :func:`model_method_of` is how the plan and
the pipeline ask whether a config's method is one. A model method may share its name only with a
merge method of :data:`mergeqp.MERGE_METHODS` that is for Python alone (``output_space`` is both: the
Python function on calibration samples and this run on live models; in a merge config the model
method runs); the name of a baseline a config runs is refused (:func:`baseline_clash`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError, check_callable, check_new_name, check_signature, lookup, named_failure
from ..merge.calibrated import check_params, statistics_methods, statistics_of
from ..merge.registry import MERGE_METHODS
from .auto import Candidate, candidate_where
from .model_method import ModelMethod, StartFit
from .output_space_method import OUTPUT_SPACE_RUN
from .regmean_sequential_method import REGMEAN_SEQUENTIAL_RUN

MODEL_METHODS: dict[str, ModelMethod] = {}

#: ``method.name`` values that select the QP merge (never a model method)
_QP_NAMES = frozenset({"qp", "auto"})


def register_model_method(method: ModelMethod) -> ModelMethod:
    """Add ``method`` under ``method.name`` (a duplicate name is an error). Once registered,
    ``method: {name: NAME, params: {...}}`` of a merge config runs it."""
    if not isinstance(method, ModelMethod):
        raise ConfigError(f"register_model_method expects a ModelMethod, got {type(method).__name__}")
    check_new_name("model method", method.name, MODEL_METHODS, error=ConfigError)
    if method.name in _QP_NAMES:
        raise ConfigError(f"model method name {method.name!r} is reserved: in a merge config it selects the QP merge")
    clash = baseline_clash(method.name)
    if clash is not None:
        raise ConfigError(clash)
    for what, fn, args in (("parse(params, where)", method.parse, ({}, "method")),
                           ("run(context, parsed)", method.run, (None, None)),
                           ("describe(parsed)", method.describe, (None,))):
        check_callable("model method", method.name, what, fn, ConfigError)
        check_signature("model method", method.name, what, fn, args, {}, ConfigError)
    for what, fn, args in (("check_sites(sites)", method.check_sites, ([],)),
                           ("memory(parsed, statistics_bytes)", method.memory, (None, None)),
                           ("report_markdown(report)", method.report_markdown, ({},))):
        if fn is not None:
            check_callable("model method", method.name, what, fn, ConfigError)
            check_signature("model method", method.name, what, fn, args, {}, ConfigError)
    if method.start is not None:
        if not isinstance(method.start, StartFit):
            raise ConfigError(f"model method {method.name!r}: start must be a StartFit (mergeqp.run.model_method), "
                              f"got {type(method.start).__name__}")
        for what, fn, args in (("start.fit(context, parsed, tasks)", method.start.fit, (None, None, None)),
                               ("start.statistics(parsed)", method.start.statistics, (None,)),
                               ("start.skip(plan, parsed, auto)", method.start.skip, (None, None, None))):
            if fn is not None:
                check_callable("model method", method.name, what, fn, ConfigError)
                check_signature("model method", method.name, what, fn, args, {}, ConfigError)
    MODEL_METHODS[method.name] = method
    return method


def baseline_clash(name: str) -> str | None:
    """Why ``name`` cannot be a model method: a merge method of :data:`~mergeqp.MERGE_METHODS` that a
    merge config runs itself (tensor-wise, or with calibration statistics) has it; ``None`` when
    free, or taken only by a merge method for Python alone (``output_space``'s, which needs samples
    that only ``merge_state_dicts`` is given)."""
    other = MERGE_METHODS.get(name)
    if other is None or not (other.tensorwise or other.statistics is not None):
        return None
    return (f"{name!r} is both a merge method (mergeqp.MERGE_METHODS, which a merge config runs as a baseline) and a "
            f"model method: a config could not say which it means; register the model method under another name")


def get_model_method(name: str) -> ModelMethod:
    """The registered model method ``name`` (an unknown name lists the valid ones)."""
    return lookup("model method", name, MODEL_METHODS)


def entry_call(method: ModelMethod, what: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)``, one of a (user's) model method's functions used while planning (``what``: its
    name): an error of ours passes as it is, any other exception becomes one :class:`ConfigError`
    line naming the method and the function (exit 2, no traceback)."""
    with named_failure(f"model method {method.name!r}: {what}", ConfigError):
        return fn(*args)


def start_method(name: str) -> ModelMethod | None:
    """The model method ``name`` where it can be a ``start: auto`` candidate (it has a
    :class:`~.model_method.StartFit`), else ``None`` (a baseline, ``qp``, or a model method that cannot)."""
    entry = MODEL_METHODS.get(name)
    return entry if entry is not None and entry.start is not None else None


def parse_candidate(entry: ModelMethod, cand: Candidate) -> Any:
    """A model-method candidate's parameters, parsed by its entry (errors name the candidate)."""
    return entry_call(entry, "parse", entry.parse, cand.params, candidate_where(cand.label))


def start_statistics(cand: Candidate) -> list[Candidate] | None:
    """The statistics-based merges a model-method candidate's fit needs per split (its
    :attr:`~.model_method.StartFit.statistics`); ``None`` when ``cand`` is no model method."""
    entry = start_method(cand.name)
    if entry is None:
        return None
    assert entry.start is not None
    if entry.start.statistics is None:
        return []
    needs = entry_call(entry, "start.statistics", entry.start.statistics, parse_candidate(entry, cand))
    where = f"{candidate_where(cand.label)}: model method {entry.name!r}: start.statistics(parsed)"
    if not isinstance(needs, (list, tuple)) or not all(
            isinstance(n, (list, tuple)) and len(n) == 2 and isinstance(n[0], str) and isinstance(n[1], Mapping)
            for n in needs):
        raise ConfigError(f"{where} must return a list of (method name, params dict) pairs, got {needs!r:.120}")
    for name, params in needs:
        if statistics_of(name) is None:
            raise ConfigError(f"{where} names {name!r}, which has no calibration statistics to collect (those that "
                              f"do: {', '.join(statistics_methods())}); a tensor-wise baseline needs none: "
                              f"context.merge({name!r}, params) merges it as it is")
        check_params(name, dict(params), where)
    return [Candidate(name=name, params=dict(params)) for name, params in needs]


def method_names() -> list[str]:
    """The names a merge config's ``method.name`` may take besides ``qp`` / ``auto``: the merge methods
    (baselines) and the model methods, each once (for the errors that list them)."""
    return [*MERGE_METHODS, *(n for n in MODEL_METHODS if n not in MERGE_METHODS)]


def model_method_of(cfg: Any) -> ModelMethod | None:
    """The model method a merge config's ``method`` selects, or ``None`` (the QP or a baseline)."""
    m = cfg.method
    return None if m.is_qp else MODEL_METHODS.get(m.name)


register_model_method(OUTPUT_SPACE_RUN)
register_model_method(REGMEAN_SEQUENTIAL_RUN)
