"""A parametrisation reads more of a layer than its residuals without edits elsewhere: a checkpoint merge
hands ``for_site`` the layer's :class:`~mergeqp.stats.parametrisation.SiteInputs` (its base weight and
the live model's weight at the layer when the atoms are built), each compared here with the
checkpoints: the base's in ``single`` mode, the soup's when a trust region starts from the soup, also
when called after the merge."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from mergeqp.config import load_config  # noqa: E402
from mergeqp.io.checkpoint import open_checkpoint  # noqa: E402
from mergeqp.run.pipeline import run_merge  # noqa: E402
from mergeqp.stats.parametrisation import (  # noqa: E402
    PARAMETRISATIONS,
    RowsParametrisation,
    SiteInputs,
    register_parametrisation,
)

SEEN: list[dict] = []


class RowsReadingTheLayer(RowsParametrisation):
    """The rows parametrisation, recording what ``for_site`` could read of each layer."""

    name = "test_rows_reading_the_layer"

    def for_site(self, site, deltas, options, *, seed=0, output_stats=None):
        inputs = options["site_inputs"]
        assert isinstance(inputs, SiteInputs)
        # kept and called only after the merge, when the model holds the merged layer (stop 59 review:
        # a late first call read the final merge, not the weight at the build)
        SEEN.append({"site": site.name, "deltas": torch.as_tensor(deltas).clone(), "inputs": inputs})
        return self


@pytest.fixture(scope="module")
def registered():
    register_parametrisation(RowsReadingTheLayer())
    yield
    PARAMETRISATIONS.pop(RowsReadingTheLayer.name, None)


@pytest.fixture(scope="module")
def llama(tiny_hf, tmp_path_factory):
    return tiny_hf.make_family(tmp_path_factory.mktemp("inputs") / "llama", "llama", K=2,
                               perturbed=(tiny_hf.BLOCK_PATTERN["llama"],), scale=0.3, n_prompts=10)


def _augmented(folder, name):
    ck = open_checkpoint(folder)
    return ck.get(f"{name}.weight").to(torch.float64)  # (Llama's MLP layers have no bias)


@pytest.mark.parametrize("method, start", [({"mode": "single"}, "base"),
                                           ({"mode": "trust_region", "start": "soup",
                                             "mode_options": {"max_steps": 1}}, "soup")])
def test_for_site_reads_the_layers_base_and_current_weight(tiny_hf, llama, tmp_path, registered, method, start):
    SEEN.clear()
    layer = tiny_hf.MLP_LAYER["llama"]
    cfg = load_config(llama.write_config(tmp_path / "c.yml", layer,
                                         {"name": "qp", "parametrisation": RowsReadingTheLayer.name, **method}))
    rep = run_merge(cfg, tmp_path / "out", progress=False).report
    assert all(r["certificate"]["certified"] for r in rep["layers"])
    first = SEEN[0]
    inputs = first["inputs"]
    assert inputs.base_weight() is inputs.base_weight()  # read once, then kept
    first["base"], first["current"] = inputs.base_weight(), inputs.current_weight()
    base = _augmented(llama.base, first["site"])
    assert torch.equal(first["base"], base)
    fts = [_augmented(f, first["site"]) for f in llama.finetuned]
    assert torch.equal(first["deltas"], torch.stack([w - base for w in fts]))
    expected = base if start == "base" else base + sum(w - base for w in fts) / len(fts)
    assert torch.allclose(first["current"], expected, rtol=1e-6, atol=1e-7)  # (the live model computes in float32)
    if start == "soup":
        assert not torch.allclose(first["current"], base)


def test_a_parametrisation_may_not_declare_an_option_the_merge_fills():
    from mergeqp.errors import ValidationError

    class Clash(RowsParametrisation):
        name = "test_rows_clash"
        config_options = ("site_inputs",)

    with pytest.raises(ValidationError, match=r"config_options \['site_inputs'\] are keys the merge fills"):
        register_parametrisation(Clash())
    assert "test_rows_clash" not in PARAMETRISATIONS
