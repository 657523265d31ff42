"""``parametrisation: rows+baselines`` in a ``mergeqp merge`` config: the baselines' merged residuals
are atoms, every baseline is a feasible point, the report gives each one's linearised objective
beside the optimum (which is never above them), and bad configurations are refused up front."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import mergeqp
from mergeqp.config import load_config, parse_config
from mergeqp.errors import ConfigError
from mergeqp.merge.registry import merge_state_dicts
from mergeqp.run.pipeline import run_merge


@pytest.fixture(scope="module")
def llama(tiny_hf, tmp_path_factory):
    return tiny_hf.make_family(tmp_path_factory.mktemp("baseline_atoms") / "llama", "llama", K=2, scale=0.3,
                               n_prompts=10)


def test_optimum_is_never_above_any_baseline(tiny_hf, llama, tmp_path):
    layer = tiny_hf.MLP_LAYER["llama"]
    method = {"name": "qp", "mode": "single", "parametrisation": "rows+baselines",
              "baselines": ["ties", {"name": "task_arithmetic", "params": {"scaling": 0.5}}],
              "constraints": ["box:0,1"]}
    cfg = load_config(llama.write_config(tmp_path / "cfg.yml", [layer], method))
    run_merge(cfg, tmp_path / "out", progress=False)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    (record,) = report["layers"]
    assert record["certificate"]["certified"] is True
    points = record["objective_at"]
    assert {"baseline:ties", "baseline:task_arithmetic", "zero"} <= set(points)
    tol = 1e-9 * abs(points["zero"])
    assert record["objective_after"] <= min(points["baseline:ties"], points["baseline:task_arithmetic"]) + tol
    assert record["n_variables"] == 2 * (report["plan"]["layers"][0]["out_features"] + 2)
    # (stop 47) the soup is rows 1/K with the baseline atoms 0 (1/K on every atom was the soup plus
    # every baseline's residual: 3087 against the soup's 1530 in the review's run); with K = 2 it is
    # task arithmetic at 0.5, itself an atom here
    assert points["soup"] == pytest.approx(points["baseline:task_arithmetic"], rel=1e-8)


@pytest.mark.parametrize("baseline", ["soup", {"name": "task_arithmetic", "params": {"scaling": 0.7}}],
                         ids=["soup", "task_arithmetic"])
def test_a_baseline_in_the_rows_span_is_certified_without_constraints(tiny_hf, llama, tmp_path, baseline):
    """Stop 74 review: `rows+baselines` with `baselines: [soup]` and `constraints: []` reached the plain
    rows optimum but reported "no finite optimality bound" (exit 1): the soup's atoms are combinations of
    the rows atoms, H is flat along their difference, and the statistics (computed apart; transformers'
    RMSNorm rounds to float32 even in a float64 model) gave g a slope there. Now the tie is exact."""
    layer = tiny_hf.MLP_LAYER["llama"]
    rows = {"name": "qp", "mode": "single", "parametrisation": "rows", "constraints": []}
    both = {**rows, "parametrisation": "rows+baselines", "baselines": [baseline]}
    reports = {}
    for name, method in (("rows", rows), ("both", both)):
        cfg = load_config(llama.write_config(tmp_path / f"{name}.yml", [layer], method))
        run_merge(cfg, tmp_path / name, progress=False)
        reports[name] = json.loads((tmp_path / name / "report.json").read_text())["layers"][0]
    assert reports["both"]["certificate"]["certified"] is True, reports["both"]["certificate"]
    assert reports["both"]["objective_after"] == pytest.approx(reports["rows"]["objective_after"], rel=1e-9)


def test_snap_to_row_span_ties_only_a_residual_in_the_span():
    import numpy as np

    from mergeqp.stats.baseline_atoms import RowsBaselinesParametrisation, snap_to_row_span

    rng = np.random.default_rng(0)
    deltas = rng.standard_normal((3, 5, 7))
    soup = deltas.mean(axis=0) * (1 + 1e-12)
    fit, coef = snap_to_row_span(soup, deltas)
    assert coef is not None and np.allclose(coef, 1 / 3 * (1 + 1e-12)) and np.abs(fit - soup).max() < 1e-14
    ties_like = np.where(np.abs(deltas).argmax(axis=0) == 0, deltas[0], 0.0)  # elementwise: off the span
    assert snap_to_row_span(ties_like, deltas)[1] is None
    param = RowsBaselinesParametrisation({"soup": fit})
    param.tie_to_rows("soup", coef)
    columns = param.atom_combinations(3, 5, 7)
    n = 6
    # the combined atom's column is the rows' columns times coef (the identity's for every other atom)
    expected = np.concatenate([np.append(coef[:, k2], 0.0) for k2 in range(3)])
    assert sorted(columns) == [5, 11, 17] and all(np.array_equal(c, expected) for c in columns.values())
    M = np.eye(18)
    for t, c in columns.items():
        M[:, t] = c
    design = rng.standard_normal((4, 18))  # any design whose soup columns ARE the combination:
    for k in range(3):
        design[:, k * n + 5] = sum(design[:, k2 * n:k2 * n + 5] @ coef[:, k2] for k2 in range(3))
    assert np.allclose(design @ M, design)
    # tie_statistics is M'HM, M'g (two tasks), without forming M
    from mergeqp.stats.parametrisation import tie_statistics

    A = rng.standard_normal((2, 30, 18))
    H, g = np.einsum("tpa,tpb->tab", A, A), rng.standard_normal((2, 18))
    H2, g2 = tie_statistics(H, g, columns)
    np.testing.assert_allclose(H2, M.T @ H @ M, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(g2, g @ M, rtol=1e-12, atol=1e-12)


def test_a_regularised_layer_reports_the_objective_its_certificate_bounds(tiny_hf, llama, tmp_path):
    """Stop 74 review: with `regularisation`, `objective_after` is J without the penalty while the
    certificate bounds J + mu ||d - d_ref||^2, which no field showed; now `objective_after_regularised`."""
    layer = tiny_hf.MLP_LAYER["llama"]
    for mu in (0.0, 5.0):
        method = {"name": "qp", "mode": "single", "parametrisation": "rows", "constraints": ["box:0,1"],
                  "regularisation": mu, "reference": "soup"}
        run_merge(load_config(llama.write_config(tmp_path / f"r{mu}.yml", [layer], method)), tmp_path / f"r{mu}",
                  progress=False)
        (record,) = json.loads((tmp_path / f"r{mu}" / "report.json").read_text())["layers"]
        if mu == 0:
            assert "objective_after_regularised" not in record
        else:
            assert record["objective_after_regularised"] > record["objective_after"]
            assert record["certificate"]["certified"] is True


def test_regularisation_toward_the_soup_is_toward_the_soup(tiny_hf, llama, tmp_path):
    """(stop 47) `regularisation` with `reference: soup` pulled rows+baselines toward 1/K on every
    atom, the soup plus every baseline's residual: with a strong weight the merge came out as soup +
    TIES, worse than the base. Now a strong weight gives the soup itself."""
    from safetensors.torch import load_file

    layer = tiny_hf.MLP_LAYER["llama"]
    method = {"name": "qp", "mode": "sequential", "parametrisation": "rows+baselines", "baselines": ["ties"],
              "constraints": [], "regularisation": 1e8, "reference": "soup"}
    run_merge(load_config(llama.write_config(tmp_path / "cfg.yml", [layer], method)), tmp_path / "out",
              progress=False)
    key = f"{layer}.weight"
    merged = load_file(str(tmp_path / "out" / "model.safetensors"))[key]
    soup = sum(load_file(str(ft / "model.safetensors"))[key] for ft in llama.finetuned) / len(llama.finetuned)
    base = load_file(str(llama.base / "model.safetensors"))[key]
    assert float((merged - soup).abs().max()) <= 1e-4 * float((soup - base).abs().max())


def test_statistics_baseline_atom_is_the_checkpoint_regmean(tiny_hf, llama, tmp_path):
    """RegMean (calibration statistics) as an atom: its merged residual is that of ``method: regmean``
    on the same calibration prompts, the optimum is at or below its point, and the record gives
    the weight the solution put on each baseline."""
    layer = tiny_hf.MLP_LAYER["llama"]
    method = {"name": "qp", "mode": "single", "parametrisation": "rows+baselines",
              "baselines": [{"name": "regmean", "params": {"alpha": 0.9}}, "ties"], "constraints": ["box:0,1"]}
    run_merge(load_config(llama.write_config(tmp_path / "cfg.yml", [layer], method)), tmp_path / "out",
              progress=False)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    (record,) = report["layers"]
    assert record["certificate"]["certified"] is True
    points = record["objective_at"]
    assert record["objective_after"] <= min(points["baseline:regmean"], points["baseline:ties"]) + 1e-9 * points["zero"]
    assert set(record["baselines"]) == {"regmean", "ties"}
    assert any("rows+baselines: the atoms of regmean" in n for n in report["notes"])

    reg = {"name": "regmean", "params": {"alpha": 0.9}}
    run_merge(load_config(llama.write_config(tmp_path / "reg.yml", [layer], reg)), tmp_path / "regmean",
              progress=False)
    key = f"{layer}.weight"
    base = mergeqp.open_checkpoint(llama.base).get(key).double()
    U = mergeqp.open_checkpoint(tmp_path / "regmean").get(key).double() - base
    assert record["baselines"]["regmean"]["residual_norm"] == pytest.approx(float(U.norm()), rel=1e-6)
    assert float(U.norm()) > 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert "Baseline atoms (rows+baselines)" in md


def test_baseline_atom_is_the_checkpoint_baseline(tiny_hf, llama):
    """The TIES atom is exactly the TIES merge of the layer's weight and bias (same code path)."""
    from mergeqp.merge.baseline_residuals import site_baseline_residuals
    from mergeqp.merge.multilayer import WeightSource
    from mergeqp.merge.sites import LayerSite, weight_from_tensors

    base = mergeqp.open_checkpoint(llama.base)
    fts = [mergeqp.open_checkpoint(f) for f in llama.finetuned]
    key = f"{tiny_hf.MLP_LAYER['llama']}.weight"
    r, m = base.get(key).shape
    site = LayerSite(tiny_hf.MLP_LAYER["llama"], "linear", int(r), int(m), False)
    ws = WeightSource(base, fts)
    U = site_baseline_residuals([("ties", {"density": 0.5})], ws.base_weight(site), site,
                                ws.deltas(site).numpy(), ["ties"])["ties"]
    merged = merge_state_dicts("ties", {key: base.get(key)}, [{key: f.get(key)} for f in fts], density=0.5,
                               progress=False)[key]
    expected = weight_from_tensors(site, merged) - ws.base_weight(site)
    assert torch.allclose(torch.from_numpy(U), expected, atol=1e-6)


def test_config_errors():
    base = {"base": "b", "models": [{"path": "x", "calibration": "c"}], "layers": ["l"]}
    with pytest.raises(ConfigError, match="needs 'baselines'"):
        parse_config({**base, "method": {"parametrisation": "rows+baselines"}})
    with pytest.raises(ConfigError, match="did you mean 'alpha'"):
        parse_config({**base, "method": {"parametrisation": "rows+baselines",
                                         "baselines": [{"name": "regmean", "params": {"alpha": 0.5, "alhpa": 1}}]}})
    with pytest.raises(ConfigError, match="cannot be set in a config"):
        parse_config({**base, "method": {"parametrisation": "rows+baselines",
                                         "baselines": [{"name": "fisher", "params": {"fishers": [1]}}]}})
    fitted = parse_config({**base, "method": {"parametrisation": "rows+baselines", "baselines": ["regmean", "ties"]}})
    assert [b.name for b in fitted.method.baselines] == ["regmean", "ties"]
    with pytest.raises(ConfigError, match="apply only to parametrisation: rows\\+baselines"):
        parse_config({**base, "method": {"parametrisation": "rows", "baselines": ["ties"]}})
    with pytest.raises(ConfigError, match="names a baseline twice"):
        parse_config({**base, "method": {"parametrisation": "rows+baselines", "baselines": ["ties", "ties"]}})
    with pytest.raises(ConfigError, match="ties"):
        parse_config({**base, "method": {"parametrisation": "rows+baselines",
                                         "baselines": [{"name": "ties", "params": {"densty": 0.5}}]}})
    cfg = parse_config({**base, "method": {"parametrisation": "rows+baselines", "baselines": "ties"}})
    assert [b.name for b in cfg.method.baselines] == ["ties"]


@pytest.mark.parametrize("mode, seen", [("trust_region", 1), ("single", 2)])
def test_atoms_do_not_see_the_batches_the_trust_region_chooses_on(tiny_hf, llama, tmp_path, monkeypatch, mode, seen):
    """A RegMean atom is fitted without the trust region's held-out batches (its early stopping
    scores them, so they must be unseen by everything fitted for its QPs); a mode that holds out
    nothing fits it on every calibration batch. Each task has 2 batches of 4 prompts here."""
    from mergeqp.merge.calibrated import StatisticsCollector

    seen_batches: list[tuple[str, int]] = []
    real = StatisticsCollector.__call__

    def counting(self, index, model_name, model, batches):
        seen_batches.append((self.name, len(batches)))
        return real(self, index, model_name, model, batches)

    monkeypatch.setattr(StatisticsCollector, "__call__", counting)
    layer = tiny_hf.MLP_LAYER["llama"]
    method = {"name": "qp", "mode": mode, "parametrisation": "rows+baselines",
              "baselines": [{"name": "regmean", "params": {"alpha": 0.9}}], "constraints": ["box:-1,1"]}
    if mode == "trust_region":
        method["mode_options"] = {"holdout": 0.25, "refit": True, "max_steps": 2}
    run_merge(load_config(llama.write_config(tmp_path / "cfg.yml", [layer], method)), tmp_path / "out",
              progress=False)
    assert seen_batches == [("regmean", seen)] * 2  # one call per fine-tune
    notes = json.loads((tmp_path / "out" / "report.json").read_text())["notes"]
    note = next(n for n in notes if n.startswith("rows+baselines: the atoms of regmean"))
    assert ("but the last 0.25 of each task's" in note) == (mode == "trust_region")
