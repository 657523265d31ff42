"""The calibration objective that the QP models, measured exactly on a model (:func:`squared_error`),
and the held-out metrics of a merge: teacher-forced MSE, KL and cross-entropy, and a classifier
head's accuracy."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ValidationError
from ..io.calibration import Batch
from .fold import FoldedHead, head_identity, prepare_fold
from .heads import ClassifierHead, backbone, forward, last_hidden, linear_head
from .spec import OutputSpec, apply_mask
from .targets import TargetBatch, class_labels


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
        key = key + head_identity(head.weight, head.bias)
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
                metric = fold.spec.output_metric
                if metric.whitens:
                    out = metric.whitened(out, probs.to(f64))
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


#: model -> keys of targets for which :func:`objective_fold` found no valid fold
_OBJECTIVE_FOLD_REFUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
