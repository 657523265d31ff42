"""Hypothesis profiles: ``dev`` (default) draws new examples on every run; ``ci`` (set by
``.ci/run`` through ``MERGEQP_HYPOTHESIS_PROFILE=ci``) draws the same examples every run, so
that CI results do not depend on chance."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("dev", print_blob=True)
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("MERGEQP_HYPOTHESIS_PROFILE", "dev"))
