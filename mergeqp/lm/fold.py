"""Folding a linear head into the output metric (``OutputSpec.fold_head``): the compared output as
a small linear map of the final hidden state (:class:`FoldedHead`), used only where it is checked to
reproduce the model's output and the targets (:func:`fold_decision`)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ValidationError
from .heads import agree, backbone, last_hidden, linear_head
from .spec import OutputSpec, apply_mask
from .targets import TargetBatch


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
        metric = self.spec.output_metric
        if metric.whitens:
            x = metric.whitened(x, probs)
        return apply_mask(x, mask)

    def unfolded(self, n: Any, mask: Any = None, index: Any = None, probs: Any = None) -> Any:
        """``spec.select`` of the head's logits ``W n + b`` (``(B, T, V)`` formed): the check of the fold."""
        logits = n.to(self.weight.dtype) @ self.weight.t()
        if self.bias is not None:
            logits = logits + self.bias
        return self.spec.select(logits, mask, index, probs)


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
    return tuple(mine.shape) == tuple(target.shape) and agree(mine, target, dtype)


#: model -> what :func:`_fold_mismatch` already verified for it: ``"head"`` (the identity and
#: version of the head's weight when the model's logits were found to be head o backbone) and
#: ``"targets"`` (id of a target tensor -> weak references to it and to the hidden state it was
#: checked with; keyed by id, since tensors do not compare as dictionary keys). The sequential,
#: hybrid and trust-region modes collect statistics many times on one model with the same targets;
#: the check (two full forward passes) is done once. Weak: a model or target that is dropped is
#: forgotten.
_FOLD_VERIFIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def head_identity(weight: Any, bias: Any) -> tuple[Any, ...]:
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
    head_key = (head_identity(fold.weight, fold.bias), fold.spec)
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
                if tuple(full.shape) != tuple(folded.shape) or not agree(folded, full, dtype):
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
        if not shared and (tuple(mine.shape) != tuple(target.shape) or not agree(mine, target, dtype)) and not (
                tb.head_precision is not None and _agrees_rounded(fold, tb, mask, index, probs, device)):
            where = labels[i] if labels is not None else f"target batch {i}"
            return (f"{where}: the fine-tuned model's logits are not this model's head applied to "
                    f"its final hidden state (the head differs between the base and the fine-tune?)")
        verified["targets"][id(tb.identity)] = (weakref.ref(tb.identity), weakref.ref(tb.hidden))
    return None
