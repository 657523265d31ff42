"""The merge config schema, and bad configs failing fast (before any weight is loaded)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from mergeqp.config import check_paths, load_config, parse_config
from mergeqp.errors import ConfigError

MINIMAL = {"base": "b", "models": [{"path": "x", "calibration": "c.txt"}], "layers": "m.*"}


def _err(data) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return str(info.value)


def test_minimal_config_defaults():
    cfg = parse_config(MINIMAL, root="/r")
    assert cfg.layers == ["m.*"]
    m = cfg.method  # no method: the recommended merge (method: auto)
    assert (m.name, m.mode, m.parametrisation, m.constraints, m.solver) == ("qp", "trust_region", "rows", [], "auto")
    assert m.start is not None and m.start.name == "auto"
    written = parse_config({**MINIMAL, "method": {}}).method  # a written-out block without a name is the QP
    assert (written.name, written.mode, written.constraints) == ("qp", "sequential", ["box:0,1"])
    assert cfg.output.restrict == "none" and cfg.targets == "finetuned" and cfg.dtype == "float32"
    assert cfg.models[0].prompts().path == "c.txt" and cfg.models[0].prompts().field == "text"
    assert cfg.resolve("x") == Path("/r/x") and cfg.resolve("/abs") == Path("/abs")
    assert cfg.model_names() == ["x"]
    one = parse_config({**MINIMAL, "method": {"constraints": "simplex"}})
    assert one.method.constraints == ["simplex"]


def test_joint_compare_sequential_is_a_mode_option_and_the_older_key_folds_into_it():
    joint = {"name": "qp", "mode": "joint"}
    new = parse_config({**MINIMAL, "method": {**joint, "mode_options": {"compare_sequential": False}}}).method
    old = parse_config({**MINIMAL, "method": {**joint, "compare_sequential": False}}).method
    assert new.effective_mode_options == old.effective_mode_options == {"compare_sequential": False}
    assert parse_config({**MINIMAL, "method": joint}).method.effective_mode_options == {}
    same = parse_config({**MINIMAL, "method": {**joint, "compare_sequential": True,
                                               "mode_options": {"compare_sequential": True}}}).method
    assert same.effective_mode_options == {"compare_sequential": True}
    msg = _err({**MINIMAL, "method": {"name": "qp", "mode": "single", "compare_sequential": False}})
    assert "compare_sequential applies only to mode: joint" in msg and "mode: single" in msg
    msg = _err({**MINIMAL, "method": {**joint, "compare_sequential": True,
                                      "mode_options": {"compare_sequential": False}}})
    assert "given twice with different values" in msg
    msg = _err({**MINIMAL, "method": {**joint, "mode_options": {"compare_sequentail": False}}})
    assert "compare_sequentail" in msg and "compare_sequential" in msg
    assert "compare_sequential" in _err({**MINIMAL, "method": {**joint, "mode_options": {"compare_sequential": "no"}}})


@pytest.mark.parametrize("data, where, key", [
    ({**MINIMAL, "desnity": 1}, "(top level)", "desnity"),
    ({**MINIMAL, "method": {"name": "qp", "constraint": "box"}}, "method", "constraint"),
    ({**MINIMAL, "models": [{"path": "x", "calibration": "c", "wieght": 2}]}, "models[x]", "wieght"),
    ({**MINIMAL, "models": [{"path": "x", "calibration": {"path": "c", "fild": "t"}}]}, "models[x].calibration", "fild"),
    ({**MINIMAL, "calibration": {"max_len": 3}}, "calibration", "max_len"),
    ({**MINIMAL, "output": {"restrict": "topk", "k": 3, "kk": 1}}, "output", "kk"),
    ({**MINIMAL, "root": "/"}, "root", "root"),
])
def test_unknown_keys_name_the_key_and_the_valid_ones(data, where, key):
    msg = _err(data)
    assert f"{where}: unknown key {key!r}" in msg
    if key != "root":
        assert "valid keys:" in msg


def test_unknown_key_suggests_the_close_one():
    assert "did you mean 'constraints'" in _err({**MINIMAL, "method": {"constraint": "box"}})


@pytest.mark.parametrize("data, fragment", [
    ({**MINIMAL, "method": {"name": "ties", "mode": "joint"}}, "apply only to name: qp"),
    ({**MINIMAL, "method": {"name": "qp", "params": {"a": 1}}}, "'params' is for baselines"),
    ({**MINIMAL, "method": {"mode": "hybrid"}}, "needs 'start'"),
    ({**MINIMAL, "method": {"mode": "joint", "start": {"name": "soup"}}}, "only used with mode: hybrid"),
    ({**MINIMAL, "method": {"parametrisation": "basis"}}, "needs 'rank'"),
    ({**MINIMAL, "method": {"rank": 3}}, "apply only to parametrisation: basis"),
    ({**MINIMAL, "method": {"parametrisation": "basis", "basis": "best", "rank": 2}}, "method.basis"),
    ({**MINIMAL, "method": {"parametrisation": "basis", "rank": 2, "basis_max_size": "1GB"}}, "basis: optimal"),
    ({**MINIMAL, "method": {"name": "fisher", "basis_max_size": "1GB"}}, "apply only to name: qp"),
    ({**MINIMAL, "method": {"mode": "parallel"}}, "method.mode"),
    ({**MINIMAL, "output": {"restrict": "topk"}}, "needs 'k'"),
    ({**MINIMAL, "output": {"pool": "mean", "metric": "kl"}}, "pool: mean needs metric: euclidean"),
    ({**MINIMAL, "output": {"pool": "max"}}, "output.pool"),
    ({**MINIMAL, "models": [{"path": "x"}]}, "needs calibration prompts"),
    ({**MINIMAL, "models": [{"path": "a/x", "calibration": "c"}, {"path": "b/x", "calibration": "c"}]}, "must be unique"),
    ({**MINIMAL, "calibration": {"holdout": 1.5}}, "holdout"),
    ({**MINIMAL, "calibration": {"holdout": 1.0}}, "holdout 1.0 is ambiguous"),  # (stop 73: read as one prompt)
    ({**MINIMAL, "device": "tpu"}, "device"),
    ({**MINIMAL, "models": []}, "models"),
    ({"models": [{"path": "x", "calibration": "c"}], "layers": "a"}, "base: required key is missing"),
    ({"base": "b", "models": [{"path": "x", "calibration": "c"}]},
     "layers: required key is missing (the linear layers to merge: names or globs, e.g. [model.layers.*.mlp.down_proj]"),
    ({**MINIMAL, "method": {"name": "qpp", "mode": "sequential"}}, "unknown merge method 'qpp'"),
    ({**MINIMAL, "method": {"name": "tie", "mode": "joint"}}, "(did you mean 'ties'?)"),
    ({**MINIMAL, "method": {"name": "ties", "mode": "joint"}}, "method 'ties' is a baseline: key(s) ['mode']"),
    ({**MINIMAL, "seed": -1}, "seed"),
    ({**MINIMAL, "seed": 2**70}, "seed"),
    ({**MINIMAL, "calibration": {"batch_size": True}}, "batch_size"),
    ({**MINIMAL, "calibration": {"batch_size": "4"}}, "batch_size"),
    ({**MINIMAL, "models": [{"path": "x", "calibration": {"path": "c", "holdout": 2.5}}]}, "holdout is a count"),
    ({**MINIMAL, "models": [{"path": "x", "calibration": {"path": "c", "holdout": -1}}]}, "holdout must be >= 0"),
    ({**MINIMAL, "models": [{"path": "x", "calibration": "c", "weight": 0}]}, "every model has weight 0"),
])
def test_invalid_values(data, fragment):
    assert fragment in _err(data)


def test_optimal_basis_config():
    m = parse_config({**MINIMAL, "method": {"parametrisation": "basis", "basis": "optimal", "rank": 2}}).method
    assert (m.basis, m.rank, m.basis_max_size) == ("optimal", 2, "2GB")
    m = parse_config({**MINIMAL, "method": {"parametrisation": "basis", "basis": "optimal", "rank": 2,
                                            "basis_max_size": 1000}}).method
    assert m.basis_max_size == 1000


def test_fisher_and_regmean_configs_parse():
    for name in ("fisher", "regmean"):
        cfg = parse_config({**MINIMAL, "method": {"name": name, "params": {"weights": [1.0]}}})
        assert cfg.method.name == name and not cfg.method.is_qp
    cfg = parse_config({**MINIMAL, "method": {"mode": "hybrid", "start": {"name": "regmean", "params": {"alpha": 0.5}}}})
    assert cfg.method.start.name == "regmean"


def test_baseline_config_needs_no_prompts():
    cfg = parse_config({**MINIMAL, "models": [{"path": "x"}], "method": {"name": "ties", "params": {"density": 0.5}}})
    assert not cfg.method.is_qp and cfg.method.params == {"density": 0.5}


def test_floats_written_with_an_exponent_and_no_dot_are_numbers(tmp_path):
    """(stop 50) PyYAML reads YAML 1.1, where ``1e-9`` is a string: the strict schema refused
    ``tol: 1e-9`` with "Input should be a valid number" although docs/hf.md gives such defaults."""
    text = yaml.safe_dump(MINIMAL) + (
        "method: {name: qp, mode: trust_region, regularisation: 1e-3, solver: osqp,\n"
        "         solver_options: {eps_abs: 1e-9}, mode_options: {tol: 1E-9, min_radius: 5e-5}}\n")
    (tmp_path / "cfg.yml").write_text(text)
    cfg = load_config(tmp_path / "cfg.yml")
    assert cfg.method.regularisation == 1e-3 and cfg.method.solver_options == {"eps_abs": 1e-9}
    assert cfg.method.mode_options == {"tol": 1e-9, "min_radius": 5e-5}
    from mergeqp.config import read_yaml

    assert read_yaml("a: .5\nb: 3\nc: 1e\nd: 1.2.3\ne: -2E+2") == {"a": 0.5, "b": 3, "c": "1e", "d": "1.2.3",
                                                                    "e": -200.0}
    # sizes written as numbers are whole bytes (8e9 had reached the size parser as a string); a text
    # read as a number says to quote it
    sizes = yaml.safe_dump(MINIMAL) + "max_memory: 8e9\nmax_shard_size: 5e8\n"
    (tmp_path / "sizes.yml").write_text(sizes)
    cfg = load_config(tmp_path / "sizes.yml")
    assert cfg.max_memory_bytes() == 8 * 10**9 and cfg.max_shard_size == 5 * 10**8
    (tmp_path / "bad_size.yml").write_text(yaml.safe_dump(MINIMAL) + "max_memory: 1.5\n")
    with pytest.raises(ConfigError, match=r"max_memory: a size is a whole number of bytes or a string such as 5GB"):
        load_config(tmp_path / "bad_size.yml")
    named = {**MINIMAL, "models": [{**MINIMAL["models"][0], "name": "NAMEX"}]}
    (tmp_path / "name.yml").write_text(yaml.safe_dump(named).replace("NAMEX", "1e3"))
    with pytest.raises(ConfigError, match=r"YAML read 1000.0 as a number: put the text in quotes"):
        load_config(tmp_path / "name.yml")


def test_load_config_resolves_relative_paths_and_reports_yaml_errors(tmp_path):
    (tmp_path / "cfg.yml").write_text(yaml.safe_dump(MINIMAL))
    cfg = load_config(tmp_path / "cfg.yml")
    assert cfg.resolve(cfg.base) == tmp_path.resolve() / "b"
    with pytest.raises(ConfigError, match="missing input"):
        check_paths(cfg)
    try:
        check_paths(cfg)
    except ConfigError as exc:  # every missing input is listed at once
        assert "base" in str(exc) and "models[x].path" in str(exc) and "models[x].calibration" in str(exc)
    (tmp_path / "bad.yml").write_text("base: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML") as info:
        load_config(tmp_path / "bad.yml")
    assert f'in "{tmp_path / "bad.yml"}", line ' in str(info.value) and "<unicode string>" not in str(info.value)
    (tmp_path / "list.yml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(tmp_path / "list.yml")
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yml")
    (tmp_path / "dir.yaml").mkdir()  # (stop 60 review: "not found" for a path that exists)
    with pytest.raises(ConfigError, match="is a folder"):
        load_config(tmp_path / "dir.yaml")


@pytest.mark.parametrize("content, message", [
    (b"base: b\n# caf\xe9\nmodels: []\n", r"is not UTF-8 text: byte 0xe9 at line 2, column 6 \(save it as UTF-8\)"),
    ("base: b\n".encode("utf-16"), r"is UTF-16 text .* save it as UTF-8"),
    (b"", r"is empty \(no YAML mapping in it"),
    (b"# only a comment\n", r"is empty"),
])
def test_a_config_that_is_not_utf8_or_empty_is_named(tmp_path, content, message):
    """(stop 67 review) A Latin-1 or UTF-16 config raised a UnicodeDecodeError traceback (exit 1, the
    code of an uncertified merge); an empty one was "got NoneType". A UTF-8 byte-order mark is fine."""
    path = tmp_path / "cfg.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        load_config(path)
    path.write_bytes(b"\xef\xbb\xbf" + yaml.safe_dump(MINIMAL).encode())
    assert load_config(path).base == MINIMAL["base"]


def test_a_prompt_file_that_is_not_utf8_names_its_line(tmp_path):
    from mergeqp.errors import ValidationError
    from mergeqp.io.calibration import read_prompts

    path = tmp_path / "p.txt"
    for ending in (b"\r\n", b"\r", b"\n"):  # lines end as Path.read_text reads them
        path.write_bytes(ending.join([b"first", "caf\u00e9".encode(), b"third", b""]))
        assert read_prompts(path) == ["first", "caf\u00e9", "third"]
    for ending in (b"\n", b"\r\n", b"\r"):
        path.write_bytes(b"first" + ending + b"second caf\xe9" + ending)
        with pytest.raises(ValidationError, match=r"prompt file .*p.txt is not UTF-8 text: byte 0xe9 at line 2, "
                                                  r"column 11"):
            read_prompts(path)


def test_a_key_written_twice_is_refused_naming_both_lines(tmp_path):
    """(stop 60 review) YAML keeps the last of two equal keys: a second `method:` line replaced the QP
    block without a word. Each mapping, at any depth, refuses a repeated key; a merge key may still be
    overridden."""
    from mergeqp.config import read_yaml

    (tmp_path / "twice.yml").write_text("base: b\nmethod: {name: qp, mode: sequential}\nlayers: [x]\nmethod: ties\n")
    with pytest.raises(ConfigError, match=r"key 'method' appears twice in one mapping \(lines 2 and 4\)"):
        load_config(tmp_path / "twice.yml")
    with pytest.raises(yaml.YAMLError, match="key 'k' appears twice"):
        read_yaml("method:\n  name: qp\n  mode_options: {k: 1, k: 2}\n")
    assert read_yaml("a: &x {p: 1, q: 2}\nb:\n  <<: *x\n  p: 3\n") == {"a": {"p": 1, "q": 2}, "b": {"p": 3, "q": 2}}
    assert read_yaml("a: {p: 1}\nb: {p: 1}\n") == {"a": {"p": 1}, "b": {"p": 1}}  # equal keys in two mappings
    chain = "defs:\n  a: &a {x: 1}\n  b: &b\n    <<: *a\n    x: 2\nc:\n  <<: *b\n"  # (review: a chain of merges)
    assert read_yaml(chain) == yaml.safe_load(chain)


# ---------------------------------------------------------------------- against real checkpoints
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")



@pytest.fixture(scope="module")
def fam(tiny_hf, tmp_path_factory):
    return tiny_hf.make_family(tmp_path_factory.mktemp("cfg") / "llama", "llama", K=2,
                         perturbed=("model.layers.1.mlp.*",), n_prompts=6)


@pytest.fixture
def no_weights(monkeypatch):
    """Make every way of loading a tensor or a model fail loudly."""
    import safetensors
    import transformers

    from mergeqp.io.checkpoint import Checkpoint

    def boom(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(Checkpoint, "get", boom)
    monkeypatch.setattr(safetensors, "safe_open", boom)
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(boom))


def _cfg(fam, tmp_path, **changes):
    path = fam.write_config(tmp_path / "cfg.yml", fam.mlp_layer, {"name": "qp", "mode": "single"})
    data = yaml.safe_load(path.read_text())
    data.update(changes)
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def test_dry_run_plan_loads_no_weights(fam, tmp_path, no_weights, capsys):
    from mergeqp.cli import main

    cfg = _cfg(fam, tmp_path, layers=["model.layers.1.*"])
    from mergeqp.run.plan import build_plan

    plan = build_plan(cfg)
    assert [s.name for s in plan.sites] == [f"model.layers.1.{n}" for n in
                                          ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                           "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    assert [g.n_variables for g in plan.groups] == [2 * s.r for s in plan.sites]
    assert all(g.solver.startswith("auto ->") for g in plan.groups)
    assert plan.memory["statistics"] == 2 * (2 * 32) ** 2 * 8  # 2 tasks, n = K r = 64 for gate/up
    assert [t.n_heldout for t in plan.tasks] == [4, 4]
    assert main(["merge", str(tmp_path / "cfg.yml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "merge plan: qp (single), 7 layer(s) of LlamaForCausalLM" in out
    assert "memory estimate" in out and "solver auto ->" in out
    assert not (tmp_path / "out").exists()


def test_bad_inputs_fail_before_loading_weights(fam, tmp_path, no_weights, capsys):
    from mergeqp.cli import main
    from mergeqp.run.plan import build_plan

    with pytest.raises(ConfigError, match=r"layer pattern 'model\.layers\.9\.\*' matches no linear layer; .*model\.layers\.0\.self_attn\.q_proj"):
        build_plan(_cfg(fam, tmp_path, layers=["model.layers.9.*"]))
    # a module that holds linear layers: the pattern that selects them
    with pytest.raises(ConfigError, match=r"layer pattern 'model\.layers\.1\.mlp' matches no linear layer \('model\.layers"
                                          r"\.1\.mlp' is a module holding 3 of them: model\.layers\.1\.mlp\.\* selects"):
        build_plan(_cfg(fam, tmp_path, layers=["model.layers.1.mlp"]))
    # (stop 48 review) a name without its leading part: say so (it listed every layer, nothing more)
    with pytest.raises(ConfigError, match=r"matches no linear layer \(it matches 2 layer\(s\) as the end of their "
                                          r"names, e\.g\. model\.layers\.0\.mlp\.down_proj: write the full name, "
                                          r"or '\*\.layers\.\*\.mlp\.down_proj'\)"):
        build_plan(_cfg(fam, tmp_path, layers=["layers.*.mlp.down_proj"]))
    bad = _cfg(fam, tmp_path, method={"name": "qp", "constraints": ["boxx:0,1"]})
    with pytest.raises(ConfigError, match="unknown constraint set 'boxx'"):
        build_plan(bad)
    with pytest.raises(ConfigError, match="unknown solver"):
        build_plan(_cfg(fam, tmp_path, method={"name": "qp", "solver": "gurobi"}))
    data = yaml.safe_load((tmp_path / "cfg.yml").read_text())
    data["models"][1]["calibration"] = str(tmp_path / "nowhere.txt")
    (tmp_path / "cfg.yml").write_text(yaml.safe_dump(data))
    assert main(["merge", str(tmp_path / "cfg.yml"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "missing input" in err and "nowhere.txt" in err and "Traceback" not in err


def test_different_architectures_fail_fast(fam, tmp_path, no_weights):
    from mergeqp.run.plan import build_plan

    cfg = _cfg(fam, tmp_path)
    data = cfg.model_dump(exclude_unset=True)
    data["models"][1]["path"] = str(fam.root / "gpt2_model")
    with pytest.raises(ConfigError, match=r"different architecture: its config.json has model_type 'gpt2'"):
        build_plan(parse_config({k: v for k, v in data.items() if k != "root"}, root=cfg.root))
    data["models"][1]["path"] = str(fam.root / "wide_llama")
    with pytest.raises(ConfigError, match=r"tensor '[\w.]+' has shape \(\d+, 24\) in model 'math' but \(\d+, 16\) in the base"):
        build_plan(parse_config({k: v for k, v in data.items() if k != "root"}, root=cfg.root))


@pytest.mark.parametrize("key, value", [("num_attention_heads", 1), ("rms_norm_eps", 0.5)])
def test_a_fine_tune_with_other_function_settings_fails_fast(fam, tmp_path, no_weights, key, value):
    """(stop 47) Heads or a norm's epsilon changed in a fine-tune's config.json without changing a tensor's
    shape: merged with exit 0, its targets from another function (the base's calibration J 7378 against
    1641 in the review's run) and the model written with the base's config."""
    import json

    from mergeqp.run.plan import build_plan

    odd = tmp_path / "odd_ft"
    shutil.copytree(fam.finetuned[1], odd)
    config = json.loads((odd / "config.json").read_text())
    assert config[key] != value
    (odd / "config.json").write_text(json.dumps({**config, key: value}))
    cfg = _cfg(fam, tmp_path)
    data = cfg.model_dump(exclude_unset=True)
    data["models"][1]["path"] = str(odd)
    with pytest.raises(ConfigError, match=f"computes another function than the base: its config.json has {key}"):
        build_plan(parse_config({k: v for k, v in data.items() if k != "root"}, root=cfg.root))


def test_rotary_settings_compare_by_what_transformers_reads_and_other_differences_are_noted(fam, tmp_path, no_weights):
    """(stop 50) transformers 5 keeps the rotary settings in ``rope_parameters``, which the list of
    function-defining keys lacked: a fine-tune with another rope theta was merged silently. Configs now
    compare as ``transformers`` reads them (an old-style ``rope_theta`` equals the same theta in
    ``rope_parameters``), and a difference in a setting neither known to change the function nor known
    to be harmless is a note of the plan, not silence."""
    import json

    from mergeqp.run.plan import build_plan

    def plan_with(edit):
        odd = tmp_path / f"odd_{len(list(tmp_path.glob('odd_*')))}"
        shutil.copytree(fam.finetuned[1], odd)
        config = json.loads((odd / "config.json").read_text())
        (odd / "config.json").write_text(json.dumps(edit(config)))
        data = _cfg(fam, tmp_path).model_dump(exclude_unset=True)
        data["models"][1]["path"] = str(odd)
        return build_plan(parse_config({k: v for k, v in data.items() if k != "root"}, root=fam.root))

    def old_style(theta):
        def edit(config):
            config = {k: v for k, v in config.items() if k != "rope_parameters"}
            return {**config, "rope_theta": theta}
        return edit

    base_theta = (json.loads((fam.base / "config.json").read_text()).get("rope_parameters") or {}).get("rope_theta", 10000.0)
    with pytest.raises(ConfigError, match=r"computes another function than the base: its config.json has rope"):
        plan_with(old_style(base_theta / 20))
    with pytest.raises(ConfigError, match=r"computes another function than the base: its config.json has rope"):
        plan_with(lambda c: {**c, "rope_parameters": {"rope_theta": base_theta / 20, "rope_type": "default"}})
    same = plan_with(old_style(base_theta))  # saved by another transformers version: the same function
    assert not [n for n in same.notes if "differs from the base" in n]
    benign = plan_with(lambda c: {**c, "torch_dtype": "bfloat16", "use_cache": False, "_name_or_path": "x",
                                  "attention_dropout": 0.1, "activation_dropout": 0.2})
    assert not [n for n in benign.notes if "differs from the base" in n]
    odd = plan_with(lambda c: {**c, "my_custom_gate": 3})
    (note,) = [n for n in odd.notes if "differs from the base" in n]
    assert "model 'math'" in note and "my_custom_gate (3 vs the base's not set)" in note


def test_a_base_config_without_architectures_is_named_not_the_layer_pattern(fam, tmp_path, no_weights):
    """(stop 50) transformers.AutoModel builds the backbone, whose names lack the checkpoint's ``model.``
    prefix: the error blamed the layer pattern ("the model's linear layers are: (none)")."""
    import json

    from mergeqp.run.plan import build_plan

    base = tmp_path / "base"
    shutil.copytree(fam.base, base)
    config = json.loads((base / "config.json").read_text())
    del config["architectures"]
    (base / "config.json").write_text(json.dumps(config))
    data = _cfg(fam, tmp_path).model_dump(exclude_unset=True)
    data["base"] = str(base)
    with pytest.raises(ConfigError, match=r"config.json names no `architectures`, so transformers.AutoModel built "
                                          r"LlamaModel; add .*LlamaForCausalLM.*the checkpoint holds e.g. '"):
        build_plan(parse_config({k: v for k, v in data.items() if k != "root"}, root=fam.root))


def test_a_peft_adapter_folder_is_named(fam, tmp_path, no_weights):
    """(stop 47) A LoRA adapter folder given as a fine-tune: 'lacks tensor lm_head.weight', no word of
    the adapter."""
    import json

    from safetensors.torch import save_file

    from mergeqp.run.plan import build_plan

    adapter = tmp_path / "lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    save_file({"base_model.model.model.layers.0.mlp.down_proj.lora_A.weight": torch.zeros(4, 32)},
              str(adapter / "adapter_model.safetensors"))
    shutil.copy(fam.finetuned[1] / "config.json", adapter / "config.json")
    cfg = _cfg(fam, tmp_path)
    data = cfg.model_dump(exclude_unset=True)
    data["models"][1]["path"] = str(adapter)
    with pytest.raises(ConfigError, match="PEFT adapter .* merge_and_unload"):
        build_plan(parse_config({k: v for k, v in data.items() if k != "root"}, root=cfg.root))
    # (stop 53 review) the same adapter as its file, as a .bin folder, and as the base
    as_file = {**data, "models": [data["models"][0], {**data["models"][1],
                                                      "path": str(adapter / "adapter_model.safetensors")}]}
    with pytest.raises(ConfigError, match="PEFT adapter .* merge_and_unload"):
        build_plan(parse_config({k: v for k, v in as_file.items() if k != "root"}, root=cfg.root))
    as_base = {**data, "base": str(adapter)}
    with pytest.raises(ConfigError, match="PEFT adapter .* merge_and_unload"):
        build_plan(parse_config({k: v for k, v in as_base.items() if k != "root"}, root=cfg.root))
    binary = tmp_path / "lora_bin"
    binary.mkdir()
    shutil.copy(adapter / "adapter_config.json", binary / "adapter_config.json")
    torch.save({"w": torch.zeros(2)}, binary / "adapter_model.bin")
    data["models"][1]["path"] = str(binary)
    with pytest.raises(ConfigError, match="PEFT adapter .* merge_and_unload"):
        build_plan(parse_config({k: v for k, v in data.items() if k != "root"}, root=cfg.root))


@pytest.mark.parametrize("changes, message", [
    ({"output": {"restrict": "topk", "k": 1000}}, r"output.k 1000: .* k must be at most \d+"),
    ({"method": {"name": "qp", "mode": "single", "parametrisation": "basis", "basis": "svd", "rank": 1000}},
     r"basis rank 1000 must be in \[1, \d+\]"),
    ({"method": {"name": "task_arithmetic", "params": {"weights": [1, 2, 3]}}},
     "method.params.weights has 3 entries but there are 2 fine-tuned models"),
    ({"output": {"metric": "kl", "fold_head": True}}, "fold_head: true, but the head cannot be folded"),
])
def test_what_the_config_alone_shows_fails_in_the_dry_run(fam, tmp_path, no_weights, changes, message):
    """(stop 47) Each of these passed --dry-run (exit 0) and stopped the run with exit 2 only after
    the models were loaded, some after every task's targets were computed."""
    from mergeqp.run.plan import build_plan

    with pytest.raises(ConfigError, match=message):
        build_plan(_cfg(fam, tmp_path, **changes))


@pytest.mark.parametrize("data, message", [
    ({"base": "b", "models": ["./a", "./b"], "layers": ["x"]}, r"models\[#1\]: expected a mapping {path, name"),
    ({"base": "b", "models": [{"path": "a"}], "layers": ["x"], "calibration": "code.jsonl"},
     "under models\\[\\].calibration"),
    ({"base": "b", "models": [{"path": "a"}], "layers": ["x"], "method": None}, "method: expected a mapping"),
    ({"base_model": "b", "models": [{"model": "a"}], "merge_method": "ties"}, "looks like a mergekit config"),
])
def test_values_of_the_wrong_kind_say_what_is_expected(data, message):
    """(stop 47) pydantic's 'Input should be a valid dictionary or instance of ModelEntry' named an
    internal class; a mergekit file got "did you mean 'models'" for base_model."""
    with pytest.raises(ConfigError, match=message) as info:
        parse_config(data)
    assert "instance of" not in str(info.value)


def test_a_baseline_without_every_models_prompts_says_it_is_not_evaluated(fam, tmp_path, no_weights):
    """(stop 47) The report had no evaluation and no note saying why."""
    from mergeqp.run.plan import build_plan

    cfg = _cfg(fam, tmp_path, method={"name": "ties"})
    data = cfg.model_dump(exclude_unset=True)
    del data["models"][1]["calibration"]
    plan = build_plan(parse_config({k: v for k, v in data.items() if k != "root"}, root=cfg.root))
    assert any(n.startswith("no evaluation: models ['math']") for n in plan.notes), plan.notes
    assert not any("no evaluation" in n for n in build_plan(_cfg(fam, tmp_path, method={"name": "ties"})).notes)


def test_tokenizer_mismatch_fails_fast(fam, tmp_path, no_weights):
    from mergeqp.run.plan import build_plan

    cfg = _cfg(fam, tmp_path)
    data = cfg.model_dump(exclude_unset=True)
    data["models"][0]["path"] = str(fam.root / "retok")
    with pytest.raises(ConfigError, match=r"tokenizer mismatch: model 'code' .* tokens only in it: \['zebra'\]"):
        build_plan(parse_config(data, root=cfg.root))


def test_a_special_token_designation_alone_is_named_with_the_fix(fam, tmp_path, no_weights):
    """(stop 47) Both whole lists of special tokens were printed, and not the 'tokenizer:' key that
    resolves it."""
    from transformers import AutoTokenizer

    from mergeqp.run.plan import build_plan

    odd = tmp_path / "special"
    shutil.copytree(fam.finetuned[0], odd)
    tok = AutoTokenizer.from_pretrained(str(fam.base))
    word = next(w for w in sorted(tok.get_vocab()) if w not in tok.all_special_tokens)
    tok.add_special_tokens({"additional_special_tokens": [word]})
    assert len(tok.get_vocab()) == len(AutoTokenizer.from_pretrained(str(fam.base)).get_vocab())
    tok.save_pretrained(str(odd))
    cfg = _cfg(fam, tmp_path)
    data = cfg.model_dump(exclude_unset=True)
    data["models"][0]["path"] = str(odd)
    with pytest.raises(ConfigError, match=rf"special only in it: \['{re.escape(word)}'\].*'tokenizer: <folder>'"):
        build_plan(parse_config(data, root=cfg.root))
    build_plan(parse_config({**data, "tokenizer": str(odd)}, root=cfg.root))  # the fix it names


@pytest.fixture(scope="module", autouse=True)
def _odd_models(tiny_hf, fam):
    """Checkpoints that must be rejected: another architecture, other shapes, another tokenizer."""
    from transformers import LlamaConfig

    tiny_hf.build_base(fam.root / "gpt2_model", "gpt2")
    cfg = tiny_hf.make_config("llama")
    wide = LlamaConfig(**{**cfg.to_dict(), "hidden_size": 24, "head_dim": 12})
    tiny_hf.model_class("llama")(wide).save_pretrained(str(fam.root / "wide_llama"))
    shutil.copytree(fam.finetuned[0], fam.root / "retok")
    tiny_hf.build_tokenizer(fam.root / "retok", extra_word="zebra")


def test_dry_run_of_fisher_regmean_and_optimal_basis_loads_no_weights(tiny_hf, fam, tmp_path, no_weights):
    from mergeqp.run.plan import build_plan

    layer_numel = 16 * 32  # down_proj, no bias
    plan = build_plan(_cfg(fam, tmp_path, method={"name": "fisher", "params": {"fisher_floor": 1e-5}}))
    assert plan.memory["fisher statistics"] == 2 * 8 * layer_numel
    assert "diagonal Fisher of the selected tensors" in plan.render() and "evaluation:" in plan.render()
    plan = build_plan(_cfg(fam, tmp_path, method={"name": "regmean", "params": {"alpha": 0.5}}))
    assert plan.memory["regmean statistics"] == 2 * 8 * 32 * 32
    plan = build_plan(_cfg(fam, tmp_path, method={"name": "qp", "mode": "hybrid", "start": {"name": "fisher"}}))
    assert "fisher statistics (all tensors)" in plan.memory and "diagonal Fisher" in plan.render()
    plan = build_plan(_cfg(fam, tmp_path, method={"name": "qp", "parametrisation": "basis", "basis": "optimal",
                                                  "rank": 4}))
    V = len(tiny_hf.vocab())
    # positions: the longest prompt's tokens (measured by the plan), at most max_length 12; x V x r
    assert plan.longest_prompt is not None and plan.batch_length == min(12, plan.longest_prompt) < 12
    assert plan.memory["optimal-basis mean Jacobian (one layer)"] == plan.batch_length * V * 16 * 8
    assert "optimal basis per layer (Corollary 4.2)" in plan.render()
    assert plan.groups[0].n_variables == 2 * 4
    with pytest.raises(ConfigError, match="method.basis_max_size: cannot parse size 'lots'"):
        build_plan(_cfg(fam, tmp_path, method={"name": "qp", "parametrisation": "basis", "basis": "optimal",
                                               "rank": 4, "basis_max_size": "lots"}))
    with pytest.raises(ConfigError, match=r"method: 'regmean' needs calibration prompts for every model"):
        data = yaml.safe_load((tmp_path / "cfg.yml").read_text())
        data["method"] = {"name": "regmean"}
        del data["models"][0]["calibration"]
        (tmp_path / "cfg.yml").write_text(yaml.safe_dump(data))
        build_plan(load_config(tmp_path / "cfg.yml"))


def test_a_holdout_count_above_the_prompts_is_clamped_with_a_note(fam, tmp_path, no_weights):
    from mergeqp.run.plan import build_plan

    plan = build_plan(_cfg(fam, tmp_path, calibration={"holdout": 500}))
    assert all(t.n_calibration == 1 for t in plan.tasks)
    assert any("holdout 500" in n and "would leave none" in n for n in plan.notes)
    assert "holdout 500" in plan.render()


def test_a_holdout_fraction_that_holds_out_nothing_is_noted(fam, tmp_path, no_weights):
    """calibration.holdout 0.01 of a few prompts is 0 prompts: the held-out evaluation of those
    tasks is empty, and the plan says so (a review found it silent with 1-2 prompts per task)."""
    from mergeqp.run.plan import build_plan

    plan = build_plan(_cfg(fam, tmp_path, calibration={"holdout": 0.01}))
    assert all(t.n_heldout == 0 for t in plan.tasks)
    assert any("holdout 0.01" in n and "no held-out metric" in n for n in plan.notes)
    plan = build_plan(_cfg(fam, tmp_path, calibration={"holdout": 0.5}))
    assert not any("no held-out metric" in n for n in plan.notes)


@pytest.mark.parametrize("changes, fragment", [
    ({"method": {"name": "qp", "constraints": ["box:0,0.1", "simplex"]}}, "is empty"),
    ({"method": {"name": "qp", "constraints": ["box:0,1", "sign:2"]}}, "density must lie in (0, 1]"),
    ({"max_shard_size": "tiny"}, "max_shard_size: cannot parse size"),
    ({"max_shard_size": -5}, "max_shard_size: size must be positive"),
])
def test_dry_run_catches_what_would_fail_after_the_statistics(fam, tmp_path, no_weights, changes, fragment):
    from mergeqp.run.plan import build_plan

    with pytest.raises(ConfigError, match=None) as info:
        build_plan(_cfg(fam, tmp_path, **changes))
    assert fragment in str(info.value)


def test_dry_run_refuses_auto_folds_without_batches(fam, tmp_path, no_weights, capsys):
    """The review's case: method auto (4 folds) on a task whose calibration prompts fill one batch
    passed --dry-run and failed in the run, after the models and the candidates' statistics were
    loaded. The plan refuses it now (6 prompts, 4 held out, batches of 4: one batch)."""
    from mergeqp.cli import main

    path = fam.write_config(tmp_path / "auto.yml", fam.mlp_layer, {"name": "auto"})
    assert main(["merge", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "start: auto with 4 folds: task" in err and "has 1 calibration batch(es) (2 prompts in batches of 4" in err
    # (stop 52 review) the holdout that took the prompts is named, and what to change
    assert "after calibration.holdout kept 4 of its prompts" in err and "or calibration.holdout)" in err
    assert "folds: 1" not in err  # (a review of stop 75: every task has one batch, so folds: 1 would fail too)
    for method, fragment in (({"name": "auto", "params": {"folds": 1}}, "start: auto holdout 0.25: every task has a "
                                                                         "single calibration batch"),
                             ({"name": "qp", "mode": "trust_region", "mode_options": {"holdout": 0.25}},
                              "mode trust_region's mode_options.holdout 0.25: every task has a single calibration")):
        # (the same review: both passed the dry run and failed after the models were loaded)
        other = fam.write_config(tmp_path / "held.yml", fam.mlp_layer, method)
        assert main(["merge", str(other), "--dry-run"]) == 2
        err = capsys.readouterr().err
        # (the review of the fixes: the calibration.holdout that took the prompts is named here too)
        assert fragment in err and "after calibration.holdout kept up to 4 of each task's prompts" in err, err
    data = yaml.safe_load(path.read_text())
    data["calibration"]["batch_size"] = 1  # two batches of one prompt: the plan passes
    path.write_text(yaml.safe_dump(data))
    assert main(["merge", str(path), "--dry-run"]) == 0


def test_trust_region_plan_names_the_solver_of_its_boxed_qps(fam, tmp_path, no_weights):
    """Without constraints each trust-region QP still has its radius box: the plan said
    'auto -> closed_form' while every step ran active_set."""
    from mergeqp.run.plan import build_plan

    plan = build_plan(_cfg(fam, tmp_path, method={"name": "qp", "mode": "trust_region"}))
    assert plan.groups and all(g.solver.startswith("auto ->") and "closed_form" not in g.solver for g in plan.groups)
    plan = build_plan(_cfg(fam, tmp_path, method={"name": "qp", "mode": "single", "constraints": ["none"]}))
    assert all(g.solver == "auto -> closed_form" for g in plan.groups)


def test_option_errors_read_without_pydantic_internals():
    """(stop 47) 'mode_options: Value error, radius ...' and, for a dict of weights, one error per
    member of pydantic's union ('weights.float', 'weights.tuple[float, ...]')."""
    from mergeqp.merge.registry import get_merge_method

    with pytest.raises(ConfigError) as info:
        parse_config({"base": "b", "models": [{"path": "a"}], "layers": ["x"],
                      "method": {"name": "qp", "mode": "trust_region", "mode_options": {"radius": 10}}})
    assert "Value error" not in str(info.value) and "radius (10) must lie between" in str(info.value)
    with pytest.raises(ConfigError) as info:
        get_merge_method("task_arithmetic").parse({"weights": {"code": 1}})
    assert "parameter 'weights' must be a number or a list of numbers (got {'code': 1})" in str(info.value)
    assert "weights.float" not in str(info.value)


def test_a_baseline_given_a_module_gets_the_module_hint(fam, tmp_path, no_weights):
    """(stop 47) The QP's message said 'P is a module holding 3 of them: P.* selects them all'; a
    baseline's only 'matches no layer or tensor'."""
    from mergeqp.run.plan import build_plan

    module = fam.mlp_layer.rsplit(".", 1)[0]  # e.g. model.layers.1.mlp
    with pytest.raises(ConfigError, match=r"matches no layer or tensor \(.* is a module holding \d+ of them"):
        build_plan(_cfg(fam, tmp_path, method={"name": "soup"}, layers=[module]))


def test_a_sketch_no_smaller_than_the_compared_outputs_is_left_out(fam, tmp_path, no_weights):
    """(stop 54 review) ``output.sketch: 100000`` on a model whose prompts compare a few hundred
    numbers estimated the statistics with noise at 20x their cost (2 min and 5.7 GB against 5 s):
    the plan now leaves the sketch out, with a note; a sketch below that count is kept."""
    from mergeqp.run.plan import build_plan

    plan = build_plan(_cfg(fam, tmp_path, output={"sketch": 100000}))
    assert plan.sketch_dropped and plan.output_spec().sketch is None
    assert any("output.sketch 100000 is not below" in n and "computed exactly" in n for n in plan.notes)
    plan = build_plan(_cfg(fam, tmp_path, output={"sketch": 3}))
    assert not plan.sketch_dropped and plan.output_spec().sketch == 3
    assert not any("output.sketch" in n for n in plan.notes)
    # above the folded count (positions x hidden 16) but below every logit (positions x 46): kept, since
    # the run may refuse to fold the head (a fine-tune that changed it), and then compares every logit
    T = plan.batch_length
    plan = build_plan(_cfg(fam, tmp_path, output={"sketch": T * 30}))
    assert not plan.sketch_dropped and plan.output_spec().sketch == T * 30


def test_a_model_whose_path_gives_no_name_is_counted_in_errors():
    """A review of stop 74: `path: "."` gave 'models[].weight'."""
    with pytest.raises(ConfigError, match=r"models\[#1\]\.weight"):
        parse_config({"base": "b", "models": [{"path": ".", "weight": -1}], "layers": ["x"]})
