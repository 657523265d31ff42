"""A registered (non-``transformers``) architecture merged by the run layer, and what it makes
checkable against the MNIST experiment's own code on a small ReLU MLP (nonlinear, so the
linearisation is not exact):

- ``mergeqp.register_architecture``: a ``PreTrainedModel`` subclass of the user's is loaded,
  merged and written like a library model; an unknown class is an error naming the registry;
- the damped ``output_space`` (``steps > 1``) equals the experiment's Levenberg-Marquardt
  implementation (:func:`mergeqp.experiments.output_space.output_space_merge`) and is never
  worse than its reference;
- ``method: auto`` with a start fitted to calibration data, or such a start written out (``start:
  regmean``): the trust region's early stopping
  starts from that start fitted without its held-out batches (its held-out objective equals
  RegMean fitted on the other batches, computed by the experiment's own RegMean), and the
  result is never worse than the start fitted on every batch.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from mergeqp.errors import ConfigError
from mergeqp.experiments.hf_mlp import MlpForClassification, save_mlp
from mergeqp.experiments.mnist import MnistConfig, _regmean_model
from mergeqp.experiments.mnist_auto import auto_merge
from mergeqp.experiments.models import MLP
from mergeqp.experiments.output_space import OutputSpaceConfig, output_space_merge
from mergeqp.experiments.trust_region import calibration_error, calibration_targets
from mergeqp.merge.report import render_markdown
from mergeqp.run.model_methods import get_model_method
from mergeqp.run.architectures import ARCHITECTURES, architecture_class, register_architecture

N_PER_TASK = 16


@pytest.fixture(scope="module")
def mlps():
    """A float64 ReLU MLP 12-10-8-3, three fine-tunes that perturb ``layer2``, 16 inputs per task."""
    torch.manual_seed(0)
    base = MLP(d_in=12, h1=10, h2=8, n_classes=3).double().eval()
    fts = []
    for k in range(3):
        m = MLP(d_in=12, h1=10, h2=8, n_classes=3).double().eval()
        m.load_state_dict(base.state_dict())
        with torch.no_grad():
            m.layer2.weight.add_(0.4 * torch.randn_like(m.layer2.weight))
            m.layer2.bias.add_(0.2 * torch.randn_like(m.layer2.bias))
        fts.append(m)
    gen = torch.Generator().manual_seed(1)
    calib = [torch.randn(N_PER_TASK, 12, generator=gen, dtype=torch.float64) + 0.5 * k for k in range(3)]
    return base, fts, calib


def test_registered_architecture_loads_and_unknown_is_named(tmp_path, mlps):
    base, _, _ = mlps
    assert ARCHITECTURES["MlpForClassification"] is MlpForClassification
    folder = save_mlp(base, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    assert architecture_class(config, str(folder)) is MlpForClassification
    with pytest.raises(ConfigError, match="'NoSuchNet' is not known to transformers .* registered with mergeqp.register_architecture; registered: "):
        architecture_class({"architectures": ["NoSuchNet"]}, "somewhere")
    with pytest.raises(Exception, match="not a model class"):
        register_architecture(object)


def test_soup_of_a_registered_architecture(mlps):
    """The soup through the run layer equals the mean of the fine-tunes' weights."""
    base, fts, calib = mlps
    names = ["a", "b", "c"]
    res = auto_merge(base, fts, names, calib, ["layer2"], method={"name": "soup"}, batch_size=4)
    sd = res.model.state_dict()
    for key in ("layer2.weight", "layer2.bias"):
        torch.testing.assert_close(sd[key], torch.stack([m.state_dict()[key] for m in fts]).mean(0),
                                   rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sd["layer1.weight"], base.state_dict()["layer1.weight"], rtol=0, atol=0)


def test_damped_output_space_equals_the_experiments_levenberg_marquardt(mlps):
    base, fts, calib = mlps
    names = ["a", "b", "c"]
    reference = _regmean_model(MnistConfig(regmean_alpha=0.9), base, fts, calib)  # (the run layer's default alpha)
    expected = output_space_merge(reference, fts, "layer2", calib, OutputSpaceConfig(ridge=0.1, steps=8))
    assert sum(s.accepted for s in expected.steps) >= 2  # the damped steps do something here
    res = auto_merge(base, fts, names, calib, ["layer2"], batch_size=4,
                     method={"name": "output_space", "params": {"ridge": 0.1, "steps": 8, "alpha": 0.9}})
    layer = res.report["output_space_layers"][0]
    targets = calibration_targets(fts, calib)
    got = calibration_error(res.model, calib, targets)
    assert got == pytest.approx(expected.error, rel=1e-8)
    assert layer["objective_before"] == pytest.approx(expected.start_error, rel=1e-9)
    assert layer["calibration_after"] == pytest.approx(got, rel=1e-9) and got <= expected.start_error
    assert layer["accepted_steps"] == sum(s.accepted for s in expected.steps)
    torch.testing.assert_close(res.model.layer2.weight, expected.model.layer2.weight, rtol=1e-6, atol=1e-8)
    sections = get_model_method("output_space").report_markdown(res.report)
    assert f"| {layer['accepted_steps']} of {len(layer['steps'])} damped |" in render_markdown(res.report,
                                                                                           method_sections=sections)


def test_damped_output_space_refuses_a_radius(mlps):
    base, fts, calib = mlps
    with pytest.raises(ConfigError, match="'radius' bounds one solve"):
        auto_merge(base, fts, ["a", "b", "c"], calib, ["layer2"], batch_size=4,
                   method={"name": "output_space", "params": {"steps": 3, "radius": 1.0}})


@pytest.mark.parametrize("chosen", [True, False], ids=["auto", "explicit"])
def test_early_stopping_holds_its_batches_out_of_a_fitted_start(mlps, chosen):
    """RegMean as the start, chosen by ``auto`` (the only candidate) or written out (``start:
    regmean``, since stop 54: before, early stopping scored RegMean fitted on all 16 inputs, the
    held-out batch included; a review found the held-out objective at the start equal to the full
    fit's): the trust region's held-out objective at its start is RegMean fitted on each task's
    first 12 inputs, scored on the last 4 (the held-out batch); the result is never worse than
    RegMean fitted on all 16."""
    base, fts, calib = mlps
    regmean = {"name": "regmean", "params": {"alpha": 0.9}}
    method = ({"name": "auto", "params": {"folds": 2, "candidates": [regmean]}} if chosen else
              {"name": "qp", "mode": "trust_region", "start": regmean, "mode_options": {"holdout": 0.25, "refit": True}})
    res = auto_merge(base, fts, ["a", "b", "c"], calib, ["layer2"], method=method, batch_size=4)
    held = res.report["trust_region"]["holdout"]
    fit, out = [x[:12] for x in calib], [x[12:] for x in calib]
    clean = _regmean_model(MnistConfig(regmean_alpha=0.9), base, fts, fit)
    assert held["validation_start"] == pytest.approx(calibration_error(clean, out, calibration_targets(fts, out)),
                                                     rel=1e-9)
    full = _regmean_model(MnistConfig(regmean_alpha=0.9), base, fts, calib)
    full_error = calibration_error(full, calib, calibration_targets(fts, calib))
    leaked = calibration_error(full, out, calibration_targets(fts, out))
    assert abs(held["validation_start"] - leaked) > 1e-6 * leaked  # not the full fit's
    assert res.start_objective == pytest.approx(full_error, rel=1e-9)
    assert res.objective <= full_error * (1 + 1e-9)
    assert any("held-out batches" in n and "regmean" in n for n in res.report["notes"])
