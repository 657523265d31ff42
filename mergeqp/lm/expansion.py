"""The Gauss-Newton model of the cross-entropy at the current model (``metric: cross_entropy``):
:class:`CrossEntropyExpansion`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import ValidationError
from ..output_metrics import kl_whiten
from .spec import OutputSpec


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
