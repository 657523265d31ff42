"""Teacher-forced evaluation of many merged causal LMs that differ from the base only in their
upper decoder blocks (the language experiment's evaluation).

:class:`UpperEvaluator` computes, once per text, the hidden states entering the first fine-tuned
block with the base model (:class:`~mergeqp.experiments.finetune_lm.DecoderSplit`), then scores
every model by running only the upper blocks, the final norm and the output head with that model's
upper tensors swapped in. A model whose tensors outside the upper blocks differ from the base
(beyond float rounding) is scored with full forward passes instead, so the numbers never depend
on the shortcut. Per domain (its texts, the domain's fine-tune as the reference):

- ``ce``: next-token cross-entropy of the texts' real tokens (nats per predicted token);
- ``mse``: teacher-forced logit MSE to the reference, mean over real tokens and vocabulary;
- ``kl``: mean ``KL(reference || model)`` per real token (nats).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ValidationError
from ..merge.sites import checkpoint_names
from .finetune_lm import DecoderSplit, lower_states, pad_hidden, pad_ids, tokenize_each

METRICS = ("ce", "mse", "kl")
#: relative tolerance under which a tensor counts as the base's (mergekit's float32 averages of
#: identical tensors differ from them by rounding)
SAME_AS_BASE_RTOL = 1e-6


@dataclass(frozen=True)
class ModelTensors:
    """A model given by its tensors that differ from the base: ``upper`` (inside the evaluator's
    upper part) and ``other`` (anywhere else; empty for the merges of this experiment)."""

    upper: Mapping[str, Any]
    other: Mapping[str, Any]


def differing_tensors(base_state: Mapping[str, Any], state: Mapping[str, Any], upper_names: set[str],
                      rtol: float = SAME_AS_BASE_RTOL, *, complete: bool = True) -> ModelTensors:
    """Split ``state``'s tensors that differ from ``base_state`` (max abs difference above ``rtol`` x
    the base tensor's max abs) into upper / other; a reshaped tensor is an error, and so is a missing
    one when ``state`` is a ``complete`` model (``complete=False``: ``state`` holds only the merged
    tensors, the others are the base's; a name the base lacks is an error)."""
    if not complete:
        unknown_names = sorted(set(state) - set(base_state))
        if unknown_names:
            raise ValidationError(f"merged tensors {unknown_names[:5]} are not tensors of the base")
    upper, other = {}, {}
    for name, ref in base_state.items():
        if name not in state:
            if not complete:
                continue
            raise ValidationError(f"merged model lacks tensor {name!r} of the base")
        t = state[name]
        if tuple(t.shape) != tuple(ref.shape):
            raise ValidationError(f"merged tensor {name!r} has shape {tuple(t.shape)}, base {tuple(ref.shape)}")
        t = t.to(ref.device, ref.dtype)  # the base's copy lives where the model runs (e.g. CUDA)
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        if ref.numel() and float((t - ref).abs().max()) > rtol * max(scale, 1e-30):
            (upper if name in upper_names else other)[name] = t
    return ModelTensors(upper, other)


def same_model(a: ModelTensors | None, b: ModelTensors | None, rtol: float = SAME_AS_BASE_RTOL) -> float | None:
    """The largest relative difference (max abs difference over the tensor's max abs) between two
    models' tensors when each tensor differs by at most ``rtol``, else ``None`` (``None`` models are
    the base; models changing different tensors are different)."""
    ta = {} if a is None else {**a.upper, **a.other}
    tb = {} if b is None else {**b.upper, **b.other}
    if set(ta) != set(tb):
        return None
    worst = 0.0
    for name, x in ta.items():
        y = tb[name]
        if tuple(x.shape) != tuple(y.shape):
            return None
        scale = max(float(y.abs().max()) if y.numel() else 0.0, 1e-30)
        diff = float((x.to(y.dtype) - y).abs().max()) / scale if y.numel() else 0.0
        if diff > rtol:
            return None
        worst = max(worst, diff)
    return worst


def file_names(model: Any) -> dict[str, str]:
    """``{name in the files: parameter name}`` for the tensors that ``model`` calls by another name
    than its checkpoint files: ``transformers`` renames some on load and back on save (GPT-NeoX's
    file ``embed_out.weight`` is the module ``lm_head``), so the fine-tunes' and mergekit's folders
    use the file names (the run layer's own mapping, :func:`mergeqp.merge.sites.checkpoint_names`)."""
    return {stored: live for live, stored in checkpoint_names(model).items() if stored != live}


class UpperEvaluator:
    """Scores models on domains' texts (see the module docstring).

    ``base``: the base model (eval mode, float32, on ``device``); ``first``: the first block that
    any model changes; ``domains``: name -> texts; ``max_length`` tokens per text; ``base_state``:
    the base's parameters (name -> tensor) when another evaluator of the same model already holds
    a copy (default: cloned here); ``names``: disk names of tensors -> the model's parameter names
    (:func:`file_names`), applied to every state given to :meth:`tensors_of`. Evaluators may
    share one model: each call leaves it as the base. The split is checked against full forward
    passes on one batch; where it differs (``note`` says so) every model is scored with full passes."""

    def __init__(self, base: Any, tokenizer: Any, first: int, domains: Mapping[str, Sequence[str]], *,
                 max_length: int, batch_size: int, device: str, base_state: Mapping[str, Any] | None = None,
                 names: Mapping[str, str] | None = None) -> None:
        import torch  # optional heavy dependency (experiment extra)

        self.model = base
        self.names = dict(names or {})
        self.split: DecoderSplit | None = DecoderSplit.of(base, first)
        self.device = device
        self.batch_size = batch_size
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        self.base_state = dict(base_state) if base_state is not None else {
            n: p.detach().clone() for n, p in base.named_parameters()}
        self._changed: set[str] = set()
        self.texts: dict[str, list[Any]] = {}
        self.states: dict[str, list[Any]] = {}
        for name, texts in domains.items():
            ids = [t for t in tokenize_each(tokenizer, texts, max_length) if t.shape[0] >= 2]
            if not ids:
                raise ValidationError(f"domain {name!r}: no evaluation text has two or more tokens")
            # batches of texts of about one length: little padding to run through the blocks
            # and the head (every metric is a sum over real tokens, so the order is immaterial)
            ids.sort(key=lambda t: int(t.shape[0]))
            self.texts[name] = ids
        # the shortcut is checked once against full forward passes on a real batch (the longest
        # texts of the first domain); where it differs, every model is scored with full passes
        probe = next(iter(self.texts.values()))[-batch_size:]
        probe_ids = pad_ids(probe, self.pad_id).to(device)
        probe_mask = pad_ids([t.new_ones(t.shape) for t in probe], 0).to(device)
        self.upper_names = self.split.upper_parameter_names(probe_ids, probe_mask)
        if not self.split.matches(probe_ids, probe_mask):
            self.split = None
            self.note = (f"{type(base).__name__}: the split forward differs from the full model; every model is "
                         "scored with full forward passes")
        else:
            self.note = None
            with torch.no_grad():
                for name, ids in self.texts.items():
                    self.states[name] = lower_states(self.split, ids, batch_size, device)

    def tensors_of(self, state: Mapping[str, Any], *, complete: bool = True) -> ModelTensors:
        """The tensors of a full state dict ``state`` (``complete=False``: of the merged tensors
        only, the rest being the base's) that differ from the base."""
        state = {self.names.get(k, k): v for k, v in state.items()}
        return differing_tensors(self.base_state, state, self.upper_names, complete=complete)

    def _load(self, tensors: ModelTensors | None) -> None:
        """Put ``tensors`` into the working model (``None``: the base); only the tensors that the
        previous model changed or this one changes are copied."""
        import torch  # optional heavy dependency (experiment extra)

        params = dict(self.model.named_parameters())
        new = {} if tensors is None else {**tensors.upper, **tensors.other}
        with torch.no_grad():
            for name in self._changed - set(new):
                params[name].copy_(self.base_state[name])
            for name, t in new.items():
                params[name].copy_(t.to(params[name].device, params[name].dtype))
        self._changed = set(new)

    def _logits(self, tensors: ModelTensors | None, domain: str, start: int) -> tuple[Any, Any, Any]:
        import torch  # optional heavy dependency (experiment extra)

        ids = self.texts[domain][start: start + self.batch_size]
        batch_ids = pad_ids(ids, self.pad_id).to(self.device)
        with torch.no_grad():
            if self.split is None or (tensors is not None and tensors.other):
                mask = pad_ids([t.new_ones(t.shape) for t in ids], 0).to(self.device)
                logits = self.model(input_ids=batch_ids, attention_mask=mask, use_cache=False).logits
            else:
                hidden, mask = pad_hidden(self.states[domain][start: start + self.batch_size])
                logits = self.split.upper(hidden, mask)
        return logits, batch_ids, mask

    def evaluate(self, models: Mapping[str, ModelTensors | None], references: Mapping[str, ModelTensors],
                 progress: Callable[[str], None] | None = None, *,
                 per_text: bool = False) -> dict[str, dict[str, dict[str, Any]]]:
        """``{model: {domain: {ce, mse, kl}}}`` for every model (``None`` = the base) on every
        domain, against ``references[domain]`` (that domain's fine-tune). ``per_text``: each
        domain's entry also holds ``text_nll`` and ``text_predicted``, every text's summed
        next-token NLL and number of predicted tokens, in one order for every model (so that
        models can be compared text by text: :mod:`.uncertainty`)."""
        import torch  # optional heavy dependency (experiment extra)

        missing = [d for d in self.texts if d not in references]
        if missing:
            raise ValidationError(f"no reference model for domain(s) {missing}")
        sums = {m: {d: {"nll": 0.0, "pred": 0, "se": 0.0, "kl": 0.0, "tok": 0, "text_nll": [], "text_pred": []}
                    for d in self.texts} for m in models}
        vocab = None
        for domain in self.texts:
            if progress is not None:
                progress(f"evaluating {len(models)} models on {domain}")
            for start in range(0, len(self.texts[domain]), self.batch_size):
                self._load(references[domain])
                ref, ids, mask = self._logits(references[domain], domain, start)
                real = mask.bool()
                nxt = real[:, 1:] & real[:, :-1]
                lse_ref = torch.logsumexp(ref, -1)  # (B, T)
                p = torch.exp(ref - lse_ref[..., None])
                p_sum = p.sum(-1)  # 1 up to rounding
                vocab = ref.shape[-1]
                for name, tensors in models.items():
                    self._load(tensors)
                    x, _, _ = self._logits(tensors, domain, start)
                    s = sums[name][domain]
                    # per-token quantities in the model's dtype over (B, T), sums in float64; with
                    # d = x - ref and lse = logsumexp: log q = x - lse(x), so NLL = lse(x) - x[next token]
                    # and KL(p || q) = sum p (log p - log q) = (lse(x) - lse(ref)) sum p - sum p d (exactly
                    # 0 for x = ref, and no (B, T, V) log-probabilities formed)
                    lse = torch.logsumexp(x, -1)
                    per_token = lse[:, :-1] - x[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]  # (B, T - 1)
                    nll = per_token[nxt]
                    d = x - ref
                    kl = ((lse - lse_ref) * p_sum - torch.einsum("btv,btv->bt", p, d))[real]
                    se = torch.einsum("btv,btv->bt", d, d)[real]
                    s["nll"] += float(nll.double().sum())
                    s["pred"] += int(nxt.sum())
                    if per_text:
                        s["text_nll"] += torch.where(nxt, per_token, 0.0).double().sum(1).tolist()
                        s["text_pred"] += nxt.sum(1).tolist()
                    s["se"] += float(se.double().sum())
                    s["kl"] += float(kl.double().sum())
                    s["tok"] += int(real.sum())
        self._load(None)

        def entry(s: dict[str, Any]) -> dict[str, Any]:
            out: dict[str, Any] = {"ce": s["nll"] / max(s["pred"], 1), "mse": s["se"] / max(s["tok"] * (vocab or 1), 1),
                                   "kl": s["kl"] / max(s["tok"], 1)}
            if per_text:
                out.update(text_nll=s["text_nll"], text_predicted=[int(n) for n in s["text_pred"]])
            return out

        return {m: {d: entry(s) for d, s in per.items()} for m, per in sums.items()}


__all__ = ["METRICS", "ModelTensors", "UpperEvaluator", "differing_tensors", "file_names", "same_model"]
