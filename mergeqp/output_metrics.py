"""Output metrics: how the merge objective scores a compared output (``output.metric``), a registry.

An entry (:class:`OutputMetric`) owns what differs between metrics, so that the statistics, the
plan, the run's checks, the report and ``mergeqp merge``'s summary ask the entry instead of
switching on its name:

- ``euclidean`` (*plain*): the squared error of the (restricted) output against each fine-tune's.
- ``kl``: a *whitening* metric. A linear map ``F``, built from each target position's own
  ``distribution`` (here ``p = softmax(y)`` of the target's logits), is applied to the merged
  model's and the target's output before their squared error: ``||F x - F y||^2 = (x - y)'F'F(x - y)``
  with ``F'F = diag(p) - pp'``, the softmax Gauss-Newton metric, about ``2 KL`` per position.
- ``cross_entropy``: a *data* metric, scored against the prompts' own next tokens (or class
  labels), not a fine-tune; its quadratic model is the Gauss-Newton expansion at the current
  model (:class:`mergeqp.lm.CrossEntropyExpansion`).

Users register whitening metrics of their own (:func:`register_output_metric`): a
``distribution(target)`` computed once per target batch from the target's compared output (after a
``topk`` gather, before a projection) and a ``whiten(x, aux)`` linear in ``x``. Any such map keeps
the objective a convex QP in the merge coefficients, and the statistics, the head fold
(``restrict: topk``), the trust region and the certificate work as for ``kl``. Data metrics need a
Gauss-Newton expansion of their own and are not registrable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import (
    OWN_ENTRY_HINT,
    BadDataError,
    MergeQPError,
    ValidationError,
    check_callable,
    check_new_name,
    did_you_mean,
    first_line,
    named_failure,
)

#: the ways the compared positions may be pooled (``output.pool``)
POOLS = ("none", "mean")
#: the held-out measures a merge's evaluation holds (``ModelEvaluation`` fields of the run layer, each
#: ``{task: value}``), which an entry's ``heldout`` and ``regression`` may name
HELDOUT_MEASURES = ("heldout_mse", "heldout_kl", "heldout_cross_entropy", "heldout_accuracy")


@dataclass(frozen=True)
class OutputMetric:
    """One registered output metric (see the module docstring).

    ``distribution(target) -> aux`` and ``whiten(x, aux) -> F x``: a whitening metric's map (both
    or neither). ``target`` is the fine-tune's output at each compared position before any
    projection (``(B, T, V)`` logits, or ``(B, T, k)`` under ``topk``); ``aux`` has its shape, is
    kept with the targets in float64 and cast to ``x``'s dtype by ``whiten``; ``whiten`` acts on
    the last axis of each position separately, is linear in ``x``, differentiable (torch
    operations) and keeps ``x``'s shape and dtype.
    ``scores_data``: scored against the prompts' own next tokens or class labels (built-in only).
    ``pools``: the ``output.pool`` values it takes. ``check(field, restrict, pool)``: why this
    metric refuses that output (``None``: it takes it). ``objective``: the report's words for the
    merge objective. ``heldout``: ``(label, measure)`` pairs ``mergeqp merge`` prints first, each
    measure one of :data:`HELDOUT_MEASURES`. ``regression``: ``(measure, words)``, the held-out
    measure whose rise the report flags (``words``: "held-out ... is higher"); ``None``: the
    held-out MSE (or a classifier's accuracy)."""

    name: str
    description: str
    distribution: Callable[[Any], Any] | None = None
    whiten: Callable[[Any, Any], Any] | None = None
    scores_data: bool = False
    pools: tuple[str, ...] = ("none",)
    check: Callable[[str, str, str], str | None] | None = None
    objective: str = ""
    heldout: tuple[tuple[str, str], ...] = ()
    regression: tuple[str, str] | None = None
    #: the built-in entries' maps are trusted (their results are not checked at every call)
    builtin: bool = dataclasses.field(default=False, repr=False, compare=False)

    @property
    def whitens(self) -> bool:
        """Each target position's output is compared through a map of its own (``kl``)."""
        return self.whiten is not None

    @property
    def plain(self) -> bool:
        """The plain squared error of the compared output (``euclidean``): it takes a given
        projection matrix, keeps every-logit targets as the head's hidden states, and lets the
        evaluation compare distributions."""
        return not self.whitens and not self.scores_data

    def problem(self, field: str, restrict: str, pool: str, matrix: bool = False) -> str | None:
        """Why this metric cannot score that output (``None``: it can); one message for the
        config's check and :class:`mergeqp.lm.OutputSpec`'s."""
        if matrix and not self.plain:
            return f"an output matrix ('matrix') takes metric: euclidean (the euclidean metric), not {self.name}"
        if pool not in self.pools:
            takers = [n for n, m in OUTPUT_METRICS.items() if pool in m.pools]
            why = (" (it compares each position's own distribution, which a mean over positions is not)"
                   if self.whitens else "")
            return f"pool: {pool} needs metric: euclidean or another that takes it ({', '.join(takers)}), not {self.name}{why}"
        if self.check is None:
            return None
        try:
            why = self.check(field, restrict, pool)
        except Exception as exc:  # noqa: BLE001 - a user's code, named in one line
            return f"output metric {self.name!r}: check(field, restrict, pool) failed: {type(exc).__name__}: {first_line(exc)}"
        if why is None or isinstance(why, str):
            return why or None
        return (f"output metric {self.name!r}: check(field, restrict, pool) returned {why!r}; it must return None "
                f"(the metric takes this output) or the reason it does not (a string)")

    def distribution_of(self, target: Any) -> Any:
        """``distribution(target)`` in float64; a user's map that fails or answers a tensor of another
        shape, or one with NaN or inf entries, is an error naming the metric (not the model)."""
        import torch

        assert self.distribution is not None
        if self.builtin:
            return self.distribution(target).to(torch.float64)
        where = f"output metric {self.name!r}: distribution(target) on a target of shape {tuple(target.shape)}"
        with named_failure(where, ValidationError):
            aux = self.distribution(target)
        if not isinstance(aux, torch.Tensor) or tuple(aux.shape) != tuple(target.shape):
            raise ValidationError(f"{where} returned {_kind(aux)}; it must return a tensor of the target's shape")
        aux = aux.to(device=target.device, dtype=torch.float64)
        if not bool(torch.all(torch.isfinite(aux))):
            raise BadDataError(f"{where} has NaN or inf entries")
        return aux

    def whitened(self, x: Any, aux: Any) -> Any:
        """``whiten(x, aux)``; a user's map that fails or changes ``x``'s shape is an error naming the metric."""
        assert self.whiten is not None
        if self.builtin:
            return self.whiten(x, aux)
        try:
            out = self.whiten(x, aux)
        except MergeQPError:
            raise
        except Exception as exc:  # noqa: BLE001 - a user's code, named in one line
            raise ValidationError(f"output metric {self.name!r}: whiten(x, aux) failed on x of shape {tuple(x.shape)}: "
                                  f"{type(exc).__name__}: {first_line(exc)}") from exc
        if not hasattr(out, "shape") or tuple(out.shape) != tuple(x.shape):
            raise ValidationError(f"output metric {self.name!r}: whiten(x, aux) returned {_kind(out)} for x of shape "
                                  f"{tuple(x.shape)}; it must keep x's shape")
        return out

    def fold_obstacle(self, restrict: str) -> str | None:
        """Why a head cannot fold into this metric with that restriction (``None``: it can)."""
        if self.plain or restrict == "topk":
            return None
        return (f"the {self.name} metric with restrict {restrict!r} has a vocabulary-size metric W'F'FW per position "
                f"(F: its map of each position's distribution; for kl and cross_entropy F'F = diag p - p p'): fold it "
                f"with restrict: topk")

    def classifies(self, pool: str) -> bool:
        """Scored against class labels through each task's head on the pooled output."""
        return self.scores_data and pool != "none"


def _kind(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"{type(value).__name__} of shape {tuple(shape)}" if shape is not None else type(value).__name__


OUTPUT_METRICS: dict[str, OutputMetric] = {}


def output_metric(name: str) -> OutputMetric:
    """The registered metric ``name``; an unknown name is a :class:`ValidationError` listing the
    registered ones (with a did-you-mean)."""
    try:
        return OUTPUT_METRICS[name]
    except (KeyError, TypeError):
        valid = list(OUTPUT_METRICS)
        hint = did_you_mean(str(name), valid)
        raise ValidationError(f"unknown output metric {name!r}{hint}; valid: {', '.join(valid)}"
                              + ("" if hint else f"; {OWN_ENTRY_HINT}")) from None


def register_output_metric(metric: OutputMetric) -> OutputMetric:
    """Add a whitening metric of one's own (``output.metric: NAME``; see the module docstring).

    Checked here, on a small random input: ``whiten`` keeps the shape and is linear in ``x``, and
    ``distribution`` gives a finite tensor of the target's shape. A name already registered, a
    data metric and a half-given map are refused."""
    if not isinstance(metric, OutputMetric):
        raise ValidationError(f"register_output_metric expects an OutputMetric, got {type(metric).__name__}")
    check_new_name("output metric", metric.name, OUTPUT_METRICS)
    if metric.builtin:
        raise ValidationError(f"output metric {metric.name!r}: builtin=True is for the built-in entries, whose maps are "
                              f"not checked at each call")
    if metric.scores_data:
        raise ValidationError(f"output metric {metric.name!r}: a metric scored against the prompts' own tokens needs "
                              f"its own Gauss-Newton expansion; only the built-in cross_entropy has one (register a "
                              f"whitening metric: distribution and whiten)")
    if metric.whiten is None or metric.distribution is None:
        raise ValidationError(f"output metric {metric.name!r}: give both distribution(target) and whiten(x, aux) (the "
                              f"plain squared error is the built-in euclidean)")
    check_callable("output metric", metric.name, "distribution(target) -> aux", metric.distribution)
    check_callable("output metric", metric.name, "whiten(x, aux) -> F x", metric.whiten)
    if not isinstance(metric.pools, tuple) or metric.pools != ("none",):
        raise ValidationError(f"output metric {metric.name!r}: pools {metric.pools!r}: a whitening metric maps each "
                              f"position through its own target, so it takes pool 'none' only (pools=('none',))")
    if metric.check is not None:
        check_callable("output metric", metric.name, "check(field, restrict, pool) -> reason or None", metric.check)
    _check_report_fields(metric)
    _probe(metric)
    OUTPUT_METRICS[metric.name] = metric
    return metric


def _check_report_fields(metric: OutputMetric) -> None:
    """``heldout``: pairs ``(label, measure)``; ``regression``: ``None`` or ``(measure, words)``; each
    measure one of :data:`HELDOUT_MEASURES`; ``objective``: a string."""
    where = f"output metric {metric.name!r}"
    measures = ", ".join(HELDOUT_MEASURES)
    pairs = metric.heldout if isinstance(metric.heldout, (tuple, list)) else [metric.heldout]
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(v, str) for v in pair)
                and pair[1] in HELDOUT_MEASURES):
            raise ValidationError(f"{where}: heldout must be pairs (label, measure) with a measure of {measures}; "
                                  f"got {pair!r} in {metric.heldout!r}")
    reg = metric.regression
    if reg is not None and not (isinstance(reg, (tuple, list)) and len(reg) == 2 and all(isinstance(v, str) for v in reg)
                                and reg[0] in HELDOUT_MEASURES):
        raise ValidationError(f"{where}: regression must be None or (measure, words) with a measure of {measures}; "
                              f"got {reg!r}")
    if not isinstance(metric.objective, str) or not isinstance(metric.description, str):
        raise ValidationError(f"{where}: description and objective must be strings")


def _probe(metric: OutputMetric) -> None:
    """Refuse a map that is not what the objective needs, on small random float64 inputs of two
    shapes: ``distribution`` a finite tensor of the target's shape; ``whiten`` finite, of ``x``'s
    shape and dtype, linear in ``x``, acting on each position separately and differentiable."""
    import torch

    gen = torch.Generator().manual_seed(0)
    where = f"output metric {metric.name!r}"
    for shape in ((2, 3, 5), (1, 4, 7)):
        target, x, y = (torch.randn(*shape, generator=gen, dtype=torch.float64) for _ in range(3))
        aux = metric.distribution_of(target)
        fx, fy, fxy = (metric.whitened(v, aux) for v in (x, y, 2.0 * x - 3.0 * y))
        for out in (fx, fy, fxy):
            if not isinstance(out, torch.Tensor) or out.dtype != x.dtype:
                raise ValidationError(f"{where}: whiten(x, aux) must return a tensor of x's dtype ({x.dtype}), got "
                                      f"{getattr(out, 'dtype', type(out).__name__)}")
            if not bool(torch.all(torch.isfinite(out))):
                raise ValidationError(f"{where}: whiten(x, aux) has NaN or inf entries on finite inputs of shape {shape}")
        scale = max(float((fx.abs() + fy.abs()).max()), 1.0)
        if not float((fxy - (2.0 * fx - 3.0 * fy)).abs().max()) <= 1e-6 * scale:
            raise ValidationError(f"{where}: whiten(x, aux) is not linear in x (whiten(2x - 3y) != 2 whiten(x) - 3 "
                                  f"whiten(y) on inputs of shape {shape}); the objective would not be a quadratic in "
                                  f"the merge coefficients")
        moved = x.clone()
        moved[0, 0] += 1.0  # one position changed: only that position's output may change
        rest = (metric.whitened(moved, aux) - fx).abs()
        rest[0, 0] = 0.0
        if float(rest.max()) > 1e-9 * scale:
            raise ValidationError(f"{where}: whiten(x, aux) mixes positions (changing x at one position changed the "
                                  f"output at another); it must act on the last axis of each position separately")
        leaf = x.clone().requires_grad_(True)
        try:
            out = metric.whiten(leaf, aux)
            grad = torch.autograd.grad(out.sum(), leaf, allow_unused=True)[0] if out.requires_grad else None
        except Exception as exc:  # noqa: BLE001 - a user's code, named in one line
            raise ValidationError(f"{where}: whiten(x, aux) could not be differentiated: {type(exc).__name__}: "
                                  f"{first_line(exc)}") from exc
        if grad is None:
            raise ValidationError(f"{where}: whiten(x, aux) is not differentiable in x (write it with torch "
                                  f"operations on x: the statistics differentiate through it)")


# ---------------------------------------------------------------------------------- built-ins
def softmax_distribution(target: Any) -> Any:
    """``p = softmax(target)`` along the last axis, in float64 (``kl``'s distribution: over the
    target's top ``k`` logits under ``restrict: topk``, renormalised)."""
    import torch

    return torch.softmax(target.to(torch.float64), dim=-1)


def kl_whiten(x: Any, p: Any) -> Any:
    """``F x = sqrt(p) * (x - (p'x) 1)`` along the last axis (``x``: logits ``(..., V)``; ``p``: a
    distribution of the same shape), in ``x``'s dtype: ``||F x - F y||^2 = (x - y)' (diag(p) -
    p p') (x - y)``, twice the second-order ``KL(p || softmax(x))`` at ``p = softmax(y)``."""
    p = p.to(dtype=x.dtype)
    return p.sqrt() * (x - (p * x).sum(dim=-1, keepdim=True))


def _cross_entropy_check(field: str, restrict: str, pool: str) -> str | None:
    if pool != "none":  # class labels through each task's head
        if restrict != "none":
            return (f"metric: cross_entropy with pool: {pool} (class labels through each model's head) takes "
                    f"restrict: none, not {restrict}")
        return None
    if field != "logits":
        return (f"metric: cross_entropy without pool scores next-token logits, not field {field!r} (to score class "
                f"labels through each model's head on it, add pool: mean)")
    if restrict == "projection":
        return ("metric: cross_entropy takes restrict: none (every token) or topk (the model's top k tokens and the "
                "rest as one logit), not projection")
    return None


EUCLIDEAN = OutputMetric(
    "euclidean", "the squared error of the (restricted) output against each fine-tune's", pools=POOLS,
    objective="sum of squared compared-output errors", builtin=True)
KL = OutputMetric(
    "kl", "the softmax Gauss-Newton metric on logits: about twice the KL divergence from each fine-tune",
    distribution=softmax_distribution, whiten=kl_whiten,
    objective="the merge objective: about twice the summed KL divergence from each fine-tune",
    heldout=(("KL", "heldout_kl"),),
    regression=("heldout_kl", "held-out KL divergence from the fine-tunes is higher"), builtin=True)
CROSS_ENTROPY = OutputMetric(
    "cross_entropy", "the prompts' own next tokens (or class labels through each task's head): exact "
    "cross-entropy, Gauss-Newton model at the current merge", scores_data=True, pools=POOLS,
    check=_cross_entropy_check,
    objective="the merge objective: twice the summed cross-entropy of the prompts' own next tokens or class labels",
    heldout=(("cross-entropy", "heldout_cross_entropy"), ("accuracy", "heldout_accuracy")),
    regression=("heldout_cross_entropy", "held-out cross-entropy is higher"), builtin=True)
for _builtin in (EUCLIDEAN, KL, CROSS_ENTROPY):
    OUTPUT_METRICS[_builtin.name] = _builtin
