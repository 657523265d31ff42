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
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import BadDataError, ValidationError
from .io.calibration import Batch

RESTRICTIONS = ("none", "topk", "projection")
METRICS = ("euclidean", "kl")
POOLS = ("none", "mean")


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
    tokens: ``(B, T, q)`` becomes ``(B, q)``; Euclidean metric only).
    """

    field: str = "logits"
    restrict: str = "none"
    k: int | None = None
    seed: int = 0
    metric: str = "euclidean"
    fold_head: bool | None = None
    sketch: int | None = None
    pool: str = "none"
    _cache: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.restrict not in RESTRICTIONS:
            raise ValidationError(f"output restriction {self.restrict!r}; valid: {', '.join(RESTRICTIONS)}")
        if self.restrict != "none" and (self.k is None or self.k < 1):
            raise ValidationError(f"output restriction {self.restrict!r} needs k >= 1")
        if self.metric not in METRICS:
            raise ValidationError(f"output metric {self.metric!r}; valid: {', '.join(METRICS)}")
        if self.fold_head not in (None, True, False):
            raise ValidationError(f"output fold_head {self.fold_head!r}; valid: auto (None), true, false")
        if self.sketch is not None and (isinstance(self.sketch, bool) or not isinstance(self.sketch, int)
                                        or self.sketch < 1):
            raise ValidationError(f"output sketch {self.sketch!r}: a number of outputs per sample >= 1, or None")
        if self.pool not in POOLS:
            raise ValidationError(f"output pool {self.pool!r}; valid: {', '.join(POOLS)}")
        if self.pool != "none" and self.metric != "euclidean":
            raise ValidationError(f"output pool {self.pool!r} needs the euclidean metric (the {self.metric} metric "
                                  f"compares each position's distribution, which a mean over positions is not)")

    def sketch_matrix(self, batch: int, outputs: int, key: tuple[int, ...], dtype: Any, device: Any) -> Any:
        """The per-sample sketches ``S`` (``(batch, s, outputs)``, entries ``N(0, 1/s)``, so
        ``E[S_j'S_j] = I``) of the batch identified by ``key`` (e.g. task and batch index): a
        float64 draw from ``seed`` and ``key``, cast to ``dtype``."""
        import torch

        assert self.sketch is not None
        size = batch * self.sketch * outputs
        if size > 2**28:
            raise ValidationError(
                f"output sketch: {batch} x {self.sketch} x {outputs} sketch entries per batch (over 2^28); "
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
        if self.metric == "kl" and self.restrict != "topk":
            return (f"the kl metric with restrict {self.restrict!r} has a vocabulary-size metric "
                    f"W'(diag p - p p')W per position (fold it with restrict: topk)")
        return None

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
            raise ValidationError(f"model output has no {self.field!r}; available: {keys}")
        return value

    def projection(self, vocab: int, dtype: Any, device: Any) -> Any:
        """The ``(V, k)`` projection matrix (float64 draw from ``seed``, then cast)."""
        import torch

        key = (vocab, str(dtype), str(device))
        if key not in self._cache:
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
        """The target's distribution ``p`` (float64, ``(..., V)``; ``(..., k)`` renormalised over the
        top-``k`` ``index`` for ``topk``) that the ``kl`` metric's map :func:`kl_whiten` uses."""
        import torch

        logits = target_raw.gather(-1, index) if self.restrict == "topk" else target_raw
        return torch.softmax(logits.to(torch.float64), dim=-1)

    def select(self, raw: Any, mask: Any = None, index: Any = None, probs: Any = None) -> Any:
        """Restrict ``raw`` (last axis = vocabulary / features) and zero the masked positions.

        For ``metric="kl"``, ``probs`` is the target's distribution (:meth:`target_probs`, on
        ``raw``'s device) and ``raw`` is whitened by :func:`kl_whiten` (after a ``topk`` gather,
        before a ``projection``)."""
        if self.metric == "kl" and probs is None:
            raise ValidationError("the kl output metric needs the target's distribution (probs)")
        if self.restrict == "topk":
            if index is None:
                raise ValidationError("topk restriction needs the target's indices")
            raw = raw.gather(-1, index)
        if self.metric == "kl":
            raw = kl_whiten(raw, probs)
        if self.restrict == "projection":
            out = raw @ self.projection(raw.shape[-1], raw.dtype, raw.device)
        else:
            out = raw
        out = apply_mask(out, mask)
        return mean_pool(out, mask) if self.pool == "mean" else out


def kl_whiten(x: Any, p: Any) -> Any:
    """``F x = sqrt(p) * (x - (p'x) 1)`` along the last axis (``x``: logits ``(..., V)``; ``p``: a
    distribution of the same shape), in ``x``'s dtype: ``||F x - F y||^2 = (x - y)' (diag(p) -
    p p') (x - y)``, twice the second-order ``KL(p || softmax(x))`` at ``p = softmax(y)``."""
    p = p.to(dtype=x.dtype)
    return p.sqrt() * (x - (p * x).sum(dim=-1, keepdim=True))


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


@dataclass(frozen=True)
class TargetBatch:
    """A batch with its target: ``target`` is the fine-tuned model's compared output
    (restricted and masked, float64 on CPU); ``index`` the top-k indices (or ``None``);
    ``probs`` the target's distribution for the ``kl`` metric (float64 on CPU, ``(B, T, V)`` or
    ``(B, T, k)`` for ``topk``; else ``None``); ``hidden`` the fine-tune's final hidden state
    ``n*`` (the head's input, ``(B, T, H)`` float64 on CPU) when the head may be folded (see
    :class:`FoldedHead`), else ``None``; ``count`` the number of compared positions (real
    tokens, or samples)."""

    batch: Batch
    target: Any
    index: Any = None
    probs: Any = None
    hidden: Any = None

    @property
    def count(self) -> int:
        """Compared positions: real tokens of a masked sequence output, else every position
        (``B`` for one vector per sample)."""
        if self.target.dim() >= 3:
            if self.batch.mask is not None and tuple(self.batch.mask.shape) == tuple(self.target.shape[:2]):
                return int(self.batch.mask.sum())
            return int(self.target[..., 0].numel())
        return int(self.target.shape[0])

    def selection(self, device: Any) -> tuple[Any, Any, Any]:
        """``(mask, index, probs)`` on ``device`` (each ``None`` when absent): the batch's
        arguments of :meth:`OutputSpec.select` and of a folded head."""
        mask = None if self.batch.mask is None else self.batch.mask.to(device)
        index = None if self.index is None else self.index.to(device)
        probs = None if self.probs is None else self.probs.to(device)
        return mask, index, probs

    @property
    def entries(self) -> int:
        """Compared scalars: ``count`` times the per-position size."""
        per_position = int(self.target.shape[-1]) if self.target.dim() >= 3 else int(self.target[0].numel())
        return self.count * per_position


def forward(model: Any, batch: Batch, device: Any) -> Any:
    """Run ``model`` on a batch (moved to ``device``) without gradients."""
    import torch

    with torch.no_grad():
        return model(**{k: v.to(device) for k, v in batch.inputs.items()})


def teacher_forced_targets(model: Any, batches: Sequence[Batch], spec: OutputSpec, device: Any) -> list[TargetBatch]:
    """The fine-tuned ``model``'s compared outputs on ``batches`` (teacher forced), as targets."""
    import torch

    out = []
    head = linear_head(model) if spec.fold_obstacle() is None else None
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
        probs = spec.target_probs(raw, index) if spec.metric == "kl" else None
        target = spec.select(raw, None if batch.mask is None else batch.mask.to(raw.device), index, probs)
        out.append(TargetBatch(batch, target.detach().to("cpu", torch.float64),
                               None if index is None else index.to("cpu"),
                               None if probs is None else probs.detach().to("cpu"), hidden))
    return out


def compared_output(model: Any, tb: TargetBatch, spec: OutputSpec, device: Any) -> Any:
    """The model's restricted, masked output on ``tb``'s batch (float64, CPU)."""
    import torch

    raw = spec.raw(forward(model, tb.batch, device))
    return spec.select(raw, *tb.selection(raw.device)).to("cpu", torch.float64)


def squared_error(model: Any, batches: Sequence[TargetBatch], spec: OutputSpec, device: Any) -> tuple[float, int]:
    """``(sum of squared errors, number of compared entries)`` of ``model`` against the targets
    (for the ``kl`` metric, of the whitened outputs: about ``2 * sum KL``)."""
    total = 0.0
    entries = 0
    for tb in batches:
        total += _squared(compared_output(model, tb, spec, device), tb)
        entries += tb.entries
    return total, entries


def _squared(output: Any, tb: TargetBatch) -> float:
    diff = output - tb.target
    return float((diff * diff).sum())


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

    distributions = (spec.field == "logits" and spec.restrict == "none" and spec.metric == "euclidean"
                     and spec.pool == "none")
    total = kl = ce = 0.0
    entries = positions = predicted = 0
    for tb in batches:
        x = compared_output(model, tb, spec, device)
        total += _squared(x, tb)
        entries += tb.entries
        if not distributions:
            continue
        log_q = torch.log_softmax(x, dim=-1)
        log_p = torch.log_softmax(tb.target, dim=-1)
        kl += float((log_p.exp() * (log_p - log_q)).sum())  # masked positions: both rows 0, KL 0
        positions += tb.count
        ids = tb.batch.inputs.get("input_ids")
        if ids is None or x.dim() != 3 or tuple(ids.shape) != tuple(x.shape[:2]):
            continue
        real = torch.ones_like(ids, dtype=torch.bool) if tb.batch.mask is None else tb.batch.mask.bool()
        pairs = real[:, :-1] & real[:, 1:]  # position t predicts the real token t + 1
        nll = -log_q[:, :-1].gather(-1, ids[:, 1:].unsqueeze(-1).to(torch.int64)).squeeze(-1)
        ce += float(nll[pairs].sum())
        predicted += int(pairs.sum())
    return HeldoutMetrics(total / max(entries, 1), kl / positions if distributions and positions else None,
                          ce / predicted if predicted else None)


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
        if self.spec.metric == "kl":
            x = kl_whiten(x, probs)
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
    reason = spec.fold_obstacle()
    head = linear_head(model) if reason is None else None
    inner = backbone(model) if head is not None else None
    if reason is None and head is None:
        reason = "the model's output head is not an nn.Linear"
    if reason is None and inner is None:
        reason = "the model has no backbone (base_model) separate from its head"
    if reason is None and any(tb.hidden is None for tb in batches):
        reason = "the targets hold no final hidden state (the fine-tune's head is not an nn.Linear)"
    if reason is None:
        inside = {id(m) for m in inner.modules()}
        outside = [type(s).__name__ for s in sites if id(s) not in inside]
        if outside:
            reason = f"merge site(s) outside the backbone ({', '.join(outside)})"
    fold = None if reason is not None else FoldedHead.of(head, spec)
    if fold is not None and batches:
        reason = _fold_mismatch(model, inner, fold, batches, device)
    if reason is None:
        return fold
    if spec.fold_head:
        raise ValidationError(f"output fold_head: true, but the head cannot be folded: {reason}")
    return None


#: model -> what :func:`_fold_mismatch` already verified for it: ``"head"`` (the identity and
#: version of the head's weight when the model's logits were found to be head o backbone) and
#: ``"targets"`` (id of a target tensor -> weak references to it and to the hidden state it was
#: checked with; keyed by id, since tensors do not compare as dictionary keys). The sequential,
#: hybrid and trust-region modes collect statistics many times on one model with the same targets;
#: the check (two full forward passes) is done once. Weak: a model or target that is dropped is
#: forgotten.
_FOLD_VERIFIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _head_key(fold: FoldedHead) -> tuple[Any, ...]:
    """The identity of the head's parameters: storage, version (bumped by in-place writes), shape,
    dtype and device; a changed or replaced head is checked again."""
    parts = [fold.weight] + ([fold.bias] if fold.bias is not None else [])
    return tuple((int(t.data_ptr()), int(t._version), tuple(t.shape), str(t.dtype), str(t.device)) for t in parts)


def _fold_mismatch(model: Any, inner: Any, fold: FoldedHead, batches: Sequence[TargetBatch],
                   device: Any) -> str | None:
    """Why ``fold`` does not reproduce the model's compared output or the targets (``None``: it
    does). What passed once for this model, head and target is not checked again
    (:data:`_FOLD_VERIFIED`)."""
    import torch

    try:
        verified = _FOLD_VERIFIED.setdefault(model, {"head": None, "targets": {}})
    except TypeError:  # a model that cannot be weakly referenced: check every time
        verified = {"head": None, "targets": {}}
    head_key = (_head_key(fold), fold.spec)
    if verified["head"] != head_key or len(verified["targets"]) > 4096:
        verified["head"] = None
        verified["targets"].clear()
    dtype = fold.weight.dtype
    for i, tb in enumerate(batches):
        seen = verified["targets"].get(id(tb.target))
        if verified["head"] is not None and seen is not None and seen[0]() is tb.target and seen[1]() is tb.hidden:
            continue
        mask, index, probs = tb.selection(device)
        with torch.no_grad():
            if verified["head"] is None:
                inputs = {k: v.to(device) for k, v in tb.batch.inputs.items()}
                full = fold.spec.select(fold.spec.raw(model(**inputs)), mask, index, probs)
                folded = fold.unfolded(last_hidden(inner(**inputs)), mask, index, probs)
                if tuple(full.shape) != tuple(folded.shape) or not _agree(folded, full, dtype):
                    return ("the model's logits are not its head applied to its backbone's last_hidden_state "
                            "(a scaled or soft-capped head?)")
                verified["head"] = head_key
            mine = fold.unfolded(tb.hidden.to(device=device, dtype=dtype), mask, index, probs)
        if tuple(mine.shape) != tuple(tb.target.shape) or not _agree(mine, tb.target, dtype):
            return (f"target batch {i}: the fine-tuned model's logits are not this model's head applied to "
                    f"its final hidden state (the head differs between the base and the fine-tune?)")
        verified["targets"][id(tb.target)] = (weakref.ref(tb.target), weakref.ref(tb.hidden))
    return None
