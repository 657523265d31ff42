"""``--overwrite`` and the output folders it may replace (:func:`mergeqp.io.atomic.replace_refusal`)."""

from __future__ import annotations

import pytest


def test_overwrite_replaces_only_an_earlier_output(tmp_path, monkeypatch):
    """(stop 46 review) ``sweep --out . --overwrite`` deleted every file of the current folder:
    --overwrite now replaces an earlier output of mergeqp only (a report, results, a sweep's table,
    a model's safetensors), never the current folder, one holding it or the home folder."""
    from mergeqp.errors import ValidationError
    from mergeqp.experiments.mnist import prepare_out_dir
    from mergeqp.io.atomic import check_output_folder, replace_refusal

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.tex").write_text("x")
    assert "no earlier mergeqp output" in replace_refusal(notes)
    for check in (lambda: check_output_folder(notes, overwrite=True, option="--out"),
                  lambda: prepare_out_dir(notes, overwrite=True)):
        with pytest.raises(ValidationError, match=r"replaces only an earlier output of mergeqp.*Its files are kept"):
            check()
    assert sorted(p.name for p in notes.iterdir()) == ["thesis.tex"]
    for marker in ("report.json", "results.json", "sweep.csv"):
        earlier = tmp_path / f"earlier_{marker}"
        earlier.mkdir()
        (earlier / marker).write_text("{}")
        assert replace_refusal(earlier) is None, marker
        check_output_folder(earlier, overwrite=True)
    (notes / "sub").mkdir()
    monkeypatch.chdir(notes / "sub")
    assert replace_refusal(notes) == "it is the current folder or holds it"
    monkeypatch.setenv("HOME", str(tmp_path / "earlier_report.json"))
    assert replace_refusal(tmp_path / "earlier_report.json") == "it is your home folder"


@pytest.mark.parametrize("weights", ["model.safetensors", "model.safetensors.index.json"])
def test_overwrite_keeps_a_model_folder_mergeqp_did_not_write(tmp_path, weights):
    """(stop 49) A folder of safetensors weights without mergeqp's file list or a report (another
    tool's model: a fine-tune named as ``--out`` by mistake) was deleted by ``--overwrite``; it is
    kept now, and the same weights written by mergeqp (with its list) are replaced."""
    from mergeqp.errors import ValidationError
    from mergeqp.io.atomic import MANIFEST, atomic_folder, check_output_folder, replace_refusal

    theirs = tmp_path / "their_model"
    theirs.mkdir()
    (theirs / weights).write_text("{}")
    (theirs / "config.json").write_text("{}")
    assert "a model's weights but neither" in replace_refusal(theirs) and MANIFEST in replace_refusal(theirs)
    with pytest.raises(ValidationError, match=r"replaces only an earlier output of mergeqp.*Its files are kept"):
        check_output_folder(theirs, overwrite=True, option="--out")
    assert sorted(p.name for p in theirs.iterdir()) == sorted([weights, "config.json"])
    ours = tmp_path / "ours"
    with atomic_folder(ours) as staging:
        (staging / weights).write_text("{}")
        (staging / "config.json").write_text("{}")
    assert replace_refusal(ours) is None
    check_output_folder(ours, overwrite=True)
