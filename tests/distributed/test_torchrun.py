"""``mergeqp collect`` and ``mergeqp merge`` under ``torchrun --nproc-per-node 2`` (gloo on the
CPU, loopback): the calibration batches are shared between the ranks, the float64 sums are
all-reduced, and rank 0 writes exactly what one process writes (to 1e-10 relative); rank 1 writes
nothing. Both commands run on a tiny random Llama."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from mergeqp.cli import main  # noqa: E402
from mergeqp.io.checkpoint import open_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LAYER = "model.layers.1.mlp.down_proj"

FACTORY = """
from transformers import LlamaConfig, LlamaForCausalLM

def make():
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    return LlamaForCausalLM(cfg)
"""


def _torchrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2 -m mergeqp ARGS`` with this checkout importable."""
    if shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None:
        pytest.skip("torchrun is not installed next to this Python")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc-per-node", "2",
           "-m", "mergeqp", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _close(a: np.ndarray, b: np.ndarray, what: str) -> None:
    """``a == b`` to 1e-10 relative (in the norm of ``b``; exact for non-floating arrays)."""
    if not np.issubdtype(b.dtype, np.floating):
        assert np.array_equal(a, b), what
        return
    scale = max(float(np.abs(b).max(initial=0.0)), 1e-300)
    assert a.shape == b.shape and float(np.abs(a - b).max(initial=0.0)) <= 1e-10 * scale, what


@pytest.fixture(scope="module")
def llama_inputs(tmp_path_factory):
    """A tiny random Llama (factory file), two fine-tuned state dicts perturbed at ``LAYER`` and
    one calibration file of token ids per task (7 and 5 prompts: 4 + 3 batches of 2)."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("torchrun_collect")
    (root / "factory.py").write_text(textwrap.dedent(FACTORY))
    namespace: dict = {}
    exec(compile(textwrap.dedent(FACTORY), "factory.py", "exec"), namespace)  # noqa: S102
    torch.manual_seed(0)
    base = namespace["make"]().eval()
    save_file({k: v.contiguous() for k, v in base.state_dict().items()}, str(root / "base.safetensors"))
    gen = torch.Generator().manual_seed(1)
    for k in range(2):
        sd = {n: v.clone().contiguous() for n, v in base.state_dict().items()}
        for n in (f"{LAYER}.weight", "model.layers.1.mlp.up_proj.weight"):
            sd[n] += 0.3 * sd[n].std() * torch.randn(sd[n].shape, generator=gen)
        save_file(sd, str(root / f"ft{k}.safetensors"))
        torch.save(torch.randint(0, 32, (7 - 2 * k, 6), generator=gen), root / f"cal{k}.pt")
    return root


def _collect_args(root: Path, out: str) -> list[str]:
    return ["collect", "--factory", f"{root / 'factory.py'}:make", "--base", str(root / "base.safetensors"),
            "--finetuned", str(root / "ft0.safetensors"), str(root / "ft1.safetensors"), "--names", "a", "b",
            "--layer", LAYER, "--calibration", str(root / "cal0.pt"), str(root / "cal1.pt"),
            "--batch-size", "2", "--dtype", "float64", "--parametrisation", "rows", "scalar",
            "--out", str(root / out), "--quiet"]


def test_two_process_collection_equals_one_process(llama_inputs):
    root = llama_inputs
    assert main(_collect_args(root, "one.npz")) == 0
    run = _torchrun(_collect_args(root, "two.npz"), root)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("statistics ->") == 1  # rank 0 alone reports (and writes)
    with np.load(root / "one.npz") as one, np.load(root / "two.npz") as two:
        assert sorted(one.files) == sorted(two.files)
        for name in one.files:
            if name == "meta":
                a, b = json.loads(str(two[name])), json.loads(str(one[name]))
                a["metadata"].pop("seconds"), b["metadata"].pop("seconds")
                assert a == b
            else:
                _close(two[name], one[name], name)
        assert int(one["task_counts"].sum()) == 12
    with np.load(root / "one_problem.npz") as one, np.load(root / "two_problem.npz") as two:
        for name in ("H", "g", "c"):
            _close(two[name], one[name], name)


def test_two_process_merge_equals_one_process(tiny_hf, tmp_path):
    fam = tiny_hf.make_family(tmp_path / "fam", "llama", K=2, scale=0.3, n_prompts=10)
    cfg = fam.write_config(tmp_path / "cfg.yml", tiny_hf.MLP_LAYER["llama"], {"name": "qp", "mode": "single"},
                           output={"restrict": "projection", "k": 8}, output_dtype="float64")
    assert main(["merge", str(cfg), "--out", str(tmp_path / "one"), "--quiet"]) == 0
    run = _torchrun(["merge", str(cfg), "--out", str(tmp_path / "two"), "--quiet"], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("merged model written to") == 1
    one, two = open_checkpoint(tmp_path / "one"), open_checkpoint(tmp_path / "two")
    assert one.names() == two.names()
    for name in one.names():
        _close(two.get(name).numpy(), one.get(name).numpy(), name)
    r1 = json.loads((tmp_path / "one" / "report.json").read_text())
    r2 = json.loads((tmp_path / "two" / "report.json").read_text())
    for key in ("objective_before", "objective_after", "objective_after_exact", "energy_fraction"):
        a, b = r2["layers"][0][key], r1["layers"][0][key]
        assert abs(a - b) <= 1e-10 * abs(b), key
    assert r2["evaluation"]["merged"]["calibration_objective"] == pytest.approx(
        r1["evaluation"]["merged"]["calibration_objective"], rel=1e-10)
