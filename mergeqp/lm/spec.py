"""What output of a Hugging Face model is compared, teacher-forced targets, and the metrics.

The merge objective compares, at every real (unpadded) token position, the merged model's
output with the task's fine-tuned model's output on the same prompt (teacher forcing: the
prompt's tokens are the inputs, no generation). ``OutputSpec`` says which output
(``field``, default ``logits``) and how a large vocabulary ``V`` is reduced to ``k`` numbers
per position so that the statistics stay tractable (their size grows with the compared
output's length):

- ``restrict="none"``: every logit; the objective is the summed squared logit error.
- ``restrict="projection"``: ``o = logits @ P`` with ``P`` a ``(V, k)`` Gaussian matrix with
  entries ``N(0, 1/k)`` drawn from ``seed``: ``E ||P'(h - y)||^2 = ||h - y||^2``, so the
  objective is an unbiased, Johnson-Lindenstrauss estimate of the full one (relative error
  ~ ``sqrt(2/k)`` per position, averaging out over positions). It is linear, so the
  linearisation and the QP are those of the full objective seen through ``P``.
- ``restrict="topk"``: at each position, the ``k`` vocabulary entries the *target* ranks
  highest; the merged model's logits are gathered at the same indices. The objective ignores
  every other logit (a biased restriction that weights the tokens that matter to the task).

Positions outside the attention mask are multiplied by 0 in both the output and the target.

``pool="mean"`` compares one vector per prompt instead of one per position: the mean of the
(restricted, masked) outputs over the prompt's real tokens, as a sentence encoder's
mean-pooled embedding (all-MiniLM, sentence-transformers). The pooling is linear, so the
objective stays a convex QP, and it is the output that heads on the pooled embedding read.

``metric`` says how a position's logits are compared:

- ``metric="euclidean"`` (default): the squared error of the (restricted) output, as above.
- ``metric="kl"``: the softmax Gauss-Newton (Fisher) metric. With the target's logits ``y``
  (``V`` entries) and ``p = softmax(y)``, ``KL(p || softmax(x))`` has the Hessian
  ``M = diag(p) - p p'`` at ``x = y`` and zero gradient there, so
  ``KL ~ 1/2 (x - y)' M (x - y)``. ``M = F'F`` with the linear map
  ``F x = sqrt(p) * (x - (p'x) 1)`` (:func:`kl_whiten`), which depends only on the target, so
  the compared output becomes ``F x`` and the target ``F y``: ``||F x - F y||^2 =
  (x - y)' M (x - y)``, about ``2 KL`` per position. The objective stays linear in ``x`` (a
  convex QP) and approximates ``2 * sum KL`` over the compared positions. ``F`` is applied
  before ``projection`` (``P`` then acts on the whitened logits); with ``topk`` the logits are
  gathered first and ``p`` is the target's distribution restricted to its top ``k`` entries
  and renormalised (``softmax`` of the target's top-``k`` logits), so the objective is the
  second-order KL between the distributions conditioned on those ``k`` tokens. Each target
  batch stores ``p`` (``probs``, float64, the compared entries' size before projection).
- ``metric="cross_entropy"``: what language-model users measure, the next-token cross-entropy
  of the calibration prompts' own tokens (no fine-tune's output is compared: position ``t``
  predicts token ``t + 1`` wherever both are real). The objective is ``2 * sum`` of the
  negative log-likelihoods (nats), exact. It is not quadratic in the logits, so each
  linearisation uses its Gauss-Newton model *at the current model* (:class:`CrossEntropyExpansion`):
  with the current distribution ``q`` and the label ``y``, ``2 CE(x) ~ ||F (x - x0) + r||^2 +
  const`` where ``F'F = diag(q) - q q'`` and ``r = (q - e_y) / sqrt(q)``, which has the exact
  value and gradient at ``x0`` and a positive semi-definite curvature: still a convex QP, now a
  model of the real objective that the trust-region mode re-expands at every accepted step.
  ``restrict="none"`` tracks every token; ``restrict="topk"`` tracks the ``k`` tokens the
  current model ranks highest (the label forced in) and one more logit for all the others
  together, ``lse`` of the rest: the value and gradient stay exact, the curvature omits the
  spread of the rest inside that group. ``topk`` folds into the head like the KL metric.

  **Classification** (``pool="mean"`` with ``cross_entropy``): each prompt has a class label
  (:class:`~mergeqp.io.calibration.Batch` ``labels``) and its task a linear head
  (:class:`ClassifierHead`, ``C`` classes) that reads the mean-pooled output; the objective is
  ``2 * sum`` of the prompts' classification negative log-likelihoods, exact, with the same
  Gauss-Newton model over the ``C`` class logits (:func:`data_logits`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ..errors import ValidationError
from ..output_metrics import OutputMetric, POOLS, output_metric


RESTRICTIONS = ("none", "topk", "projection")


#: entries of one batch's sketch matrices (``prompts x s x outputs``) at most (:meth:`OutputSpec.sketch_matrix`)
MAX_SKETCH_ENTRIES = 2**28


@dataclass(frozen=True)
class OutputSpec:
    """Which output is compared and its restriction (see the module docstring).

    ``field``: attribute of the model's output (``logits``, ``last_hidden_state``, ...).
    ``restrict``: ``none`` | ``topk`` | ``projection``; ``k``: their size; ``seed``: of ``P``.
    ``metric``: ``euclidean`` | ``kl`` (the softmax Gauss-Newton metric on logits).
    ``fold_head``: ``None`` (auto) | ``True`` | ``False``: compute the statistics from the final
    hidden state through the folded linear head (:class:`FoldedHead`). ``sketch``: ``None`` or
    ``s``: the statistics' Hessian from ``s`` Gaussian combinations of each sample's outputs.
    ``pool``: ``"none"`` (every position) or ``"mean"`` (per prompt, the mean over its real
    tokens: ``(B, T, q)`` becomes ``(B, q)``; Euclidean metric only). ``matrix``: with
    ``restrict="projection"``, a given ``(features, q)`` matrix ``M`` instead of the random one (the
    output ``y`` is compared as ``y M``, e.g. through a stack of classifier heads ``M = [W_1; ...]'``,
    so the objective weighs what they read); ``k`` is its ``q``; Euclidean metric only.
    """

    field: str = "logits"
    restrict: str = "none"
    k: int | None = None
    seed: int = 0
    metric: str = "euclidean"
    fold_head: bool | None = None
    sketch: int | None = None
    pool: str = "none"
    matrix: Any = dataclasses.field(default=None, compare=False, repr=False)
    _cache: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.matrix is not None:
            import numpy as np

            m = np.asarray(self.matrix, dtype=np.float64)
            if m.ndim != 2 or 0 in m.shape or not np.all(np.isfinite(m)):
                raise ValidationError(f"output matrix must be a finite 2-D (features, q) matrix, got shape {m.shape}")
            if self.restrict != "projection":
                raise ValidationError(f"an output matrix is a projection: restrict projection, not {self.restrict!r}")
            if self.k is not None and int(self.k) != m.shape[1]:
                raise ValidationError(f"output k={self.k} but the output matrix has {m.shape[1]} columns")
            object.__setattr__(self, "matrix", m)
            object.__setattr__(self, "k", int(m.shape[1]))
        if self.restrict not in RESTRICTIONS:
            raise ValidationError(f"output restriction {self.restrict!r}; valid: {', '.join(RESTRICTIONS)}")
        if self.restrict != "none" and (self.k is None or self.k < 1):
            raise ValidationError(f"output restriction {self.restrict!r} needs k >= 1")
        metric = output_metric(self.metric)
        if self.fold_head not in (None, True, False):
            raise ValidationError(f"output fold_head {self.fold_head!r}; valid: auto (None), true, false")
        if self.sketch is not None and (isinstance(self.sketch, bool) or not isinstance(self.sketch, int)
                                        or self.sketch < 1):
            raise ValidationError(f"output sketch {self.sketch!r}: a number of outputs per sample >= 1, or None")
        if self.pool not in POOLS:
            raise ValidationError(f"output pool {self.pool!r}; valid: {', '.join(POOLS)}")
        problem = metric.problem(self.field, self.restrict, self.pool, self.matrix is not None)
        if problem is not None:
            raise ValidationError(problem)

    def sketch_matrix(self, batch: int, outputs: int, key: tuple[int, ...], dtype: Any, device: Any) -> Any:
        """The per-sample sketches ``S`` (``(batch, s, outputs)``, entries ``N(0, 1/s)``, so
        ``E[S_j'S_j] = I``) of the batch identified by ``key`` (e.g. task and batch index): a
        float64 draw from ``seed`` and ``key``, cast to ``dtype``."""
        import torch

        assert self.sketch is not None
        size = batch * self.sketch * outputs
        if size > MAX_SKETCH_ENTRIES:
            raise ValidationError(
                f"output sketch: {batch} x {self.sketch} x {outputs} sketch entries per batch (over "
                f"{MAX_SKETCH_ENTRIES:,}); "
                f"fold the head (output.fold_head) or restrict the output first, or use smaller batches")
        seed = int(self.seed)
        for part in key:
            seed = (seed * 1_000_003 + int(part) + 1) % (2**63 - 1)
        gen = torch.Generator().manual_seed(seed)
        S = torch.randn(batch, self.sketch, outputs, generator=gen, dtype=torch.float64) / math.sqrt(self.sketch)
        return S.to(dtype=dtype, device=device)

    def fold_obstacle(self) -> str | None:
        """Why this output cannot be folded into the final hidden state (``None``: it can)."""
        if self.fold_head is False:
            return "fold_head is false"
        if self.field != "logits":
            return f"the compared output is {self.field!r}, not logits"
        if self.pool != "none":
            return f"the output is pooled ({self.pool}) over positions"
        return self.output_metric.fold_obstacle(self.restrict)

    @property
    def output_metric(self) -> OutputMetric:
        """The registered entry of ``metric`` (:mod:`mergeqp.output_metrics`)."""
        return output_metric(self.metric)

    @property
    def scores_data(self) -> bool:
        """The objective scores the prompts' own next tokens or class labels (a data metric:
        ``cross_entropy``), not a fine-tune."""
        return self.output_metric.scores_data

    @property
    def classifies(self) -> bool:
        """The objective scores class labels through each task's head on the pooled output
        (``cross_entropy`` with ``pool="mean"``), not next tokens."""
        return self.output_metric.classifies(self.pool)

    def raw(self, model_output: Any) -> Any:
        """The compared tensor of a model's forward output (``(B, T, V)``, ``(B, C)``, ...)."""
        import torch

        if isinstance(model_output, torch.Tensor):
            return model_output
        try:
            value = model_output[self.field]
        except (KeyError, TypeError, IndexError):
            value = getattr(model_output, self.field, None)
        if value is None:
            keys = list(model_output.keys()) if hasattr(model_output, "keys") else []
            raise ValidationError(f"output.field {self.field!r}: the model's output has no such field; available: {keys}")
        return value

    def projection(self, vocab: int, dtype: Any, device: Any) -> Any:
        """The ``(V, k)`` projection matrix: ``matrix`` when given, else a float64 draw from
        ``seed`` scaled by ``1/sqrt(k)``; cast to ``dtype``."""
        import torch

        key = (vocab, str(dtype), str(device))
        if key not in self._cache:
            if self.matrix is not None:
                if self.matrix.shape[0] != vocab:
                    raise ValidationError(f"output.matrix: the matrix has {self.matrix.shape[0]} rows but the compared "
                                          f"output {self.field!r} has {vocab} features per position; it needs one "
                                          f"row per feature")
                P = torch.from_numpy(self.matrix)
            else:
                gen = torch.Generator().manual_seed(int(self.seed))
                assert self.k is not None
                P = torch.randn(vocab, self.k, generator=gen, dtype=torch.float64) / math.sqrt(self.k)
            self._cache[key] = P.to(dtype=dtype, device=device)
        return self._cache[key]

    def topk_index(self, target_raw: Any) -> Any:
        """Indices ``(..., k)`` of the target's ``k`` largest entries along the last axis."""
        assert self.k is not None
        if self.k > target_raw.shape[-1]:
            raise ValidationError(f"output topk k={self.k} exceeds the output size {target_raw.shape[-1]}")
        return target_raw.topk(self.k, dim=-1).indices

    def target_probs(self, target_raw: Any, index: Any = None) -> Any:
        """A whitening metric's per-position ``distribution`` of the target (float64, ``(..., V)``;
        ``(..., k)`` of the top-``k`` ``index`` for ``topk``; for ``kl`` its softmax, renormalised
        over the top ``k``) that its map (:func:`kl_whiten` for ``kl``) uses; ``None`` for
        another metric."""
        metric = self.output_metric
        if metric.distribution is None:
            return None
        logits = target_raw.gather(-1, index) if self.restrict == "topk" else target_raw
        return metric.distribution_of(logits)

    def select(self, raw: Any, mask: Any = None, index: Any = None, probs: Any = None) -> Any:
        """Restrict ``raw`` (last axis = vocabulary / features) and zero the masked positions.

        For a whitening metric (``kl``), ``probs`` is the target's distribution (:meth:`target_probs`,
        on ``raw``'s device) and ``raw`` is whitened by the metric's map (:func:`kl_whiten` for ``kl``;
        after a ``topk`` gather, before a ``projection``)."""
        metric = self.output_metric
        if metric.whitens and probs is None:
            raise ValidationError(f"the {self.metric} output metric needs the target's distribution (probs)")
        if self.restrict == "topk":
            if index is None:
                raise ValidationError("topk restriction needs the target's indices")
            raw = raw.gather(-1, index)
        if metric.whitens:
            raw = metric.whitened(raw, probs)
        if self.restrict == "projection":
            out = raw @ self.projection(raw.shape[-1], raw.dtype, raw.device)
        else:
            out = raw
        out = apply_mask(out, mask)
        return mean_pool(out, mask) if self.pool == "mean" else out


def apply_mask(out: Any, mask: Any) -> Any:
    """Zero positions where ``mask`` (``(B, T)``) is 0, if ``out`` is ``(B, T, ...)``."""
    if mask is None or out.dim() < 2 or tuple(out.shape[:2]) != tuple(mask.shape):
        return out
    m = mask.to(out.dtype)
    while m.dim() < out.dim():
        m = m.unsqueeze(-1)
    return out * m


def mean_pool(out: Any, mask: Any) -> Any:
    """Per sample, the mean of ``out`` (``(B, T, ...)``, already masked) over the real positions
    of ``mask`` (``(B, T)``; ``None``: every position): ``(B, ...)``."""
    if out.dim() < 3:
        raise ValidationError(f"output pool: mean needs a per-position output (B, T, ...), got shape "
                              f"{tuple(out.shape)}")
    if mask is None or tuple(out.shape[:2]) != tuple(mask.shape):
        return out.mean(dim=1)
    counts = mask.to(out.dtype).sum(dim=1).clamp_min(1.0)
    while counts.dim() < out.dim() - 1:
        counts = counts.unsqueeze(-1)
    return out.sum(dim=1) / counts
