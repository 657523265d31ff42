"""Progress bars of the libraries mergeqp drives (``transformers``' "Loading weights" bars)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def library_bars(enabled: bool) -> Iterator[None]:
    """With ``enabled`` false, ``transformers`` shows no progress bar inside (the Python APIs'
    ``progress=False``, the CLI's ``--quiet``); its previous setting is restored on exit."""
    if enabled:
        yield
        return
    try:
        from transformers.utils import logging as hf_logging  # optional heavy dependency
    except ImportError:
        yield
        return
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


__all__ = ["library_bars"]
