"""Each fine-tuned model that :func:`prepare_tasks` loads is freed before the next one loads:
by reference counting (no full garbage collection, which cost ~0.3 s per model in a large
process), and by a collection when a reference cycle keeps it alive."""

from __future__ import annotations

import gc
import weakref

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import mergeqp.run.models as models  # noqa: E402
from mergeqp.config import load_config  # noqa: E402
from mergeqp.run.pipeline import run_merge  # noqa: E402


@pytest.fixture(scope="module")
def fam(tiny_hf, tmp_path_factory):
    return tiny_hf.make_family(tmp_path_factory.mktemp("release") / "llama", "llama", K=2, n_prompts=10)


@pytest.mark.parametrize("cycle", [False, True])
@pytest.mark.parametrize("method", [{"name": "qp", "mode": "single"}, {"name": "regmean"}])
def test_models_are_freed_before_the_next_loads(tiny_hf, fam, tmp_path, monkeypatch, cycle, method):
    loaded: list[weakref.ref] = []
    real_load = models.load_model

    def load(ck, *args, **kw):
        assert all(r() is None for r in loaded[1:]), "a fine-tuned model outlived its turn"
        model = real_load(ck, *args, **kw)
        if cycle:
            model.__dict__["_cycle"] = model  # a reference cycle: only the collector frees it
        loaded.append(weakref.ref(model))
        return model

    collections: list[int] = []
    real_collect = gc.collect
    monkeypatch.setattr(models, "load_model", load)
    monkeypatch.setattr(gc, "collect", lambda *a: collections.append(1) or real_collect(*a))
    cfg = load_config(fam.write_config(tmp_path / "c.yml", [tiny_hf.MLP_LAYER["llama"]], method))
    run_merge(cfg, tmp_path / "out", progress=False)
    n_ft = len(fam.finetuned)
    assert len(loaded) >= n_ft
    # a QP run also loads the base first, as the stand-in fine-tune of its early design check, and frees it
    freed = n_ft + (1 if method["name"] == "qp" else 0)
    assert len(collections) == (freed if cycle else 0)
