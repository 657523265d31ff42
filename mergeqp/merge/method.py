"""The merge-method type, the parameters every method shares, and small shared helpers.

A :class:`MergeMethod` couples a name, a pydantic parameter model (``extra="forbid"``: an
unknown or misspelt parameter is an error listing the valid ones) and a ``run`` function
``run(inputs, names, params) -> {name: merged tensor}`` over the *selected* floating-point
tensors. :func:`mergeqp.merge.registry.merge_state_dicts` does the selection and assembles the
full state dict around what ``run`` returns.

Shared parameters (every method):

- ``include``: patterns (exact names or globs, see :mod:`mergeqp.merge.selection`) of the
  tensors to merge; default ``None`` = every floating-point tensor.
- ``exclude``: patterns removed from the selection; default none.
- ``unselected``: what the output holds for tensors not merged: ``"base"`` (a copy of the
  base's tensor, the default when a base is given), ``"average"`` (the uniform mean of the
  fine-tuned tensors; the default when ``base`` is ``None``) or ``"drop"`` (left out: the result
  holds only the merged tensors, the cheap way to get one layer). Non-floating tensors (integer
  buffers, masks) are never merged: they are copied from the reference model (base, else
  ``finetuned[0]``) unless ``"drop"``. Normalisation layers' running statistics (names ending in
  ``running_mean`` / ``running_var``), when selected, are the uniform mean of the fine-tuned
  models' under every method (:func:`~mergeqp.merge.registry.is_running_statistic`): they are
  activation statistics, and a task vector can make a variance negative.
- ``progress``: show a progress bar over tensors (on a terminal); default ``True``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator
from pydantic import ValidationError as PydanticValidationError

from ..errors import ConfigError, did_you_mean

MAX_REPR = 60


class MethodParams(BaseModel):
    """Parameters every merge method accepts (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True, allow_inf_nan=False)

    include: tuple[str, ...] | None = None
    exclude: tuple[str, ...] = ()
    unselected: Literal["base", "average", "drop"] | None = None
    progress: bool = True

    @field_validator("include", "exclude", mode="before")
    @classmethod
    def _one_pattern(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value


class WeightedParams(MethodParams):
    """Adds ``weights``: one float per fine-tuned model, or one float for all; ``None`` = the
    method's default (documented per method)."""

    weights: float | tuple[float, ...] | None = None


@dataclass(frozen=True)
class CalibrationStatistics:
    """What a merge method that is not tensor-wise needs from ``mergeqp merge``: statistics of
    each fine-tuned model on its own calibration prompts (the capability Fisher and RegMean
    declare; see :mod:`mergeqp.merge.calibration_statistics`).

    ``supplied``: parameters the pipeline fills in (a config may not set them); ``what``: the
    statistics' name for messages; ``plan_line``: the plan's description; ``collect(collector,
    model, inputs, label) -> ({name: tensor}, text)`` for one loaded fine-tuned model
    (``collector`` a :class:`~mergeqp.merge.calibrated.StatisticsCollector`: it holds the parsed
    parameters, the selected parameter names and linear layers); ``prepare(collector, stats,
    params) -> (stats, params)`` runs once before the merge (e.g. a global normalisation);
    ``merge_kwargs(collector, stats, names) -> dict`` the statistics' keyword arguments of one
    chunk merge (``names``: the chunk's live tensor names); ``summary(collector) -> dict`` for the
    report; ``nbytes(K, keys, numel, sites) -> int`` the float64 memory of K models' statistics
    for checkpoint ``keys`` (``numel(key)``; ``sites`` the architecture's linear layers);
    ``forward_only``: ``collect`` runs the model forward only (hooks on layer inputs, no gradient
    of a weight), so it also serves a model whose blocks stay on disk (``lazy: true``).
    ``count_key``: when given, ``collect``'s statistics are means over units (real tokens, examples)
    and each statistic ``k`` carries its number of units in the entry ``count_key(k)`` of the same
    dict; statistics of disjoint batch sets then pool exactly as weighted means
    (:func:`~mergeqp.merge.calibrated.pool_statistics`), so that ``method: auto``'s
    cross-validation collects each batch once for all its fits instead of once per fit.
    ``prepare`` and ``merge_kwargs`` see the count entries too (and ignore them). ``pools(collector)``:
    whether they pool with the collector's parameters (default: whenever ``count_key`` is given; an
    estimator whose value depends on how examples are grouped into batches does not).
    """

    supplied: tuple[str, ...]
    what: str
    plan_line: str
    collect: Callable[..., tuple[dict[str, Any], str]]
    merge_kwargs: Callable[..., dict[str, Any]]
    summary: Callable[..., dict[str, Any]]
    nbytes: Callable[..., int]
    prepare: Callable[..., tuple[list[dict[str, Any]], dict[str, Any]]] | None = None
    forward_only: bool = False
    count_key: Callable[[str], str] | None = None
    pools: Callable[[Any], bool] | None = None


@dataclass(frozen=True)
class MergeMethod:
    """A registered merge method.

    ``run(inputs, names, params)``: ``inputs`` a :class:`~mergeqp.merge.inputs.MergeInputs`,
    ``names`` the selected floating-point tensors (reference order), ``params`` an instance of
    ``params``; returns ``{name: tensor}`` for exactly ``names`` (any float dtype; the caller
    casts to the reference dtype). ``needs_base``: whether task vectors (``finetuned - base``)
    are used. ``tensorwise``: whether each tensor is merged from its own values alone (so
    :func:`~mergeqp.merge.registry.merge_tensors` applies). ``statistics``: the calibration
    statistics ``mergeqp merge`` collects for it (a :class:`CalibrationStatistics`), or ``None``.
    """

    name: str
    summary: str
    reference: str
    params: type[MethodParams]
    run: Callable[..., dict[str, Any]]
    needs_base: bool = True
    tensorwise: bool = True
    statistics: CalibrationStatistics | None = None

    def valid_params(self) -> list[str]:
        return sorted(self.params.model_fields)

    def defaults(self) -> dict[str, Any]:
        """Default value of every parameter."""
        return {n: f.default for n, f in self.params.model_fields.items()}

    def parse(self, given: Mapping[str, Any]) -> MethodParams:
        """Validate ``given``; raise :class:`ConfigError` naming each bad parameter and listing
        the valid ones."""
        try:
            return self.params(**given)
        except PydanticValidationError as exc:
            problems = []
            unions: dict[str, list[str]] = {}  # a value none of a union's types took: one line, not one per type
            for err in exc.errors():
                loc = [str(p) for p in err["loc"]]
                if len(loc) >= 2 and loc[0] in self.params.model_fields and not loc[1].isdigit() \
                        and err["type"] != "extra_forbidden":
                    kinds = unions.setdefault(loc[0], [])
                    if not kinds:
                        got = repr(given.get(loc[0]))
                        problems.append((loc[0], got if len(got) <= MAX_REPR else got[: MAX_REPR - 3] + "..."))
                    kinds.append(loc[1])
                    continue
                field = ".".join(loc)
                if err["type"] == "extra_forbidden":
                    problems.append(f"unknown parameter {field!r}{did_you_mean(field, self.valid_params())}")
                    continue
                got = repr(err.get("input"))
                got = got if len(got) <= MAX_REPR else got[: MAX_REPR - 3] + "..."
                msg = err["msg"].removeprefix("Value error, ")
                problems.append(f"parameter {field!r}: {msg} (got {got})" if field else msg)
            problems = [f"parameter {p[0]!r} must be {' or '.join(_KINDS.get(k, k) for k in unions[p[0]])} (got {p[1]})"
                        if isinstance(p, tuple) else p for p in problems]
            raise ConfigError(
                f"merge method {self.name!r}: {'; '.join(problems)}; valid parameters: "
                f"{', '.join(self.valid_params())}"
            ) from None


# ---------------------------------------------------------------------------- helpers
#: pydantic's names of a union's member types, as a config's reader says them
_KINDS = {"float": "a number", "int": "a whole number", "str": "a string", "bool": "true or false",
          "tuple[float, ...]": "a list of numbers", "list[float]": "a list of numbers", "none": "null"}


def resolve_weights(weights: float | Sequence[float] | None, K: int, default: float | None) -> list[float]:
    """``K`` model weights from a scalar, a length-K sequence, or ``None`` (-> ``default``,
    where ``default=None`` means uniform ``1/K``)."""
    if weights is None:
        return [1.0 / K if default is None else float(default)] * K
    if isinstance(weights, (int, float)):
        return [float(weights)] * K
    w = [float(x) for x in weights]
    if len(w) != K:
        raise ConfigError(f"parameter 'weights' has {len(w)} entries but there are {K} fine-tuned models")
    return w


def compute_dtype(tensor: Any) -> Any:
    """float64 tensors are merged in float64, every other float dtype in float32."""
    import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def iterate(names: Sequence[str], params: MethodParams, desc: str) -> Iterable[str]:
    """``names`` with a tqdm bar when ``params.progress`` (shown only on a terminal)."""
    from tqdm.auto import tqdm  # optional heavy dependency, imported on first use (importing mergeqp stays light)

    return tqdm(names, desc=desc, unit="tensor", disable=None if params.progress else True, leave=False)


def stacked(tensors: Sequence[Any], dtype: Any, device: Any) -> Any:
    """``(K, *shape)`` stack of ``tensors`` in ``dtype`` on ``device``."""
    import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

    return torch.stack([t.to(device=device, dtype=dtype) for t in tensors], dim=0)


def weight_column(weights: Sequence[float], like: Any) -> Any:
    """Weights as a ``(K, 1, ..., 1)`` tensor broadcasting against ``like`` (``(K, *shape)``)."""
    import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

    w = torch.tensor(list(weights), dtype=like.dtype, device=like.device)
    return w.reshape((-1,) + (1,) * (like.dim() - 1))


def tensorwise_run(merge_one: Callable[..., Any], desc: str,
                   setup: Callable[[dict[str, Any], Any], Any] | None = None) -> Callable[..., dict[str, Any]]:
    """A ``run`` applying ``merge_one(name, base, finetuned, params, state)`` per tensor.

    ``base`` is the reference model's tensor (``None`` if there is no base), ``finetuned`` the K
    fine-tuned tensors, ``state`` a per-merge dict the method may use (e.g. its mask drawer);
    ``setup(state, params)``, when given, runs once before the first tensor (even when no tensor
    is selected); ``state["finish"]``, when set, is called once at the end.
    """

    def run(inputs: Any, names: Sequence[str], params: MethodParams) -> dict[str, Any]:
        state: dict[str, Any] = {"inputs": inputs}
        if setup is not None:
            setup(state, params)
        out = {}
        for name in iterate(names, params, desc):
            base = inputs.base.get(name) if inputs.base is not None else None
            out[name] = merge_one(name, base, inputs.finetuned_tensors(name), params, state)
        if "finish" in state:
            state["finish"]()
        return out

    return run
