"""Fisher and RegMean in ``mergeqp merge``: their calibration statistics from the config's prompts.

The two baselines that are not tensor-wise (``fisher``, ``regmean``; see ``docs/baselines.md``)
need statistics of each fine-tuned model on its own task's data. ``mergeqp merge`` gets them from
the same calibration prompts as the QP (tokenised with the base tokenizer, the held-out prompts
left out), while each fine-tuned model is loaded anyway for its teacher-forced targets (one model
at a time, :func:`mergeqp.merge.pipeline.prepare_tasks` calls the :class:`StatisticsCollector`):

- ``regmean``: :func:`mergeqp.merge.compute_grams` of the selected linear layers only, on the
  real tokens (padding removed, :func:`mergeqp.io.calibration.unpadded_inputs`): every real
  token is a row of ``X_k``, ``G_k = X_k'X_k / N_k``. Other selected tensors follow the method's
  rule (the weighted average of the fine-tuned tensors).
- ``fisher``: :func:`mergeqp.merge.compute_fisher` over the selected tensors only; one example =
  one prompt; its log-likelihood is the sum over the prompt's real tokens of
  ``log p(y_t | prompt)`` teacher forced, with ``y_t`` the fine-tuned model's own argmax
  prediction at position ``t`` (``argmax`` labels). Why not the prompt's next tokens (the
  empirical Fisher)? (1) The argmax works for every model the pipeline merges: causal LMs,
  masked LMs fed unmasked text (whose "label" at a position would be the input token itself)
  and classifiers (ViT) calibrated on unlabelled inputs; (2) it is the mode of the model's own
  predictive distribution, the distribution Matena & Raffel's Fisher takes its expectation over,
  whereas the empirical Fisher weights directions by how badly the model fits the data
  (Kunstner et al., 2019); (3) it measures what the merge has to preserve here -- the
  fine-tuned model's own outputs, the same targets the QP and the evaluation use.

The merge itself is :func:`mergeqp.merge_state_dicts` with the precomputed ``fishers=`` /
``grams=`` (RegMean also gets the ``meta``-device architecture, which tells it which tensors
are linear layers and how they are stored), run on the selected tensors in chunks that never
split a module's weight from its bias. ``normalize_fisher`` is applied over all selected
tensors before chunking, so the result does not depend on the chunk size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import ConfigError, MergeQPError, ValidationError
from .sites import checkpoint_names, model_sites

#: parameters that ``mergeqp merge`` supplies itself (a YAML file cannot hold them)
SUPPLIED = {
    "fisher": ("model", "calibration", "fishers", "log_likelihood"),
    "regmean": ("model", "calibration", "grams"),
}
STATISTICS_METHODS = tuple(SUPPLIED)


def needs_statistics(name: str) -> bool:
    """Whether the baseline ``name`` gets calibration statistics from the pipeline."""
    return name in SUPPLIED


def check_params(name: str, params: Mapping[str, Any], where: str) -> None:
    """Validate a Fisher / RegMean parameter block from a config (the pipeline supplies the
    model, the calibration data and the statistics; everything else is the method's own)."""
    from . import get_merge_method  # type: ignore[attr-defined]

    supplied = [k for k in params if k in SUPPLIED[name]]
    if supplied:
        raise ConfigError(
            f"{where}.params: {', '.join(repr(k) for k in supplied)} cannot be set in a config: mergeqp merge "
            f"computes the {'Fisher information' if name == 'fisher' else 'Gram matrices'} from each model's "
            f"calibration prompts (give 'calibration' per model)"
        )
    method = get_merge_method(name)
    valid = config_params(name)
    unknown = [k for k in params if k not in valid and k not in SUPPLIED[name]]
    if unknown:
        import difflib

        close = difflib.get_close_matches(str(unknown[0]), valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{where}.params: unknown parameter {unknown[0]!r} of {name!r}{hint}; valid: "
                          f"{', '.join(valid)}")
    placeholder = {"model": object(), "calibration": []}
    try:
        method.parse({**params, **placeholder})
    except MergeQPError as exc:
        raise ConfigError(f"{where}.params: {exc}") from None


def config_params(name: str) -> list[str]:
    """The parameters of ``name`` a config may set (the method's own, minus what the pipeline
    supplies and the tensor selection, which is the config's ``layers``)."""
    from . import get_merge_method  # type: ignore[attr-defined]

    skip = set(SUPPLIED[name]) | {"include", "exclude", "progress"}
    return [p for p in get_merge_method(name).valid_params() if p not in skip]


def live_names(skeleton: Any) -> dict[str, str]:
    """Checkpoint name -> live state-dict name of the architecture (``transformers`` renames some)."""
    return {stored: live for live, stored in checkpoint_names(skeleton).items()}


def module_chunks(keys: Sequence[str], nbytes: Callable[[str], int], chunk_bytes: int) -> list[list[str]]:
    """``keys`` cut into chunks of at most ``chunk_bytes`` (a chunk always holds at least one
    module), never separating tensors of one module (``x.weight`` and ``x.bias``)."""
    modules: dict[str, list[str]] = {}
    for k in keys:
        modules.setdefault(k.rsplit(".", 1)[0], []).append(k)
    chunks: list[list[str]] = []
    current: list[str] = []
    size = 0
    for group in modules.values():
        g = sum(nbytes(k) for k in group)
        if current and size + g > chunk_bytes:
            chunks.append(current)
            current, size = [], 0
        current.extend(group)
        size += g
    if current:
        chunks.append(current)
    return chunks


class StatisticsCollector:
    """Collects Fisher or RegMean statistics of each fine-tuned model (called once per model,
    while it is loaded) for the checkpoint tensors ``keys``, then merges them.

    ``skeleton``: the architecture (``meta`` device is enough); ``params``: the method's
    parameters from the config; ``batch_size``: examples per statistics batch."""

    def __init__(self, name: str, params: Mapping[str, Any], skeleton: Any, keys: Sequence[str],
                 n_models: int, batch_size: int, log: Callable[[str], None] | None = None):
        from . import get_merge_method  # type: ignore[attr-defined]

        if name not in SUPPLIED:
            raise ValidationError(f"merge method {name!r} takes no calibration statistics from the pipeline")
        self.name = name
        self.params = dict(params)
        self.parsed = get_merge_method(name).parse({**self.params, "model": skeleton, "calibration": []})
        self.skeleton = skeleton
        self.keys = list(keys)
        self.batch_size = batch_size
        self.log = log or (lambda msg: None)
        self.live = live_names(skeleton)
        live_keys = {self.live.get(k, k) for k in self.keys}
        param_names = {n for n, _ in skeleton.named_parameters(remove_duplicate=False)}
        self.fisher_names = [n for n in (self.live.get(k, k) for k in self.keys) if n in param_names]
        self.layers = [s.name for s in model_sites(skeleton) if f"{s.name}.weight" in live_keys]
        self.statistics: list[dict[str, Any] | None] = [None] * n_models
        self.records: list[dict[str, Any]] = [{} for _ in range(n_models)]
        self.notes: list[str] = []

    # ------------------------------------------------------------------ collection
    def __call__(self, index: int, model_name: str, model: Any, batches: Sequence[Any]) -> None:
        """Statistics of fine-tuned model ``index`` (a live model on its device) on its task's
        calibration ``batches`` (:class:`mergeqp.io.calibration.Batch`)."""
        import torch

        from ..io.calibration import unpadded_inputs

        t = time.perf_counter()
        inputs = unpadded_inputs(batches, self.batch_size)
        examples = sum(int(next(iter(b.values())).shape[0]) for b in inputs)
        tokens = sum(int(b["input_ids"].numel()) for b in inputs if "input_ids" in b)
        if self.name == "regmean":
            stats = self._grams(model, inputs, model_name) if self.layers else {}
            what = f"input Gram matrices of {len(stats)} linear layer(s)"
        else:
            stats = self._fisher(model, inputs, model_name) if self.fisher_names else {}
            what = f"diagonal Fisher of {len(stats)} tensor(s)"
        self.statistics[index] = {k: v.detach().to("cpu", torch.float64) for k, v in stats.items()}
        seconds = time.perf_counter() - t
        self.records[index] = {"model": model_name, "examples": examples, "tokens": tokens, "seconds": seconds}
        self.log(f"{self.name} statistics for {model_name}: {what} on {examples} example(s) ({seconds:.1f} s)")

    def _grams(self, model: Any, inputs: list[dict[str, Any]], label: str) -> dict[str, Any]:
        from .regmean import compute_grams

        return compute_grams(model, inputs, layers=self.layers, label=label)

    def _fisher(self, model: Any, inputs: list[dict[str, Any]], label: str) -> dict[str, Any]:
        from .fisher import compute_fisher

        p = self.parsed
        kwargs = {"names": self.fisher_names, "estimator": p.estimator, "chunk_size": p.chunk_size, "label": label}
        if p.per_example != "vmap" or p.estimator != "per_example":
            return compute_fisher(model, inputs, per_example=p.per_example, **kwargs)
        # torch.func.vmap trips over data-dependent checks in some models: BERT's with an attention
        # mask, GPT-2's without one (the masks are all ones here, so either form is the same model)
        unmasked = [{k: v for k, v in b.items() if k != "attention_mask"} for b in inputs]
        errors = []
        for attempt in (inputs, unmasked):
            try:
                return compute_fisher(model, attempt, per_example="vmap", **kwargs)
            except RuntimeError as exc:
                errors.append(str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__)
        if "per_example" in self.params:
            raise ValidationError(f"Fisher of model {label!r}: torch.func.vmap cannot trace the model "
                                  f"({errors[-1]}); set per_example: loop") from None
        note = (f"fisher: torch.func.vmap cannot trace this model ({errors[-1]}); per-example gradients "
                f"computed in a loop (per_example: loop)")
        if note not in self.notes:
            self.notes.append(note)
            self.log(note)
        return compute_fisher(model, inputs, per_example="loop", **kwargs)

    # ------------------------------------------------------------------ merge
    def merge(self, plan: Any, keys: Sequence[str], chunk_bytes: int) -> dict[str, Any]:
        """``{checkpoint key: merged tensor}`` (the base's dtype) for ``keys``: the registry's
        Fisher / RegMean merge with the collected statistics, in module-aligned chunks."""
        import torch

        from . import merge_state_dicts  # type: ignore[attr-defined]

        missing = [i for i, s in enumerate(self.statistics) if s is None]
        if missing:
            raise ValidationError(f"{self.name}: no statistics for model(s) {missing}")
        stats: list[dict[str, Any]] = [s for s in self.statistics if s is not None]
        params = {k: v for k, v in self.params.items()}
        if self.name == "fisher" and self.parsed.normalize_fisher:
            for k, F in enumerate(stats):
                norm = float(torch.sqrt(sum((v ** 2).sum() for v in F.values()))) if F else 0.0
                if norm > 0:
                    stats[k] = {n: v / norm for n, v in F.items()}
            params["normalize_fisher"] = False
        out: dict[str, Any] = {}
        for chunk in module_chunks(list(keys), lambda k: plan.base.info(k).nbytes, chunk_bytes):
            base_sd = plan.base.get_many(chunk)
            floats = [k for k in chunk if base_sd[k].is_floating_point()]
            for k in chunk:
                if k not in floats:
                    out[k] = base_sd[k]
            if not floats:
                continue
            live = {k: self.live.get(k, k) for k in floats}
            base_live = {live[k]: base_sd[k] for k in floats}
            fts_live = [{live[k]: v for k, v in ft.get_many(floats).items()} for ft in plan.finetuned]
            names = set(live.values())
            if self.name == "fisher":
                extra = {"fishers": [{n: F[n] for n in F if n in names} for F in stats]}
            else:
                extra = {"model": self.skeleton, "grams": [{n: G[n] for n in G if f"{n}.weight" in names}
                                                           for G in stats]}
            try:
                merged = merge_state_dicts(self.name, base_live, fts_live, **{"progress": False, **params, **extra})
            except MergeQPError as exc:
                raise type(exc)(f"{self.name} merge of {floats[0]!r}...: {exc}") from None
            for k in floats:
                out[k] = merged[live[k]].to(base_sd[k].dtype)
        return out

    def summary(self) -> dict[str, Any]:
        """What was collected (for the report)."""
        if self.name == "fisher":
            p = self.parsed
            what = {"statistic": "diagonal empirical Fisher, per example (one prompt), of the selected tensors",
                    "labels": "argmax of the fine-tuned model's own logits at every real token (teacher forced)",
                    "estimator": p.estimator, "tensors": len(self.fisher_names)}
        else:
            what = {"statistic": "input Gram matrices X'X/N of the selected linear layers (real tokens only)",
                    "layers": list(self.layers)}
        return {**what, "models": self.records, "notes": list(self.notes)}


__all__ = ["STATISTICS_METHODS", "StatisticsCollector", "check_params", "module_chunks", "needs_statistics"]
