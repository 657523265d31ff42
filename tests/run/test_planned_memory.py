"""A QP whose statistics and solve cannot fit is refused before any weight is loaded
(:func:`mergeqp.run.pipeline.check_groups_fit`), with the plan's sizes, which are the run's."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import mergeqp.io.memory as memory  # noqa: E402
from mergeqp.config import load_config  # noqa: E402
from mergeqp.errors import MergeQPError, ValidationError  # noqa: E402
from mergeqp.io.distributed import Ranks, _Failed  # noqa: E402
from mergeqp.run import models, pipeline  # noqa: E402
from mergeqp.run.plan import build_plan  # noqa: E402


@pytest.fixture(scope="module")
def fam(tiny_hf, tmp_path_factory):
    return tiny_hf.make_family(tmp_path_factory.mktemp("planned") / "llama", "llama", K=2, scale=0.3, n_prompts=10)


def test_a_qp_that_cannot_fit_is_refused_before_any_weight_is_loaded(tiny_hf, fam, tmp_path, monkeypatch):
    cfg = load_config(fam.write_config(tmp_path / "c.yml", "model.layers.1.mlp.*",
                                       {"name": "qp", "mode": "joint"}))
    plan = build_plan(cfg)
    (group,) = plan.groups
    need = memory.estimate_site_memory("g", group.n_variables, len(cfg.models)).peak
    loads = []
    monkeypatch.setattr(models, "load_model", lambda *a, **k: loads.append(1))
    monkeypatch.setattr(models, "load_lazy", lambda *a, **k: loads.append(1))
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: need - 1)
    with pytest.raises(ValidationError, match=r"model\.layers\.1\.mlp\.down_proj.*statistics and solve need about") as e:
        pipeline.run_merge(cfg, tmp_path / "out", progress=False, plan=plan)
    assert f"n = {group.n_variables}" in str(e.value) and not loads and not (tmp_path / "out").exists()
    # max_memory caps it the same way, whatever the machine has
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: None)
    with memory.memory_limit(need - 1), pytest.raises(ValidationError, match="max_memory"):
        pipeline.check_groups_fit(plan)
    with memory.memory_limit(need):
        pipeline.check_groups_fit(plan)  # exactly enough: no refusal


@pytest.mark.parametrize("method", [{"name": "qp", "mode": "single"}, {"name": "qp", "mode": "sequential"},
                                    {"name": "qp", "mode": "joint", "parametrisation": "scalar"},
                                    {"name": "qp", "mode": "hybrid", "start": "soup"},
                                    {"name": "qp", "mode": "trust_region", "start": "soup",
                                     "parametrisation": "rows+baselines", "baselines": ["ties", "task_arithmetic"]}],
                         ids=lambda m: f"{m['mode']}-{m.get('parametrisation', 'rows')}")
def test_the_plans_qp_sizes_are_the_runs(tiny_hf, fam, tmp_path, method):
    """The early refusal uses the plan's variable counts: each QP the run solves has the plan's n
    (a larger plan would refuse merges that fit)."""
    cfg = load_config(fam.write_config(tmp_path / "c.yml", "model.layers.1.mlp.*", method))
    plan = build_plan(cfg)
    res = pipeline.run_merge(cfg, tmp_path / "out", progress=False, plan=plan)
    report = json.loads((res.out_dir / "report.json").read_text())
    planned = {tuple(g.sites): g.n_variables for g in plan.groups}
    solved = {}
    for layer in report["layers"]:
        solved.setdefault(layer["group"], set()).add(layer["n_variables"])
    assert solved and all(len(v) == 1 for v in solved.values())
    assert sorted(v.pop() for v in solved.values()) == sorted(planned.values())


def test_the_dry_run_warns_when_a_qp_would_not_fit_here(tiny_hf, fam, tmp_path, monkeypatch, capsys):
    """--dry-run validates a config that may run on another machine: exit 0, a warning on stderr."""
    from mergeqp.cli import main

    cfg = fam.write_config(tmp_path / "c.yml", "model.layers.1.mlp.*", {"name": "qp", "mode": "joint"})
    assert main(["merge", str(cfg), "--dry-run"]) == 0
    assert "warning" not in capsys.readouterr().err
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 1000)
    assert main(["merge", str(cfg), "--dry-run"]) == 0
    err = capsys.readouterr().err
    # (stop 50) three selected layers: the warning says first that the run leaves out unchanged ones (it said the
    # run "would stop", and a run whose fine-tunes changed fewer layers did not)
    assert ("warning: if the fine-tunes change all 3 selected layers, the run would stop on this machine before loading "
            "any weight (it first leaves out the selected layers that no fine-tune changed" in err)
    assert "statistics and solve" in err
    assert main(["merge", str(cfg), "--out", str(tmp_path / "o"), "--quiet"]) == 2  # and the run stops
    assert "statistics and solve need about" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_a_first_batch_design_that_cannot_fit_is_refused_before_the_fine_tunes_load(tiny_hf, fam, tmp_path,
                                                                                    monkeypatch):
    """The statistics' check of their first batch's design, made when the run starts with the base
    standing in for the first fine-tune: refused with the message the statistics give, after loading
    only the base (not the fine-tunes, not a start selection), and the same sizes as that check."""
    import mergeqp.merge.firstorder as fo

    cfg = load_config(fam.write_config(tmp_path / "c.yml", "model.layers.1.mlp.*",
                                       {"name": "qp", "mode": "trust_region", "start": "soup"}))
    plan = build_plan(cfg)
    seen = []
    check = fo.check_design_memory
    monkeypatch.setattr(fo, "check_design_memory", lambda *a, **k: seen.append(a[:4]) or check(*a, **k))
    pipeline.run_merge(cfg, tmp_path / "ok", progress=False, plan=plan)  # fits: the early and the run's checks agree
    # the early check (the first task's largest batch) is one the run makes; the run checks its
    # first batch's design and each larger one, before building it
    assert len(seen) >= 2 and seen[0] in seen[1:], seen
    # the plan's (and --dry-run's) design item: the same formula at the longest batch the plan allows
    design = next(v for k, v in plan.memory.items() if k.startswith("design (one batch"))
    assert design >= max(memory.design_bytes(*s) for s in seen)
    assert plan.batch_length * 16 == seen[0][1]  # prompts as long as the plan's longest (hidden 16: folded)
    assert design == memory.design_bytes(*seen[0])  # and then equal
    samples, outputs, n, itemsize = seen[0]
    need = memory.design_bytes(samples, outputs, n, itemsize)
    loads = []
    load = models.load_model
    monkeypatch.setattr(models, "load_model", lambda *a, **k: loads.append(a[0]) or load(*a, **k))
    monkeypatch.setattr(fo, "available_memory_bytes", lambda: need - 1)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: need - 1)
    with pytest.raises(ValidationError, match=r"one calibration batch's design \(\d+ prompts x \d+ compared outputs"):
        pipeline.run_merge(cfg, tmp_path / "out", progress=False, plan=plan)
    assert loads == [plan.base] and not (tmp_path / "out").exists()


def test_a_later_larger_batch_is_checked_before_its_design_is_built(tiny_hf, fam, tmp_path, monkeypatch):
    """Batches are padded to their longest prompt, so a later task's batch can hold a larger design
    than the first: the statistics check each design larger than any checked before (here the
    second task's longer prompts), and refuse it, naming what fits, before building it."""
    import mergeqp.merge.firstorder as fo

    short, long_ = tmp_path / "short.txt", tmp_path / "long.txt"
    short.write_text("\n".join(["cat dog"] * 8) + "\n")
    long_.write_text("\n".join(["the cat runs on the mat and the dog sits"] * 8) + "\n")
    cfg_path = fam.write_config(tmp_path / "c.yml", "model.layers.1.mlp.down_proj", {"name": "qp", "mode": "single"},
                                models=[{"name": t, "path": str(ft), "calibration": str(p)}
                                        for t, ft, p in zip(fam.tasks, fam.finetuned, (short, long_))])
    cfg = load_config(cfg_path)
    seen = []
    check = fo.check_design_memory
    monkeypatch.setattr(fo, "check_design_memory", lambda *a, **k: seen.append(a[:4]) or check(*a, **k))
    pipeline.run_merge(cfg, tmp_path / "ok", progress=False)
    early, first, later = seen  # the early check (the first task's largest batch), then the run's two
    assert early == first and later[0] * later[1] > first[0] * first[1] and later[2:] == first[2:]
    # memory for the first task's design and for one prompt fewer of the second's: refused at the
    # second, before it is built, naming that batch size
    free = memory.design_bytes(later[0] - 1, *later[1:])
    assert memory.design_bytes(*first) <= free
    monkeypatch.setattr(fo, "available_memory_bytes", lambda: free)
    prompts = later[0] - 1
    with pytest.raises(ValidationError, match=rf"{later[0]} prompts x {later[1]} compared outputs.*"
                                              rf"the design alone fits with at most {prompts}\)"):
        pipeline.run_merge(cfg, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@dataclass(frozen=True)
class _TwoRanks(Ranks):
    """Rank ``rank`` of two without a launch: the other rank's object in every gathering is
    ``verdict_of_the_other`` (``gathered`` keeps this rank's), and no sum is ever reduced."""

    verdict_of_the_other: object = None
    gathered: list = field(default_factory=list, compare=False)

    def gather(self, obj):
        self.gathered.append(obj)
        other = [self.verdict_of_the_other]
        return [obj, *other] if self.rank == 0 else [*other, obj]

    def _reduce(self, tensors, op):  # the statistics' sums: never reached after a failure
        raise AssertionError("reduced after a failure")


def _rank_0_raises_what_rank_1_sent(fam, tmp_path, monkeypatch, sent, match):
    """Rank 0 of two, whose batches all pass, raises (and prints) the error the other rank sent
    (``sent``), after its batches and before any reduction; returns the config."""
    import mergeqp.merge.firstorder as fo

    cfg = load_config(fam.write_config(tmp_path / "c.yml", "model.layers.1.mlp.down_proj", {"name": "qp", "mode": "single"}))
    group = _TwoRanks(0, 2, "gloo", sent)
    monkeypatch.setattr(fo, "current_group", lambda: group)
    with pytest.raises(type(sent.error), match=match):
        pipeline.run_merge(cfg, tmp_path / "a", progress=False)
    assert group.gathered == [None]  # this rank's batches all passed
    return cfg


def test_under_torchrun_a_ranks_refusal_is_raised_on_every_rank(tiny_hf, fam, tmp_path, monkeypatch):
    """Ranks check the batches they own; a rank that refuses one stops building its batches and every
    rank raises its error after their batches, before the reduction (where the others would wait for
    it): rank 0, which prints, gives the refusing rank's message. Seen from rank 0 of two, with the
    other rank's verdict supplied by the gathering."""
    import mergeqp.merge.firstorder as fo

    other = _Failed(ValidationError("statistics at x: one calibration batch's design (refused by rank 1)"))
    cfg = _rank_0_raises_what_rank_1_sent(fam, tmp_path, monkeypatch, other, r"refused by rank 1")
    # this rank refuses its first batch: it builds no design, and raises its own error after the others
    built = []
    monkeypatch.setattr(fo.GaussNewtonSums, "add_design", lambda *a, **k: built.append(1))
    monkeypatch.setattr(pipeline, "check_first_design", lambda *a, **k: None)  # (the early check would refuse)
    monkeypatch.setattr(fo, "available_memory_bytes", lambda: 1)
    group = _TwoRanks(1, 2, "gloo", None)
    monkeypatch.setattr(fo, "current_group", lambda: group)
    with pytest.raises(ValidationError, match=r"one calibration batch's design") as e:
        pipeline.run_merge(cfg, tmp_path / "b", progress=False)
    # (the site's memory check before it, agreed over the ranks since stop 48, sent None: it passed)
    assert [f.error for f in group.gathered if f is not None] == [e.value] and not built


def test_under_torchrun_any_error_of_a_ranks_batch_is_raised_on_every_rank(tiny_hf, fam, tmp_path, monkeypatch):
    """Not only a refused design: any error of a rank's own batch (here the model raising on it)
    stops that rank's batches and reaches every rank before the reduction, where the others would
    otherwise wait until torchrun stopped them (a gloo traceback instead of the message). An error
    that cannot be pickled travels as a mergeqp error with its type and message."""
    import mergeqp.merge.firstorder as fo

    class Unpicklable(MergeQPError):
        def __init__(self, where, why):
            super().__init__(f"{where}: {why}")

    sent = _Failed(MergeQPError("Unpicklable: task 'a' batch 1: the model raised"))
    cfg = _rank_0_raises_what_rank_1_sent(fam, tmp_path, monkeypatch, sent, r"Unpicklable: task 'a' batch 1: the model")
    # rank 1, whose batch fails: its own error, as raised; no further batch after it
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise Unpicklable("task 'a' batch 1", "the model raised")

    monkeypatch.setattr(fo, "_batch_output", failing)
    monkeypatch.setattr(pipeline, "check_first_design", lambda *a, **k: None)  # (it would meet the failure first)
    group = _TwoRanks(1, 2, "gloo", None)
    monkeypatch.setattr(fo, "current_group", lambda: group)
    with pytest.raises(Unpicklable, match=r"batch 1: the model raised"):
        pipeline.run_merge(cfg, tmp_path / "b", progress=False)
    assert len(calls) == 1
    (failure,) = [f for f in group.gathered if f is not None]  # (None: the site's memory check passed)
    assert type(failure.error) is MergeQPError and str(failure.error) == str(sent.error)


def test_the_largest_design_batch_counts_what_the_outputs_scale_with():
    """Every logit per position: prompts x positions decide the design; a sketch (or pooling): the
    prompts alone."""
    from mergeqp.io.calibration import Batch
    from mergeqp.lm import OutputSpec
    from mergeqp.merge.firstorder import largest_design_batch

    long_few = Batch({"input_ids": torch.zeros(3, 50, dtype=torch.long)})
    short_many = Batch({"input_ids": torch.zeros(8, 10, dtype=torch.long)})
    assert largest_design_batch([short_many, long_few], OutputSpec()) is long_few
    assert largest_design_batch([long_few, short_many], OutputSpec(sketch=4)) is short_many


@pytest.mark.parametrize("output, per_position", [({}, 16), ({"restrict": "topk", "k": 20}, 20),
                                                  ({"restrict": "projection", "k": 8}, 8)])
def test_the_plans_design_item_counts_the_runs_compared_outputs(tiny_hf, fam, tmp_path, output, per_position):
    """Outputs per position in the dry run's design item: a folded head's hidden width (16) for
    every logit (46), a top-k's k even above the hidden width, a projection's k."""
    cfg = load_config(fam.write_config(tmp_path / "c.yml", "model.layers.1.mlp.down_proj",
                                       {"name": "qp", "mode": "single"}, output=output))
    plan = build_plan(cfg)
    design = next(v for k, v in plan.memory.items() if k.startswith("design (one batch"))
    (group,) = plan.groups
    B = min(cfg.calibration.batch_size, max(t.n_calibration for t in plan.tasks))
    assert design == memory.design_bytes(B, plan.batch_length * per_position, group.n_variables, 8)


def test_the_dry_run_warns_of_a_first_batch_the_run_would_refuse(tiny_hf, fam, tmp_path, capsys):
    """(stop 52 review) With max_memory above the statistics and solve but below the first batch's
    derivatives, the dry run said nothing and the run stopped at its first batch; the dry run now
    warns with the run's memory model (statistics, the first batch's design and derivatives) at the
    plan's upper bounds."""
    from mergeqp.cli import main
    from mergeqp.run.memory_estimate import qp_site_memory

    path = fam.write_config(tmp_path / "c.yml", "model.layers.1.mlp.down_proj",
                            {"name": "qp", "mode": "trust_region", "start": "soup"})
    plan = build_plan(load_config(path))
    (bound,) = qp_site_memory(plan)
    (group,) = plan.groups
    fits = memory.estimate_site_memory("g", group.n_variables, 2).peak  # statistics and solve alone
    assert bound.peak > 4 * fits
    cap = f"{2 * fits}B"
    assert main(["merge", str(path), "--dry-run", "--max-memory", cap]) == 0
    err = capsys.readouterr().err
    assert "warning: QP over model.layers.1.mlp.down_proj: at the plan's upper bounds" in err
    assert main(["merge", str(path), "--dry-run", "--max-memory", f"{2 * bound.peak}B"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main(["merge", str(path), "--out", str(tmp_path / "o"), "--quiet", "--max-memory", cap]) == 2
    err = capsys.readouterr().err  # the run stops at its first batch (its design, here), as warned
    assert "one calibration batch's design" in err and "max_memory" in err and not (tmp_path / "o").exists()


@pytest.mark.parametrize("arch, output, mode", [
    ("llama", {}, "auto"), ("llama", {}, "reverse"), ("gpt2", {"restrict": "projection", "k": 8}, "auto"),
    ("bert", {}, "auto"), ("bert", {}, "reverse"),
    ("llama", {"metric": "cross_entropy", "restrict": "topk", "k": 4}, "reverse")])
def test_the_dry_runs_qp_memory_is_the_runs_first_batch_check(tiny_hf, tmp_path, monkeypatch, arch, output, mode):
    """(stop 57) The dry run's model of a QP's first batch (`qp_site_memory`, which its warning
    compares with the memory available) against what the run checks at that batch
    (`firstorder.site_memory`): equal where the plan sees what the run does (a Llama's or GPT-2's
    folded head, each site's mode by counting), never below it (BERT's masked-LM head transforms
    the backbone's output, so the run cannot fold it: the plan, which once presumed the fold and
    estimated 6.3 MiB where the run checked 10.3, now counts the unfolded logits; cross-entropy's
    top k counts the rest as one more logit)."""
    from mergeqp.merge import firstorder as fo
    from mergeqp.run.memory_estimate import qp_site_memory

    fam = tiny_hf.make_family(tmp_path / arch, arch, K=2, scale=0.3, n_prompts=10)
    layer = {"llama": "model.layers.1.mlp.down_proj", "gpt2": "transformer.h.1.mlp.c_proj",
             "bert": "bert.encoder.layer.1.output.dense"}[arch]
    cfg = load_config(fam.write_config(tmp_path / "c.yml", layer, {"name": "qp", "mode": "single",
                                                                   "jacobian_mode": mode}, output=output))
    plan = build_plan(cfg)
    (planned,) = qp_site_memory(plan)
    seen = []
    check = fo.check_site_memory
    monkeypatch.setattr(fo, "check_site_memory", lambda site, *a, **k: seen.append(site) or check(site, *a, **k))
    pipeline.run_merge(cfg, tmp_path / "out", progress=False, plan=plan)
    batches = [s for s in seen if s.batch]  # (the statistics-only check before the first batch has none)
    assert batches
    run = max(batches, key=lambda s: s.peak)
    if arch == "bert":
        assert planned.peak >= run.peak and planned.derivatives >= run.derivatives
    else:
        assert (planned.batch, planned.derivatives, planned.statistics) == (run.batch, run.derivatives, run.statistics)
