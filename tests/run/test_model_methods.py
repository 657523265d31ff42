"""Model methods (``mergeqp.run.model_methods``): a ``method:`` that runs on the live models is one
registry entry. A user's method registered from a test is planned, checked, run, written and
reported like the built-in ``output_space``; its bad registrations and failures are named."""

from __future__ import annotations

import dataclasses
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from mergeqp.config import load_config  # noqa: E402
from mergeqp.errors import ConfigError, MergeMethodError  # noqa: E402
from mergeqp.io.checkpoint import open_checkpoint  # noqa: E402
from mergeqp.run.model_method import MethodOutcome, ModelMethod  # noqa: E402
from mergeqp.run.model_methods import MODEL_METHODS, get_model_method, register_model_method  # noqa: E402
from mergeqp.run.plan import build_plan  # noqa: E402
from mergeqp.run.pipeline import run_merge  # noqa: E402
from mergeqp.run.report import Evaluation  # noqa: E402


def _parse(params, where):
    unknown = set(params) - {"scale"}
    if unknown:
        raise ConfigError(f"{where}.params: unknown parameter {sorted(unknown)[0]!r} of 'first_step'")
    return float(params.get("scale", 1.0))


def _run(ctx, scale):
    """The base plus ``scale`` times the first fine-tune's change at every selected site."""
    t = time.perf_counter()
    tasks = ctx.prepare_tasks()
    keys = [k for site in ctx.plan.sites for k in site.keys]
    merged = {k: ctx.plan.base.get(k) + scale * (ctx.plan.finetuned[0].get(k) - ctx.plan.base.get(k)) for k in keys}
    model = ctx.load_base_model()
    base_eval = ctx.evaluate(model, tasks)
    ctx.load(model, merged)
    merged_eval = ctx.evaluate(model, tasks, method="first_step")
    ctx.notes.append("first_step: ran")
    return MethodOutcome(merged, model, {"scale": scale}, time.perf_counter() - t,
                         Evaluation(base=base_eval, merged=merged_eval), {"first_step_keys": keys})


def _sites(sites):
    if len(sites) != 1:
        raise ConfigError("method 'first_step' merges exactly one layer")


FIRST_STEP = ModelMethod(name="first_step", summary="the first fine-tune's change, scaled", parse=_parse, run=_run,
                         describe=lambda scale: [f"first fine-tune's change times {scale:g}"], check_sites=_sites,
                         memory=lambda scale, statistics_bytes: {"first_step scratch": 123})


@pytest.fixture
def registered():
    added = []

    def add(method):
        register_model_method(method)
        added.append(method.name)
        return method

    yield add
    for name in added:
        MODEL_METHODS.pop(name, None)


@pytest.fixture(scope="module")
def llama(tiny_hf, tmp_path_factory):
    return tiny_hf.make_family(tmp_path_factory.mktemp("mm") / "llama", "llama", K=2, scale=0.3, n_prompts=10)


def _config(fam, tmp_path, method, name="cfg", layers=None, **extra):
    return load_config(fam.write_config(tmp_path / f"{name}.yml", layers or [fam.mlp_layer], method, **extra))


def test_users_model_method_is_planned_run_written_and_reported(llama, tmp_path, registered):
    registered(FIRST_STEP)
    cfg = _config(llama, tmp_path, {"name": "first_step", "params": {"scale": 0.5}})
    plan = build_plan(cfg)
    text = plan.render()
    assert "first fine-tune's change times 0.5" in text
    assert plan.memory["first_step scratch"] == 123 and plan.memory["models (one at a time)"] > 0
    result = run_merge(cfg, tmp_path / "out", progress=False)
    key = f"{llama.mlp_layer}.weight"
    base, ft0 = open_checkpoint(llama.base).get(key), open_checkpoint(llama.finetuned[0]).get(key)
    got = open_checkpoint(result.out_dir).get(key)
    assert torch.allclose(got.double(), (base + 0.5 * (ft0 - base)).double(), atol=1e-12)
    other = "model.layers.0.mlp.down_proj.weight"  # outside the selection: the base's
    assert torch.equal(open_checkpoint(result.out_dir).get(other), open_checkpoint(llama.base).get(other))
    report = result.report
    assert report["baseline"]["method"] == "first_step" and report["baseline"]["params"] == {"scale": 0.5}
    assert report["first_step_keys"] == [key]
    assert "first_step: ran" in report["notes"]
    ev = report["evaluation"]
    assert ev["merged"]["method"] == "first_step"
    assert ev["merged"]["calibration_objective"] != ev["base"]["calibration_objective"]


def test_model_method_checks_come_from_its_entry(llama, tmp_path, registered):
    registered(FIRST_STEP)
    with pytest.raises(ConfigError, match="unknown parameter 'scal'"):
        build_plan(_config(llama, tmp_path, {"name": "first_step", "params": {"scal": 1}}, "typo"))
    with pytest.raises(ConfigError, match="merges exactly one layer"):
        build_plan(_config(llama, tmp_path, {"name": "first_step"}, "two",
                           layers=[llama.mlp_layer, "model.layers.1.mlp.up_proj"]))
    ok = _config(llama, tmp_path, {"name": "first_step"}, "ok")
    no_prompts = ok.model_copy(update={"models": [m.model_copy(update={"calibration": None}) for m in ok.models]})
    with pytest.raises(ConfigError, match="method: 'first_step' needs calibration prompts for every model"):
        build_plan(no_prompts)
    with pytest.raises(ConfigError, match="first_step does not fit"):
        build_plan(_config(llama, tmp_path, {"name": "first_step"}, "ce", output={"metric": "cross_entropy"}))
    with pytest.raises(ConfigError, match="loads its model whole"):
        build_plan(_config(llama, tmp_path, {"name": "first_step"}, "lazy", lazy=True))
    with pytest.raises(ConfigError, match="did you mean 'first_step'"):
        build_plan(_config(llama, tmp_path, {"name": "first_stp"}, "misspelt"))


def test_a_failing_or_wrong_result_is_named(llama, tmp_path, registered):
    def boom(ctx, parsed):
        raise ValueError("no luck")

    registered(ModelMethod(name="boom", summary="fails", parse=lambda p, w: None, run=boom))
    registered(ModelMethod(name="wrong", summary="returns a dict", parse=lambda p, w: None,
                           run=lambda ctx, parsed: {}))
    with pytest.raises(MergeMethodError, match="model method 'boom' failed: ValueError: no luck"):
        run_merge(_config(llama, tmp_path, {"name": "boom"}, "boom"), tmp_path / "out_boom", progress=False)
    with pytest.raises(MergeMethodError, match="returned dict, not a MethodOutcome"):
        run_merge(_config(llama, tmp_path, {"name": "wrong"}, "wrong"), tmp_path / "out_wrong", progress=False)
    assert not (tmp_path / "out_boom").exists() and not (tmp_path / "out_wrong").exists()


def test_bad_registrations_are_refused(registered):
    assert get_model_method("output_space").name == "output_space"
    with pytest.raises(ConfigError, match="already registered|taken|exists"):
        register_model_method(ModelMethod(name="output_space", summary="", parse=_parse, run=_run))
    with pytest.raises(ConfigError, match="reserved"):
        register_model_method(ModelMethod(name="qp", summary="", parse=_parse, run=_run))
    with pytest.raises(ConfigError, match=r"run\(context, parsed\) cannot be called"):
        register_model_method(ModelMethod(name="onearg", summary="", parse=_parse, run=lambda ctx: None))
    with pytest.raises(ConfigError, match="expects a ModelMethod"):
        register_model_method("first_step")
    assert "onearg" not in MODEL_METHODS


def test_a_users_planning_functions_that_fail_are_named(llama, tmp_path, registered):
    """The functions the plan calls (parse, describe, check_sites, memory) of a user's entry: an error of
    ours passes as it is, any other exception, or a memory estimate that is not bytes by item, is one
    ConfigError line naming the method and the function."""
    def bad_parse(params, where):
        raise KeyError("oops")

    registered(ModelMethod(name="badparse", summary="", parse=bad_parse, run=_run))
    with pytest.raises(ConfigError, match=r"model method 'badparse': parse failed: KeyError"):
        build_plan(_config(llama, tmp_path, {"name": "badparse"}, "bp"))
    registered(ModelMethod(name="badmem", summary="", parse=_parse, run=_run,
                           memory=lambda parsed, statistics_bytes: {"scratch": "lots"}))
    with pytest.raises(ConfigError, match=r"model method 'badmem': memory\(parsed, statistics_bytes\) must return"):
        build_plan(_config(llama, tmp_path, {"name": "badmem"}, "bm"))
    registered(ModelMethod(name="oneline", summary="", parse=_parse, run=_run, describe=lambda parsed: "one line"))
    assert "  one line" in build_plan(_config(llama, tmp_path, {"name": "oneline"}, "ol")).render()


def _returning(merged=None, fields=None):
    """A model method's run returning ``merged(ctx)`` (tensors by key) and ``fields`` as its outcome."""
    def run(ctx, parsed):
        return MethodOutcome(merged(ctx), None, {}, 0.0, None, fields or {})
    return run


def _site_weight(ctx):
    return f"{ctx.plan.sites[0].name}.weight"


@pytest.mark.parametrize("merged, message", [
    (lambda ctx: {_site_weight(ctx): ctx.plan.base.get(_site_weight(ctx)).t()}, "of shape"),
    (lambda ctx: {_site_weight(ctx): ctx.plan.base.get(_site_weight(ctx)).long()}, "not a floating-point tensor"),
    (lambda ctx: {}, "returned no merged tensor"),
    (lambda ctx: {"model.layers.0.mlp.down_proj.weight": ctx.plan.base.get("model.layers.0.mlp.down_proj.weight")},
     "a tensor outside the selected layers"),
    (lambda ctx: {"no.such.weight": torch.zeros(2)}, "not a tensor of the base checkpoint"),
    (lambda ctx: {_site_weight(ctx): [1.0]}, "returned list for"),
], ids=["transposed", "integer", "empty", "outside", "unknown", "not-a-tensor"])
def test_what_a_model_method_returns_is_checked_before_writing(llama, tmp_path, registered, merged, message):
    """(stop 51 review) A user's method could write a transposed or integer weight, an empty merge (the base
    under the method's name) or keys outside the selection, exit 0."""
    registered(ModelMethod(name="sloppy", summary="", parse=lambda p, w: None, run=_returning(merged)))
    with pytest.raises(MergeMethodError, match=message):
        run_merge(_config(llama, tmp_path, {"name": "sloppy"}), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_report_fields_are_checked_and_float64_is_written_in_the_base_dtype(llama, tmp_path, registered):
    key = f"{llama.mlp_layer}.weight"
    wide = lambda ctx: {key: ctx.plan.base.get(key).to(torch.float64) * 0.5}  # noqa: E731
    for fields, message in (({"notes": ["mine"]}, "report field 'notes' is one of the report's own"),
                            ({"layers": []}, "report field 'layers'"),
                            ({"mine": object()}, "report field 'mine' is not JSON-able")):
        name = f"fields{len(MODEL_METHODS)}"
        registered(ModelMethod(name=name, summary="", parse=lambda p, w: None, run=_returning(wide, fields)))
        with pytest.raises(MergeMethodError, match=message):
            run_merge(_config(llama, tmp_path, {"name": name}, name), tmp_path / f"out_{name}", progress=False)
    registered(ModelMethod(name="halved", summary="", parse=lambda p, w: None,
                           run=_returning(wide, {"halved_keys": [key]})))
    cfg = _config(llama, tmp_path, {"name": "halved"}, "halved")
    result = run_merge(cfg, tmp_path / "out_halved", progress=False)
    written = open_checkpoint(result.out_dir)
    assert written.info(key).dtype == open_checkpoint(llama.base).info(key).dtype
    assert result.report["halved_keys"] == [key] and result.report["baseline"]["kind"] == "model method"
    assert "model method `halved`" in (result.out_dir / "report.md").read_text()


def test_a_model_method_may_not_take_a_baselines_name(llama, tmp_path, registered):
    """(stop 51 review) registered as 'ties' it silently replaced TIES for method.name (not for start:)."""
    with pytest.raises(ConfigError, match="'ties' is both a merge method"):
        register_model_method(ModelMethod(name="ties", summary="", parse=_parse, run=_run))
    assert "ties" not in MODEL_METHODS
    registered(ModelMethod(name="late", summary="", parse=_parse, run=_run))
    from mergeqp.merge.registry import MERGE_METHODS, register_merge_method

    register_merge_method(dataclasses.replace(MERGE_METHODS["soup"], name="late"))
    try:
        with pytest.raises(ConfigError, match="'late' is both a merge method"):
            build_plan(_config(llama, tmp_path, {"name": "late"}))
    finally:
        MERGE_METHODS.pop("late")


def test_a_model_methods_own_report_sections(llama, tmp_path, registered):
    """A model method's ``report_markdown`` renders its report fields in report.md (before the
    evaluation); one that fails or returns anything but a list of strings is named, and nothing is
    written."""
    key = f"{llama.mlp_layer}.weight"
    half = lambda ctx: {key: ctx.plan.base.get(key) * 0.5}  # noqa: E731

    def sections(report):
        return [f"## Halved tensors\n\n{len(report['halved_keys'])} tensor(s): `{report['halved_keys'][0]}`"]

    registered(ModelMethod(name="sectioned", summary="", parse=lambda p, w: None,
                           run=_returning(half, {"halved_keys": [key]}), report_markdown=sections))
    result = run_merge(_config(llama, tmp_path, {"name": "sectioned"}, "sectioned"), tmp_path / "out", progress=False)
    md = (result.out_dir / "report.md").read_text()
    assert f"## Halved tensors\n\n1 tensor(s): `{key}`" in md
    for name, fn, message in (("raising", lambda report: [report["missing"]],
                               r"model method 'raising': report_markdown\(report\) failed: KeyError"),
                              ("text", lambda report: "## One string",
                               r"model method 'text': report_markdown\(report\) returned str, not a list")):
        registered(ModelMethod(name=name, summary="", parse=lambda p, w: None, run=_returning(half),
                               report_markdown=fn))
        with pytest.raises(MergeMethodError, match=message):
            run_merge(_config(llama, tmp_path, {"name": name}, name), tmp_path / f"out_{name}", progress=False)
        assert not (tmp_path / f"out_{name}").exists()
    with pytest.raises(ConfigError, match=r"report_markdown\(report\) cannot be called"):
        register_model_method(ModelMethod(name="noarg", summary="", parse=_parse, run=_run,
                                          report_markdown=lambda: []))


def test_a_model_method_as_a_start_says_how_to_run_it(llama, tmp_path):
    """(stop 52 review) ``start: output_space`` said to use it from Python, though YAML runs it as the
    method or as an ``auto`` candidate."""
    cfg = _config(llama, tmp_path, {"name": "qp", "mode": "trust_region", "start": "output_space"}, "start_os")
    with pytest.raises(ConfigError, match=r"method.start: 'output_space' is a model method .* 'method: output_space'"
                                          r".*candidates: \[output_space"):
        build_plan(cfg)


def test_an_unknown_start_lists_the_starts(llama, tmp_path):
    """(stop 67 review) ``start: qp`` was refused with a list of valid names that offered 'qp' and
    'output_space' (both refused there) and left out 'auto' (valid); a candidate's list offers the
    QP and the model methods with a start fit."""
    for start, want, refused in (("qp", "auto", ("'qp'", "output_space")), ("aut", "did you mean 'auto'", ())):
        cfg = _config(llama, tmp_path, {"name": "qp", "mode": "trust_region", "start": start}, f"start_{start}")
        with pytest.raises(ConfigError, match=r"method.start: unknown start") as err:
            build_plan(cfg)
        listed = str(err.value).split("valid starts:")[1]
        assert want in str(err.value) and "ties" in listed
        assert not any(name in listed for name in refused)
    cfg = _auto_cfg(llama, tmp_path, ["ties", "nonesuch"], name="unknown_candidate")
    with pytest.raises(ConfigError, match=r"unknown merge method 'nonesuch'") as err:
        build_plan(cfg)
    assert "qp" in str(err.value).split("valid merge methods:")[1]


# ---------------------------------------------------------------------- as start: auto candidates (stop 58)
def _auto_cfg(fam, tmp_path, candidates, name="auto"):
    method = {"name": "qp", "mode": "trust_region", "mode_options": {"max_steps": 1},
              "start": {"name": "auto", "params": {"candidates": candidates, "folds": 1, "holdout": 0.5}}}
    return _config(fam, tmp_path, method, name=name, calibration={"batch_size": 2})


def test_a_users_model_method_is_a_start_candidate_through_its_start_fit(llama, tmp_path, registered):
    """(stop 58, an architecture review's find) Start candidates were chosen by name: the auto
    selection knew `output_space` alone and refused a user's model method as "unknown merge method".
    A `ModelMethod` with a `StartFit` is now a candidate like it: its statistics are collected per
    split (`statistics`), its `fit` gets each split's batches and the merges of those statistics, it is
    scored on the held-out batches, and `skip` is the plan's word on it."""
    from mergeqp.run.model_method import StartFit

    fits = []

    def fit(ctx, scale, tasks):
        reference = ctx.merge("regmean", {"alpha": 0.5})
        fits.append((len(tasks), sorted(reference) == sorted(ctx.floats), len(ctx.changed_sites())))
        soup = ctx.merge("soup", {})
        return {k: soup[k] + scale * (reference[k] - soup[k]) for k in reference}

    registered(dataclasses.replace(FIRST_STEP, name="toward_regmean",
                                   start=StartFit(fit=fit, statistics=lambda scale: [("regmean", {"alpha": 0.5})],
                                                  skip=lambda plan, scale, auto: "too far" if scale > 5 else None)))
    cfg = _auto_cfg(llama, tmp_path, ["soup", {"name": "toward_regmean", "params": {"scale": 2.0}},
                                      {"name": "toward_regmean", "params": {"scale": 9.0}}])
    plan = build_plan(cfg)
    rendered = plan.render()
    assert "toward_regmean(scale=9.0) skipped: too far" in rendered
    assert "toward_regmean(scale=2.0) skipped" not in rendered
    assert any(k.startswith("regmean(alpha=0.5) statistics") for k in plan.memory)
    result = run_merge(cfg, tmp_path / "out", progress=False, plan=plan)
    assert fits and all(same and sites == 1 for _, same, sites in fits)
    scores = {s["label"]: s for s in result.report["start_selection"]["candidates"]}
    assert scores["toward_regmean(scale=2.0)"]["validation"] is not None
    assert scores["toward_regmean(scale=9.0)"]["skipped"] == "too far"  # the run honours the skip too
    assert len(fits) == 1  # one split (folds: 1), the skipped candidate never fitted


def test_a_model_method_without_a_start_fit_is_refused_as_a_candidate(llama, tmp_path, registered):
    """A model method whose entry declares no start fit is named as such (not "unknown merge method"),
    and the error for one used as a plain `start:` no longer offers the candidate list it cannot join."""
    registered(FIRST_STEP)
    with pytest.raises(ConfigError, match=r"model method 'first_step' cannot be a start candidate: its entry has no "
                                          r"start fit"):
        build_plan(_auto_cfg(llama, tmp_path, ["soup", "first_step"]))
    cfg = _config(llama, tmp_path, {"name": "qp", "mode": "hybrid", "start": "first_step"}, name="hyb")
    with pytest.raises(ConfigError) as info:
        build_plan(cfg)
    assert "is a model method" in str(info.value) and "candidates" not in str(info.value)


def test_a_start_fit_that_raises_is_named(llama, tmp_path, registered):
    """A user's fit that fails is one line naming the candidate, the method and the function."""
    from mergeqp.run.model_method import StartFit

    def broken(ctx, scale, tasks):
        raise KeyError("boom")

    registered(dataclasses.replace(FIRST_STEP, name="broken_start", start=StartFit(fit=broken)))
    cfg = _auto_cfg(llama, tmp_path, ["soup", "broken_start"], name="broken")
    with pytest.raises(MergeMethodError, match=r"candidate broken_start: model method 'broken_start': start.fit "
                                               r"failed: KeyError"):
        run_merge(cfg, tmp_path / "out", progress=False)


@pytest.mark.parametrize("returned, match", [
    ("outside", r"returned 'model\.layers\.0\.mlp\.down_proj\.weight': a tensor outside the tensors some fine-tune "
                r"changed and the selected layers"),
    ("transposed", r"returned '[\w.]+' of shape \([\d, ]+\), the base's is"),
    ("numpy", r"returned ndarray for .*, not a tensor"),
    ("none", r"returned NoneType, not a dict of tensors"),
    ("integer", r"returned '[\w.]+' as torch.int64, not a floating-point tensor"),
    ("meta", r"returned '[\w.]+' as a meta tensor, not one holding values")])
def test_what_a_start_fit_returns_is_checked(llama, tmp_path, registered, returned, match):
    """(stop 58 review) Nothing checked a user's fit: a tensor outside the changed ones stayed in the
    live model (the candidates scored after it were scored on it, 7360 against 240) and was written;
    a wrong shape, an array or None ended in a traceback from deep inside. Each is now one line naming
    the candidate and the method, before anything is scored or written."""
    from mergeqp.run.model_method import StartFit

    def fit(ctx, scale, tasks):
        soup = ctx.merge("soup", {})
        key = next(iter(soup))
        if returned == "outside":  # a layer no fine-tune changed (the tiny family perturbs block 1 only)
            return {**soup, "model.layers.0.mlp.down_proj.weight": ctx.plan.base.get(
                "model.layers.0.mlp.down_proj.weight") + 5}
        if returned == "transposed":
            return {**soup, key: soup[key].T.contiguous() if soup[key].ndim == 2 else soup[key][:1]}
        if returned == "numpy":
            return {**soup, key: soup[key].numpy()}
        if returned == "integer":
            return {**soup, key: soup[key].long()}
        if returned == "meta":
            return {**soup, key: soup[key].to("meta")}
        return None

    registered(dataclasses.replace(FIRST_STEP, name="bad_fit", start=StartFit(fit=fit)))
    out = tmp_path / "out"
    with pytest.raises(MergeMethodError, match=r"candidate bad_fit: model method 'bad_fit': start.fit " + match):
        run_merge(_auto_cfg(llama, tmp_path, ["soup", "bad_fit"], name=returned), out, progress=False)
    assert not out.exists() or not any(out.iterdir())


def test_the_plan_refuses_statistics_a_start_fit_cannot_get(llama, tmp_path, registered):
    """(stop 58 review) `start.statistics` naming a tensor-wise baseline, an unknown method or bad
    parameters ended the dry run in a bare AssertionError; each is now a one-line ConfigError."""
    from mergeqp.run.model_method import StartFit

    for name, stats, match in [("soup_stats", [("soup", {})], r"names 'soup', which has no calibration statistics"),
                               ("typo_stats", [("regmean", {"alfa": 0.5})], r"alfa"),
                               ("str_stats", "regmean", r"must return a list of \(method name, params dict\) pairs")]:
        registered(dataclasses.replace(FIRST_STEP, name=name, start=StartFit(fit=lambda c, p, t: {},
                                                                              statistics=lambda p, s=stats: s)))
        with pytest.raises(ConfigError, match=match):
            build_plan(_auto_cfg(llama, tmp_path, ["soup", name], name=name))


def test_the_run_skips_what_the_plan_says_it_skips(llama, tmp_path, registered):
    """(stop 58 review) Under a metric that scores the prompts' own tokens the dry run said a user's
    output-fitting candidate was skipped, and the run fitted and chose it. Both now follow one rule
    (`plan.planned_skips`): the run never fits it, its statistics are not in the memory estimate, and
    a skip() that returns anything but a reason or None is refused."""
    from mergeqp.run.model_method import StartFit

    fitted = []

    def fit(ctx, p, tasks):
        fitted.append(1)
        return ctx.merge("regmean", {"alpha": 0.7})

    registered(dataclasses.replace(FIRST_STEP, name="fits_outputs_start",
                                   start=StartFit(fit=fit, statistics=lambda p: [("regmean", {"alpha": 0.7})])))
    cfg = _auto_cfg(llama, tmp_path, ["soup", "fits_outputs_start"], name="ce")
    cfg = cfg.model_copy(update={"output": cfg.output.model_copy(update={"metric": "cross_entropy"})})
    plan = build_plan(cfg)
    assert "fits_outputs_start skipped: it fits the fine-tunes' outputs" in plan.render()
    assert not any(k.startswith("regmean(alpha=0.7)") for k in plan.memory)
    result = run_merge(cfg, tmp_path / "out", progress=False, plan=plan)
    assert not fitted
    (row,) = [c for c in result.report["start_selection"]["candidates"] if c["label"] == "fits_outputs_start"]
    assert row["skipped"].startswith("it fits the fine-tunes' outputs")
    registered(dataclasses.replace(FIRST_STEP, name="int_skip", start=StartFit(fit=fit, skip=lambda pl, p, a: 42)))
    with pytest.raises(ConfigError, match=r"start.skip\(plan, parsed, auto\) must return a reason"):
        build_plan(_auto_cfg(llama, tmp_path, ["soup", "int_skip"], name="intskip"))


def test_a_start_fit_may_return_the_live_models_own_tensors(llama, tmp_path, registered):
    """(stop 58 review) A fit that wrote its merge into the live model and returned those parameters
    had its stored tensors overwritten by the candidates fitted after it: the report named it the
    start (scored 240) and the run started from another candidate's weights (5,780). Tensors that
    share memory with the live model are copied: the merge equals that of the same fit returning
    copies."""
    import torch
    from safetensors.torch import load_file

    from mergeqp.run.model_method import StartFit

    def fit(ctx, scale, tasks, copy=False):
        soup = ctx.merge("soup", {})
        params = dict(ctx.model.named_parameters())
        out = {}
        with torch.no_grad():
            for key, tensor in soup.items():
                name = key if key in params else None
                if name is None:
                    out[key] = tensor
                    continue
                params[name].copy_(tensor)
                out[key] = params[name].detach().clone() if copy else params[name]
        return out

    written = {}
    for name, copy in (("aliased_fit", False), ("copied_fit", True)):
        registered(dataclasses.replace(FIRST_STEP, name=name,
                                       start=StartFit(fit=lambda c, p, t, copy=copy: fit(c, p, t, copy))))
        cfg = _auto_cfg(llama, tmp_path, [name, {"name": "task_arithmetic", "params": {"scaling": 3.0}}], name=name)
        result = run_merge(cfg, tmp_path / name, progress=False)
        assert result.report["start_selection"]["chosen"] == name
        written[name] = load_file(str(tmp_path / name / "model.safetensors"))
    for key, tensor in written["copied_fit"].items():
        assert torch.equal(written["aliased_fit"][key], tensor), key


def test_a_start_skip_is_asked_once_per_plan(llama, tmp_path, registered):
    """(stop 58 review) A user's `start.skip` ran two or three times per run (the memory estimate, the
    dry run's text, the run): the plan works the skips out once (`MergePlan.start_skips`) and the
    dry run, the estimate and the run read them."""
    from mergeqp.run.model_method import StartFit

    calls = []

    def skip(plan, parsed, auto):
        calls.append(1)
        return None

    registered(dataclasses.replace(FIRST_STEP, name="counted_skip",
                                   start=StartFit(fit=lambda ctx, p, tasks: ctx.merge("soup", {}), skip=skip)))
    cfg = _auto_cfg(llama, tmp_path, ["soup", "counted_skip"], name="counted")
    plan = build_plan(cfg)
    plan.render()
    assert len(calls) == 1
    run_merge(cfg, tmp_path / "out", progress=False, plan=plan)
    assert len(calls) == 1  # (every selected layer changed: the run's plan is this one)
