"""The run layer: plan, run and report a Hugging Face merge from a validated config.

``mergeqp merge`` (the CLI) and :func:`mergeqp.run_merge` (Python) both call it.
:mod:`.schema` is its typed input (the config schema that :mod:`mergeqp.config` reads YAML into);
:func:`~mergeqp.run.plan.build_plan` checks a :class:`~mergeqp.run.schema.MergeConfig` against its
inputs (no weights loaded), :func:`~mergeqp.run.pipeline.run_merge` runs it and returns a
:class:`~mergeqp.run.pipeline.MergeResult` holding the typed
:class:`~mergeqp.run.report.MergeReport`. Dependencies run one way: ``cli -> config -> run ->
merge -> stats, solvers``; :mod:`mergeqp.merge` never reads the config (:mod:`.settings` turns it
into the typed settings merge takes), and :mod:`mergeqp.config` only reads files into :mod:`.schema`.
"""

from __future__ import annotations

from .._lazy import lazy_exports

# resolved on first use, so that reading a config (:mod:`.schema`) does not load the pipeline
_EXPORTS: dict[str, str] = {
    "MergeConfig": "mergeqp.run.schema",
    "MergePlan": "mergeqp.run.merge_plan",
    "MergeReport": "mergeqp.run.report",
    "MergeResult": "mergeqp.run.pipeline",
    "build_plan": "mergeqp.run.plan",
    "run_merge": "mergeqp.run.pipeline",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports("mergeqp.run", globals(), _EXPORTS)
