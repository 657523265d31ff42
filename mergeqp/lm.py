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
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import BadDataError, ValidationError
from .io.calibration import Batch
from .output_metrics import POOLS, OutputMetric, kl_whiten, output_metric

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
        if not self.output_metric.plain and self.restrict != "topk":
            return (f"the {self.metric} metric with restrict {self.restrict!r} has a vocabulary-size metric "
                    f"W'(diag p - p p')W per position (fold it with restrict: topk)")
        return None

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
                    raise ValidationError(f"the output matrix has {self.matrix.shape[0]} rows but the compared output "
                                          f"{self.field!r} has {vocab} features")
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
        import torch

        metric = self.output_metric
        if metric.distribution is None:
            return None
        logits = target_raw.gather(-1, index) if self.restrict == "topk" else target_raw
        return metric.distribution(logits).to(torch.float64)

    def select(self, raw: Any, mask: Any = None, index: Any = None, probs: Any = None) -> Any:
        """Restrict ``raw`` (last axis = vocabulary / features) and zero the masked positions.

        For a whitening metric (``kl``), ``probs`` is the target's distribution (:meth:`target_probs`,
        on ``raw``'s device) and ``raw`` is whitened by the metric's map (:func:`kl_whiten` for ``kl``;
        after a ``topk`` gather, before a ``projection``)."""
        whiten = self.output_metric.whiten
        if whiten is not None and probs is None:
            raise ValidationError(f"the {self.metric} output metric needs the target's distribution (probs)")
        if self.restrict == "topk":
            if index is None:
                raise ValidationError("topk restriction needs the target's indices")
            raw = raw.gather(-1, index)
        if whiten is not None:
            raw = whiten(raw, probs)
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


@dataclass(frozen=True, eq=False)
class HeadTargets:
    """A fine-tune's head, kept so that its every-logit targets need not be: a target batch
    that holds only the fine-tune's final hidden states ``n*`` (``(B, T, H)``) forms its
    ``(B, T, V)`` logits ``W n* + b`` when they are read, one batch at a time, with the
    head's own ``weight`` (``(V, H)``) and ``bias`` in the model's dtype, on the model's device
    (a GPU run forms them there, as its forward pass did, and moves them to the CPU). Used by
    :func:`teacher_forced_targets` only where every batch's logits formed so are the model's
    own to rounding of its dtype (checked; bitwise on the CPU), and only for the compared
    output of every logit with the Euclidean metric (``restrict: none``), where the logits are
    ``V / H`` times the hidden state (49,152 / 576 for SmolLM2): the targets then take the
    hidden state's memory instead of the vocabulary's (:data:`HEAD_TARGETS_MIN_RATIO`)."""

    weight: Any
    bias: Any = None

    @property
    def width(self) -> int:
        return int(self.weight.shape[0])

    def logits(self, hidden: Any) -> Any:
        """``hidden @ W' + b`` in the head's dtype, on the head's device (``hidden``: any dtype or device)."""
        import torch

        return torch.nn.functional.linear(hidden.to(self.weight.device, self.weight.dtype), self.weight, self.bias)

    def same_as(self, weight: Any, bias: Any, *, rounded: bool = False) -> bool:
        """Whether ``weight`` / ``bias`` are this head's, entry for entry; with ``rounded``, also
        when this head is that head (the model's) stored in a lower precision (a fine-tune saved in
        bfloat16 or float16 from a float32 base, its head untouched: the base's head rounded)."""
        import torch

        def equal(a: Any, b: Any) -> bool:
            if a is None or b is None:
                return a is None and b is None
            if tuple(a.shape) != tuple(b.shape):
                return False
            a = a.detach().to(b.device)
            if a.dtype == b.dtype and bool(torch.equal(a, b)):
                return True
            return rounded and any(bool(torch.equal(a.to(low).to(b.dtype), b)) for low in narrower_floats(a))

        return equal(weight, self.weight) and equal(bias, self.bias)


#: logits are kept as the fine-tune's final hidden states and its head (:class:`HeadTargets`) when
#: the vocabulary is at least this many times the hidden size (forming a batch's logits again then
#: costs one product with the head, what the model's own forward pass spends on it)
HEAD_TARGETS_MIN_RATIO = 2
#: how :func:`teacher_forced_targets`'s memory check describes targets kept as hidden states
KEPT_AS_HIDDEN = "the final hidden states (the logits are formed from them by the head when read)"


@dataclass(frozen=True)
class TargetsNeed:
    """What the rest of a fine-tune's target batches will add, for a memory check
    (:func:`teacher_forced_targets`'s ``check``): ``nbytes``; ``what``, a description; and
    ``kept_as_hidden``, whether they are final hidden states (:class:`HeadTargets`), whose size a
    restriction of the compared outputs does not change."""

    nbytes: int
    what: str
    kept_as_hidden: bool = False


#: the heads of live :class:`HeadTargets`: fine-tunes that share a head share one copy of it
_HEADS: list[weakref.ref] = []


def _shared_head(weight: Any, bias: Any) -> HeadTargets:
    """A :class:`HeadTargets` of ``weight`` / ``bias`` (a copy, on their device), shared with a live
    one that has the same entries there."""
    live = [ref for ref in _HEADS if ref() is not None]
    _HEADS[:] = live
    for ref in live:
        head = ref()
        if head is not None and head.weight.device == weight.device and head.same_as(weight, bias):
            return head
    head = HeadTargets(weight.detach().clone(), None if bias is None else bias.detach().clone())
    _HEADS.append(weakref.ref(head))
    return head


def keeps_head_targets(spec: OutputSpec, vocab: int, hidden: int) -> bool:
    """Whether :func:`teacher_forced_targets` keeps ``spec``'s targets as final hidden states
    (:class:`HeadTargets`) for a linear head of ``vocab`` outputs on ``hidden`` features, when its
    check passes: every logit compared, Euclidean, per position."""
    return (spec.field == "logits" and spec.restrict == "none" and spec.output_metric.plain
            and spec.pool == "none" and vocab >= HEAD_TARGETS_MIN_RATIO * max(hidden, 1))


@dataclass(frozen=True, init=False)
class TargetBatch:
    """A batch with its target: ``target`` is the fine-tuned model's compared output
    (restricted and masked, float64 on CPU; with a ``source`` head (:class:`HeadTargets`) it is
    formed from ``hidden`` whenever it is read, and not held); ``index`` the top-k indices (or ``None``);
    ``probs`` the target's distribution for the ``kl`` metric (float64 on CPU, ``(B, T, V)`` or
    ``(B, T, k)`` for ``topk``; else ``None``); ``hidden`` the fine-tune's final hidden state
    ``n*`` (the head's input, ``(B, T, H)`` float64 on CPU) when the head may be folded (see
    :class:`FoldedHead`), else ``None``; ``count`` the number of compared positions (real
    tokens, or samples). For a metric that scores the prompts' own tokens
    (``cross_entropy``), ``labels`` holds the next token of every position (``(B, T)`` int64,
    ``-100`` where there is none: padding and each prompt's last token) and ``target`` the
    float64 indicator of the labelled positions; no fine-tune's output is involved. For a
    classification (``labels`` ``(B,)`` class indices of the prompts), ``head`` is the task's
    :class:`ClassifierHead`."""

    batch: Batch
    stored: Any
    index: Any
    probs: Any
    hidden: Any
    labels: Any
    head: Any
    source: HeadTargets | None
    #: the lower floating-point dtype (``torch.bfloat16`` / ``torch.float16``) in which the fine-tune's
    #: linear head is exactly representable, when its model computes in a wider one (a checkpoint
    #: saved in that precision), else ``None``: the fold's check then also accepts the model's head
    #: rounded to it (:func:`_fold_mismatch`)
    head_precision: Any

    def __init__(self, batch: Batch, target: Any = None, index: Any = None, probs: Any = None, hidden: Any = None,
                 labels: Any = None, head: Any = None, source: HeadTargets | None = None,
                 head_precision: Any = None) -> None:
        if (target is None) == (source is None):
            raise ValueError("a target batch holds its target or the head that forms it from hidden (one of them)")
        if source is not None and hidden is None:
            raise ValueError("a target formed by its head needs the final hidden states")
        for name, value in (("batch", batch), ("stored", target), ("index", index), ("probs", probs),
                            ("hidden", hidden), ("labels", labels), ("head", head), ("source", source),
                            ("head_precision", head_precision)):
            object.__setattr__(self, name, value)

    @property
    def target(self) -> Any:
        """The compared output of the fine-tune (float64, CPU); formed by the ``source`` head from
        ``hidden`` each time it is read when the batch holds no target."""
        if self.source is None:
            return self.stored
        return self._formed(self.hidden, self.batch.mask)

    def _formed(self, hidden: Any, mask: Any) -> Any:
        """The source head's logits of ``hidden``, masked, as float64 on the CPU (the stored form)."""
        import torch

        logits = self.source.logits(hidden)
        return apply_mask(logits, None if mask is None else mask.to(logits.device)).to("cpu", torch.float64)

    def target_rows(self, rows: slice) -> Any:
        """``target[rows]``, formed for those samples only when the batch holds no target."""
        if self.source is None:
            return self.stored[rows]
        return self._formed(self.hidden[rows], None if self.batch.mask is None else self.batch.mask[rows])

    @property
    def target_shape(self) -> tuple[int, ...]:
        """The target's shape, without forming it."""
        if self.source is None:
            return tuple(self.stored.shape)
        return (*tuple(self.hidden.shape[:-1]), self.source.width)

    @property
    def identity(self) -> Any:
        """The tensor that identifies this target (the stored target, or the hidden states it is
        formed from): caches key on it."""
        return self.stored if self.source is None else self.hidden

    @property
    def count(self) -> int:
        """Compared positions: real tokens of a masked sequence output (labelled positions for
        ``labels``), else every position (``B`` for one vector per sample)."""
        if self.labels is not None:
            return int((self.labels >= 0).sum())
        shape = self.target_shape
        if len(shape) >= 3:
            if self.batch.mask is not None and tuple(self.batch.mask.shape) == shape[:2]:
                return int(self.batch.mask.sum())
            return math.prod(shape[:-1])
        return shape[0]

    @property
    def sample_size(self) -> int:
        """Compared numbers per sample (the target's size over its first axis)."""
        return math.prod(self.target_shape[1:])

    def selection(self, device: Any) -> tuple[Any, Any, Any]:
        """``(mask, index, probs)`` on ``device`` (each ``None`` when absent): the batch's
        arguments of :meth:`OutputSpec.select` and of a folded head."""
        mask = None if self.batch.mask is None else self.batch.mask.to(device)
        index = None if self.index is None else self.index.to(device)
        probs = None if self.probs is None else self.probs.to(device)
        return mask, index, probs

    @property
    def entries(self) -> int:
        """Compared scalars: ``count`` times the per-position size (one loss per labelled position
        for ``labels``)."""
        if self.labels is not None:
            return self.count
        shape = self.target_shape
        per_position = shape[-1] if len(shape) >= 3 else math.prod(shape[1:])
        return self.count * per_position


def forward(model: Any, batch: Batch, device: Any) -> Any:
    """Run ``model`` on a batch (moved to ``device``) without gradients."""
    import torch

    with torch.no_grad():
        return model(**{k: v.to(device) for k, v in batch.inputs.items()})


def next_token_labels(batch: Batch, where: str = "calibration batch") -> Any:
    """``(B, T)`` int64: position ``t``'s next token ``input_ids[t + 1]`` where both are real tokens,
    else ``-100`` (padding, each prompt's last token). Raises :class:`ValidationError` when the
    batch has no ``input_ids`` (tensor inputs without token ids cannot be scored as text)."""
    import torch

    ids = batch.inputs.get("input_ids")
    if ids is None or ids.dim() != 2:
        raise ValidationError(f"{where}: the cross_entropy metric scores next tokens and needs text prompts "
                              f"(input_ids of shape (B, T)); got inputs {sorted(batch.inputs)}")
    real = torch.ones_like(ids, dtype=torch.bool) if batch.mask is None else batch.mask.to(ids.device).bool()
    labels = torch.full_like(ids, -100, dtype=torch.int64)
    pairs = real[:, :-1] & real[:, 1:]
    labels[:, :-1] = torch.where(pairs, ids[:, 1:].to(torch.int64), torch.full_like(labels[:, :-1], -100))
    return labels


@dataclass(frozen=True, eq=False)
class ClassifierHead:
    """A task's linear classifier on the pooled output: ``logits = pooled @ weight' + bias``
    (``weight`` ``(C, H)``, ``bias`` ``(C,)`` or ``None``; float64 tensors)."""

    weight: Any
    bias: Any = None
    name: str = "head"

    @classmethod
    def of(cls, weight: Any, bias: Any = None, name: str = "head") -> ClassifierHead:
        """Checked: a finite 2-D weight with two or more classes and a matching finite bias."""
        import torch

        w = torch.as_tensor(weight).detach().to("cpu", torch.float64)
        if w.dim() != 2 or w.shape[0] < 2 or w.shape[1] < 1:
            raise ValidationError(f"{name}: the head's weight must be (classes >= 2, features), got shape {tuple(w.shape)}")
        if not torch.all(torch.isfinite(w)):
            raise BadDataError(f"{name}: the head's weight has NaN or inf entries")
        b = None
        if bias is not None:
            b = torch.as_tensor(bias).detach().to("cpu", torch.float64).reshape(-1)
            if b.numel() != w.shape[0]:
                raise ValidationError(f"{name}: the head's bias has {b.numel()} entries for {w.shape[0]} classes")
            if not torch.all(torch.isfinite(b)):
                raise BadDataError(f"{name}: the head's bias has NaN or inf entries")
        return cls(w, b, name)

    @property
    def classes(self) -> int:
        return int(self.weight.shape[0])

    def logits(self, pooled: Any) -> Any:
        """``(B, C)`` class logits of a pooled output ``(B, H)``, in its dtype and on its device."""
        if pooled.dim() != 2 or int(pooled.shape[-1]) != int(self.weight.shape[1]):
            raise ValidationError(f"{self.name}: the head reads {int(self.weight.shape[1])} features but the pooled "
                                  f"output has shape {tuple(pooled.shape)}")
        x = pooled @ self.weight.to(device=pooled.device, dtype=pooled.dtype).t()
        return x if self.bias is None else x + self.bias.to(device=pooled.device, dtype=pooled.dtype)


def classification_metrics(model: Any, batches: Sequence[TargetBatch], head: ClassifierHead, spec: OutputSpec,
                           device: Any) -> tuple[float, float] | None:
    """``(accuracy, cross-entropy in nats)`` per prompt of ``head`` on the model's pooled ``spec``
    output over the prompts of ``batches`` that carry class labels (``None`` when none does)."""
    import torch

    correct = total = 0
    nll = 0.0
    for tb in batches:
        if tb.batch.labels is None:
            continue
        labels = class_labels(tb.batch, head, "held-out batch")
        logits = head_logits(spec, head, tb.batch, forward(model, tb.batch, device)).to("cpu", torch.float64)
        correct += int((logits.argmax(dim=-1) == labels).sum())
        nll += float(token_nll(logits, labels).sum())
        total += int(labels.numel())
    return (correct / total, nll / total) if total else None


def head_log_likelihood(head: ClassifierHead, spec: OutputSpec) -> Any:
    """``log_likelihood(model_output, targets)`` of a classifier that reads the model's pooled
    ``spec.field`` through ``head``: ``sum log softmax(head(mean over positions))[y]`` with ``y`` the
    targets or, without targets, the classifier's own prediction (its argmax; Fisher's label rule).
    For unpadded inputs (every position real), as :func:`mergeqp.io.calibration.unpadded_inputs`
    gives them."""
    import torch

    def log_likelihood(output: Any, targets: Any) -> Any:
        raw = spec.raw(output)
        logits = head.logits(raw.mean(dim=1) if raw.dim() >= 3 else raw)
        logp = torch.log_softmax(logits, dim=-1)
        y = logits.detach().argmax(dim=-1) if targets is None else targets
        return logp.gather(-1, y.unsqueeze(-1)).sum()

    return log_likelihood


def class_labels(batch: Batch, head: ClassifierHead, where: str = "calibration batch") -> Any:
    """The batch's ``(B,)`` class indices, checked against the head's classes."""
    labels = batch.labels
    if labels is None:
        raise ValidationError(f"{where}: the cross_entropy metric with pool: mean scores class labels; the prompts "
                              f"have none (set the task's calibration label_field)")
    if labels.dim() != 1 or int(labels.shape[0]) != batch.size:
        raise ValidationError(f"{where}: {tuple(labels.shape)} labels for {batch.size} prompts")
    if labels.numel() and int(labels.max()) >= head.classes:
        raise ValidationError(f"{where}: class label {int(labels.max())} but {head.name} has {head.classes} classes "
                              f"(labels are the head's row indices, 0 to {head.classes - 1})")
    return labels.to("cpu").long()


def label_targets(batches: Sequence[Batch], head: ClassifierHead | None = None) -> list[TargetBatch]:
    """The targets of a metric that scores the prompts' own next tokens (:func:`next_token_labels`)
    or, with a task's ``head``, their class labels (:func:`class_labels`)."""
    import torch

    out = []
    for i, batch in enumerate(batches):
        if head is None:
            labels = next_token_labels(batch, f"calibration batch {i}")
        else:
            labels = class_labels(batch, head, f"calibration batch {i}")
        out.append(TargetBatch(batch, (labels >= 0).to(torch.float64), labels=labels, head=head))
    return out


def data_logits(spec: OutputSpec, tb: TargetBatch, model_output: Any) -> Any:
    """The logits that a data metric scores: the model's next-token logits, or for a
    classification the task head's class logits ``(B, C)`` of the masked, mean-pooled output."""
    if tb.head is None:
        return spec.raw(model_output)
    return head_logits(spec, tb.head, tb.batch, model_output)


def head_logits(spec: OutputSpec, head: ClassifierHead, batch: Batch, model_output: Any) -> Any:
    """``head``'s class logits ``(B, C)`` of the model's ``spec`` output on ``batch``, masked and
    mean-pooled over the batch's real positions."""
    raw = spec.raw(model_output)
    return head.logits(spec.select(raw, None if batch.mask is None else batch.mask.to(raw.device)))


def teacher_forced_targets(model: Any, batches: Sequence[Batch], spec: OutputSpec, device: Any,
                           head: ClassifierHead | None = None,
                           check: Callable[[TargetsNeed], None] | None = None) -> list[TargetBatch]:
    """The fine-tuned ``model``'s compared outputs on ``batches`` (teacher forced), as targets
    (for a metric that scores the prompts' own tokens or, with the task's ``head``, their class
    labels: those labels; ``model`` is then not run).

    ``check(need)``: called once, after the first batch, with the :class:`TargetsNeed` of the other
    batches' targets (:func:`target_bytes` of the first, scaled by each batch's positions); it may
    refuse (raise) before they are allocated."""
    import torch

    if spec.scores_data:
        if spec.classifies and head is None:
            raise ValidationError("the cross_entropy metric with pool: mean needs each task's classifier head")
        return label_targets(batches, head if spec.classifies else None)
    out = []
    linear = linear_head(model)
    compact = (linear is not None and not linear.weight.is_meta
               and keeps_head_targets(spec, int(linear.weight.shape[0]), int(linear.weight.shape[1])))
    head = linear if spec.fold_obstacle() is None or compact else None
    precision = stored_precision(head.weight, head.bias) if head is not None and not head.weight.is_meta else None
    source = None
    for batch in batches:
        if head is None:
            raw, hidden = spec.raw(forward(model, batch, device)), None
        else:
            captured: list[Any] = []
            handle = head.register_forward_hook(lambda mod, args, output: captured.append(args[0]))
            try:
                raw = spec.raw(forward(model, batch, device))
            finally:
                handle.remove()
            hidden = captured[0].detach().to("cpu", torch.float64) if len(captured) == 1 else None
        if not torch.all(torch.isfinite(raw)):
            raise BadDataError("the fine-tuned model produced non-finite outputs on the calibration prompts "
                               "(NaN or inf in its checkpoint, or an overflow in its dtype)")
        index = spec.topk_index(raw) if spec.restrict == "topk" else None
        probs = spec.target_probs(raw, index)
        target = spec.select(raw, None if batch.mask is None else batch.mask.to(raw.device), index, probs)
        target = target.detach().to("cpu", torch.float64)
        tb = None
        if compact and hidden is not None:
            source = source if source is not None else _shared_head(head.weight, head.bias)
            tb = TargetBatch(batch, hidden=hidden, source=source)
            if tuple(tb.target_shape) != tuple(target.shape) or not _same_target(tb.target, target, raw.device):
                tb = None  # this batch's logits are not its head's of the captured input: kept whole
        if tb is None:
            tb = TargetBatch(batch, target, None if index is None else index.to("cpu"),
                             None if probs is None else probs.detach().to("cpu"),
                             hidden if spec.fold_obstacle() is None else None, head_precision=precision)
        del target
        out.append(tb)
        if check is not None and len(out) == 1 and len(batches) > 1:
            first, positions = target_bytes(out[0]), batch.positions
            rest = sum(b.positions for b in batches[1:])
            shape = out[0].target_shape
            width = shape[-1] if shape else 1
            kept = out[0].source is not None
            what = (KEPT_AS_HIDDEN if kept else f"{width:,} compared outputs" + (", their distributions"
                    if probs is not None else "") + (", the final hidden states" if out[0].hidden is not None else ""))
            check(TargetsNeed(first * rest // max(positions, 1), f"{rest:,} more positions x {what} (float64)", kept))
    return out


def narrower_floats(t: Any) -> list[Any]:
    """The floating-point dtypes a checkpoint is commonly stored in (bfloat16, then float16) that are
    narrower than tensor ``t``'s (none for a tensor that is not floating-point)."""
    import torch

    if not t.is_floating_point():
        return []
    return [low for low in (torch.bfloat16, torch.float16) if torch.finfo(low).bits < torch.finfo(t.dtype).bits]


def stored_precision(weight: Any, bias: Any = None) -> Any:
    """The narrower floating-point dtype (bfloat16, then float16) in which ``weight`` and ``bias``
    are exactly representable, when narrower than their own dtype (a checkpoint saved in it and
    read into a wider one); else ``None``."""
    import torch

    for low in narrower_floats(weight):
        if all(t is None or bool(torch.equal(t.detach().to(low).to(t.dtype), t.detach())) for t in (weight, bias)):
            return low
    return None


def _same_target(formed: Any, target: Any, device: Any) -> bool:
    """Whether the target formed by the head (on the model's device) is the model's own: entry for
    entry when the model ran on the CPU, to rounding of float32 on another device."""
    import torch

    if torch.device(device).type == "cpu":
        return bool(torch.equal(formed, target))
    return bool(torch.equal(formed, target)) or _agree(formed, target, torch.float32)


def target_bytes(tb: TargetBatch) -> int:
    """Bytes held by one batch's target (its compared outputs, top-k indices, distributions and
    final hidden states)."""
    return sum(int(t.numel()) * int(t.element_size()) for t in (tb.stored, tb.index, tb.probs, tb.hidden)
               if t is not None)


#: float64 bytes of the model's compared output that one step of :func:`compared_rows` forms (at
#: least one sample): with a large vocabulary a batch's ``(B, T, V)`` logits in float64, with the
#: target's and their differences or log-probabilities beside them, are several times the model's
#: own output; one sample at a time they are not
COMPARED_CHUNK_BYTES = 64 * 2**20


def compared_rows(model: Any, tb: TargetBatch, spec: OutputSpec, device: Any) -> Any:
    """``(rows, x, y)`` for consecutive samples ``rows`` (a ``slice``) of ``tb``'s batch: the
    model's restricted, masked output ``x`` and the target ``y`` of those samples (float64, CPU),
    from one forward pass of the whole batch; as many samples at a time as fit in
    :data:`COMPARED_CHUNK_BYTES` (every sample of a small output at once)."""
    import torch

    raw = spec.raw(forward(model, tb.batch, device))
    mask, index, probs = tb.selection(raw.device)
    B = int(raw.shape[0])
    step = max(1, COMPARED_CHUNK_BYTES // (8 * max(tb.sample_size, 1)))

    def rows(t: Any, r: slice) -> Any:
        return None if t is None else t[r]

    for i in range(0, B, step):
        r = slice(i, min(i + step, B))
        x = spec.select(raw[r], rows(mask, r), rows(index, r), rows(probs, r)).to("cpu", torch.float64)
        yield r, x, tb.target_rows(r)


def squared_error(model: Any, batches: Sequence[TargetBatch], spec: OutputSpec, device: Any) -> tuple[float, int]:
    """``(sum of squared errors, number of compared entries)`` of ``model`` against the targets
    (for the ``kl`` metric, of the whitened outputs: about ``2 * sum KL``; for ``cross_entropy``,
    the exact ``2 * sum`` of the next-token negative log-likelihoods and the labelled positions):
    the calibration objective that the QP models."""
    if spec.scores_data:
        return _data_objective(model, batches, spec, device)
    fold = objective_fold(model, spec, batches, device)
    if fold is not None:
        return _folded_squared_error(model, batches, fold, device)
    total = 0.0
    entries = 0
    for tb in batches:
        for _, x, y in compared_rows(model, tb, spec, device):
            total += _squared(x, tb, y)
        entries += tb.entries
    return total, entries


def objective_fold(model: Any, spec: OutputSpec, batches: Sequence[TargetBatch], device: Any) -> FoldedHead | None:
    """The :class:`FoldedHead` with which :func:`squared_error` takes its value from the final
    hidden states instead of the vocabulary-size outputs, or ``None``: only where
    :func:`prepare_fold` verified (on this model, head and targets) that the logits are the head of
    the backbone's output and every target the head of its stored hidden state, so that
    ``||F(W n + b) - F(W n_t + b)||^2 = ||F W (n - n_t)||^2`` holds to rounding; ``fold_head:
    false`` keeps the vocabulary-size computation. A refusal is remembered for these targets."""
    if spec.fold_obstacle() is not None or not batches:
        return None
    key = (id(spec), tuple(id(tb.identity) for tb in batches))
    try:
        refused = _OBJECTIVE_FOLD_REFUSED.setdefault(model, set())
    except TypeError:  # a model that cannot be weakly referenced
        refused = set()
    head = linear_head(model)
    if head is not None:
        key = key + _head_key(head.weight, head.bias)
    if key in refused:
        return None
    try:
        fold = prepare_fold(model, spec, batches, device)
    except ValidationError:  # fold_head: true that cannot fold: the statistics say so, not this value
        fold = None
    if fold is None:
        if len(refused) > 64:
            refused.clear()
        refused.add(key)
    return fold


def _folded_squared_error(model: Any, batches: Sequence[TargetBatch], fold: FoldedHead,
                          device: Any) -> tuple[float, int]:
    """:func:`squared_error` through ``fold`` (float64 from the hidden states on; the same
    compared entries as unfolded): for every logit ``||G (n - n_t)||^2`` with ``G'G = W'W``, for
    ``topk`` the target's rows of the head (whitened for ``kl``; the bias cancels)."""
    import torch

    inner = backbone(model)
    f64 = torch.float64
    total = 0.0
    entries = 0
    for tb in batches:
        mask, index, probs = tb.selection(device)
        with torch.no_grad():
            n = last_hidden(inner(**{k: v.to(device) for k, v in tb.batch.inputs.items()}))
            d = n.to(f64) - tb.hidden.to(device=device, dtype=f64)
            if fold.reduced is not None:
                out = d @ fold.reduced.to(device=device, dtype=f64).t()
            else:
                rows = fold.weight.to(device)[index].to(f64)  # (B, T, k, H): the target's rows
                out = torch.einsum("bth,btkh->btk", d, rows)
                whiten = fold.spec.output_metric.whiten
                if whiten is not None:
                    out = whiten(out, probs.to(f64))
            out = apply_mask(out, mask)
            total += float((out * out).sum())
        entries += tb.entries
    return total, entries


def token_nll(logits: Any, labels: Any) -> Any:
    """``(B, T)`` float64: ``-log softmax(logits)[label]`` at each labelled position, 0 elsewhere
    (``labels`` ``-100``)."""
    import torch

    valid = labels >= 0
    logp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    nll = -logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, nll, torch.zeros_like(nll))


def _data_objective(model: Any, batches: Sequence[TargetBatch], spec: OutputSpec, device: Any) -> tuple[float, int]:
    total = 0.0
    count = 0
    for tb in batches:
        if tb.labels is None:
            raise ValidationError("the cross_entropy metric needs next-token labels (label_targets)")
        logits = data_logits(spec, tb, forward(model, tb.batch, device))
        total += 2.0 * float(token_nll(logits, tb.labels.to(logits.device)).sum())
        count += tb.count
    return total, count


def _squared(output: Any, tb: TargetBatch, target: Any = None) -> float:
    """``||output - target||^2`` (``target``: ``tb.target``, formed once by the caller if given)."""
    diff = output - (tb.target if target is None else target)
    return float(diff.mul_(diff).sum())


def teacher_forced_mse(model: Any, batches: Sequence[TargetBatch], spec: OutputSpec, device: Any) -> float:
    """Mean squared error per compared entry (e.g. per logit of each real token)."""
    total, entries = squared_error(model, batches, spec, device)
    return total / max(entries, 1)


@dataclass(frozen=True)
class HeldoutMetrics:
    """A model's teacher-forced metrics against one task's fine-tuned model.

    ``mse``: squared error per compared entry (per logit of each real token). ``kl``: mean
    ``KL(softmax(y) || softmax(x))`` per compared position, in nats (``None`` unless the compared
    output is the full, unprojected ``logits``). ``cross_entropy``: mean next-token cross-entropy
    of the prompts' real tokens, in nats per predicted token (``None`` unless the output is
    ``(B, T, V)`` logits of ``input_ids`` prompts with at least one predicted token)."""

    mse: float
    kl: float | None
    cross_entropy: float | None


def teacher_forced_metrics(model: Any, batches: Sequence[TargetBatch], spec: OutputSpec,
                           device: Any) -> HeldoutMetrics:
    """:class:`HeldoutMetrics` of ``model`` on ``batches`` (one forward pass per batch); ``mse``
    equals :func:`teacher_forced_mse`."""
    import torch

    distributions = (spec.field == "logits" and spec.restrict == "none" and spec.output_metric.plain
                     and spec.pool == "none")
    total = kl = ce = 0.0
    entries = positions = predicted = 0
    for tb in batches:
        entries += tb.entries
        if distributions:
            positions += tb.count
        all_ids = tb.batch.inputs.get("input_ids")
        for rows, x, y in compared_rows(model, tb, spec, device):
            total += _squared(x, tb, y)
            if not distributions:
                continue
            # float64 (rows, T, V) tensors, each freed or overwritten as soon as it is used
            shape = tuple(x.shape)
            log_q = torch.log_softmax(x, dim=-1)
            del x
            log_p = torch.log_softmax(y, dim=-1)
            del y
            ids = None if all_ids is None else all_ids[rows]
            if ids is not None and len(shape) == 3 and tuple(ids.shape) == shape[:2]:
                real = torch.ones_like(ids, dtype=torch.bool) if tb.batch.mask is None else tb.batch.mask[rows].bool()
                pairs = real[:, :-1] & real[:, 1:]  # position t predicts the real token t + 1
                nll = -log_q[:, :-1].gather(-1, ids[:, 1:].unsqueeze(-1).to(torch.int64)).squeeze(-1)
                ce += float(nll[pairs].sum())
                predicted += int(pairs.sum())
            p = log_p.exp()
            kl += float(p.mul_(log_p.sub_(log_q)).sum())  # p (log p - log q); masked positions: both rows 0, KL 0
    return HeldoutMetrics(total / max(entries, 1), kl / positions if distributions and positions else None,
                          ce / predicted if predicted else None)


# ---------------------------------------------------------------------- cross-entropy expansion
@dataclass(frozen=True, eq=False)
class CrossEntropyExpansion:
    """The Gauss-Newton model of ``2 * sum CE`` at the current model on one batch (``metric:
    cross_entropy``; see the module docstring).

    At each labelled position the logits are reduced to ``g`` group logits ``u``: every token
    (``restrict: none``, ``index`` ``None``), or the current model's top ``k`` tokens with the label
    forced in (``index``, ``(B, T, k)``) and ``lse`` of all the others as one more logit. With the
    current group distribution ``probs`` (``q``, float64, ``(B, T, g)``; ``softmax(u0) = q``
    exactly) and the label's group ``e_y``, the compared output is ``F u`` (:func:`kl_whiten` with
    ``q``, masked to the labelled positions) and the ``target`` is ``F u0 - r`` with ``r = (q -
    e_y) / sqrt(q)``, so ``||F u - target||^2 = ||F (u - u0) + r||^2`` has the value ``||r||^2``,
    the gradient ``2 (q - e_y)`` and the Hessian ``2 (diag q - q q')`` of ``2 CE`` at ``u0``;
    ``loss`` is the exact ``2 * sum CE`` there, so the QP's constant is ``loss - ||r||^2``.

    Folded (``weight``, ``bias``: the model's linear head), the group logits are computed from the
    final hidden state ``n``: the tracked tokens' head rows, and for the rest the direction
    ``rest_row`` (``(B, T, H)``, the rest's head rows averaged with the current probabilities: the
    derivative of ``lse`` of the rest), so no ``(B, T, V)`` logits enter a derivative pass."""

    index: Any
    probs: Any
    valid: Any
    target: Any
    residual: Any
    loss: float
    weight: Any = None
    bias: Any = None
    rest_row: Any = None

    @classmethod
    def at(cls, spec: OutputSpec, labels: Any, *, logits: Any = None, hidden: Any = None,
           weight: Any = None, bias: Any = None) -> CrossEntropyExpansion:
        """The expansion at the current ``logits`` (``(B, T, V)``), or folded at the final ``hidden``
        state (``(B, T, H)``) with the head ``weight`` (``(V, H)``) and ``bias``; ``labels``
        ``(B, T)`` (:func:`next_token_labels`)."""
        import torch

        folded = hidden is not None
        if folded:
            if weight is None:
                raise ValidationError("a folded cross-entropy expansion needs the head's weight")
            # the head's product in the model's own precision (a (B, T, V) float64 product cost half
            # of this expansion's time), everything after it in float64
            head_dtype = torch.promote_types(hidden.dtype, torch.float32)  # never below float32
            x0 = (hidden.to(head_dtype) @ weight.to(head_dtype).t()).to(torch.float64)
            if bias is not None:
                x0 = x0 + bias.to(torch.float64)
        elif logits is None:
            raise ValidationError("a cross-entropy expansion needs the current logits or hidden state")
        else:
            x0 = logits.to(torch.float64)
        labels = labels.to(x0.device)
        valid = labels >= 0
        V = int(x0.shape[-1])
        # log-sum-exp and the probabilities from one exponential pass (every (B, T, V) pass counts)
        top = x0.amax(dim=-1, keepdim=True)
        q_full = (x0 - top).exp_()
        total = q_full.sum(dim=-1, keepdim=True)
        lse = top + total.log()
        q_full.div_(total)
        loss = 2.0 * float(torch.where(valid, lse[..., 0] - x0.gather(-1, labels.clamp_min(0).unsqueeze(-1))[..., 0],
                                       torch.zeros_like(lse[..., 0])).sum())
        index = None
        rest_row = None
        if spec.restrict == "topk":
            assert spec.k is not None
            if spec.k >= V:
                raise ValidationError(f"output topk k={spec.k} must be below the vocabulary size {V} for the "
                                      f"cross_entropy metric (the rest is one more logit); use restrict: none")
            index = x0.topk(spec.k, dim=-1).indices  # (B, T, k)
            lab = labels.clamp_min(0).unsqueeze(-1)
            missing = valid & ~(index == lab).any(dim=-1)
            index[..., -1] = torch.where(missing, lab[..., 0], index[..., -1])
            q_track = q_full.gather(-1, index)
            q_rest_full = q_full.scatter_(-1, index, 0.0)  # in place: the rest's probabilities
            q_rest = q_rest_full.sum(dim=-1, keepdim=True)
            probs = torch.cat([q_track, q_rest], dim=-1)
            label_group = (index == lab).to(torch.float64)
            label_group = torch.cat([label_group, torch.zeros_like(q_rest)], dim=-1)
            if folded:
                # the rest's probabilities normalised in float64 first (no underflow in the cast)
                share = q_rest_full.div_(q_rest.clamp_min(torch.finfo(torch.float64).tiny))
                rest_row = (share.to(head_dtype) @ weight.to(head_dtype)).to(torch.float64)
            del q_rest_full, q_full
        else:
            probs = q_full
            label_group = torch.zeros_like(probs).scatter(-1, labels.clamp_min(0).unsqueeze(-1), 1.0)
        tiny = torch.finfo(torch.float64).tiny
        r = torch.where(probs > tiny, (probs - label_group) / probs.clamp_min(tiny).sqrt(), torch.zeros_like(probs))
        r = r * valid.unsqueeze(-1).to(r.dtype)
        out = cls(index, probs, valid, None, r.reshape(r.shape[0], -1), loss, None if not folded else weight,
                  None if not folded else bias, rest_row)
        with torch.no_grad():
            u0 = out.group_logits(hidden.to(torch.float64) if folded else x0)
            target = out._whiten(u0) - r
        return dataclasses.replace(out, target=target.reshape(target.shape[0], -1))

    @property
    def width(self) -> int:
        """Group logits per position (``k + 1``, or the vocabulary)."""
        return int(self.probs.shape[-1])

    def group_logits(self, source: Any) -> Any:
        """``u`` (``(B, T, g)``) of logits ``(B, T, V)``, or of a final hidden state ``(B, T, H)`` when
        folded: linear in the hidden state; for logits, the rest's ``lse`` (first-order the same)."""
        import torch

        if self.index is None:
            return source if self.weight is None else self._head(source, None)
        if self.weight is None:
            tracked = source.gather(-1, self.index.to(source.device))
            rest = source.scatter(-1, self.index.to(source.device), float("-inf")).logsumexp(dim=-1, keepdim=True)
            return torch.cat([tracked, rest], dim=-1)
        tracked = self._head(source, self.index.to(source.device))
        rest = (source * self.rest_row.to(device=source.device, dtype=source.dtype)).sum(dim=-1, keepdim=True)
        return torch.cat([tracked, rest], dim=-1)

    def _head(self, n: Any, index: Any) -> Any:
        import torch

        if index is None:
            x = n @ self.weight.to(device=n.device, dtype=n.dtype).t()
            return x if self.bias is None else x + self.bias.to(device=n.device, dtype=n.dtype)
        # the tracked rows only, then cast (exact either way; casting the whole head first copied
        # V x H values per call)
        x = torch.einsum("bth,btkh->btk", n, self.weight.to(n.device)[index].to(n.dtype))
        return x if self.bias is None else x + self.bias.to(device=n.device, dtype=n.dtype)[index]

    def _whiten(self, u: Any) -> Any:
        x = kl_whiten(u, self.probs.to(u.device))
        return x * self.valid.to(device=u.device, dtype=x.dtype).unsqueeze(-1)

    def compared(self, source: Any) -> Any:
        """The compared output ``F u`` (``(B, T g)``, zero at unlabelled positions) of logits or, when
        folded, of a final hidden state; linear to first order in it."""
        x = self._whiten(self.group_logits(source))
        return x.reshape(x.shape[0], -1)

    @property
    def constant(self) -> float:
        """``loss - ||r||^2``: what the QP adds so that its value at the current point is the loss."""
        return self.loss - float((self.residual * self.residual).sum())


# ---------------------------------------------------------------------- folding a linear head
def linear_head(model: Any) -> Any:
    """The model's output head (``get_output_embeddings()``) if it is an ``nn.Linear``, else ``None``."""
    import torch

    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    return head if isinstance(head, torch.nn.Linear) else None


def backbone(model: Any) -> Any:
    """The module whose output's ``last_hidden_state`` feeds the head (``model.base_model``), or
    ``None`` when the model has no separate one."""
    inner = getattr(model, "base_model", None)
    return inner if inner is not None and inner is not model else None


def last_hidden(out: Any) -> Any:
    """``last_hidden_state`` of a backbone's output (or its first element)."""
    import torch

    if isinstance(out, torch.Tensor):
        return out
    value = getattr(out, "last_hidden_state", None)
    return value if value is not None else out[0]


@dataclass(frozen=True, eq=False)
class FoldedHead:
    """The compared output as a small linear map of the final hidden state ``n`` (``(B, T, H)``;
    see the module docstring). ``weight``: the head ``W`` (``(V, H)``) and ``bias`` (``(V,)`` or
    ``None``) in the model's dtype; ``reduced``: the fixed map ``G`` (``(q, H)``: ``R`` with
    ``R'R = W'W`` for ``none``, ``P'W`` for ``projection``) or ``None`` for ``topk``."""

    spec: OutputSpec
    weight: Any
    bias: Any
    reduced: Any

    @classmethod
    def of(cls, head: Any, spec: OutputSpec) -> FoldedHead:
        """The folded head of an ``nn.Linear`` ``head`` for ``spec`` (the ``(q, H)`` map is
        computed in float64 once per head weight and kept in ``spec``'s cache)."""
        import torch

        W = head.weight.detach()
        bias = None if head.bias is None else head.bias.detach()
        if spec.restrict == "topk":
            return cls(spec, W, bias, None)
        key = ("fold", W.data_ptr(), W._version, tuple(W.shape), str(W.dtype), str(W.device))
        if key not in spec._cache:
            G = W.to(torch.float64)
            if spec.restrict == "projection":
                G = spec.projection(int(W.shape[0]), torch.float64, W.device).t() @ G  # (k, H)
            if G.shape[0] > G.shape[1]:  # more rows than H: the Gram's root carries the same metric
                evals, evecs = torch.linalg.eigh(G.t() @ G)
                keep = evals > float(evals.max().clamp_min(0.0)) * G.shape[1] * torch.finfo(torch.float64).eps
                G = evals[keep].sqrt().unsqueeze(1) * evecs[:, keep].t()  # (q, H), R'R = G'G
            if len(spec._cache) > 8:  # heads of models no longer used
                spec._cache.clear()
            spec._cache[key] = G.to(W.dtype)
        return cls(spec, W, bias, spec._cache[key])

    @property
    def width(self) -> int | None:
        """Numbers per position of the folded output (``q`` or ``k``)."""
        return int(self.reduced.shape[0]) if self.reduced is not None else self.spec.k

    def compared(self, n: Any, mask: Any = None, index: Any = None, probs: Any = None) -> Any:
        """The folded compared output of hidden states ``n`` (``(B, T, H)``): ``(B, T, q)``, masked;
        ``index`` / ``probs``: the target's top-``k`` indices and distribution (``topk``)."""
        import torch

        if self.reduced is not None:
            return apply_mask(n @ self.reduced.t(), mask)
        if index is None:
            raise ValidationError("topk restriction needs the target's indices")
        rows = self.weight[index]  # (B, T, k, H): only the target's top-k rows of the head
        x = torch.einsum("bth,btkh->btk", n.to(rows.dtype), rows)
        if self.bias is not None:
            x = x + self.bias[index]
        whiten = self.spec.output_metric.whiten
        if whiten is not None:
            x = whiten(x, probs)
        return apply_mask(x, mask)

    def unfolded(self, n: Any, mask: Any = None, index: Any = None, probs: Any = None) -> Any:
        """``spec.select`` of the head's logits ``W n + b`` (``(B, T, V)`` formed): the check of the fold."""
        logits = n.to(self.weight.dtype) @ self.weight.t()
        if self.bias is not None:
            logits = logits + self.bias
        return self.spec.select(logits, mask, index, probs)


def _agree(a: Any, b: Any, dtype: Any) -> bool:
    """``a`` and ``b`` equal to rounding of ``dtype`` (relative to ``b``'s norm, float64)."""
    import torch

    a, b = a.to("cpu", torch.float64), b.to("cpu", torch.float64)
    tol = min(1e3 * float(torch.finfo(dtype).eps), 1e-2)
    return float((a - b).norm()) <= tol * float(b.norm()) + 1e-300


def prepare_fold(model: Any, spec: OutputSpec, batches: Sequence[TargetBatch], device: Any,
                 sites: Sequence[Any] = ()) -> FoldedHead | None:
    """The :class:`FoldedHead` that the statistics of ``model`` (the linearisation point) on
    ``batches`` may use, or ``None`` (``spec.fold_head`` ``None``: whenever folding is impossible;
    ``True``: raise :class:`ValidationError` naming why). Checked, not assumed: the model's
    logits on the first batch are the head of its backbone's ``last_hidden_state``; every
    target is the head (this model's) of the fine-tune's stored hidden state, so the
    fine-tunes share the head; every module of ``sites`` lies inside the backbone."""
    return fold_decision(model, spec, batches, device, sites)[0]


def fold_decision(model: Any, spec: OutputSpec, batches: Sequence[TargetBatch], device: Any,
                  sites: Sequence[Any] = (), labels: Sequence[str] | None = None
                  ) -> tuple[FoldedHead | None, str | None]:
    """:func:`prepare_fold`'s fold and, when there is none, why (``None`` when the output cannot be
    folded by its kind: not logits, or ``fold_head: false``); ``labels`` name the batches in the
    reason (default ``target batch i``)."""
    reason = spec.fold_obstacle()
    if reason is not None:
        if spec.fold_head:
            raise ValidationError(f"output fold_head: true, but the head cannot be folded: {reason}")
        return None, None
    head = linear_head(model) if reason is None else None
    inner = backbone(model) if head is not None else None
    if reason is None and head is None:
        getter = getattr(model, "get_output_embeddings", None)
        declared = getter() if callable(getter) else None
        # (a ViT classifier's head is an nn.Linear the model does not declare as its output embeddings)
        reason = ("the model declares no output head (get_output_embeddings() is None)" if declared is None
                  else f"the model's output head is a {type(declared).__name__}, not an nn.Linear")
    if reason is None and inner is None:
        reason = "the model has no backbone (base_model) separate from its head"
    if reason is None and not spec.scores_data and any(tb.hidden is None for tb in batches):
        reason = "the targets hold no final hidden state (the fine-tune's head is not an nn.Linear)"
    if reason is None:
        inside = {id(m) for m in inner.modules()}
        outside = [type(s).__name__ for s in sites if id(s) not in inside]
        if outside:
            reason = f"merge site(s) outside the backbone ({', '.join(outside)})"
    fold = None if reason is not None else FoldedHead.of(head, spec)
    if fold is not None and batches:
        reason = _fold_mismatch(model, inner, fold, batches, device, labels)
    if reason is None:
        return fold, None
    if spec.fold_head:
        raise ValidationError(f"output fold_head: true, but the head cannot be folded: {reason}")
    return None, reason


def _agrees_rounded(fold: FoldedHead, tb: TargetBatch, mask: Any, index: Any, probs: Any, device: Any) -> bool:
    """Whether the target of ``tb`` is this model's head, rounded to the precision the fine-tune's
    head is stored in (``tb.head_precision``), applied to the fine-tune's final hidden state: a
    fine-tune saved in bfloat16 from a float32 base, its head untouched. The fold then compares
    with the model's own head: the targets move by that rounding only."""
    import torch

    low, dtype = tb.head_precision, fold.weight.dtype
    rounded = FoldedHead(fold.spec, fold.weight.to(low).to(dtype),
                         None if fold.bias is None else fold.bias.to(low).to(dtype), None)
    with torch.no_grad():
        mine = rounded.unfolded(tb.hidden.to(device=device, dtype=dtype), mask, index, probs)
    target = tb.target
    return tuple(mine.shape) == tuple(target.shape) and _agree(mine, target, dtype)


#: model -> what :func:`_fold_mismatch` already verified for it: ``"head"`` (the identity and
#: version of the head's weight when the model's logits were found to be head o backbone) and
#: ``"targets"`` (id of a target tensor -> weak references to it and to the hidden state it was
#: checked with; keyed by id, since tensors do not compare as dictionary keys). The sequential,
#: hybrid and trust-region modes collect statistics many times on one model with the same targets;
#: the check (two full forward passes) is done once. Weak: a model or target that is dropped is
#: forgotten.
_FOLD_VERIFIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: model -> keys of targets for which :func:`objective_fold` found no valid fold
_OBJECTIVE_FOLD_REFUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _head_key(weight: Any, bias: Any) -> tuple[Any, ...]:
    """The identity of a head's parameters: storage, version (bumped by in-place writes), shape,
    dtype and device; a changed or replaced head is checked again."""
    parts = [weight] + ([bias] if bias is not None else [])
    return tuple((int(t.data_ptr()), int(t._version), tuple(t.shape), str(t.dtype), str(t.device)) for t in parts)


def _fold_mismatch(model: Any, inner: Any, fold: FoldedHead, batches: Sequence[TargetBatch],
                   device: Any, labels: Sequence[str] | None = None) -> str | None:
    """Why ``fold`` does not reproduce the model's compared output or the targets (``None``: it
    does). What passed once for this model, head and target is not checked again
    (:data:`_FOLD_VERIFIED`)."""
    import torch

    try:
        verified = _FOLD_VERIFIED.setdefault(model, {"head": None, "targets": {}})
    except TypeError:  # a model that cannot be weakly referenced: check every time
        verified = {"head": None, "targets": {}}
    head_key = (_head_key(fold.weight, fold.bias), fold.spec)
    if verified["head"] != head_key or len(verified["targets"]) > 4096:
        verified["head"] = None
        verified["targets"].clear()
    dtype = fold.weight.dtype
    shares_head: dict[int, bool] = {}  # a kept target's head against the model's: once per head copy
    for i, tb in enumerate(batches):
        seen = verified["targets"].get(id(tb.identity))
        if verified["head"] is not None and seen is not None and seen[0]() is tb.identity and seen[1]() is tb.hidden:
            continue
        mask, index, probs = tb.selection(device)
        data = fold.spec.scores_data  # scored against the prompts' tokens: only the model's own head is checked
        with torch.no_grad():
            if verified["head"] is None:
                inputs = {k: v.to(device) for k, v in tb.batch.inputs.items()}
                raw = fold.spec.raw(model(**inputs))
                n = last_hidden(inner(**inputs))
                if data:
                    full = apply_mask(raw, mask)
                    folded = n.to(fold.weight.dtype) @ fold.weight.t()
                    folded = apply_mask(folded if fold.bias is None else folded + fold.bias, mask)
                else:
                    full = fold.spec.select(raw, mask, index, probs)
                    folded = fold.unfolded(n, mask, index, probs)
                if tuple(full.shape) != tuple(folded.shape) or not _agree(folded, full, dtype):
                    return ("the model's logits are not its head applied to its backbone's last_hidden_state "
                            "(a scaled or soft-capped head?)")
                verified["head"] = head_key
            if data:
                break
            # a target formed by the fine-tune's own head: the model's head, entry for entry, forms it
            if tb.source is not None and id(tb.source) not in shares_head:
                shares_head[id(tb.source)] = tb.source.same_as(fold.weight, fold.bias, rounded=True)
            shared = tb.source is not None and shares_head[id(tb.source)]
            if not shared:
                mine = fold.unfolded(tb.hidden.to(device=device, dtype=dtype), mask, index, probs)
                target = tb.target
        if not shared and (tuple(mine.shape) != tuple(target.shape) or not _agree(mine, target, dtype)) and not (
                tb.head_precision is not None and _agrees_rounded(fold, tb, mask, index, probs, device)):
            where = labels[i] if labels is not None else f"target batch {i}"
            return (f"{where}: the fine-tuned model's logits are not this model's head applied to "
                    f"its final hidden state (the head differs between the base and the fine-tune?)")
        verified["targets"][id(tb.identity)] = (weakref.ref(tb.identity), weakref.ref(tb.hidden))
    return None
