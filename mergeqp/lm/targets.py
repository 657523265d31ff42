"""Teacher-forced targets: each fine-tune's compared output on the calibration batches
(:class:`TargetBatch`; kept as final hidden states and the head that forms the logits where the
vocabulary is much wider, :class:`HeadTargets`), or for a data metric the prompts' own next tokens
or class labels."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import BadDataError, ValidationError
from ..io.calibration import Batch
from .heads import ClassifierHead, agree, forward, linear_head, narrower_floats, stored_precision
from .spec import OutputSpec, apply_mask


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


def _same_target(formed: Any, target: Any, device: Any) -> bool:
    """Whether the target formed by the head (on the model's device) is the model's own: entry for
    entry when the model ran on the CPU, to rounding of float32 on another device."""
    import torch

    if torch.device(device).type == "cpu":
        return bool(torch.equal(formed, target))
    return bool(torch.equal(formed, target)) or agree(formed, target, torch.float32)


def target_bytes(tb: TargetBatch) -> int:
    """Bytes held by one batch's target (its compared outputs, top-k indices, distributions and
    final hidden states)."""
    return sum(int(t.numel()) * int(t.element_size()) for t in (tb.stored, tb.index, tb.probs, tb.hidden)
               if t is not None)
