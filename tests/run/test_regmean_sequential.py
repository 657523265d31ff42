"""``method: {name: regmean_sequential}``: RegMean with each layer's Gram matrices at the merged model.

References: an independent implementation in the test (full forward passes of the merged model,
one layer at a time in the order the model calls them, RegMean's closed form in float64) on tiny
Llama and GPT-2 blocks (Conv1D, biases, fine-tuned layer norms averaged first); with one
fine-tuned layer the run layer's own RegMean; as a ``start: auto`` candidate; a layer the model
calls twice is refused. Tiny random models built offline.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from mergeqp.config import load_config  # noqa: E402
from mergeqp.errors import ValidationError  # noqa: E402
from mergeqp.io.calibration import load_tokenizer, read_prompts, split_holdout  # noqa: E402
from mergeqp.io.checkpoint import open_checkpoint  # noqa: E402
from mergeqp.merge.sites import model_sites  # noqa: E402
from mergeqp.run.pipeline import run_merge  # noqa: E402
from mergeqp.run.regmean_sequential_method import Stage, stage_grams, stages_of  # noqa: E402


def _merge(fam, tmp_path, layers, method, name, **extra):
    cfg = load_config(fam.write_config(tmp_path / f"{name}.yml", layers, method, **extra))
    return run_merge(cfg, tmp_path / f"out_{name}", progress=False)


def _load(fam, folder):
    return fam.auto_class.from_pretrained(str(folder), dtype=torch.float64, attn_implementation="eager").eval()


def _calibration_ids(fam):
    """Each task's calibration prompts as the run layer takes them (the last 4 held out, seeded per
    model), one token tensor per prompt (no padding)."""
    tok = load_tokenizer(fam.base)
    out = []
    for k, path in enumerate(fam.prompts):
        calib, _ = split_holdout(read_prompts(path), 4, 0 + k)
        out.append([tok([p], truncation=True, max_length=12, return_tensors="pt")["input_ids"] for p in calib])
    return out


def _reference(fam, pattern, alpha):
    """The sequential RegMean merge of the layers matching ``pattern``, computed independently: every
    other fine-tuned tensor averaged; then each linear layer in the order of its first call, its input
    Gram per task taken by full forward passes of the model merged so far, ``W = (sum W_k G_k)(sum
    G_k)^-1`` with ``G_k`` shrunk by ``alpha`` (weights and biases augmented, Conv1D transposed). The
    model runs in float64 with the merged tensors rounded to the checkpoints' float32, as written."""
    import fnmatch

    model = _load(fam, fam.base)
    fts = [open_checkpoint(f) for f in fam.finetuned]
    ids = _calibration_ids(fam)
    sites = [s for s in model_sites(model) if fnmatch.fnmatchcase(s.name, pattern)]
    site_keys = {k for s in sites for k in s.keys}
    params = dict(model.named_parameters())
    merged = {}
    with torch.no_grad():
        for name, p in params.items():
            module = name.rsplit(".", 1)[0]
            if fnmatch.fnmatchcase(module, pattern) and name not in site_keys:
                merged[name] = sum(ft.get(name).to(torch.float64) for ft in fts) / len(fts)
                p.copy_(merged[name].to(torch.float32))  # (the merge's tensors run as they are written)
    order = []
    handles = [model.get_submodule(s.name).register_forward_pre_hook(
        lambda mod, args, n=s.name: order.append(n) if n not in order else None) for s in sites]
    with torch.no_grad():
        model(input_ids=ids[0][0])
    for h in handles:
        h.remove()
    by_name = {s.name: s for s in sites}
    for name in order:
        s = by_name[name]
        grams = []
        for task in ids:
            rows = []
            h = model.get_submodule(name).register_forward_pre_hook(
                lambda mod, args: rows.append(args[0].reshape(-1, args[0].shape[-1]).to(torch.float64)))
            with torch.no_grad():
                for x in task:
                    model(input_ids=x)
            h.remove()
            X = torch.cat(rows)
            if s.has_bias:
                X = torch.cat([X, X.new_ones(X.shape[0], 1)], dim=1)
            G = X.T @ X / X.shape[0]
            grams.append(alpha * G + (1 - alpha) * torch.diag(torch.diagonal(G)))
        Ws = []
        for ft in fts:
            W = ft.get(s.weight_key).to(torch.float64)
            W = W.T if s.kind == "conv1d" else W
            if s.has_bias:
                W = torch.cat([W, ft.get(s.bias_key).to(torch.float64).reshape(-1, 1)], dim=1)
            Ws.append(W)
        A = sum(grams)
        B = sum(W @ G for W, G in zip(Ws, grams))
        sol = torch.linalg.solve(A, B.T).T
        weight = sol[:, : s.m]
        merged[s.weight_key] = weight.T if s.kind == "conv1d" else weight
        if s.has_bias:
            merged[s.bias_key] = sol[:, s.m]
        with torch.no_grad():
            for k in s.keys:
                params[k].copy_(merged[k].to(torch.float32))
    return merged, order


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_equals_an_independent_sequential_regmean(tiny_hf, tmp_path, arch):
    """A whole fine-tuned block (attention and MLP projections, and GPT-2's biases and layer norms): the
    written merge equals the test's own sequential RegMean to the rounding of its float32 tensors, and differs from plain
    RegMean, whose Grams come from each fine-tune's own inputs; the stages follow the model's calls."""
    fam = tiny_hf.make_family(tmp_path / arch, arch, K=2, scale=0.3, n_prompts=10)
    pattern = tiny_hf.BLOCK_PATTERN[arch]
    result = _merge(fam, tmp_path, [pattern], {"name": "regmean_sequential", "params": {"alpha": 0.5}}, "seq")
    expected, order = _reference(fam, pattern, 0.5)
    got = open_checkpoint(result.out_dir)
    for key, value in expected.items():  # (computed in float64, written in the checkpoints' float32)
        assert got.get(key).dtype == torch.float32
        torch.testing.assert_close(got.get(key).to(torch.float64), value, rtol=2e-7, atol=1e-9)
    stages = result.report["regmean_sequential_stages"]
    assert [n for st in stages for n in st["layers"]] == order
    if arch == "llama":  # query, key and value read one tensor, so do the gate and up projections
        assert [len(st["layers"]) for st in stages] == [3, 1, 2, 1]
    plain = _merge(fam, tmp_path, [pattern], {"name": "regmean", "params": {"alpha": 0.5}}, "plain")
    last = order[-1] + ".weight"
    assert not torch.allclose(open_checkpoint(plain.out_dir).get(last).to(torch.float64), expected[last], atol=1e-6)
    ev = result.report["evaluation"]
    assert ev["merged"]["method"] == "regmean_sequential" and set(ev["merged"]["heldout_mse"]) == set(fam.tasks)
    assert "## Sequential RegMean stages" in (result.out_dir / "report.md").read_text()


def test_one_fine_tuned_layer_is_regmean(tiny_hf, tmp_path):
    """When no merged layer feeds another (one fine-tuned layer), the merged model gives the layer the
    fine-tunes' own inputs: the result is the run layer's RegMean."""
    fam = tiny_hf.make_family(tmp_path / "one", "llama", K=2, perturbed=("model.layers.1.mlp.down_proj",), scale=0.3,
                              n_prompts=10)
    layer = "model.layers.1.mlp.down_proj"
    seq = _merge(fam, tmp_path, [layer], {"name": "regmean_sequential", "params": {"alpha": 0.3}}, "seq")
    plain = _merge(fam, tmp_path, [layer], {"name": "regmean", "params": {"alpha": 0.3}}, "plain")
    a = open_checkpoint(seq.out_dir).get(f"{layer}.weight").to(torch.float64)
    b = open_checkpoint(plain.out_dir).get(f"{layer}.weight").to(torch.float64)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_start_auto_candidate(tiny_hf, tmp_path):
    """As a candidate of ``start: auto`` it is fitted per fold and scored like RegMean; with one
    fine-tuned layer both score the same and the tie keeps the first listed."""
    fam = tiny_hf.make_family(tmp_path / "one", "llama", K=2, perturbed=("model.layers.1.mlp.down_proj",), scale=0.3,
                              n_prompts=10)
    layer = "model.layers.1.mlp.down_proj"
    method = {"name": "qp", "mode": "trust_region", "parametrisation": "rows", "mode_options": {"max_steps": 1},
              "start": {"name": "auto", "params": {"folds": 2, "candidates": [
                  {"name": "regmean", "params": {"alpha": 0.5}},
                  {"name": "regmean_sequential", "params": {"alpha": 0.5}}]}}}
    result = _merge(fam, tmp_path, [layer], method, "auto", calibration={"max_length": 12, "batch_size": 2,
                                                                             "holdout": 4})
    sel = result.report["start_selection"]
    scores = {c["label"]: c["validation"] for c in sel["candidates"]}
    assert scores["regmean(alpha=0.5)"] == pytest.approx(scores["regmean_sequential(alpha=0.5)"], rel=1e-9)
    assert sel["chosen"] == "regmean(alpha=0.5)"


def test_a_layer_called_twice_is_refused():
    """A module the model calls twice per pass (weights shared across depth) has inputs that depend on
    its own merge: refused, naming it; the early-stopped Grams equal a full pass's."""
    lin, head = torch.nn.Linear(4, 4).double(), torch.nn.Linear(4, 2).double()

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.head = lin, head

        def forward(self, x):
            return self.head(torch.tanh(self.lin(torch.tanh(self.lin(x)))))

    model = Twice()
    sites = [s for s in model_sites(model) if s.name == "lin"]
    inputs = [[{"x": torch.randn(5, 4, dtype=torch.float64)}]]
    with pytest.raises(ValidationError, match="layer 'lin' runs 2 times per forward pass"):
        stages_of(model, sites, inputs)
    head_site = [s for s in model_sites(model) if s.name == "head"]
    (stage,) = stages_of(model, head_site, inputs)
    assert stage == Stage(tuple(head_site))
    x = inputs[0][0]["x"]
    X = torch.tanh(lin(torch.tanh(lin(x)))).detach()
    X1 = torch.cat([X, X.new_ones(5, 1)], dim=1)
    grams = stage_grams(model, stage, inputs[0], "test")
    torch.testing.assert_close(grams["head"], X1.T @ X1 / 5)
    assert float(grams["head#rows"]) == 5


def test_max_stages_refuses_the_merge_and_skips_the_candidate(tiny_hf, tmp_path):
    """A Llama block has four stages: ``max_stages: 2`` refuses the merge before any stage is merged, and
    a ``start: auto`` candidate with it is skipped with that reason while the others go on."""
    fam = tiny_hf.make_family(tmp_path / "block", "llama", K=2, scale=0.3, n_prompts=10)
    pattern = tiny_hf.BLOCK_PATTERN["llama"]
    with pytest.raises(ValidationError, match="its 4 stages .* exceed max_stages 2"):
        _merge(fam, tmp_path, [pattern], {"name": "regmean_sequential", "params": {"max_stages": 2}}, "refused")
    assert not (tmp_path / "out_refused").exists()
    method = {"name": "qp", "mode": "trust_region", "parametrisation": "rows", "mode_options": {"max_steps": 1},
              "start": {"name": "auto", "params": {"folds": 2, "candidates": [
                  "soup", {"name": "regmean_sequential", "params": {"alpha": 0.5, "max_stages": 2}}]}}}
    result = _merge(fam, tmp_path, ["model.layers.1.mlp.down_proj"], method, "auto",
                    calibration={"max_length": 12, "batch_size": 2, "holdout": 4})
    sel = result.report["start_selection"]
    skipped = {c["label"]: c.get("skipped") for c in sel["candidates"]}
    assert sel["chosen"] == "soup"
    assert "exceed max_stages 2" in skipped["regmean_sequential(alpha=0.5, max_stages=2)"]


def test_evaluate_false_skips_the_evaluation(tiny_hf, tmp_path):
    """``evaluate: false`` (no held-out prompts): the merge is written without an evaluation, as a baseline's."""
    fam = tiny_hf.make_family(tmp_path / "one", "llama", K=2, perturbed=("model.layers.1.mlp.down_proj",), scale=0.3,
                              n_prompts=10)
    layer = "model.layers.1.mlp.down_proj"
    quiet = _merge(fam, tmp_path, [layer], {"name": "regmean_sequential"}, "quiet", evaluate=False,
                   calibration={"max_length": 12, "batch_size": 4, "holdout": 0})
    loud = _merge(fam, tmp_path, [layer], {"name": "regmean_sequential"}, "loud")
    assert "evaluation" not in quiet.report and "evaluation" in loud.report
    assert quiet.report["regmean_sequential_stages"][0]["layers"] == [layer]
