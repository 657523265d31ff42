"""Checkpoint reading (lazy, sharded, bare files), the HF folder writer, prompts and output specs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hypothesis import given, settings
from hypothesis import strategies as st

from mergeqp.errors import ValidationError
from mergeqp.io.calibration import (
    holdout_count,
    read_prompts,
    split_holdout,
    tokenize_batches,
)
from mergeqp.io.checkpoint import open_checkpoint, read_safetensors_header
from mergeqp.io.writer import check_output_folder, parse_size, save_hf_folder
from mergeqp.lm import OutputSpec


@pytest.fixture(scope="module")
def llama_dir(tiny_hf, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("io") / "llama"
    tiny_hf.build_base(folder, "llama", seed=3)
    return folder


@pytest.fixture(scope="module")
def gpt2_dir(tiny_hf, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("io") / "gpt2"
    tiny_hf.build_base(folder, "gpt2", seed=4)
    return folder


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_hf_folder_names_shapes_and_values(tiny_hf, llama_dir):
    model = tiny_hf.model_class("llama").from_pretrained(str(llama_dir))
    ck = open_checkpoint(llama_dir)
    sd = model.state_dict()
    assert ck.kind == "hf_safetensors" and ck.config["model_type"] == "llama"
    assert set(ck.names()) == set(sd)
    for name in ck.names():
        assert ck.info(name).shape == tuple(sd[name].shape)
        assert torch.equal(ck.get(name), sd[name])
    assert ck.total_bytes == sum(t.numel() * t.element_size() for t in sd.values())
    with pytest.raises(ValidationError, match="did you mean"):
        ck.info("model.layers.0.mlp.down_proj.weigth")


def test_open_reads_headers_only(tiny_hf, llama_dir, monkeypatch):
    """Opening and inspecting never loads a tensor: safe_open is not even called."""
    import safetensors

    def boom(*a, **k):
        raise AssertionError("a tensor was loaded")

    monkeypatch.setattr(safetensors, "safe_open", boom)
    ck = open_checkpoint(llama_dir)
    assert ck.info("lm_head.weight").shape == (len(tiny_hf.vocab()), 16)
    with pytest.raises(AssertionError, match="tensor was loaded"):
        ck.get("lm_head.weight")


def test_sharded_folder_round_trip(tiny_hf, llama_dir, tmp_path):
    model = tiny_hf.model_class("llama").from_pretrained(str(llama_dir))
    model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="8KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ck = open_checkpoint(tmp_path / "sharded")
    assert len(ck.files) > 1
    sd = model.state_dict()
    assert set(ck.names()) == set(sd)
    for name in ck.names():
        assert torch.equal(ck.get(name), sd[name])


def test_a_folder_is_read_as_transformers_loads_it(tiny_hf, llama_dir, tmp_path):
    """(stop 53 review) A folder holding model.safetensors and, beside it, another model's shards with
    their index: transformers loads model.safetensors, and so does open_checkpoint (it read the
    shards, so a merge took one model's residuals and evaluated the other's weights). A folder with
    config.json and one weight file of another name, which transformers does not load, is refused
    with the fix."""
    import shutil

    model = tiny_hf.model_class("llama").from_pretrained(str(llama_dir))
    both = tmp_path / "both"
    model.save_pretrained(str(both), max_shard_size="8KB")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.save_pretrained(str(tmp_path / "single"))
    shutil.copy(tmp_path / "single" / "model.safetensors", both / "model.safetensors")
    loaded = tiny_hf.model_class("llama").from_pretrained(str(both)).state_dict()
    ck = open_checkpoint(both)
    assert len(ck.files) == 1
    for name in ck.names():
        assert torch.equal(ck.get(name), loaded[name]), name
    loose = tmp_path / "loose"
    loose.mkdir()
    shutil.copy(both / "config.json", loose / "config.json")
    shutil.copy(both / "model.safetensors", loose / "weights.safetensors")
    with pytest.raises(ValidationError, match="rename weights.safetensors to model.safetensors"):
        open_checkpoint(loose)
    (loose / "config.json").unlink()  # a bare folder of one tensor file stays readable
    assert set(open_checkpoint(loose).names()) == set(ck.names())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64", "int64"])
def test_read_without_a_memory_map_equals_get(tiny_hf, llama_dir, tmp_path, dtype):
    """``Checkpoint.read`` (plain file reads) gives what ``get`` (memory map) gives: sharded folders,
    every dtype, empty and scalar tensors, renamed views; torch files fall back to ``get``."""
    from safetensors.torch import save_file

    model = tiny_hf.model_class("llama").from_pretrained(str(llama_dir))
    sd = {k: (v * 100).to(getattr(torch, dtype)).contiguous() for k, v in model.state_dict().items()}
    sd["empty"] = torch.zeros(0, 3, dtype=getattr(torch, dtype))
    sd["scalar"] = torch.tensor(7, dtype=getattr(torch, dtype))
    save_file(sd, str(tmp_path / "w.safetensors"))
    model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="8KB")
    torch.save(sd, tmp_path / "w.pt")
    for ck in (open_checkpoint(tmp_path / "w.safetensors"), open_checkpoint(tmp_path / "sharded"),
               open_checkpoint(tmp_path / "w.pt")):
        for name in ck.names():
            a, b = ck.read(name), ck.get(name)
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
        name = ck.names()[1]
        assert torch.equal(ck.read(name, dtype=torch.float64), ck.get(name, dtype=torch.float64))
    ck = open_checkpoint(tmp_path / "w.safetensors")
    renamed = ck.renamed({"model.norm.weight": "norm"})
    assert torch.equal(renamed.read("norm"), ck.get("model.norm.weight"))


def test_bare_safetensors_and_torch_files(tiny_hf, llama_dir, tmp_path):
    from safetensors.torch import save_file

    sd = {k: v.clone() for k, v in tiny_hf.model_class("llama").from_pretrained(str(llama_dir)).state_dict().items()}
    save_file(sd, str(tmp_path / "w.safetensors"))
    torch.save(sd, tmp_path / "w.pt")
    torch.save({"state_dict": sd}, tmp_path / "wrapped.bin")
    for name, kind in (("w.safetensors", "safetensors"), ("w.pt", "torch"), ("wrapped.bin", "torch")):
        ck = open_checkpoint(tmp_path / name)
        assert ck.kind == kind and ck.config is None
        for key, value in sd.items():
            assert torch.equal(ck.get(key), value)
    (tmp_path / "bad.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00nope!")
    with pytest.raises(ValidationError, match="not a safetensors file"):
        open_checkpoint(tmp_path / "bad.safetensors")
    torch.save([1, 2, 3], tmp_path / "list.pt")
    with pytest.raises(ValidationError, match="expected a state dict"):
        open_checkpoint(tmp_path / "list.pt")
    with pytest.raises(ValidationError, match="not found"):
        open_checkpoint(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValidationError, match="no weights found"):
        open_checkpoint(tmp_path / "empty")
    # torch's legacy (non-zip) format loads without the memory map; random bytes are named as what they are,
    # not met with torch's advice to save them again with the zip format (a QA review, stop 76)
    torch.save({"w": torch.ones(2)}, tmp_path / "legacy.bin", _use_new_zipfile_serialization=False)
    assert torch.equal(open_checkpoint(tmp_path / "legacy.bin").get("w"), torch.ones(2))
    (tmp_path / "garbage.bin").write_bytes(bytes(range(256)) * 20)
    with pytest.raises(ValidationError, match=r"cannot read torch checkpoint .*garbage.bin: (?!.*torch.save)"):
        open_checkpoint(tmp_path / "garbage.bin")
    (tmp_path / "empty.bin").write_bytes(b"")
    (tmp_path / "text.bin").write_text("hello text")
    for name, why in (("empty.bin", "EOFError"), ("text.bin", "KeyError: 101")):
        with pytest.raises(ValidationError, match=rf"{name}: it is not a PyTorch tensor file \(torch.load: {why}\)$"):
            open_checkpoint(tmp_path / name)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_writer_sharded_folder_loads_with_from_pretrained(tiny_hf, arch, llama_dir, gpt2_dir, tmp_path):
    src = llama_dir if arch == "llama" else gpt2_dir
    ck = open_checkpoint(src)
    before = tiny_hf.file_digests(src)
    written = save_hf_folder(tmp_path / "out", ((n, ck.get(n)) for n in ck.names()), source_folder=src,
                             max_shard_bytes=6000, protected=[src])
    assert len(written.weight_files) > 1 and written.index == "model.safetensors.index.json"
    index = json.loads((tmp_path / "out" / written.index).read_text())
    assert set(index["weight_map"]) == set(ck.names())
    assert index["metadata"]["total_size"] == ck.total_bytes
    for f in written.weight_files:  # every shard holds <= limit unless it is a single tensor
        infos, meta = read_safetensors_header(tmp_path / "out" / f)
        assert meta["format"] == "pt"
        assert sum(i.nbytes for i in infos.values()) <= 6000 or len(infos) == 1
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(written.copied)
    cls = tiny_hf.auto_class(arch)
    a, b = cls.from_pretrained(str(src)).eval(), cls.from_pretrained(str(tmp_path / "out")).eval()
    ids = torch.tensor([[4, 9, 12, 7, 5]])
    assert torch.equal(_logits(a, ids), _logits(b, ids))
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(tmp_path / "out")).get_vocab() == tiny_hf.vocab()
    assert tiny_hf.file_digests(src) == before  # inputs untouched


def test_writer_dtype_and_refusals(llama_dir, tmp_path):
    ck = open_checkpoint(llama_dir)
    out = tmp_path / "half"
    save_hf_folder(out, ((n, ck.get(n)) for n in ck.names()), source_folder=llama_dir, dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert open_checkpoint(out).info("lm_head.weight").dtype == "bfloat16"
    with pytest.raises(ValidationError, match="not empty"):
        check_output_folder(out, [])
    with pytest.raises(ValidationError, match="overlaps input"):
        check_output_folder(llama_dir, [llama_dir], overwrite=True)
    with pytest.raises(ValidationError, match="overlaps input"):
        check_output_folder(llama_dir / "sub", [llama_dir])
    with pytest.raises(ValidationError, match="overlaps input"):
        check_output_folder(llama_dir.parent, [llama_dir], overwrite=True)
    with pytest.raises(ValidationError, match="given twice"):
        save_hf_folder(tmp_path / "dup", iter([("a", torch.zeros(2)), ("a", torch.ones(2))]))


def test_a_sentence_transformers_folder_keeps_its_modules(llama_dir, tmp_path):
    """A QA review, stop 76: a merged all-MiniLM-L6-v2 lost ``modules.json`` and its pooling and
    Normalize modules; ``SentenceTransformer(out)`` then built Transformer + Pooling, and the embeddings
    were no longer unit vectors. The module folders' files (the base's: the merge changes the
    transformer) are copied; a module path outside the folder is not followed."""
    import shutil

    src = tmp_path / "st"
    shutil.copytree(llama_dir, src)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
               {"idx": 3, "name": "3", "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"},
               {"idx": 4, "name": "4", "path": "../outside", "type": "x"}]
    (src / "modules.json").write_text(json.dumps(modules))
    (src / "sentence_bert_config.json").write_text('{"max_seq_length": 256}')
    (src / "1_Pooling").mkdir()
    (src / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    (src / "2_Dense" / "sub").mkdir(parents=True)
    (src / "2_Dense" / "config.json").write_text('{"in_features": 8}')
    (src / "2_Dense" / "sub" / "model.safetensors").write_bytes(b"dense weights")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text("not the model's")
    ck = open_checkpoint(src)
    out = tmp_path / "out"
    written = save_hf_folder(out, ((n, ck.get(n)) for n in ck.names()), source_folder=src)
    for rel in ("modules.json", "sentence_bert_config.json", "1_Pooling/config.json", "2_Dense/config.json",
                "2_Dense/sub/model.safetensors"):
        assert (out / rel).read_bytes() == (src / rel).read_bytes(), rel
        assert rel in written.copied
    assert not (out / "3_Normalize").exists()  # (no files: sentence-transformers needs none for it)
    assert not any("secret" in p.name or p.name == "outside" for p in out.rglob("*"))
    plain = tmp_path / "plain"
    save_hf_folder(plain, ((n, ck.get(n)) for n in ck.names()), source_folder=llama_dir)
    assert not (plain / "modules.json").exists() and not (plain / "1_Pooling").exists()
    # a link inside a module folder is not followed out of it
    (src / "1_Pooling" / "linked.txt").symlink_to(tmp_path / "outside" / "secret.txt")
    linked = tmp_path / "linked"
    save_hf_folder(linked, ((n, ck.get(n)) for n in ck.names()), source_folder=src)
    assert (linked / "1_Pooling" / "config.json").is_file() and not (linked / "1_Pooling" / "linked.txt").exists()
    # the transformer in a folder of its own: that folder holds the base's weights, which would come back
    # into SentenceTransformer(out) over the merged ones at the top (a review of the fix): nothing of
    # sentence-transformers is copied then, as before stop 76
    (src / "0_Transformer").mkdir()
    (src / "0_Transformer" / "model.safetensors").write_bytes(b"the base's weights")
    modules[0]["path"] = "0_Transformer"
    (src / "modules.json").write_text(json.dumps(modules))
    sub = tmp_path / "sub"
    save_hf_folder(sub, ((n, ck.get(n)) for n in ck.names()), source_folder=src)
    assert not (sub / "modules.json").exists() and not (sub / "0_Transformer").exists()
    # ... and the merge's report says so (mergeqp.run.pipeline adds the note)
    from mergeqp.io.writer import sentence_transformers_note

    assert sentence_transformers_note(src).startswith("the base is a sentence-transformers model whose transformer "
                                                      "lies in 0_Transformer/")
    assert sentence_transformers_note(llama_dir) is None and sentence_transformers_note(None) is None
    modules[0]["path"] = ""
    (src / "modules.json").write_text(json.dumps(modules))
    assert sentence_transformers_note(src) is None


def test_an_overflow_of_the_output_dtype_is_named_as_one(tmp_path):
    """(stop 60 review) Values above float16's 65,504 written as float16 were reported as NaN or inf in
    the merge, which sent the user looking for them in the checkpoints: the writer, a baseline's cast and
    the run's cast say that the cast overflowed, by how much, and what to write instead; a NaN that was
    there before the cast is still reported as one."""
    from mergeqp.errors import BadDataError
    from mergeqp.io.writer import cast_checked
    from mergeqp.merge.registry import merge_state_dicts

    big = torch.tensor([[1.0, 7e5], [-9e4, 2.0]])
    with pytest.raises(BadDataError, match=r"'w' of the merged model: 2 value\(s\) overflow float16 when cast to it "
                                           r"\(largest magnitude 7e\+05; float16 holds up to 6\.55e\+04\)"):
        save_hf_folder(tmp_path / "o", iter([("w", big)]), dtype="float16")
    assert not (tmp_path / "o").exists()
    assert torch.equal(cast_checked("w", big, torch.bfloat16, "m"), big.to(torch.bfloat16))  # float32's range
    with pytest.raises(BadDataError, match="non-finite value"):
        cast_checked("w", torch.tensor([float("nan"), 1.0]), torch.float16, "m")
    base = {"w": torch.zeros(2, 2)}
    with pytest.raises(BadDataError, match=r"of the task_arithmetic merge: 2 value.* overflow float16.*\(float32, or bfloat16"):
        merge_state_dicts("task_arithmetic", base, [{"w": big}, {"w": big}], out_dtype="float16", scaling=1.0)
    huge = torch.tensor([1e39, 0.0], dtype=torch.float64)  # (review: float32's overflow was told to use float32)
    for kind in (torch.float32, torch.bfloat16):
        with pytest.raises(BadDataError, match=rf"overflow {str(kind)[6:]} .*: write a wider output dtype \(float64\)"):
            cast_checked("w", huge, kind, "m")
    with pytest.raises(ValidationError, match="must be a floating-point torch dtype"):  # never truncated silently
        cast_checked("w", big, torch.int8, "m")
    for bad in (torch.int8, "int8", "cuda", 3):
        with pytest.raises(ValidationError, match="out_dtype must be a floating-point torch dtype"):
            merge_state_dicts("task_arithmetic", base, [{"w": big}], out_dtype=bad, scaling=1.0)


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("200MiB") == 200 * 2**20
    assert parse_size(1234) == 1234
    assert parse_size("1.5KB") == 1500
    for bad in ("five", "-1GB", 0, "0B"):
        with pytest.raises(ValidationError):
            parse_size(bad)


@settings(max_examples=15, deadline=None)
@given(limit=st.integers(min_value=16, max_value=4000), sizes=st.lists(st.integers(1, 300), min_size=1, max_size=12))
def test_writer_round_trip_property(tmp_path_factory, limit, sizes):
    out = tmp_path_factory.mktemp("prop")
    tensors = {f"t{i}": torch.arange(n, dtype=torch.float32) * (i + 1) for i, n in enumerate(sizes)}
    written = save_hf_folder(out, iter(tensors.items()), max_shard_bytes=limit, overwrite=True)
    ck = open_checkpoint(out / written.weight_files[0]) if len(written.weight_files) == 1 else None
    if ck is None:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        got = {}
        for name, f in index["weight_map"].items():
            got[name] = open_checkpoint(out / f).get(name)
    else:
        got = ck.state_dict()
    assert set(got) == set(tensors)
    for k, value in tensors.items():
        assert torch.equal(got[k], value)
    assert written.total_bytes == 4 * sum(sizes)


# ---------------------------------------------------------------------- prompts and batches
def test_read_prompts_formats_and_errors(tmp_path):
    (tmp_path / "a.txt").write_text("first prompt\n\n  second  \n")
    assert read_prompts(tmp_path / "a.txt") == ["first prompt", "second"]
    (tmp_path / "b.jsonl").write_text('{"text": "x y"}\n"bare"\n\n{"text": "z"}\n')
    assert read_prompts(tmp_path / "b.jsonl") == ["x y", "bare", "z"]
    assert read_prompts(tmp_path / "b.jsonl", max_prompts=2) == ["x y", "bare"]
    (tmp_path / "c.jsonl").write_text('{"prompt": "p"}\n')
    assert read_prompts(tmp_path / "c.jsonl", field="prompt") == ["p"]
    with pytest.raises(ValidationError, match=r"c.jsonl:1: object has no field 'text'"):
        read_prompts(tmp_path / "c.jsonl")
    (tmp_path / "d.jsonl").write_text('{"text": "ok"}\n{broken\n')
    with pytest.raises(ValidationError, match=r"d.jsonl:2: not JSON"):
        read_prompts(tmp_path / "d.jsonl")
    (tmp_path / "e.json").write_text('["u", {"text": "v"}]')
    assert read_prompts(tmp_path / "e.json") == ["u", "v"]
    (tmp_path / "f.txt").write_text("\n\n")
    with pytest.raises(ValidationError, match="no prompts"):
        read_prompts(tmp_path / "f.txt")
    with pytest.raises(ValidationError, match="prompt files are"):
        read_prompts(tmp_path / "g.csv")


def test_split_holdout_is_seeded_partition():
    items = list(range(20))
    calib, held = split_holdout(items, 0.25, seed=7)
    assert len(held) == 5 and sorted(calib + held) == items and not set(calib) & set(held)
    assert split_holdout(items, 0.25, seed=7) == (calib, held)
    assert split_holdout(items, 0.25, seed=8) != (calib, held)
    assert holdout_count(3, 10) == 2 and holdout_count(10, 0) == 0 and holdout_count(10, 3) == 3


def test_tokenize_batches_pads_right_and_masks(llama_dir):
    from mergeqp.io.calibration import load_tokenizer

    tok = load_tokenizer(llama_dir)
    batches = tokenize_batches(tok, ["the cat sits on the mat", "code", "x y z plus two"], max_length=4, batch_size=2)
    assert [b.size for b in batches] == [2, 1]
    first = batches[0]
    assert first.inputs["input_ids"].shape == (2, 4)
    assert first.mask.tolist() == [[1, 1, 1, 1], [1, 0, 0, 0]]
    assert int(first.inputs["input_ids"][1, 1]) == tok.pad_token_id


def test_output_spec_restrictions():
    gen = torch.Generator().manual_seed(0)
    raw = torch.randn(3, 5, 40, generator=gen, dtype=torch.float64)
    mask = torch.ones(3, 5, dtype=torch.int64)
    mask[1, 3:] = 0
    top = OutputSpec(restrict="topk", k=4)
    idx = top.topk_index(raw)
    sel = top.select(raw, mask, idx)
    assert sel.shape == (3, 5, 4)
    assert torch.equal(sel[0, 0], raw[0, 0].sort(descending=True).values[:4])
    assert torch.all(sel[1, 3:] == 0)
    # the projection is an unbiased estimate of the squared norm: E ||P'x||^2 = ||x||^2
    x = torch.randn(40, generator=gen, dtype=torch.float64)
    ests = [float((OutputSpec(restrict="projection", k=16, seed=s).select(x[None]) ** 2).sum()) for s in range(400)]
    assert abs(np.mean(ests) / float(x @ x) - 1.0) < 0.08
    P = OutputSpec(restrict="projection", k=16, seed=1).projection(40, torch.float64, "cpu")
    assert torch.equal(P, OutputSpec(restrict="projection", k=16, seed=1).projection(40, torch.float64, "cpu"))
    with pytest.raises(ValidationError, match="needs k"):
        OutputSpec(restrict="topk")
    with pytest.raises(ValidationError, match="valid"):
        OutputSpec(restrict="fancy", k=2)


def test_target_batch_counts():
    from mergeqp.io.calibration import Batch
    from mergeqp.lm import TargetBatch

    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    seq = TargetBatch(Batch({"input_ids": mask}, mask), torch.zeros(2, 3, 5))
    assert (seq.count, seq.entries) == (3, 15)
    unmasked = TargetBatch(Batch({"pixel_values": torch.zeros(2, 1)}), torch.zeros(2, 4, 5))
    assert (unmasked.count, unmasked.entries) == (8, 40)
    vec = TargetBatch(Batch({"pixel_values": torch.zeros(2, 1)}), torch.zeros(2, 3))
    assert (vec.count, vec.entries) == (2, 6)


@pytest.mark.parametrize("shard", [None, 200])
def test_written_model_files_get_the_umask_permissions(tmp_path, shard):
    """safetensors creates its file 0600: a merged model folder had config.json readable by all and
    its weights by the owner only. Every written file now has 0666 less the umask."""
    import os
    import stat

    import torch

    from mergeqp.io.writer import save_hf_folder

    old = os.umask(0o022)
    try:
        tensors = [(f"w{i}", torch.full((8, 8), float(i))) for i in range(4)]
        save_hf_folder(tmp_path / "out", tensors, config={"model_type": "test"},
                       **({"max_shard_bytes": shard} if shard else {}))
    finally:
        os.umask(old)
    files = sorted((tmp_path / "out").iterdir())
    assert any(f.suffix == ".safetensors" for f in files)
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f.name


def test_identical_merges_are_identical_files(tmp_path):
    """Reproducibility (stop 43 review): safetensors writes its header's metadata in hash order,
    which varies between processes; the header is rewritten sorted, so the same tensors and
    metadata give the same bytes in any process. An unchanged config.json is copied byte for byte."""
    import hashlib
    import subprocess
    import sys

    code = ("import sys, torch; from mergeqp.io.atomic import save_safetensors; "
            "save_safetensors({'w': torch.arange(6.0).reshape(2, 3), 'b': torch.ones(2)}, sys.argv[1], "
            "metadata={'producer': 'mergeqp', 'format': 'pt', 'method': 'soup', 'zeta': '1'})")
    digests = set()
    for i in range(4):
        path = tmp_path / f"m{i}.safetensors"
        subprocess.run([sys.executable, "-c", code, str(path)], check=True)
        digests.add(hashlib.sha256(path.read_bytes()).hexdigest())
    assert len(digests) == 1
    import json
    import struct

    from safetensors import safe_open

    raw = (tmp_path / "m0.safetensors").read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    assert list(header["__metadata__"]) == ["format", "method", "producer", "zeta"]
    with safe_open(str(tmp_path / "m0.safetensors"), "pt") as f:
        assert f.metadata()["method"] == "soup" and f.get_tensor("w")[1, 2] == 5.0

    import torch

    from mergeqp.io import save_hf_folder

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text('{\n  "model_type": "llama",   "dtype": "float32"\n}\n')  # odd whitespace
    save_hf_folder(tmp_path / "out", [("w", torch.zeros(2))], source_folder=src)
    assert (tmp_path / "out" / "config.json").read_bytes() == (src / "config.json").read_bytes()
    save_hf_folder(tmp_path / "out16", [("w", torch.zeros(2, dtype=torch.float16))], source_folder=src)
    assert '"float16"' in (tmp_path / "out16" / "config.json").read_text()  # changed: rewritten


def test_prompt_lines_end_at_newlines_only(tmp_path):
    """(stop 53 review) U+2028, U+0085 and form feeds inside a prompt are text, not line ends:
    json.dumps(..., ensure_ascii=False) writes them raw into valid JSONL (refused before), and a .txt
    prompt holding one was split in two; CRLF files still read line by line."""
    texts = ["one\u2028line", "next\u0085line\x0cwith a form feed", "plain"]
    jl = tmp_path / "p.jsonl"
    jl.write_text("\r\n".join(json.dumps({"text": t}, ensure_ascii=False) for t in texts) + "\r\n", encoding="utf-8")
    assert read_prompts(jl) == texts
    txt = tmp_path / "p.txt"
    txt.write_text("\r\n".join(texts) + "\r\n\r\n", encoding="utf-8")
    assert read_prompts(txt) == texts


def test_writer_copies_the_custom_code_a_config_names(llama_dir, tmp_path):
    """(stop 56 review) A config with ``auto_map`` (a model with custom code) was written without its
    ``configuration_*.py`` / ``modeling_*.py``: from_pretrained(trust_remote_code=True) failed. Python
    files of a folder without ``auto_map`` are not copied."""
    import shutil

    src = tmp_path / "custom"
    shutil.copytree(llama_dir, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_my.MyConfig", "AutoModelForCausalLM": "modeling_my.MyModel"}
    (src / "config.json").write_text(json.dumps(cfg))
    for name in ("configuration_my.py", "modeling_my.py", "helpers.py"):
        (src / name).write_text(f"# {name}\n")
    ck = open_checkpoint(src)
    written = save_hf_folder(tmp_path / "out", ((n, ck.get(n)) for n in ck.names()), source_folder=src)
    for name in ("configuration_my.py", "modeling_my.py", "helpers.py"):  # (modules import each other)
        assert (tmp_path / "out" / name).read_text() == f"# {name}\n" and name in written.copied
    plain = save_hf_folder(tmp_path / "plain", ((n, ck.get(n)) for n in ck.names()), source_folder=llama_dir)
    assert not any(n.endswith(".py") for n in plain.copied)


def test_config_settings_of_composite_models_are_found_in_their_language_config():
    """A composite model (Llava, Gemma 3, Qwen2-VL) keeps vocab_size and its context in text_config:
    the dry run's vocabulary, the context cut and experiment lm's tokenizer check read them there
    (before stop 77 only top-level keys, so the checks were silently skipped)."""
    from mergeqp.io.checkpoint import config_int, config_setting
    from mergeqp.run.merge_plan import context_length

    flat = {"vocab_size": 100, "max_position_embeddings": 64, "text_config": {"vocab_size": 7}}
    nested = {"model_type": "llava", "text_config": {"vocab_size": 32064, "max_position_embeddings": 4096},
              "vision_config": {"max_position_embeddings": 577, "vocab_size": 3}}
    assert config_setting(flat, "vocab_size") == ("vocab_size", 100)  # the top level first
    assert config_setting(nested, "vocab_size") == ("text_config.vocab_size", 32064)  # never the vision tower's
    assert config_int(nested, "vocab_size") == ("text_config.vocab_size", 32064)
    assert context_length(nested) == ("text_config.max_position_embeddings", 4096)
    assert context_length(flat) == ("max_position_embeddings", 64)
    assert config_setting({"llm_config": {"n_positions": 9}}, "n_positions") == ("llm_config.n_positions", 9)
    assert config_setting(nested, "hidden_size") is None and config_setting(None, "vocab_size") is None
    # null, boolean, zero or non-integer values are not sizes
    assert config_int({"vocab_size": None, "text_config": {"vocab_size": 5}}, "vocab_size") == ("text_config.vocab_size", 5)
    for bad in (True, 0, -3, 2.5, "8"):
        assert config_int({"vocab_size": bad}, "vocab_size") is None
    assert context_length({"n_positions": True, "text_config": {"n_ctx": 16}}) == ("text_config.n_ctx", 16)
