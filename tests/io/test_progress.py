"""The libraries' progress bars follow mergeqp's ``progress`` flag and are restored after."""

from __future__ import annotations

import pytest

from mergeqp.io.progress import library_bars

hf_logging = pytest.importorskip("transformers.utils.logging")


def test_library_bars_off_inside_and_restored():
    hf_logging.enable_progress_bar()
    with library_bars(False):
        assert not hf_logging.is_progress_bar_enabled()
    assert hf_logging.is_progress_bar_enabled()
    with library_bars(True):
        assert hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    with library_bars(False):
        pass
    assert not hf_logging.is_progress_bar_enabled()  # (a caller's own setting is kept)
    hf_logging.enable_progress_bar()


def test_library_bars_off_silences_the_gguf_readers_own_tqdm():
    """transformers' GGUF reader draws with its own ``tqdm``, which ``disable_progress_bar`` does not
    reach (``experiment lm --quiet`` showed "Converting and de-quantizing GGUF tensors", stop 73)."""
    gguf_utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    original = gguf_utils.tqdm
    with library_bars(False):
        bar = gguf_utils.tqdm(range(2), desc="x")
        assert bar.disable
        bar.close()
    assert gguf_utils.tqdm is original
    with library_bars(True):
        assert gguf_utils.tqdm is original
