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
    for marker in ("report.json", "results.json", "sweep.csv", "model.safetensors", "model.safetensors.index.json"):
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
