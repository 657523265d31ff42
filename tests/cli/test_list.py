"""``mergeqp list``: every registered name of each kind with one line on it, the built-ins and a
user's (``--import``); an unknown kind is a usage error with a did-you-mean."""

from __future__ import annotations

import json

import pytest

from mergeqp.cli import main
from mergeqp.cli.names import KINDS


def _listed(capsys, *argv):
    assert main(["list", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_registered_name_is_listed_with_a_line(capsys):
    from mergeqp.constraints.parse import CONSTRAINT_SETS
    from mergeqp.experiments.lm import DOMAINS
    from mergeqp.merge.modes import MERGE_MODES
    from mergeqp.merge.registry import MERGE_METHODS
    from mergeqp.output_metrics import OUTPUT_METRICS
    from mergeqp.run.model_methods import MODEL_METHODS
    from mergeqp.solvers.instance_families import FAMILIES
    from mergeqp.solvers.registry import SOLVERS
    from mergeqp.stats.bases import BASES
    from mergeqp.stats.parametrisation import PARAMETRISATIONS

    listed = _listed(capsys)
    assert list(listed) == list(KINDS)
    names = {k: [e["name"] for e in v] for k, v in listed.items()}
    assert names["constraints"] == list(CONSTRAINT_SETS)
    assert names["solvers"] == ["auto", *SOLVERS]
    assert names["parametrisations"] == list(PARAMETRISATIONS)
    assert names["bases"] == list(BASES)
    assert set(names["methods"]) == {"qp", "auto", *MERGE_METHODS, *MODEL_METHODS}
    assert len(names["methods"]) == len(set(names["methods"]))  # output_space once: the model method
    assert names["modes"] == list(MERGE_MODES)
    assert names["metrics"] == list(OUTPUT_METRICS)
    assert names["families"] == list(FAMILIES)  # bench --family (stop 73: not listed)
    assert names["domains"] == list(DOMAINS)  # experiment lm --domains
    # every built-in entry says what it is, in one line without reST markup
    for kind, entries in listed.items():
        for e in entries:
            assert e["description"] and "\n" not in e["description"] and "``" not in e["description"], (kind, e)


def _listed_with(plugin, capsys, kinds, registered):
    """``mergeqp --import PLUGIN list KINDS``'s output; the ``(registry, name)`` entries the plugin
    registers are removed after."""
    try:
        assert main(["--import", str(plugin), "list", *kinds]) == 0
        return capsys.readouterr().out
    finally:
        for registry, name in registered:
            registry.pop(name, None)


def test_a_users_entries_are_listed_after_import(tmp_path, capsys):
    plugin = tmp_path / "listed_plugin.py"
    plugin.write_text(
        "import torch\nimport mergeqp\nfrom mergeqp.constraints import Box\n"
        "def cap(args, spec, context):\n    '''cap:C: every coefficient in [0, C].'''\n    return Box(0, float(args[0]))\n"
        "mergeqp.register_constraint('test_listed_cap', cap)\n"
        "mergeqp.register_constraint('test_listed_lambda', lambda args, spec, context: Box(0, 1))\n"
        "mergeqp.register_output_metric(mergeqp.OutputMetric('test_listed_metric', 'my metric, listed',\n"
        "    distribution=lambda y: torch.softmax(y.double(), -1), whiten=lambda x, p: x * p.to(x.dtype)))\n")
    from mergeqp.constraints.parse import CONSTRAINT_SETS
    from mergeqp.output_metrics import OUTPUT_METRICS

    out = _listed_with(plugin, capsys, ["constraints", "metrics"], [
        (CONSTRAINT_SETS, "test_listed_cap"), (CONSTRAINT_SETS, "test_listed_lambda"),
        (OUTPUT_METRICS, "test_listed_metric")])
    assert "constraints (method.constraints, --constraint):" in out and "metrics (output.metric):" in out
    assert "test_listed_cap" in out and "cap:C: every coefficient in [0, C]." in out
    (line,) = [ln for ln in out.splitlines() if "test_listed_lambda" in ln]  # (stop 60 review: a blank line)
    assert "(its parser has no docstring)" in line
    assert "test_listed_metric" in out and "my metric, listed" in out
    assert "solvers" not in out  # only the kinds asked for


def test_a_users_family_and_domain_are_listed_after_import(tmp_path, capsys):
    plugin = tmp_path / "listed_bench_plugin.py"
    plugin.write_text(
        "from mergeqp.experiments.lm import register_domain\n"
        "from mergeqp.solvers.instance_families import InstanceFamily, register_family\n"
        "def my_texts():\n    '''My own texts, one per line.'''\n    raise RuntimeError('not read by list')\n"
        "register_domain('test_listed_domain', my_texts)\n"
        "register_family(InstanceFamily('test_listed_family', K=3, r=5, set_type='box', description='my family'))\n")
    from mergeqp.experiments.lm import DOMAINS
    from mergeqp.solvers.instance_families import FAMILIES

    out = _listed_with(plugin, capsys, ["families", "domains"],
                       [(DOMAINS, "test_listed_domain"), (FAMILIES, "test_listed_family")])
    (line,) = [ln for ln in out.splitlines() if "test_listed_family" in ln]
    assert "n = 15 (3 x 5): my family" in line
    (line,) = [ln for ln in out.splitlines() if "test_listed_domain" in ln]
    assert "My own texts, one per line." in line and "a default" not in line
    assert "bbc_news" in out and "[a default]" in out


def test_an_unknown_kind_is_a_usage_error(capsys):
    assert main(["list", "metric"]) == 2
    err = capsys.readouterr().err
    assert "unknown kind 'metric'" in err and "did you mean 'metrics'" in err and "valid kinds: constraints" in err


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_alone(capsys, kind):
    assert list(_listed(capsys, kind)) == [kind]
