"""``calibration.balance: tokens``: each task's weight divided by its number of compared positions
(times their mean over tasks), so that tasks with longer prompts do not dominate the objective.

Reference: the same merge with ``balance: none`` and the models' ``weight`` set by hand to
``mean(counts) / count`` gives the identical objective and solution; with prompts of different
lengths the balanced weights differ from 1 and move the solution."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import mergeqp  # noqa: E402
from mergeqp.config import load_config, parse_config  # noqa: E402
from mergeqp.errors import ConfigError, ValidationError  # noqa: E402
from mergeqp.run.pipeline import run_merge  # noqa: E402
from mergeqp.run.tasks import TaskData, balanced  # noqa: E402

NOTE = re.compile(r"(\w+) (\d+) positions -> weight")


@pytest.fixture(scope="module")
def llama(tiny_hf, tmp_path_factory):
    return tiny_hf.make_family(tmp_path_factory.mktemp("balance") / "llama", "llama", K=2, scale=0.3, n_prompts=10)


def _uneven_prompts(llama, tmp_path):
    """Task 0 keeps its prompts; task 1 gets prompts of two or three words."""
    short = tmp_path / "short.txt"
    words = [w for line in llama.prompts[1].read_text().splitlines() for w in line.split()]
    short.write_text("\n".join(" ".join(words[i:i + 2 + i % 2]) for i in range(0, 30, 3)) + "\n")
    return [llama.prompts[0], short]


def _run(tiny_hf, llama, tmp_path, name, balance, weights=(1.0, 1.0), metric="euclidean"):
    prompts = _uneven_prompts(llama, tmp_path)
    models = [{"name": t, "path": str(ft), "calibration": str(p), "weight": w}
              for t, ft, p, w in zip(llama.tasks, llama.finetuned, prompts, weights)]
    method = {"name": "qp", "mode": "single", "parametrisation": "rows", "constraints": ["box:0,1"]}
    cfg = load_config(llama.write_config(
        tmp_path / f"{name}.yml", [tiny_hf.MLP_LAYER["llama"]], method, models=models,
        calibration={"max_length": 12, "batch_size": 4, "holdout": 4, "balance": balance},
        output={"metric": metric}))
    run_merge(cfg, tmp_path / name, progress=False)
    return json.loads((tmp_path / name / "report.json").read_text())


@pytest.mark.parametrize("metric", ["euclidean", "cross_entropy"])
def test_balanced_run_equals_the_hand_weighted_one(tiny_hf, llama, tmp_path, metric):
    bal = _run(tiny_hf, llama, tmp_path, "bal", "tokens", metric=metric)
    (note,) = [n for n in bal["notes"] if n.startswith("calibration.balance tokens")]
    counts = {name: int(c) for name, c in NOTE.findall(note)}
    assert set(counts) == set(llama.tasks)
    c = np.array([counts[t] for t in llama.tasks], dtype=float)
    assert c[0] > 1.5 * c[1]  # the short prompts have far fewer positions
    weights = tuple(float(w) for w in c.mean() / c)
    hand = _run(tiny_hf, llama, tmp_path, "hand", "none", weights=weights, metric=metric)
    plain = _run(tiny_hf, llama, tmp_path, "plain", "none", metric=metric)
    (rb,), (rh,), (rp,) = bal["layers"], hand["layers"], plain["layers"]
    assert rp["objective_before"] != pytest.approx(rb["objective_before"], rel=1e-6)  # another objective
    assert rb["objective_after"] == pytest.approx(rh["objective_after"], rel=1e-9)
    assert rb["objective_before"] == pytest.approx(rh["objective_before"], rel=1e-9)
    key = f"{tiny_hf.MLP_LAYER['llama']}.weight"
    W = {name: mergeqp.open_checkpoint(tmp_path / name).get(key).double() for name in ("bal", "hand", "plain")}
    assert torch.allclose(W["bal"], W["hand"], atol=1e-7)
    assert not torch.allclose(W["bal"], W["plain"], atol=1e-5)  # the weights matter here
    assert not any(n.startswith("calibration.balance") for n in plain["notes"])


def test_balanced_weights_and_errors():
    tasks = [TaskData("a", 2.0, [], []), TaskData("b", 1.0, [], [])]
    out = balanced(tasks, [300, 100])
    assert [t.weight for t in out] == pytest.approx([2.0 * 200 / 300, 1.0 * 200 / 100])
    with pytest.raises(ValidationError, match="no compared position"):
        balanced(tasks, [10, 0])
    with pytest.raises(ConfigError, match="balance"):
        parse_config({"base": "b", "models": [{"path": "m"}], "layers": ["x"],
                      "calibration": {"balance": "words"}})


def test_a_task_without_compared_positions_is_named(tiny_hf, llama, tmp_path):
    """(stop 53 review) Prompts of one token compare no next token under cross_entropy: with one such
    task the run said nothing (the task added nothing), with all of them it fitted J = 0 -> 0 and
    wrote the soup. Now a note names the task, and with every task empty the run is refused."""
    one = tmp_path / "one.txt"
    one.write_text("\n".join(["a"] * 10) + "\n")
    method = {"name": "qp", "mode": "single", "parametrisation": "rows", "constraints": ["box:0,1"]}

    def config(name, prompts):
        models = [{"name": t, "path": str(ft), "calibration": str(p)}
                  for t, ft, p in zip(llama.tasks, llama.finetuned, prompts)]
        return load_config(llama.write_config(
            tmp_path / f"{name}.yml", [tiny_hf.MLP_LAYER["llama"]], method, models=models,
            calibration={"max_length": 12, "batch_size": 4, "holdout": 4}, output={"metric": "cross_entropy"}))

    res = run_merge(config("some", [llama.prompts[0], one]), tmp_path / "some", progress=False)
    (note,) = [n for n in res.report["notes"] if "no compared position" in n]
    assert repr(llama.tasks[1]) in note and llama.tasks[0] not in note
    with pytest.raises(ValidationError, match="no task has a compared position"):
        run_merge(config("none", [one, one]), tmp_path / "none", progress=False)
