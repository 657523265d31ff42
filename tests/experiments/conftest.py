"""Fixtures of the experiment tests: a tiny MNIST configuration, an IDX file writer and a stand-in
for an experiment's run function (what the CLI passes to it)."""

from __future__ import annotations

import gzip
import struct
from collections.abc import Callable

import numpy as np
import pytest

from mergeqp.experiments.mnist import MnistConfig
from mergeqp.experiments.models import TrainConfig
from mergeqp.experiments.output_space import OutputSpaceConfig
from mergeqp.experiments.trust_region import TrustRegionConfig

IDX_CODES = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09, np.dtype(">i2"): 0x0B,
             np.dtype(">i4"): 0x0C, np.dtype(">f4"): 0x0D, np.dtype(">f8"): 0x0E}


@pytest.fixture(scope="session")
def tiny_config() -> Callable[[], MnistConfig]:
    """``tiny_config()``: the MNIST experiment shrunk to a few seconds: fewer samples, epochs,
    QPs and bases."""

    def _tiny_config() -> MnistConfig:
        return MnistConfig(
            calibration_per_task=40, train_per_task=120, test_per_task=60,
            base_train=TrainConfig(epochs=2, lr=2e-3, batch_size=64),
            finetune_train=TrainConfig(epochs=2, lr=1e-3, batch_size=64),
            adam_steps=200,
            trust_region=TrustRegionConfig(max_qps=3),
            geometry_p=(2, 8), random_seeds=(0,),
            output_space=OutputSpaceConfig(steps=3),
            # method: auto with few candidates and folds (the defaults take minutes)
            auto_method={"name": "auto", "params": {"folds": 2, "candidates": [
                "soup", "regmean", {"name": "output_space", "params": {"ridge": 0.1, "steps": 3}}]}},
        )

    return _tiny_config


@pytest.fixture(scope="session")
def write_idx() -> Callable[[str, np.ndarray, bool], None]:
    """``write_idx(path, array, gz)``: write ``array`` as an IDX file (big-endian data, the type
    code from its dtype), gzip-compressed when ``gz``."""

    def _write_idx(path: str, array: np.ndarray, gz: bool) -> None:
        arr = np.asarray(array)
        be = arr.dtype.newbyteorder(">") if arr.dtype.itemsize > 1 else arr.dtype
        code = IDX_CODES[np.dtype(be)]
        header = bytes([0, 0, code, arr.ndim]) + struct.pack(">" + "I" * arr.ndim, *arr.shape)
        data = header + arr.astype(be).tobytes()
        with (gzip.open(path, "wb") if gz else open(path, "wb")) as fh:
            fh.write(data)

    return _write_idx


class StopRun(BaseException):
    """Raised by :func:`capture_run`'s stand-in: the CLI got as far as calling the experiment. (A
    ``BaseException``: the CLI turns every ``Exception`` it did not anticipate into one line and exit 70.)"""


@pytest.fixture
def capture_run(monkeypatch) -> Callable[[object, str], list[dict]]:
    """``seen = capture_run(module, "run_x_experiment")``: the module's run function replaced by
    one that records its keyword arguments in ``seen`` and raises :class:`StopRun`."""

    def _capture(module: object, name: str) -> list[dict]:
        seen: list[dict] = []

        def fake(out, **kwargs):
            seen.append(kwargs)
            raise StopRun

        monkeypatch.setattr(module, name, fake)
        return seen

    return _capture
