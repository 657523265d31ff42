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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import ValidationError, check_callable, check_new_name, did_you_mean, first_line

#: the ways the compared positions may be pooled (``output.pool``)
POOLS = ("none", "mean")


@dataclass(frozen=True)
class OutputMetric:
    """One registered output metric (see the module docstring).

    ``distribution(target) -> aux`` and ``whiten(x, aux) -> F x``: a whitening metric's map (both
    or neither; ``aux`` has ``target``'s shape, is kept with the targets in float64 and cast to
    ``x``'s dtype by ``whiten``; ``whiten`` must be linear in ``x`` and keep its shape).
    ``scores_data``: scored against the prompts' own next tokens or class labels (built-in only).
    ``pools``: the ``output.pool`` values it takes. ``check(field, restrict, pool)``: why this
    metric refuses that output (``None``: it takes it). ``objective``: the report's words for the
    merge objective. ``heldout``: ``(label, evaluation key)`` pairs ``mergeqp merge`` prints
    beside the mean squared error. ``regression``: ``(evaluation key, words)`` of the held-out
    quantity whose rise the report flags (``words``: "held-out ... is higher")."""

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
        return None if self.check is None else self.check(field, restrict, pool)

    def classifies(self, pool: str) -> bool:
        """Scored against class labels through each task's head on the pooled output."""
        return self.scores_data and pool != "none"


OUTPUT_METRICS: dict[str, OutputMetric] = {}


def output_metric(name: str) -> OutputMetric:
    """The registered metric ``name``; an unknown name is a :class:`ValidationError` listing the
    registered ones (with a did-you-mean)."""
    try:
        return OUTPUT_METRICS[name]
    except (KeyError, TypeError):
        valid = list(OUTPUT_METRICS)
        raise ValidationError(f"unknown output metric {name!r}{did_you_mean(str(name), valid)}; "
                              f"valid: {', '.join(valid)}") from None


def register_output_metric(metric: OutputMetric) -> OutputMetric:
    """Add a whitening metric of one's own (``output.metric: NAME``; see the module docstring).

    Checked here, on a small random input: ``whiten`` keeps the shape and is linear in ``x``, and
    ``distribution`` gives a finite tensor of the target's shape. A name already registered, a
    data metric and a half-given map are refused."""
    if not isinstance(metric, OutputMetric):
        raise ValidationError(f"register_output_metric expects an OutputMetric, got {type(metric).__name__}")
    check_new_name("output metric", metric.name, OUTPUT_METRICS)
    if metric.scores_data:
        raise ValidationError(f"output metric {metric.name!r}: a metric scored against the prompts' own tokens needs "
                              f"its own Gauss-Newton expansion; only the built-in cross_entropy has one (register a "
                              f"whitening metric: distribution and whiten)")
    if metric.whiten is None or metric.distribution is None:
        raise ValidationError(f"output metric {metric.name!r}: give both distribution(target) and whiten(x, aux) (the "
                              f"plain squared error is the built-in euclidean)")
    check_callable("output metric", metric.name, "distribution(target) -> aux", metric.distribution)
    check_callable("output metric", metric.name, "whiten(x, aux) -> F x", metric.whiten)
    bad_pools = [p for p in metric.pools if p not in POOLS] or (["mean"] if "mean" in metric.pools else [])
    if bad_pools:
        raise ValidationError(f"output metric {metric.name!r}: pools {list(metric.pools)}: a whitening metric maps each "
                              f"position through its own target, so it takes pool 'none' only")
    if metric.check is not None:
        check_callable("output metric", metric.name, "check(field, restrict, pool) -> reason or None", metric.check)
    _probe(metric)
    OUTPUT_METRICS[metric.name] = metric
    return metric


def _probe(metric: OutputMetric) -> None:
    """Refuse a map that is not shape-keeping and linear in ``x``, or a non-finite distribution."""
    import torch

    gen = torch.Generator().manual_seed(0)
    target, x, y = (torch.randn(2, 3, 5, generator=gen, dtype=torch.float64) for _ in range(3))
    where = f"output metric {metric.name!r}"
    assert metric.distribution is not None and metric.whiten is not None

    def failed(what: str, exc: Exception) -> ValidationError:
        return ValidationError(f"{where}: {what} failed on a (2, 3, 5) float64 input: {type(exc).__name__}: "
                               f"{first_line(exc, 200)}")

    try:
        aux = metric.distribution(target)
    except Exception as exc:  # noqa: BLE001 - a user's code, named in one line
        raise failed("distribution(target)", exc) from exc
    if not isinstance(aux, torch.Tensor) or tuple(aux.shape) != tuple(target.shape) \
            or not bool(torch.all(torch.isfinite(aux))):
        raise ValidationError(f"{where}: distribution(target) must return a finite tensor of the target's shape "
                              f"(2, 3, 5), got {getattr(aux, 'shape', type(aux).__name__)}")
    try:
        fx, fy, fxy = (metric.whiten(v, aux) for v in (x, y, 2.0 * x - 3.0 * y))
    except Exception as exc:  # noqa: BLE001 - a user's code, named in one line
        raise failed("whiten(x, aux)", exc) from exc
    for out in (fx, fy, fxy):
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(x.shape):
            raise ValidationError(f"{where}: whiten(x, aux) must return a tensor of x's shape (2, 3, 5), got "
                                  f"{getattr(out, 'shape', type(out).__name__)}")
    scale = float((fx.abs() + fy.abs()).max()) + 1e-300
    if float((fxy - (2.0 * fx - 3.0 * fy)).abs().max()) > 1e-9 * max(scale, 1.0):
        raise ValidationError(f"{where}: whiten(x, aux) is not linear in x (whiten(2x - 3y) != 2 whiten(x) - 3 "
                              f"whiten(y)); the objective would not be a quadratic in the merge coefficients")


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
    objective="sum of squared compared-output errors")
KL = OutputMetric(
    "kl", "the softmax Gauss-Newton metric on logits: about twice the KL divergence from each fine-tune",
    distribution=softmax_distribution, whiten=kl_whiten,
    objective="the merge objective: about twice the summed KL divergence from each fine-tune",
    heldout=(("KL", "heldout_kl"),),
    regression=("heldout_kl", "held-out KL divergence from the fine-tunes is higher"))
CROSS_ENTROPY = OutputMetric(
    "cross_entropy", "the prompts' own next tokens (or class labels through each task's head): exact "
    "cross-entropy, Gauss-Newton model at the current merge", scores_data=True, pools=POOLS,
    check=_cross_entropy_check,
    objective="the merge objective: twice the summed cross-entropy of the prompts' own next tokens or class labels",
    heldout=(("cross-entropy", "heldout_cross_entropy"), ("accuracy", "heldout_accuracy")),
    regression=("heldout_cross_entropy", "held-out cross-entropy is higher"))
for _builtin in (EUCLIDEAN, KL, CROSS_ENTROPY):
    OUTPUT_METRICS[_builtin.name] = _builtin
