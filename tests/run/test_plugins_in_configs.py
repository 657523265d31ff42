"""A merge config that uses a researcher's own entries (stop 43 review): it can name the modules
that register them (``imports:``), and what those entries cannot do is refused by the plan, before
any weight is loaded: a named solver that cannot take the set, a parametrisation without a tangent
rule, a basis registered for Python only; a misspelt mode option gets a did-you-mean; an
architecture whose module was not imported is named."""

from __future__ import annotations

import json

import pytest
import yaml

pytest.importorskip("torch")
pytest.importorskip("transformers")

from mergeqp.cli import main
from mergeqp.config import load_config
from mergeqp.constraints import CONSTRAINT_SETS
from mergeqp.errors import ConfigError
from mergeqp.merge.modes import MERGE_MODES
from mergeqp.io.memory import human_bytes
from mergeqp.run.memory_estimate import DERIVATIVES, qp_site_memory
from mergeqp.run.plan import build_plan
from mergeqp.stats.bases import BASES
from mergeqp.stats.parametrisation import PARAMETRISATIONS

PLUGIN = '''
import numpy as np
import mergeqp
from mergeqp.constraints import Box
from mergeqp.stats.basis import Basis
from mergeqp.stats.parametrisation import RowsParametrisation


class Capped(mergeqp.ConstraintSet):
    """[0, 0.6] declared only by its CVXPY form (no projection, no linear form)."""
    name = "cfgcap"

    def violation(self, d):
        return float(max(0.0, -np.min(d), np.max(d) - 0.6))

    def cvxpy(self, var):
        return [var >= 0, var <= 0.6]


class RowsNoTangents(RowsParametrisation):
    """rows for collect_statistics only: no tangent rule (checkpoint merging needs one)."""
    name = "cfg_rows_python_only"
    tangents = mergeqp.Parametrisation.tangents


mergeqp.register_constraint("cfgcap", lambda a, s, c: Capped())
mergeqp.register_constraint("cfgbox", lambda a, s, c: Box(0, 0.7))
mergeqp.register_parametrisation(RowsNoTangents())
mergeqp.register_basis("cfg_python_basis", lambda stats, p, *, seed=0, task_weights=None: Basis(np.eye(stats.r)[:, :p]))
'''


@pytest.fixture()
def plugin(tmp_path):
    path = tmp_path / "cfg_plugin.py"
    path.write_text(PLUGIN)
    before = [dict(r) for r in (CONSTRAINT_SETS, PARAMETRISATIONS, BASES, MERGE_MODES)]
    yield path
    for reg, old in zip((CONSTRAINT_SETS, PARAMETRISATIONS, BASES, MERGE_MODES), before):
        for name in [n for n in reg if n not in old]:
            del reg[name]


def _config(fam, path, method, **extra):
    return fam.write_config(path, [fam.mlp_layer], method, **extra)


def test_a_configs_imports_register_what_it_names_and_the_merge_uses_it(tiny_hf, tmp_path, plugin):
    fam = tiny_hf.make_family(tmp_path / "fam", "llama", K=2, scale=0.3, n_prompts=10)
    cfg_path = _config(fam, tmp_path / "c.yml", {"name": "qp", "mode": "single", "constraints": ["cfgbox"]},
                       imports=["cfg_plugin.py"])  # relative to the config's folder
    assert main(["merge", str(cfg_path), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    (layer,) = report["layers"]
    assert layer["certificate"]["certified"] and layer["coefficients"]["max"] <= 0.7 + 1e-7
    # the report names the code that registered what the merge used, with the file's hash
    import hashlib

    (entry,) = [e for e in report["imports"] if e["file"] == str(plugin)]
    assert entry["import"] == "cfg_plugin.py" and entry["sha256"] == hashlib.sha256(plugin.read_bytes()).hexdigest()
    assert f"imported module: `cfg_plugin.py` ({plugin}" in (tmp_path / "out" / "report.md").read_text()
    # a missing module is named with the key, before anything else
    bad = _config(fam, tmp_path / "bad.yml", {"name": "qp"}, imports=["nowhere.py"])
    with pytest.raises(ConfigError, match=r"bad.yml: imports: nowhere.py: no such file"):
        load_config(bad)
    typo = yaml.safe_load(cfg_path.read_text())
    typo["import"] = typo.pop("imports")
    (tmp_path / "typo.yml").write_text(yaml.safe_dump(typo))
    with pytest.raises(ConfigError, match=r"unknown key 'import' \(did you mean 'imports'\?\)"):
        load_config(tmp_path / "typo.yml")


@pytest.mark.parametrize(("method", "match"), [
    ({"name": "qp", "mode": "single", "constraints": ["cfgcap"], "solver": "active_set"},
     r"method.solver: 'active_set' cannot solve these QPs \(cfgcap\): does not handle cfgcap"),
    ({"name": "qp", "mode": "single", "constraints": ["box:0,1", "sign"], "solver": "torch_fista"},
     r"method.solver: 'torch_fista' cannot solve these QPs \(box:0,1 & sign\)"),
    ({"name": "qp", "mode": "single", "parametrisation": "cfg_rows_python_only"},
     r"method.parametrisation: 'cfg_rows_python_only' has no tangent rule"),
    ({"name": "qp", "mode": "single", "parametrisation": "basis", "basis": "cfg_python_basis"},
     r"basis 'cfg_python_basis' is registered without a checkpoint_source"),
    ({"name": "qp", "mode": "trust_region", "start": "soup", "mode_options": {"radious": 0.1}},
     r"unknown key 'radious' for mode: trust_region \(did you mean 'radius'\?\)"),
], ids=["solver-set", "solver-sign", "no-tangents", "python-only-basis", "mode-option-typo"])
def test_what_a_users_entry_cannot_do_is_refused_by_the_plan(tiny_hf, tmp_path, plugin, method, match):
    fam = tiny_hf.make_family(tmp_path / "fam", "llama", K=2, scale=0.3, n_prompts=10)
    cfg_path = _config(fam, tmp_path / "c.yml", method, imports=[str(plugin)])
    with pytest.raises(ConfigError, match=match):
        build_plan(load_config(cfg_path))


def test_auto_plans_the_sign_set_with_the_solver_that_takes_it(tiny_hf, tmp_path):
    """The plan builds the layer's sign rows on stand-in residuals that make rows (zeros made none,
    and the plan named active_set, which cannot take them)."""
    fam = tiny_hf.make_family(tmp_path / "fam", "llama", K=2, scale=0.3, n_prompts=10)
    plan = build_plan(load_config(_config(fam, tmp_path / "c.yml",
                                          {"name": "qp", "mode": "single", "constraints": ["box:0,1", "sign"]})))
    (group,) = plan.groups
    assert group.solver.startswith("auto -> ") and "active_set" not in group.solver


def test_an_architecture_whose_module_was_not_imported_is_named(tiny_hf, tmp_path):
    fam = tiny_hf.make_family(tmp_path / "fam", "llama", K=2, scale=0.3, n_prompts=10)
    config = json.loads((fam.base / "config.json").read_text())
    config["architectures"] = ["NotImportedForCausalLM"]
    config["model_type"] = "not-imported"
    (fam.base / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"architecture 'NotImportedForCausalLM' is not known to transformers .*"
                                          r"importing its module first"):
        build_plan(load_config(_config(fam, tmp_path / "c.yml", {"name": "qp"})))


def test_the_console_summary_prints_a_joint_qp_once_and_each_sequential_layer_apart(tiny_hf, tmp_path, capsys):
    """(stop 57 review) The layers of one QP (joint, trust region) share its objective, certificate
    and time: the summary and report.md's table repeated them per layer, as if each layer had
    reached them alone. One line (row) per QP now, the layers' energies listed; sequential layers
    keep one each."""
    fam = tiny_hf.make_family(tmp_path / "fam", "llama", K=2, scale=0.3, n_prompts=10)
    layers = ["model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"]
    for mode in ("joint", "sequential"):
        cfg_path = fam.write_config(tmp_path / f"{mode}.yml", layers, {"name": "qp", "mode": mode,
                                                                       "parametrisation": "scalar"})
        assert main(["merge", str(cfg_path), "--out", str(tmp_path / mode), "--quiet"]) == 0
        lines = [ln for ln in capsys.readouterr().out.splitlines() if ": J " in ln]
        md = (tmp_path / mode / "report.md").read_text()
        table = md[md.index("## Merged layers"):].split("\n\n")[1].splitlines()[2:]  # report.md: the same
        if mode == "joint":
            assert len(lines) == 1 and lines[0].startswith(f"  {layers[0]}, {layers[1]} (one QP, n = 4): J ")
            assert "(per layer)" in lines[0]
            assert len(table) == 1 and table[0].startswith(f"| `{layers[0]}`<br>`{layers[1]}` | joint |")
        else:
            assert [ln.split(":")[0].strip() for ln in lines] == layers
            assert [row.split(" | ")[0] for row in table] == [f"| `{name}`" for name in layers]


def test_a_baselines_console_summary_shows_the_prompts_cross_entropy(tiny_hf, tmp_path, capsys):
    """A practitioner compares merges of language models by held-out cross-entropy: the summary of
    a baseline (Euclidean evaluation) prints it beside the MSE, as the recommended run does."""
    fam = tiny_hf.make_family(tmp_path / "fam", "llama", K=2, scale=0.3, n_prompts=10)
    cfg_path = fam.write_config(tmp_path / "c.yml", [fam.mlp_layer], {"name": "soup"})
    assert main(["merge", str(cfg_path), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    ce = report["evaluation"]["merged"]["heldout_cross_entropy"]
    assert ce and "held-out cross-entropy (mean over tasks): base " in out and "held-out MSE" in out
    assert f"{sum(ce.values()) / len(ce):#.4g}" in out


def test_the_plans_derivative_estimate_counts_no_logits_when_the_head_folds(tiny_hf, tmp_path):
    """A head folded into the final hidden state forms no vocabulary-size tangents: the plan's
    estimate drops them (the practitioner's dry-run said 114 GiB for a 9.85 GB run; stop 57: the
    dry run's warning still counted chunks as wide as the vocabulary), and the plan's item is the
    QP memory model's (the dry run's warning and the run's first-batch check)."""
    fam = tiny_hf.make_family(tmp_path / "fam", "llama", K=2, scale=0.3, n_prompts=10)
    method = {"name": "qp", "mode": "single"}
    plain = build_plan(load_config(_config(fam, tmp_path / "a.yml", method, output={"fold_head": False})))
    folded = build_plan(load_config(_config(fam, tmp_path / "b.yml", method,
                                            output={"metric": "cross_entropy", "restrict": "topk", "k": 4})))
    vocab = plain.vocab_size
    assert vocab and folded.derivative_width(True) < vocab == plain.derivative_width(False)
    for plan in (plain, folded):
        (site,) = qp_site_memory(plan)
        assert plan.memory[DERIVATIVES] == site.derivatives > 0
        assert f"derivatives {human_bytes(site.derivatives)}" in site.describe()
    assert folded.memory[DERIVATIVES] < plain.memory[DERIVATIVES]


def test_a_users_merge_mode_that_raises_is_named(tiny_hf, tmp_path, capsys):
    fam = tiny_hf.make_family(tmp_path / "fam", "llama", K=2, scale=0.3, n_prompts=10)
    (tmp_path / "boom.py").write_text(
        "import mergeqp\nfrom mergeqp.merge.modes import SequentialMode\n"
        "class Boom(SequentialMode):\n    name = 'cfg_boom'\n"
        "    def run(self, ctx, sites):\n        raise ValueError('my mode exploded')\n"
        "mergeqp.register_merge_mode(Boom())\n")
    cfg_path = _config(fam, tmp_path / "c.yml", {"name": "qp", "mode": "cfg_boom"}, imports=["boom.py"])
    try:
        assert main(["merge", str(cfg_path), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    finally:
        MERGE_MODES.pop("cfg_boom", None)
    err = capsys.readouterr().err
    assert "merge mode 'cfg_boom' failed: ValueError: my mode exploded" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


OPTION_PLUGIN = '''
import mergeqp
from mergeqp.errors import ValidationError
from mergeqp.stats.parametrisation import RowsParametrisation

SEEN = []


class RowsWithOption(RowsParametrisation):
    """rows, with an option of its own (a key of the method block)."""
    name = "cfg_rows_min"
    config_options = ("min_rows",)

    def check_config(self, options, given):
        if "min_rows" not in given or not isinstance(options["min_rows"], int) or options["min_rows"] < 1:
            raise ValueError(f"min_rows must be a positive integer, got {options['min_rows']!r}")

    def check_site(self, site, options):
        if site.r < options["min_rows"]:
            raise ValidationError(f"{site.name} has {site.r} rows, fewer than min_rows {options['min_rows']}")

    def for_site(self, site, deltas, options, *, seed=0, output_stats=None):
        SEEN.append(options["min_rows"])
        return self

    def solution_record(self, d):
        return {"cfg_mean": float(d.mean())}

    def site_record(self, deltas, output_stats=None, *, seed=0):
        return {"name": "cfg_rows_min", "cfg_norm": float((deltas ** 2).sum() ** 0.5)}

    def report_markdown(self, layers):
        return ["## My parametrisation\\n\\n" + ", ".join(f"{r['layer']}: mean {r['cfg_mean']:.6f}" for r in layers)]


mergeqp.register_parametrisation(RowsWithOption())
'''


def test_a_users_parametrisation_with_options_of_its_own(tiny_hf, tmp_path, plugin):
    """(stop 49 review) A parametrisation declaring ``config_options`` of its own made *every* config
    fail with a raw AttributeError (the method block had no such field) and its keys were refused as
    unknown. Its keys are keys of the method block now: checked by the entry, refused under another
    parametrisation, kept in the report, and they reach ``check_site`` / ``for_site``; its
    ``solution_record`` and ``report_markdown`` reach report.json / report.md."""
    import sys

    path = tmp_path / "cfg_options_plugin.py"
    path.write_text(OPTION_PLUGIN)
    fam = tiny_hf.make_family(tmp_path / "fam", "llama", K=2, scale=0.3, n_prompts=10)
    plain = _config(fam, tmp_path / "plain.yml", {"name": "qp", "mode": "single"}, imports=[str(path)])
    build_plan(load_config(plain))  # a config not using it is unaffected
    method = {"name": "qp", "mode": "single", "parametrisation": "cfg_rows_min", "min_rows": 2}
    good = _config(fam, tmp_path / "good.yml", method, imports=[str(path)])
    assert main(["merge", str(good), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    assert sys.modules["mergeqp_plugin_cfg_options_plugin"].SEEN == [2]  # (mergeqp.plugins' module name)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert '"min_rows": 2' in json.dumps(report) and report["layers"][0]["certificate"]["certified"]
    # its own record reaches report.json, and its own section report.md (stop 49: Parametrisation.report_markdown)
    (layer,) = report["layers"]
    # (stop 50) the site's record is the entry's too (Parametrisation.site_record; built outside it before)
    assert layer["basis"]["name"] == "cfg_rows_min" and layer["basis"]["cfg_norm"] > 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert f"## My parametrisation\n\n{layer['layer']}: mean {layer['cfg_mean']:.6f}" in md
    for bad, match in (({**method, "min_rows": 0}, r"min_rows must be a positive integer, got 0"),
                       ({**method, "min_rows": 10**6}, r"fewer than min_rows 1000000"),
                       ({"name": "qp", "mode": "single", "min_rows": 2},
                        r"the key\(s\) 'min_rows' apply only to parametrisation: cfg_rows_min"),
                       ({**{k: v for k, v in method.items() if k != "min_rows"}, "min_row": 2},
                        r"unknown key 'min_row' \(did you mean 'min_rows'\?\)")):
        cfg_path = _config(fam, tmp_path / "bad.yml", bad, imports=[str(path)])
        with pytest.raises(ConfigError, match=match):
            build_plan(load_config(cfg_path))


def test_the_merges_device_reaches_any_solver_with_a_device_option(tiny_hf, tmp_path):
    """(stop 49 architecture review) Only solvers named ``torch*`` were given the merge's device; a
    user's GPU solver of another name ran wherever its default put it. Now a solver with a ``device``
    option gets it (unless its options set one), and one without gets none."""
    from mergeqp.run.settings import solver_options
    from mergeqp.solvers.registry import SOLVERS, get_solver

    class MyGpu(type(get_solver("torch_fista"))):
        name = "my_gpu_solver"

    fam = tiny_hf.make_family(tmp_path / "fam", "llama", K=2, scale=0.3, n_prompts=10)
    SOLVERS["my_gpu_solver"] = MyGpu()
    try:
        for solver, options, want in (("my_gpu_solver", {}, {"device": "cuda:1"}),
                                      ("torch_fista", {}, {"device": "cuda:1"}),
                                      ("my_gpu_solver", {"device": "cpu"}, {"device": "cpu"}),
                                      ("active_set", {}, {}), ("auto", {}, {})):
            cfg = load_config(_config(fam, tmp_path / "c.yml", {"name": "qp", "mode": "single", "solver": solver,
                                                                 "solver_options": options}))
            assert solver_options(cfg, "cuda:1") == want, solver
    finally:
        del SOLVERS["my_gpu_solver"]


def test_sign_consensus_with_a_users_parametrisation_from_yaml(tiny_hf, tmp_path, plugin):
    """(stop 49) ``constraints: [box:0,1, sign]`` with a user's parametrisation (here rows under
    another name, through the general ``parameter_atoms`` path) was refused; it is the merge of the
    built-in rows with the same set now."""
    from mergeqp.io.checkpoint import open_checkpoint
    from mergeqp.stats.parametrisation import RowsParametrisation, register_parametrisation

    class MyRows(RowsParametrisation):
        name = "cfg_my_rows"

    register_parametrisation(MyRows())
    fam = tiny_hf.make_family(tmp_path / "fam", "llama", K=2, scale=0.3, n_prompts=10)
    outs = {}
    for name in ("rows", "cfg_my_rows"):
        cfg = _config(fam, tmp_path / f"{name}.yml", {"name": "qp", "mode": "single", "parametrisation": name,
                                                       "constraints": ["box:0,1", "sign"], "solver": "clarabel"})
        assert main(["merge", str(cfg), "--out", str(tmp_path / name), "--quiet"]) == 0
        outs[name] = open_checkpoint(tmp_path / name)
        (layer,) = json.loads((tmp_path / name / "report.json").read_text())["layers"]
        assert layer["certificate"]["certified"]
    for key in outs["rows"].names():
        assert (outs["rows"].get(key) - outs["cfg_my_rows"].get(key)).abs().max() <= 1e-6, key
