"""The parametrisation / merge method / merge mode example of docs/architecture.md runs as written: a user's parametrisation, baseline
method, constraint set and merge mode, registered from their own code, are used from a YAML
``mergeqp merge`` and from Python; the QP is solved and certified."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


import mergeqp
from mergeqp.cli import main
from mergeqp.config import load_config, parse_config
from mergeqp.constraints import CONSTRAINT_SETS
from mergeqp.errors import ConfigError
from mergeqp.merge.modes import MERGE_MODES
from mergeqp.merge.report import jsonable
from mergeqp.merge.registry import MERGE_METHODS
from mergeqp.stats.parametrisation import PARAMETRISATIONS

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def _example() -> str:
    text = DOC.read_text().split("## Add a parametrisation, a merge method and a merge mode", 1)[1]
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)[0]


@pytest.fixture(scope="module")
def registered():
    """Run the documented example once; unregister its entries afterwards."""
    namespace: dict = {}
    exec(compile(_example(), "docs/architecture.md", "exec"), namespace)  # noqa: S102
    yield namespace
    PARAMETRISATIONS.pop("blocks", None)
    MERGE_METHODS.pop("median_tv", None)
    CONSTRAINT_SETS.pop("cap", None)
    MERGE_MODES.pop("reverse", None)


@pytest.fixture(scope="module")
def fam(tiny_hf, tmp_path_factory):
    return tiny_hf.make_family(tmp_path_factory.mktemp("extending"), "llama", K=2, scale=0.3, n_prompts=10)


def test_the_blocks_rules_agree_with_rows(registered):
    """The example parametrisation's update, tangents and statistics are the row rules summed over blocks."""
    blocks, rows = PARAMETRISATIONS["blocks"], PARAMETRISATIONS["rows"]
    rng = np.random.default_rng(0)
    K, r, m1 = 2, 5, 4
    deltas = rng.standard_normal((K, r, m1))
    d = rng.standard_normal((K, 3))
    d_rows = np.repeat(d, 2, axis=1)[:, :r]
    assert np.allclose(blocks.update(d, deltas), rows.update(d_rows, deltas))
    Z = torch.as_tensor(rng.standard_normal((6, m1)))
    delta = torch.as_tensor(deltas[0])
    t_rows = rows.tangents(Z, delta)
    assert torch.allclose(blocks.tangents(Z, delta)[1], t_rows[2] + t_rows[3])
    gram, G = np.eye(m1), np.eye(r)
    H_rows = rows.shared_hessian(deltas, gram, G)
    P = np.kron(np.eye(K), np.repeat(np.eye(3), 2, axis=1)[:, :r])
    assert np.allclose(blocks.shared_hessian(deltas, gram, G), P @ H_rows @ P.T)


def test_yaml_merge_with_user_entries_is_certified(tiny_hf, registered, fam, tmp_path, capsys):
    layer = tiny_hf.MLP_LAYER["llama"]
    cfg = fam.write_config(tmp_path / "qp.yml", ["model.layers.1.mlp.*"],
                         {"name": "qp", "mode": "reverse", "parametrisation": "blocks", "constraints": ["cap:0.8"]})
    assert main(["merge", str(cfg), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    layers = report["layers"]
    assert [r["layer"] for r in layers][0] == layer  # reverse: down_proj (the last) first
    assert [r["layer"] for r in layers] == [s["name"] for s in report["plan"]["layers"]][::-1]
    for r in layers:
        assert r["mode"] == "reverse"
        assert r["certificate"]["certified"] is True
        assert 0.0 <= r["coefficients"]["min"] and r["coefficients"]["max"] <= 0.8 + 1e-9
        assert r["objective_after"] <= min(r["objective_at"]["zero"], r["objective_at"]["soup"]) + 1e-9
        assert "task_arithmetic" in r["objective_at"]  # blocks contain the task vectors
    groups = report["plan"]["groups"]
    assert groups[0]["sites"] == [layer]
    site_r = {s["name"]: s["out_features"] for s in report["plan"]["layers"]}
    assert [g["n_variables"] for g in groups] == [2 * ((site_r[g["sites"][0]] + 1) // 2) for g in groups]
    assert "certified True" in capsys.readouterr().out


def test_yaml_baseline_with_a_user_method(tiny_hf, registered, fam, tmp_path):
    cfg = fam.write_config(tmp_path / "median.yml", [tiny_hf.MLP_LAYER["llama"]],
                         {"name": "median_tv", "params": {"scaling": 0.5}})
    assert main(["merge", str(cfg), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["baseline"]["method"] == "median_tv" and report["baseline"]["tensors"] == 1
    # K = 2: the median of two task vectors is their mean, so scaling 0.5 is half the task-arithmetic sum
    key = f"{tiny_hf.MLP_LAYER['llama']}.weight"
    merged = mergeqp.open_checkpoint(tmp_path / "out").get(key).to(torch.float64)
    base = mergeqp.open_checkpoint(fam.base).get(key).to(torch.float64)
    fts = [mergeqp.open_checkpoint(f).get(key).to(torch.float64) for f in fam.finetuned]
    expected = base + 0.5 * torch.stack([f - base for f in fts]).median(dim=0).values
    assert torch.allclose(merged, expected.to(merged.dtype))


def test_python_api_with_user_entries(tiny_hf, registered, fam, tmp_path):
    cfg = load_config(fam.write_config(tmp_path / "py.yml", [tiny_hf.MLP_LAYER["llama"]],
                                     {"name": "qp", "mode": "single", "parametrisation": "blocks",
                                      "constraints": ["cap:0.5"]}))
    result = mergeqp.run_merge(cfg, tmp_path / "out", progress=False)
    summary = result.summary
    assert isinstance(summary, mergeqp.MergeReport)
    assert summary.uncertified_layers == []
    (record,) = summary.layers
    assert record.d.shape == (2, (record.n_variables // 2))
    assert np.all(record.d >= -1e-12) and np.all(record.d <= 0.5 + 1e-9)
    written = json.loads((tmp_path / "out" / "report.json").read_text())
    assert json.loads(json.dumps(jsonable(result.report))) == written
    assert written["layers"][0]["n_variables"] == record.n_variables
    # the merged layer is W_base + sum_k sum_b d[k, b] (rows of block b of delta_k)
    site = next(s for s in result.plan.sites)
    from mergeqp.merge.multilayer import WeightSource
    from mergeqp.merge.sites import read_augmented

    ws = WeightSource(result.plan.base, result.plan.finetuned)
    expected = ws.base_weight(site) + torch.as_tensor(
        PARAMETRISATIONS["blocks"].update(record.d, ws.deltas(site).numpy()))
    assert torch.allclose(read_augmented(result.model, site).to(torch.float64), expected, atol=1e-10)


def test_config_lists_registered_names(registered):
    base = {"base": "b", "models": [{"path": "x", "calibration": "c"}], "layers": ["l"]}
    assert parse_config({**base, "method": {"parametrisation": "blocks", "mode": "reverse"}}).method.mode == "reverse"
    with pytest.raises(ConfigError) as info:
        parse_config({**base, "method": {"parametrisation": "blokcs"}})
    assert "did you mean 'blocks'" in str(info.value) and "rows" in str(info.value)
    with pytest.raises(ConfigError, match="apply only to parametrisation: basis"):
        parse_config({**base, "method": {"parametrisation": "blocks", "rank": 2}})


def test_a_user_basis_is_usable_from_a_config():
    """A basis registered with ``checkpoint_source="deltas"`` is a valid ``method.basis`` and the
    ``basis`` parametrisation builds it per layer from the layer's residuals."""
    from types import SimpleNamespace

    from mergeqp.stats.bases import BASES
    from mergeqp.stats.basis import Basis

    def leading_rows(stats, p, *, seed=0, task_weights=None):
        return Basis(np.eye(stats.r)[:, :p], name="leading_rows")

    base = {"base": "b", "models": [{"path": "x", "calibration": "c"}], "layers": ["l"]}
    method = {"parametrisation": "basis", "basis": "leading_rows", "rank": 2}
    with pytest.raises(ConfigError, match="unknown basis 'leading_rows'"):
        parse_config({**base, "method": method})
    mergeqp.register_basis("leading_rows", leading_rows, checkpoint_source="deltas")
    try:
        m = parse_config({**base, "method": method}).method
        site = SimpleNamespace(name="layer", r=4, m1=3)
        param = PARAMETRISATIONS["basis"].for_site(site, np.ones((2, 4, 3)), m.parametrisation_options())
        assert param.basis.name == "leading_rows" and param.n_atoms(4, 3) == 2
        assert np.allclose(param.update(np.ones((2, 2)), np.ones((2, 4, 3))), [[2] * 3] * 2 + [[0] * 3] * 2)
    finally:
        BASES.pop("leading_rows")


def test_a_user_output_jacobian_basis_is_built_by_its_own_builder(tiny_hf, fam, tmp_path):
    """(stop 58, an architecture review's find) A basis registered with
    ``checkpoint_source="output_jacobian"`` got the optimal basis: its builder was never called and the
    report said ``optimal``. Its builder now sees the layer's calibration-mean Jacobian
    (:class:`~mergeqp.merge.outputbasis.JacobianView`); the report names it and gives the optimal
    basis's mean-Jacobian energy beside it, never below it (Corollary 4.2: the optimal basis
    maximises that energy over bases of the same rank)."""
    from mergeqp.stats.bases import BASES, complete_basis
    from mergeqp.stats.basis import Basis

    calls = []

    def jacobian_rows(stats, p, *, seed=0, task_weights=None):
        L = stats.mean_jacobian(task_weights).sum(axis=1)  # (c, r)
        calls.append(L.shape)
        V = np.linalg.svd(L, full_matrices=False)[2].T  # the Jacobian's leading input directions
        return Basis(complete_basis(V[:, : min(p, V.shape[1])], stats.r, p), name="jacobian_rows")

    mergeqp.register_basis("jacobian_rows", jacobian_rows, checkpoint_source="output_jacobian")
    try:
        cfg = load_config(fam.write_config(tmp_path / "jr.yml", [tiny_hf.MLP_LAYER["llama"]],
                                           {"name": "qp", "mode": "single", "parametrisation": "basis",
                                            "basis": "jacobian_rows", "rank": 2}))
        from mergeqp.run.pipeline import run_merge

        res = run_merge(cfg, tmp_path / "jr", progress=False)
    finally:
        BASES.pop("jacobian_rows")
    assert calls
    (layer,) = json.loads((res.out_dir / "report.json").read_text())["layers"]
    basis = layer["basis"]
    assert basis["name"] == "jacobian_rows" and basis["rank"] == 2
    energy = basis["mean_jacobian_energy"]
    assert set(energy) == {"jacobian_rows", "optimal", "svd", "random"}
    assert energy["optimal"] >= energy["jacobian_rows"] - 1e-9
    assert layer["certificate"]["certified"]


def test_the_optimal_builder_through_the_view_is_the_direct_optimal_basis():
    """The optimal builder of `mergeqp.stats.bases`, handed a layer's output statistics through
    `JacobianView` (as a user's output_jacobian builder is), spans what the merge's own optimal basis
    spans (random range coordinates; a rank-deficient Jacobian too)."""
    from mergeqp.merge.outputbasis import JacobianView, OutputBasisStats
    from mergeqp.stats.bases import optimal_basis

    rng = np.random.default_rng(3)
    for rank, r, p in [(4, 7, 3), (2, 6, 4)]:
        L = rng.standard_normal((rank, r))
        G = rng.standard_normal((rank, rank))
        stats = OutputBasisStats("site", L, G @ G.T, float(np.trace(G @ G.T)), c=9, r=r, n_samples=5)
        direct = stats.basis(p).Q
        viewed = optimal_basis(JacobianView(stats), p).Q
        k = min(p, rank)  # beyond range(L) the completion is arbitrary: compare the captured energy too
        np.testing.assert_allclose(viewed[:, :k] @ viewed[:, :k].T, direct[:, :k] @ direct[:, :k].T, atol=1e-10)
        assert stats.energy_fraction(viewed) == pytest.approx(stats.energy_fraction(direct), abs=1e-12)


@pytest.mark.parametrize("bad, match", [("raises", r"failed: RuntimeError: builder exploded"),
                                        ("skewed", r"is not orthonormal"), ("nan", r"contains NaN or inf")])
def test_a_failing_output_jacobian_builder_is_named(tiny_hf, fam, tmp_path, bad, match):
    """(stop 58 review) A user's output_jacobian builder that raised surfaced as "merge mode 'single'
    failed", and a Basis it built that was not orthonormal or finite named neither the builder nor
    the layer: each error now names both."""
    from mergeqp.errors import ValidationError
    from mergeqp.run.pipeline import run_merge
    from mergeqp.stats.bases import BASES

    def broken(stats, p, *, seed=0, task_weights=None):
        if bad == "raises":
            raise RuntimeError("builder exploded")
        from mergeqp.stats.basis import Basis
        Q = np.eye(stats.r)[:, :p] * (2.0 if bad == "skewed" else np.nan)
        return Basis(Q, name="broken")

    mergeqp.register_basis("broken_jacobian", broken, checkpoint_source="output_jacobian")
    try:
        cfg = load_config(fam.write_config(tmp_path / "b.yml", [tiny_hf.MLP_LAYER["llama"]],
                                           {"name": "qp", "mode": "single", "parametrisation": "basis",
                                            "basis": "broken_jacobian", "rank": 2}))
        with pytest.raises(ValidationError, match=r"basis builder 'broken' at layer '[\w.]+'.*" + match):
            run_merge(cfg, tmp_path / "out", progress=False)
    finally:
        BASES.pop("broken_jacobian")
