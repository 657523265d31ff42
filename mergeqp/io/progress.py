"""Progress bars of the libraries mergeqp drives (``transformers``' "Loading weights" bars, and the
bar its GGUF reader draws with its own ``tqdm``)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

#: modules of ``transformers`` that draw bars with their own ``tqdm`` (not its logging switch)
OWN_TQDM_MODULES = ("transformers.modeling_gguf_pytorch_utils",)


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
    with contextlib.ExitStack() as stack:
        for name in OWN_TQDM_MODULES:
            stack.enter_context(_silent_tqdm(name))
        try:
            yield
        finally:
            if was:
                hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _silent_tqdm(module_name: str) -> Iterator[None]:
    """Inside, ``module_name``'s own ``tqdm`` draws nothing (a module that is missing, or has no
    ``tqdm``, is left alone)."""
    import importlib

    try:
        module = importlib.import_module(module_name)
    except Exception:  # an optional module of an optional library (e.g. without ``gguf``)
        yield
        return
    bar = getattr(module, "tqdm", None)
    if bar is None:
        yield
        return
    module.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        module.tqdm = bar


__all__ = ["OWN_TQDM_MODULES", "library_bars"]
