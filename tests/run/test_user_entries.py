"""User registry entries beyond the documented example, registered from a user's own code and
used from YAML by ``mergeqp.run_merge``: a constraint spelling that reads the layer
(``needs_layer=True``), a basis, and a merge method with calibration statistics (as a baseline
and as the hybrid start); the report names the certificate's bound."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import mergeqp
from mergeqp.config import load_config
from mergeqp.constraints import CONSTRAINT_SETS, LAYER_CONSTRAINTS, Box
from mergeqp.errors import ConfigError
from mergeqp.merge.registry import MERGE_METHODS
from mergeqp.stats.bases import BASES
from mergeqp.stats.basis import Basis

SEEN: list[tuple[tuple[int, ...], str]] = []


def _layer_cap(args, spec, context):
    """``layercap:C``: [0, C], recording the layer data the parser was given."""
    SEEN.append((tuple(np.shape(context["deltas"])), context["parametrisation"]))
    return Box(0.0, float(args[0]) if args else 0.7)


def _leading_rows(stats, p, *, seed=0, task_weights=None):
    return Basis(np.eye(stats.r)[:, :p], name="leading_rows")


@pytest.fixture(scope="module", autouse=True)
def registered():
    mergeqp.register_constraint("layercap", _layer_cap, needs_layer=True)
    mergeqp.register_merge_method(dataclasses.replace(MERGE_METHODS["regmean"], name="my_regmean"))
    mergeqp.register_basis("leading_rows", _leading_rows, checkpoint_source="deltas")
    yield
    CONSTRAINT_SETS.pop("layercap")
    LAYER_CONSTRAINTS.discard("layercap")
    MERGE_METHODS.pop("my_regmean")
    BASES.pop("leading_rows")


def _run(tiny_hf, tmp_path, arch, method):
    fam = tiny_hf.make_family(tmp_path / "fam", arch, K=2, scale=0.3, n_prompts=10)
    cfg = load_config(fam.write_config(tmp_path / "c.yml", [tiny_hf.MLP_LAYER[arch]], method))
    mergeqp.run_merge(cfg, tmp_path / "out", progress=False)
    return json.loads((tmp_path / "out" / "report.json").read_text())


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_a_layer_constraint_from_yaml_is_built_per_layer(tiny_hf, tmp_path, arch):
    SEEN.clear()
    report = _run(tiny_hf, tmp_path, arch, {"name": "qp", "mode": "single", "constraints": ["layercap:0.6"]})
    (layer,) = report["layers"]
    assert layer["certificate"]["certified"] is True
    assert layer["certificate"]["bound_method"] == "exact (closed form)"
    assert 0.0 <= layer["coefficients"]["min"] and layer["coefficients"]["max"] <= 0.6 + 1e-9
    r = next(s["out_features"] for s in report["plan"]["layers"])
    shape, parametrisation = SEEN[-1]  # the last parse is the solve's, with the layer's own deltas
    assert len(shape) == 3 and shape[:2] == (2, r) and parametrisation == "rows"


def test_a_layer_constraint_is_refused_in_a_mode_spanning_layers(tiny_hf, tmp_path):
    with pytest.raises(ConfigError, match="'layercap' is per layer and cannot be used with mode: joint"):
        _run(tiny_hf, tmp_path, "llama", {"name": "qp", "mode": "joint", "constraints": ["layercap:0.6"]})


def test_a_user_basis_from_yaml_is_merged_and_certified(tiny_hf, tmp_path):
    report = _run(tiny_hf, tmp_path, "gpt2", {"name": "qp", "mode": "sequential", "parametrisation": "basis",
                                             "basis": "leading_rows", "rank": 2})
    (layer,) = report["layers"]
    assert layer["certificate"]["certified"] is True and layer["n_variables"] == 2 * 2


@pytest.mark.parametrize("method", [{"name": "my_regmean"}, {"name": "qp", "mode": "hybrid", "start": {"name": "my_regmean"}}],
                         ids=["baseline", "hybrid-start"])
def test_a_user_method_with_calibration_statistics_from_yaml(tiny_hf, tmp_path, method):
    report = _run(tiny_hf, tmp_path, "llama", method)
    if method["name"] == "my_regmean":
        assert report["baseline"]["method"] == "my_regmean"
    else:
        assert all(r["certificate"]["certified"] is True for r in report["layers"])


def test_a_layer_constraint_is_checked_with_the_configured_parametrisation(tiny_hf, tmp_path):
    """``sign`` builds its rows per parametrisation (rows, columns, scalar): with another one the
    plan refuses it, before any statistics are collected."""
    with pytest.raises(ConfigError, match=r"method.constraints: sign consensus is defined for parametrisations whose "
                                          r"atoms each scale their own parameters .*'basis' gives no such map"):
        _run(tiny_hf, tmp_path, "llama", {"name": "qp", "mode": "single", "parametrisation": "basis",
                                          "rank": 2, "constraints": ["sign"]})
