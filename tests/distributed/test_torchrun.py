"""``mergeqp collect`` and ``mergeqp merge`` under ``torchrun --nproc-per-node 2`` (gloo on the
CPU, loopback): the calibration batches are shared between the ranks, the float64 sums are
all-reduced, and rank 0 writes exactly what one process writes (to 1e-10 relative); rank 1 writes
nothing. With several sites in ``mode: single`` the ranks solve whole sites instead. Every
command runs on a tiny random Llama; the three two-process commands share one ``torchrun``
launch (a driver calling the command line's ``main`` in turn), to pay its start-up once."""

from __future__ import annotations

import json
import os
import re
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


DRIVER = """
import json, os, sys
from mergeqp.cli import main
codes = [main(args) for args in json.load(open(sys.argv[1]))]
# one file per rank: the two ranks share torchrun's stdout, where their lines can interleave
with open(f"codes-{os.environ['RANK']}.json", "w") as f:
    json.dump(codes, f)
sys.exit(max(codes))
"""


def _commands(cwd: Path, commands: list[list[str]]) -> Path:
    """``commands`` written for :data:`DRIVER`."""
    (cwd / "commands.json").write_text(json.dumps(commands))
    return cwd / "commands.json"


def _torchrun(commands: list[list[str]], cwd: Path) -> subprocess.CompletedProcess:
    """Run each ``mergeqp`` command line of ``commands`` in turn in one ``torchrun --standalone
    --nproc-per-node 2`` launch, with this checkout importable."""
    return _launch(DRIVER, cwd, str(_commands(cwd, commands)))


def _launch(script: str, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """Run the Python ``script`` (written to ``cwd``) on two ranks: ``torchrun --standalone
    --nproc-per-node 2``, with this checkout importable."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun is not installed next to this Python")
    (cwd / "driver.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", str(cwd / "driver.py"), *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=400)


def _close(a: np.ndarray, b: np.ndarray, what: str) -> None:
    """``a == b`` to 1e-10 relative (in the norm of ``b``; exact for non-floating arrays)."""
    if not np.issubdtype(b.dtype, np.floating):
        assert np.array_equal(a, b), what
        return
    scale = max(float(np.abs(b).max(initial=0.0)), 1e-300)
    assert a.shape == b.shape and float(np.abs(a - b).max(initial=0.0)) <= 1e-10 * scale, what


def _collect_inputs(root: Path) -> None:
    """A tiny random Llama (factory file), two fine-tuned state dicts perturbed at ``LAYER`` and
    one calibration file of token ids per task (7 and 5 prompts: 4 + 3 batches of 2)."""
    from safetensors.torch import save_file

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


def _collect_args(root: Path, out: str) -> list[str]:
    return ["collect", "--factory", f"{root / 'factory.py'}:make", "--base", str(root / "base.safetensors"),
            "--finetuned", str(root / "ft0.safetensors"), str(root / "ft1.safetensors"), "--names", "a", "b",
            "--layer", LAYER, "--calibration", str(root / "cal0.pt"), str(root / "cal1.pt"),
            "--batch-size", "2", "--dtype", "float64", "--parametrisation", "rows", "scalar",
            "--out", str(root / out), "--quiet"]


#: the merge configs: one site (its batches shared: one per rank) and two sites in mode single
#: (one site per rank)
SITES = {"one_site": ["model.layers.1.mlp.down_proj"],
         "two_sites": ["model.layers.1.mlp.down_proj", "model.layers.1.mlp.up_proj"],
         "by_depth": ["model.layers.1.*"]}
#: the method of each merge config (sequential by depth: q/k/v, then o, then gate/up spread over the ranks)
METHODS = {"one_site": {"name": "qp", "mode": "single"}, "two_sites": {"name": "qp", "mode": "single"},
           "by_depth": {"name": "qp", "mode": "sequential", "mode_options": {"by_depth": True}}}


@pytest.fixture(scope="module")
def runs(tiny_hf, tmp_path_factory):
    """Every input, the one-process outputs (``one*``) and the two-process ones (``two*``) of
    ``collect`` and of the two merges; returns ``(root, torchrun's CompletedProcess)``."""
    root = tmp_path_factory.mktemp("torchrun")
    _collect_inputs(root)
    # 8 prompts per task: 4 held out, 4 for calibration in one batch
    fam = tiny_hf.make_family(root / "fam", "llama", K=2, scale=0.3, n_prompts=8)
    commands = [_collect_args(root, "two.npz")]
    assert main(_collect_args(root, "one.npz")) == 0
    for name, layers in SITES.items():
        cfg = fam.write_config(root / f"{name}.yml", layers, METHODS[name],
                               output={"restrict": "projection", "k": 8}, output_dtype="float64",
                               evaluate=name == "one_site")
        assert main(["merge", str(cfg), "--out", str(root / f"one_{name}"), "--quiet"]) == 0
        commands.append(["merge", str(cfg), "--out", str(root / f"two_{name}"), "--quiet"])
    run = _torchrun(commands, root)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-6000:]
    return root, run


def test_the_ranks_agree_and_rank_0_alone_reports(runs):
    root, run = runs
    for rank in (0, 1):  # both ranks exit 0 after each command
        assert json.loads((root / f"codes-{rank}.json").read_text()) == [0, 0, 0, 0], rank
    assert run.stdout.count("statistics ->") == 1  # collect: rank 0 alone reports (and writes)
    assert run.stdout.count("merged model written to") == 3  # once per merge


def test_two_process_collection_equals_one_process(runs):
    root, _ = runs
    with np.load(root / "one.npz") as one, np.load(root / "two.npz") as two:
        assert sorted(one.files) == sorted(two.files)
        for name in one.files:
            if name == "meta":
                a, b = json.loads(str(two[name])), json.loads(str(one[name]))
                a["metadata"].pop("seconds"), b["metadata"].pop("seconds")
                # the statistics say how many processes shared the batches (a QA review, stop 76)
                assert (a["metadata"].pop("processes"), b["metadata"].pop("processes")) == (2, 1)
                assert a == b
            else:
                _close(two[name], one[name], name)
        assert int(one["task_counts"].sum()) == 12
    with np.load(root / "one_problem.npz") as one, np.load(root / "two_problem.npz") as two:
        for name in ("H", "g", "c"):
            _close(two[name], one[name], name)


def _reports(root: Path, name: str) -> tuple[dict, dict]:
    return tuple(json.loads((root / f"{w}_{name}" / "report.json").read_text()) for w in ("one", "two"))


def test_two_process_merge_equals_one_process(runs):
    """One site: its calibration batches are shared between the ranks (one each)."""
    root, _ = runs
    one, two = open_checkpoint(root / "one_one_site"), open_checkpoint(root / "two_one_site")
    assert one.names() == two.names()
    for name in one.names():
        _close(two.get(name).numpy(), one.get(name).numpy(), name)
    r1, r2 = _reports(root, "one_site")
    for key in ("objective_before", "objective_after", "objective_after_exact", "energy_fraction"):
        a, b = r2["layers"][0][key], r1["layers"][0][key]
        assert abs(a - b) <= 1e-10 * abs(b), key
    assert r2["evaluation"]["merged"]["calibration_objective"] == pytest.approx(
        r1["evaluation"]["merged"]["calibration_objective"], rel=1e-10)
    shared = "2 processes (torchrun, gloo backend) shared the calibration batches and the sites"
    assert shared in r2["notes"] and not any("processes (torchrun" in n for n in r1["notes"])


@pytest.mark.parametrize("name", ["two_sites", "by_depth"])
def test_independent_sites_spread_over_ranks_equal_the_serial_run(runs, name):
    """mode: single with two sites, and sequential by depth over a block (the sites of one depth),
    under two ranks: each rank solves its sites whole (its QP is the serial run's, computed the
    same way), the results are gathered, rank 0 writes: the merged tensors equal the serial run's
    exactly and the report lists the layers in the same order."""
    root, _ = runs
    one, two = open_checkpoint(root / f"one_{name}"), open_checkpoint(root / f"two_{name}")
    for key in one.names():
        assert torch.equal(two.get(key), one.get(key)), key
    r1, r2 = _reports(root, name)
    assert [r["layer"] for r in r2["layers"]] == [r["layer"] for r in r1["layers"]]
    if name == "two_sites":
        assert sorted(r["layer"] for r in r2["layers"]) == sorted(SITES["two_sites"])
    else:  # 7 projections in 4 depths
        assert len(r2["layers"]) == 7 and len({r["objective_after_exact"] for r in r2["layers"]}) == 4
    for a, b in zip(r2["layers"], r1["layers"]):
        for key in ("objective_before", "objective_after", "objective_after_exact", "energy_fraction"):
            assert a[key] == b[key], key


def test_a_check_of_rank_0_alone_stops_every_rank_with_its_code(runs):
    """An --out that is not empty is checked by rank 0 (it alone writes): the other rank worked on
    until its next collective and died there with a raw gloo traceback (torchrun's report: exit 1),
    the error printed by rank 0 only. Now both ranks stop at the check with its exit code (2), the
    message is printed once and the folder is untouched."""
    root, _ = runs
    taken = root / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("x")
    for rank in (0, 1):
        (root / f"codes-{rank}.json").unlink(missing_ok=True)
    run = _torchrun([["merge", str(root / "one_site.yml"), "--out", str(taken), "--quiet"]], root)
    assert run.returncode != 0
    for rank in (0, 1):
        assert json.loads((root / f"codes-{rank}.json").read_text()) == [2], rank
    text = run.stdout + run.stderr
    printed = [line for line in text.splitlines() if line.startswith("mergeqp merge: error:")]
    assert len(printed) == 1 and "is not empty; pass --overwrite" in printed[0], text[-3000:]
    # (stop 48) torchrun's report shows the message too (rank 0's error file), not only its generic hint
    assert "traceback : mergeqp merge: error: output folder" in text, text[-3000:]
    assert "Connection closed" not in text and "GLHF" not in text
    assert sorted(p.name for p in taken.iterdir()) == ["keep.txt"]


TEARDOWN = """
import json, os, sys
import torch
from mergeqp.io import distributed as D

def threads():
    return len(os.listdir("/proc/self/task"))

imported_before = "torch.distributed.nn" in sys.modules
with D.launched("cpu") as group:
    import torch.distributed.nn  # stores the default group as a function default from here on
    live = threads()
    t = torch.full((3,), float(group.rank + 1), dtype=torch.float64)
    group.all_reduce_sum([t])
    gathered = group.gather(group.rank)
D._destroy()  # what runs at exit
with open(f"teardown-{os.environ['RANK']}.json", "w") as f:
    json.dump({"imported_before": imported_before, "live": live, "after": threads(),
               "sum": t.tolist(), "gathered": gathered}, f)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc/self/task (Linux)")
def test_the_teardown_at_exit_joins_the_workers_of_mergeqps_group(tmp_path):
    """A module imported inside the launch keeps the default group alive past its destruction
    (``torch.distributed.nn``, which ``transformers``' model code imports, stores it as a function
    default); the collectives run on mergeqp's own group, which the teardown frees: its gloo
    worker threads are joined before the interpreter finalises (a worker still releasing a tensor
    there aborted about one launch in 30 with exit -6)."""
    run = _launch(TEARDOWN, tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"teardown-{rank}.json").read_text())
        assert not got["imported_before"], "the default group was never held: the test shows nothing"
        assert got["sum"] == [3.0, 3.0, 3.0] and got["gathered"] == [0, 1], got
        assert got["after"] < got["live"], got  # the workers of mergeqp's group are gone


FAILING_BATCH = """
import json, os
import torch
from mergeqp.io import distributed as D
from mergeqp.stats import collect_statistics

torch.manual_seed(0)
base = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
tuned = []
for k in range(2):
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    m.load_state_dict(base.state_dict())
    with torch.no_grad():
        m[0].weight.add_(0.1 * torch.randn(3, 4))
    tuned.append(m)
calibration = [torch.randn(8, 4), torch.randn(8, 4)]
calibration[0][5, 2] = float("nan")  # task 0's second batch of 4: batch index 1, rank 1's
with D.launched("cpu") as group:
    try:
        collect_statistics(base, tuned, "0", calibration, batch_size=4, progress=False)
        outcome = {"raised": None}
    except Exception as exc:
        outcome = {"raised": type(exc).__name__, "message": str(exc)}
with open(f"failing-{os.environ['RANK']}.json", "w") as f:
    json.dump(outcome, f)
"""


def test_a_batch_that_fails_on_one_rank_stops_every_rank_with_its_message(tmp_path):
    """The calibration batches are shared round robin: a NaN in batch 1 reaches rank 1 only. Rank 1
    raises its error about that batch, and rank 0 (which prints) raises the same error after its
    own batches instead of waiting for rank 1 in the reduction (before stop 46 it waited there and
    raised gloo's "Connection closed by peer" when rank 1 exited)."""
    run = _launch(FAILING_BATCH, tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    outcomes = [json.loads((tmp_path / f"failing-{rank}.json").read_text()) for rank in (0, 1)]
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0]["raised"] == "BadDataError", outcomes
    assert outcomes[0]["message"].startswith("task 'model0' batch 1: the base model's compared output"), outcomes


LOW_MEMORY_ON_RANK_1 = """
import os
if os.environ.get("RANK") == "1":  # rank 1 reads less available memory (another node, another moment)
    import mergeqp.io.memory as memory
    memory.available_memory_bytes = lambda meminfo=None: 4096
"""


def test_one_ranks_refusal_is_printed_and_other_commands_are_refused(runs):
    """(stop 48 review) A memory refusal on rank 1 alone, before any weight is loaded, was printed
    nowhere: rank 0 met gloo's "Connection closed by peer" (exit 2 as a config error). Every rank now
    checks and the first refusal stops every rank at that step, rank 0 printing it. And a command that
    does not share its work (`solve`) ran whole on every rank, writing the same --out at once: refused."""
    root, _ = runs
    (root / "low_rank1.py").write_text(LOW_MEMORY_ON_RANK_1)
    for rank in (0, 1):
        (root / f"codes-{rank}.json").unlink(missing_ok=True)
    solve = ["solve", str(ROOT / "problems" / "tiny96.npz"), "--out", str(root / "sol.json")]
    merge = ["--import", str(root / "low_rank1.py"), "merge", str(root / "one_site.yml"),
             "--out", str(root / "refused"), "--quiet"]
    run = _torchrun([solve, merge], root)
    text = run.stdout + run.stderr
    for rank in (0, 1):
        assert json.loads((root / f"codes-{rank}.json").read_text()) == [2, 2], (rank, text[-3000:])
    printed = [line for line in text.splitlines() if line.startswith("mergeqp ")]
    assert len(printed) == 2, text[-3000:]
    assert "solve runs in one process" in printed[0] and not (root / "sol.json").exists()
    assert printed[1].startswith("mergeqp merge: error: merge site") and "4.0 KiB of memory available" in printed[1]
    assert "Connection closed" not in text and "GLHF" not in text and not (root / "refused").exists()


FAILING_ON_RANK_1 = FACTORY.replace("def make():", """import os

def make():
    if os.environ.get("RANK") == "1":
        raise MemoryError("cannot allocate the model on rank 1")""")


def test_an_error_of_rank_1_alone_reaches_torchruns_report(runs):
    """(stop 48 review) An error of a rank other than 0 alone was printed nowhere (rank 1 is silent;
    rank 0 died in its next collective with a 30-line gloo traceback and exit 1). Now rank 1's message
    is in its torchrun error file, which torchrun's report shows as the root cause, and rank 0 says in
    one line that another process stopped (exit 5)."""
    root, _ = runs
    (root / "factory_r1.py").write_text(textwrap.dedent(FAILING_ON_RANK_1))
    args = _collect_args(root, "never.npz")
    args[args.index("--factory") + 1] = f"{root / 'factory_r1.py'}:make"
    run = _launch(DRIVER, root, str(_commands(root, [args])))
    text = run.stdout + run.stderr
    assert run.returncode != 0 and not (root / "never.npz").exists()
    assert "traceback : mergeqp collect: error: the model factory failed: MemoryError: cannot allocate the " \
           "model on rank 1" in text, text[-3000:]
    # rank 0 meets the lost peer in its next collective (exit 5), unless torchrun's SIGTERM, sent once it
    # saw rank 1 exit, comes first (a race): one line either way, never gloo's traceback
    printed = [line for line in text.splitlines() if line.startswith("mergeqp ")]
    assert len(printed) <= 1 and "[rank0]" not in text and "GLHF" not in text, text[-3000:]
    if printed and "another process of this torchrun job stopped" in printed[0]:
        assert re.search(r"exitcode  : (5|-15) ", text), text[-3000:]
    else:
        assert not printed or "stopped by signal SIGTERM" in printed[0], text[-3000:]
