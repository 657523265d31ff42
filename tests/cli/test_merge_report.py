"""The run layer's reliability wiring: the report is written inside the atomic model folder,
`--json` prints the report after a merge, a checkpoint with NaN is named on the QP path, and a
layer whose residuals are all zero is flagged in the report."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from mergeqp.cli import main  # noqa: E402

LAYER = "model.layers.1.mlp.down_proj"


@pytest.fixture(scope="module")
def family(tiny_hf, tmp_path_factory):
    assert tiny_hf.MLP_LAYER["llama"] == LAYER
    return tiny_hf.make_family(tmp_path_factory.mktemp("runfam") / "llama", "llama", K=2, scale=0.3, n_prompts=8)


def test_json_report_after_a_merge_and_report_inside_the_folder(leftovers, family, tmp_path, capsys):
    cfg = family.write_config(tmp_path / "c.yml", [LAYER], {"name": "qp", "mode": "single"})
    out = tmp_path / "merged"
    assert main(["merge", str(cfg), "--out", str(out), "--quiet", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    on_disk = json.loads((out / "report.json").read_text())
    assert printed["layers"][0]["layer"] == LAYER and printed["layers"] == on_disk["layers"]
    assert printed["output"]["folder"] == str(out)
    assert (out / "report.md").is_file() and leftovers(tmp_path) == []


def test_zero_residual_layer_is_flagged(tiny_hf, tmp_path):
    fam = tiny_hf.make_family(tmp_path / "fam", "llama", K=2, perturbed=("model.layers.0.*",), scale=0.3,
                              n_prompts=8)
    cfg = fam.write_config(tmp_path / "c.yml", [LAYER], {"name": "qp", "mode": "single"}, evaluate=False)
    assert main(["merge", str(cfg), "--out", str(tmp_path / "o"), "--quiet"]) == 0
    notes = json.loads((tmp_path / "o" / "report.json").read_text())["notes"]
    assert any(f"layer {LAYER}: every model's residual is zero" in n for n in notes), notes


def test_qp_merge_names_the_nan_tensor(family, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "ft_bad"
    bad.mkdir()
    for f in family.finetuned[1].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    for path in bad.glob("*.safetensors"):
        sd = load_file(str(path))
        sd["model.layers.0.mlp.up_proj.weight"][1, 2] = float("inf")
        save_file(sd, str(path), metadata={"format": "pt"})
    cfg = family.write_config(tmp_path / "c.yml", [LAYER], {"name": "qp", "mode": "single"})
    text = cfg.read_text().replace(str(family.finetuned[1]), str(bad))
    cfg.write_text(text)
    assert main(["merge", str(cfg), "--out", str(tmp_path / "o"), "--quiet"]) == 3
    err = capsys.readouterr().err
    assert "'model.layers.0.mlp.up_proj.weight'" in err and str(bad) in err, err
    assert not (tmp_path / "o").exists()
