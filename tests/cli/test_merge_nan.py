"""`mergeqp merge` (Hugging Face folders) given a checkpoint with NaN: refused with exit code 3
naming the tensor and the checkpoint, whatever `evaluate` says, and nothing is written."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


from mergeqp.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def family(tiny_hf, tmp_path_factory):
    from safetensors.torch import load_file, save_file

    fam = tiny_hf.make_family(tmp_path_factory.mktemp("nanfam") / "llama", "llama", K=2, scale=0.3, n_prompts=6)
    for path in fam.finetuned[1].glob("*.safetensors"):
        sd = load_file(str(path))
        if "model.layers.1.mlp.down_proj.weight" in sd:
            sd["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
            save_file(sd, str(path), metadata={"format": "pt"})
    return fam


@pytest.mark.parametrize("method", [{"name": "ties", "params": {"density": 0.5}}, {"name": "task_arithmetic"},
                                    {"name": "qp", "mode": "single"}])
def test_merge_refuses_nan_checkpoint(digests, leftovers, tiny_hf, family, tmp_path, capsys, method):
    cfg = family.write_config(tmp_path / "c.yml", [tiny_hf.MLP_LAYER["llama"]], method,
                         evaluate=method["name"] == "qp")
    before = digests(family.root)
    code = main(["merge", str(cfg), "--out", str(tmp_path / "o"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "non-finite" in err and "Traceback" not in err
    # the tensor and the checkpoint that holds it (the baselines said "finetuned[1]" before stop 68)
    assert "tensor 'model.layers.1.mlp.down_proj.weight'" in err and str(family.finetuned[1]) in err
    assert not (tmp_path / "o").exists() and leftovers(tmp_path) == []
    assert digests(family.root) == before


@pytest.mark.parametrize("where, at", [("base", 0), ("finetune", 0), ("base", -1)])
def test_nan_outside_the_merged_layers_names_the_checkpoint_that_holds_it(digests, leftovers, tiny_hf, tmp_path,
                                                                         capsys, where, at):
    """(stop 73, a QA review) a NaN in a tensor the merge keeps from the base was reported as the merged
    model's (after the work), and NaN != NaN made every fine-tune "change" it; in a fine-tune's tensor
    outside the merge it passed. Both are refused, naming the tensor and the checkpoint: before the work
    where the NaN lies in the entries the plan samples (``at`` 0), else when the merged model is written
    (the base's last entry)."""
    from safetensors.torch import load_file, save_file

    fam = tiny_hf.make_family(tmp_path / "llama", "llama", K=2, scale=0.3, n_prompts=6)
    folder = fam.base if where == "base" else fam.finetuned[0]
    key = "model.layers.0.self_attn.q_proj.weight"
    for path in folder.glob("*.safetensors"):
        sd = load_file(str(path))
        if key in sd:
            sd[key][at, at] = float("nan")
            save_file(sd, str(path), metadata={"format": "pt"})
    cfg = fam.write_config(tmp_path / "c.yml", [tiny_hf.MLP_LAYER["llama"]], {"name": "ties"}, evaluate=False)
    before = digests(fam.root)
    code = main(["merge", str(cfg), "--out", str(tmp_path / "o"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 3, err
    who = "the base" if where == "base" else "model 'code'"
    assert f"tensor '{key}' of {who} ({folder})" in err and "non-finite" in err and "merged model" not in err
    if at == 0:  # its index in the tensor, not in the plan's flat sample ("(0,)" until a QA review, stop 76)
        assert "first at index (0, 0)" in err
    assert not (tmp_path / "o").exists() and leftovers(tmp_path) == []
    assert digests(fam.root) == before
