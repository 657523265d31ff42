"""The run layer: plan, run and report a Hugging Face merge from a validated config.

``mergeqp merge`` (the CLI) and :func:`mergeqp.run_merge` (Python) both call it:
:func:`~mergeqp.run.plan.build_plan` checks a :class:`~mergeqp.config.MergeConfig` against its
inputs (no weights loaded), :func:`~mergeqp.run.pipeline.run_merge` runs it and returns a
:class:`~mergeqp.run.pipeline.MergeResult` holding the typed
:class:`~mergeqp.run.report.MergeReport`. Dependencies run one way: ``cli -> config -> run ->
merge -> stats, solvers``; :mod:`mergeqp.merge` never reads the config (:mod:`.settings` turns it
into the typed settings merge takes).
"""

from __future__ import annotations

from .pipeline import MergeResult, run_merge
from .plan import MergePlan, build_plan
from .report import MergeReport

__all__ = ["MergePlan", "MergeReport", "MergeResult", "build_plan", "run_merge"]
