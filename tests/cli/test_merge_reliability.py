"""`mergeqp merge` given bad outputs, damaged checkpoints and non-finite settings, and faults
while it writes (a full disk reported by safetensors, SIGINT): the exit code, a message naming
the culprit, every input (the config file included) byte-identical, the old output kept and no
temporary leftovers. The cases are published in docs/reliability.md."""

from __future__ import annotations

import os
import json
import shutil
import signal
from pathlib import Path

import pytest
import yaml

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from mergeqp.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TA = {"name": "task_arithmetic"}


@pytest.fixture(scope="module")
def world(tiny_hf, tmp_path_factory):
    """A tiny Llama family, a folder of configs, damaged copies of a fine-tuned model, a link to
    the base folder, a file and an earlier (non-empty) output folder."""
    root = tmp_path_factory.mktemp("mergerel")
    fam = tiny_hf.make_family(root / "fam", "llama", K=2, n_prompts=6)
    for tag, cut in (("empty", lambda b: b""), ("trunc", lambda b: b[:-64])):
        shutil.copytree(fam.finetuned[0], root / f"ft_{tag}")
        for f in (root / f"ft_{tag}").glob("*.safetensors"):
            f.write_bytes(cut(f.read_bytes()))
    os.symlink(fam.base, root / "base_link")
    (root / "a_file.txt").write_text("not a folder")
    (root / "empty.txt").write_text("")
    (root / "old").mkdir()
    (root / "old" / "keep.txt").write_text("an earlier result")
    (root / "cfgs").mkdir()
    return fam, root


def _config(world, tiny_hf, name: str, method: dict | None = None, edit=None, **extra) -> Path:
    fam, root = world
    path = fam.write_config(root / "cfgs" / f"{name}.yml", [tiny_hf.MLP_LAYER["llama"]], method or TA,
                            **{"evaluate": False, **extra})
    if edit is not None:
        cfg = yaml.safe_load(path.read_text())
        edit(cfg, root)
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _model(index: int, folder: str):
    def edit(cfg, root):
        cfg["models"][index]["path"] = str(root / folder)
    return edit


# (id, config name, method, config edit, extra config keys, merge arguments after the config, exit, message)
MERGE_CASES = [
    ("merge-out-is-config-folder", "c1", None, None, {}, ["--out", "{cfgs}", "--overwrite"], 2, "overlaps input"),
    ("merge-out-is-config-file", "c2", None, None, {}, ["--out", "{cfgs}/c2.yml"], 2, "c2.yml overlaps input"),
    ("merge-out-is-prompt-file", "c3", None, None, {}, ["--out", "{fam}/code.jsonl"], 2, "overlaps input"),
    ("merge-out-in-base-through-link", "c4", None, None, {}, ["--out", "{root}/base_link/merged"], 2,
     "overlaps input"),
    ("merge-out-dotdot-into-base", "c5", None, None, {}, ["--out", "{fam}/ft_code/../base/merged"], 2,
     "overlaps input"),
    ("merge-out-contains-inputs", "c6", None, None, {}, ["--out", "{fam}", "--overwrite"], 2, "overlaps input"),
    ("merge-out-under-a-file", "c7", None, None, {}, ["--out", "{root}/a_file.txt/merged"], 2, "is not a folder"),
    ("merge-out-not-empty", "c8", None, None, {}, ["--out", "{root}/old"], 2, "is not empty; pass --overwrite"),
    ("merge-json-without-out", "c9", None, None, {}, ["--json"], 2, "--out DIR is required"),
    ("merge-finetuned-empty-safetensors", "c10", None, _model(0, "ft_empty"), {}, ["--dry-run"], 2,
     "not a safetensors file"),
    ("merge-finetuned-truncated", "c11", None, _model(0, "ft_trunc"), {}, ["--dry-run"], 2,
     "truncated or damaged safetensors file"),
    ("merge-truncated-qp", "c12", {"name": "qp", "mode": "single"}, _model(1, "ft_trunc"), {"evaluate": True},
     ["--out", "{root}/m"], 2, "truncated or damaged safetensors file"),
    ("merge-weight-nan", "c13", None, lambda c, r: c["models"][0].update(weight=float("nan")), {}, ["--dry-run"],
     2, "models[code].weight"),
    ("merge-scaling-inf", "c14", {"name": "task_arithmetic", "params": {"scaling": float("inf")}}, None, {},
     ["--dry-run"], 2, "parameter 'scaling': Input should be a finite number"),
    ("merge-ties-density-nan", "c15", {"name": "ties", "params": {"density": float("nan")}}, None, {},
     ["--dry-run"], 2, "parameter 'density': Input should be a finite number"),
    ("merge-regularisation-inf", "c16", {"name": "qp", "regularisation": float("inf")}, None, {}, ["--dry-run"], 2,
     "method.regularisation: Input should be a finite number"),
    ("merge-trust-region-radius-inf", "c17", {"name": "qp", "mode": "trust_region",
                                              "mode_options": {"radius": float("inf")}}, None, {}, ["--dry-run"], 2,
     "radius: Input should be a finite number"),
    ("merge-trust-region-radius-nan", "c18", {"name": "qp", "mode": "trust_region",
                                              "mode_options": {"radius": float("nan")}}, None, {}, ["--dry-run"], 2,
     "radius"),
    ("merge-trust-region-unknown-option", "c19", {"name": "qp", "mode": "trust_region",
                                                  "mode_options": {"max_iterations": 3}}, None, {}, ["--dry-run"],
     2, "unknown key 'max_iterations' for mode: trust_region"),
    ("merge-prompt-file-empty", "c20", None, lambda c, r: c["models"][0].update(calibration=str(r / "empty.txt")),
     {"evaluate": True}, ["--dry-run"], 2, "models[code].calibration: " + "{root}/empty.txt: no prompts found"),
]


@pytest.mark.parametrize("name, method, edit, extra, args, code, message",
                         [pytest.param(*c[1:], id=c[0]) for c in MERGE_CASES])
def test_merge_bad_input(world, tiny_hf, digests, leftovers, capsys, name, method, edit, extra, args, code, message):
    fam, root = world
    cfg = _config(world, tiny_hf, name, method, edit, **extra)
    fill = {"root": str(root), "fam": str(fam.root), "cfgs": str(root / "cfgs")}
    before = digests(root)
    try:
        got = main(["merge", str(cfg), *[a.format(**fill) for a in args], "--quiet"])
    except SystemExit as exc:
        got = exc.code
    err = capsys.readouterr().err
    assert got == code, err
    assert message.format(**fill) in err and "Traceback" not in err, err
    assert len([ln for ln in err.splitlines() if "error:" in ln]) == 1, err
    assert digests(root) == before, "an input (or the earlier output) changed"
    assert not (root / "m").exists() and leftovers(root) == []


def test_full_disk_while_merge_writes_keeps_the_old_folder(world, tiny_hf, digests, leftovers, capsys, monkeypatch):
    """safetensors reports a full disk as its own SafetensorError (not an OSError): still exit 4,
    the old --overwrite folder byte-identical, no staging folder."""
    import safetensors.torch as st
    from safetensors import SafetensorError

    fam, root = world
    cfg = _config(world, tiny_hf, "full_disk")
    out = root / "full_disk_out"
    assert main(["merge", str(cfg), "--out", str(out), "--quiet"]) == 0
    before_out, before_in = digests(out), digests(fam.root)
    real_save = st.save_file

    def save_file(data, path, metadata=None):  # half the shard, then the disk is full
        real_save(data, path, metadata=metadata)
        with open(path, "r+b") as fh:
            fh.truncate(os.path.getsize(path) // 2)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(st, "save_file", save_file)
    capsys.readouterr()
    code = main(["merge", str(cfg), "--out", str(out), "--overwrite", "--quiet"])
    err = capsys.readouterr().err
    assert code == 4, err
    assert "No space left on device; the output folder was not changed" in err and "Traceback" not in err
    # the output the user asked for, not the staging file's internal name (a QA review, stop 73)
    assert f"cannot write the merged model's weights in {out} (shard 1)" in err and "tmp-mergeqp" not in err
    assert digests(out) == before_out and digests(fam.root) == before_in
    assert leftovers(root) == []


# the writer announces that it has started (the staging folder exists, main's signal handling is
# in place), then waits for the signal: it lands mid-write however slow the machine is
SCRIPT = """
import sys, time
import mergeqp.io.writer as writer
real = writer._write_folder
def announced(*args, **kwargs):
    print("writing", flush=True)
    for _ in range(600):
        time.sleep(0.1)
    return real(*args, **kwargs)
writer._write_folder = announced
from mergeqp.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigint_while_merge_writes_keeps_the_old_folder(world, tiny_hf, digests, leftovers, interrupt_child):
    fam, root = world
    cfg = _config(world, tiny_hf, "sigint")
    out = root / "sigint_out"
    assert main(["merge", str(cfg), "--out", str(out), "--quiet"]) == 0
    before_out, before_in = digests(out), digests(fam.root)
    code, err = interrupt_child(SCRIPT, ["merge", str(cfg), "--out", str(out), "--overwrite", "--quiet"], "writing",
                                signal.SIGINT)
    assert code == 130, err
    assert "Traceback" not in err
    assert digests(out) == before_out and digests(fam.root) == before_in
    assert leftovers(root) == []


def test_every_merge_case_is_published():
    doc = (ROOT / "docs" / "reliability.md").read_text()
    missing = [c[0] for c in MERGE_CASES if f"| `{c[0]}` |" not in doc]
    assert missing == [], f"cases not in docs/reliability.md: {missing}"


def test_run_merge_refuses_the_config_folder(world, tiny_hf, digests, leftovers):
    """Python API: ``run_merge`` of a config read from a file never writes over that file."""
    from mergeqp.config import load_config
    from mergeqp.errors import ValidationError
    from mergeqp.run import run_merge

    fam, root = world
    cfg_path = _config(world, tiny_hf, "api")
    before = digests(root)
    with pytest.raises(ValidationError, match="overlaps input .*api.yml"):
        run_merge(load_config(cfg_path), cfg_path.parent, overwrite=True, progress=False)
    assert digests(root) == before and leftovers(root) == []


def test_overwrite_never_deletes_an_imported_plugin(world, tiny_hf, tmp_path, capsys):
    """(stop 47) A module named in the config's `imports:` that lies in the earlier output folder was
    deleted by `--overwrite` (exit 0; the report still gave its path and sha256). It is an input."""
    prev = tmp_path / "prev"
    assert main(["merge", str(_config(world, tiny_hf, "plug0")), "--out", str(prev), "--quiet"]) == 0
    plugin = prev / "my_plugin_s47.py"
    plugin.write_text("ANSWER = 42\n")
    cfg = _config(world, tiny_hf, "plug1", imports=[str(plugin)])
    capsys.readouterr()
    assert main(["merge", str(cfg), "--out", str(prev), "--overwrite", "--quiet"]) == 2
    assert "overlaps input" in capsys.readouterr().err and plugin.read_text() == "ANSWER = 42\n"


def test_overwrite_keeps_files_added_to_an_earlier_output(world, tiny_hf, tmp_path, capsys):
    """(stop 48) `merge --overwrite` into an earlier merge's folder deleted the files a user had put
    there since (notes, evaluations). The folder lists what mergeqp wrote (a hidden manifest); other
    files make --overwrite refuse (exit 2, named, nothing changed); without them it replaces the folder."""
    from mergeqp.io.atomic import MANIFEST, folder_files

    cfg = _config(world, tiny_hf, "added0")
    prev = tmp_path / "prev"
    assert main(["merge", str(cfg), "--out", str(prev), "--quiet"]) == 0
    written = folder_files(prev)
    assert (prev / MANIFEST).is_file() and "config.json" in written
    assert json.loads((prev / MANIFEST).read_text())["files"] == written
    assert main(["merge", str(cfg), "--out", str(prev), "--overwrite", "--quiet"]) == 0  # only its own files
    (prev / "eval").mkdir()
    (prev / "eval" / "scores.csv").write_text("task,acc\n")
    (prev / "notes.md").write_text("keep me")
    before = {f: (prev / f).read_bytes() for f in folder_files(prev)}
    capsys.readouterr()
    assert main(["merge", str(cfg), "--out", str(prev), "--overwrite", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "2 file(s) that mergeqp did not write there (eval/scores.csv, notes.md)" in err and "move them" in err
    assert {f: (prev / f).read_bytes() for f in folder_files(prev)} == before
    (prev / "notes.md").unlink()
    shutil.rmtree(prev / "eval")
    assert main(["merge", str(cfg), "--out", str(prev), "--overwrite", "--quiet"]) == 0
