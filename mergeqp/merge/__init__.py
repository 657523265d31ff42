"""Merging: baseline merge methods on state dicts, and the layer sites the QP merges.

Baselines (task arithmetic, soup, TIES, DARE and variants, row-uniform DARE, Fisher, RegMean)
run through one registry::

    merged = merge_state_dicts("ties", base, [ft1, ft2], density=0.2, include=["*.mlp.*"])

Names are resolved lazily so that importing a submodule (``mergeqp.merge.sites``) pulls in
nothing else; this module imports no other mergeqp subpackage.
"""

from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "merge_state_dicts": "mergeqp.merge.registry",
    "merge_tensors": "mergeqp.merge.registry",
    "MERGE_METHODS": "mergeqp.merge.registry",
    "register_merge_method": "mergeqp.merge.registry",
    "get_merge_method": "mergeqp.merge.registry",
    "MergeMethod": "mergeqp.merge.method",
    "select_tensors": "mergeqp.merge.selection",
    "compute_fisher": "mergeqp.merge.fisher",
    "compute_grams": "mergeqp.merge.regmean",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports('mergeqp.merge', globals(), _EXPORTS)
