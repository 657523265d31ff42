"""The process-wide memo of passed input checks (:mod:`mergeqp.io.verified`): a checkpoint's
finiteness and two tokenizers' agreement are checked once per process while their files are
unchanged, and again as soon as a file changes (a NaN written later is still found, a changed
vocabulary still refused); files modified within ``RACY_SECONDS`` are never remembered."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

import mergeqp.io.writer as writer  # noqa: E402
import mergeqp.run.models as models  # noqa: E402
import mergeqp.run.checkpoints as checkpoints_mod  # noqa: E402
from mergeqp.errors import BadDataError, ConfigError  # noqa: E402
from mergeqp.io import verified  # noqa: E402
from mergeqp.io.checkpoint import open_checkpoint  # noqa: E402
from mergeqp.merge.inputs import TensorSource  # noqa: E402


@pytest.fixture()
def fam(tiny_hf, tmp_path, monkeypatch):
    """A tiny family written just now: the racy-file rule is off (a file's change time cannot be
    set back) except where a test turns it on."""
    verified.forget()
    monkeypatch.setattr(verified, "RACY_SECONDS", 0.0)
    f = tiny_hf.make_family(tmp_path / "fam", "llama", K=2)
    yield f
    verified.forget()


@pytest.fixture()
def counted(monkeypatch):
    """Names passed to check_tensor_finite, wherever it is called from."""
    names: list[str] = []
    real = writer.check_tensor_finite

    def count(name, tensor, model):
        names.append(name)
        return real(name, tensor, model)

    for mod in (models, writer, __import__("mergeqp.merge.inputs", fromlist=["x"])):  # (writer: cast_checked)
        monkeypatch.setattr(mod, "check_tensor_finite", count)
    return names


def _poison(folder):
    """Rewrite the folder's weights with a NaN in its first floating tensor (same size)."""
    path = next(folder.glob("*.safetensors"))
    state = load_file(str(path))
    name = next(k for k, v in state.items() if v.is_floating_point())
    state[name] = state[name].clone()
    state[name].view(-1)[0] = float("nan")
    save_file(state, str(path), metadata={"format": "pt"})
    return name


def test_signature_changes_with_the_files(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"1234")
    s0 = verified.signature(tmp_path)
    assert verified.signature(tmp_path) == s0
    os.utime(tmp_path / "a.bin", ns=(1, 1))
    s1 = verified.signature(tmp_path)
    assert s1 != s0
    (tmp_path / "b.bin").write_bytes(b"")
    assert verified.signature(tmp_path) != s1
    assert verified.signature(tmp_path, ["a.bin", "c.json"]).files[1] == ("c.json",)  # absent


def test_a_model_is_checked_once_until_its_files_change(fam, counted):
    ck = open_checkpoint(fam.finetuned[0])
    models.load_model(ck, fam.base, torch.float64, "cpu")
    first = len(counted)
    assert first > 0
    models.load_model(ck, fam.base, torch.float64, "cpu")
    assert len(counted) == first  # unchanged files: not read again for NaN
    models.load_model(ck, fam.base, torch.float32, "cpu")
    assert len(counted) == 2 * first  # another dtype is another check (float64 -> float32 can overflow)
    bad = _poison(fam.finetuned[0])
    with pytest.raises(BadDataError, match=bad):
        models.load_model(open_checkpoint(fam.finetuned[0]), fam.base, torch.float64, "cpu")


def test_tensor_sources_share_the_memo(fam, counted):
    ck = open_checkpoint(fam.finetuned[1])
    name = next(n for n in ck.names() if "mlp" in n)
    TensorSource(ck, "ft").get(name)
    TensorSource(open_checkpoint(fam.finetuned[1]), "ft again").get(name)
    assert counted.count(name) == 1
    bad = _poison(fam.finetuned[1])
    with pytest.raises(BadDataError, match=bad):
        TensorSource(open_checkpoint(fam.finetuned[1]), "ft").get(bad)


def test_recent_files_are_never_remembered(fam, counted, monkeypatch):
    monkeypatch.setattr(verified, "RACY_SECONDS", 3600.0)  # every file of the family is recent
    ck = open_checkpoint(fam.finetuned[0])
    models.load_model(ck, fam.base, torch.float64, "cpu")
    first = len(counted)
    models.load_model(ck, fam.base, torch.float64, "cpu")
    assert len(counted) == 2 * first


def test_tokenizers_are_compared_once_until_a_file_changes(fam, monkeypatch):
    loads: list[str] = []
    real = checkpoints_mod.load_tokenizer

    def counting(folder):
        loads.append(str(folder))
        return real(folder)

    monkeypatch.setattr(checkpoints_mod, "load_tokenizer", counting)
    ft = fam.finetuned[0]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (ft / name).write_text((fam.base / name).read_text().replace("{", "{\n", 1))  # other bytes, same tokenizer
    checkpoints_mod.check_tokenizers(fam.base, [("ft", ft)])
    assert len(loads) == 2  # the base's and the fine-tune's
    checkpoints_mod.check_tokenizers(fam.base, [("ft", ft)])
    assert len(loads) == 2
    vocab = ft / "tokenizer.json"
    vocab.write_text(vocab.read_text().replace('"lemma"', '"lemmas"'))
    with pytest.raises(ConfigError, match="tokenizer mismatch"):
        checkpoints_mod.check_tokenizers(fam.base, [("ft", ft)])


def test_float8_tensors_are_checked_for_nan():
    """(stop 73, a review) ``torch.isfinite`` is not implemented for float8 dtypes: the check raised a bare
    NotImplementedError; it upcasts them."""
    import torch

    from mergeqp.errors import BadDataError
    from mergeqp.io.writer import check_tensor_finite

    check_tensor_finite("w", torch.zeros(4, dtype=torch.float8_e4m3fn), "model m")
    with pytest.raises(BadDataError, match=r"tensor 'w' of model m has 1 non-finite"):
        check_tensor_finite("w", torch.tensor([1.0, float("nan")]).to(torch.float8_e4m3fn), "model m")
