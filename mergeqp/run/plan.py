"""Validate a ``mergeqp merge`` config against its checkpoints and build the plan, loading no weights.

Everything here reads only metadata: ``config.json``, safetensors headers (names, dtypes,
shapes), tokenizer files, prompt files, and a ``meta``-device skeleton of the architecture
(module types without storage). Errors found here (missing files, models of different
architectures, tokenizer mismatch, a layer pattern that matches nothing, a bad constraint or
solver name) are raised before any tensor is loaded. ``mergeqp merge --dry-run`` prints
:meth:`MergePlan.render`. What a batch's statistics cost and the sketch chosen from it are
:mod:`~mergeqp.run.statistics_cost`'s; the memory estimate is :mod:`~mergeqp.run.memory_estimate`'s.
"""

from __future__ import annotations


import fnmatch
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from .architectures import ARCHITECTURES, causal_lm_obstacle
from .auto import (
    AUTO,
    MIN_FOLD_BATCHES,
    QP_CANDIDATE,
    calibration_batches,
    candidate_where,
    is_auto_start,
    parse_auto_params,
    too_few_batches,
)
from .checkpoints import (aligned_checkpoints, changed_keys, check_architectures, check_decoder_inputs,
                          check_tokenizers, has_tokenizer, output_fields, same_stored_value, skeleton,
                          stored_names)
from .schema import MergeConfig, check_paths, qp_candidate_block
from ..constraints import as_constraint_set, check_feasible, layer_constraint, layer_context, parse_constraint
from ..errors import ConfigError, MergeQPError, ValidationError, unknown
from ..io.calibration import (
    holdout_count,
    is_tensor_file,
    load_tokenizer,
    read_labelled_prompts,
    read_prompts,
    read_tensor_inputs,
    split_holdout,
    tensor_labels,
)
from ..io.checkpoint import Checkpoint, config_int, open_checkpoint
from ..io.arrays import read_head, read_matrix
from ..io.memory import human_bytes
from ..io.writer import check_tensor_finite, parse_size
from ..merge.calibrated import check_params, statistics_methods
from ..merge.modes import get_merge_mode
from ..lm import ClassifierHead
from ..output_metrics import output_metric
from ..merge.baseline_residuals import statistics_baselines
from ..merge.registry import MERGE_METHODS, get_merge_method
from ..merge.sites import (
    LayerSite,
    listing,
    match_sites,
    model_sites,
    module_hint,
    shared_linear_layers,
    site_matches,
    tied_match,
)
from ..problem import MergeQP
from ..solvers.registry import choose_solver, declines, get_solver
from ..stats.parametrisation import Parametrisation, get_parametrisation
from .model_methods import (MODEL_METHODS, baseline_clash, entry_call, method_names, model_method_of, parse_candidate,
                            start_method)
from .memory_estimate import OPTIMAL_JACOBIAN, estimate_memory
from .merge_plan import CLASSIFIER_SUFFIXES, GroupPlan, MergePlan, TaskPlan, context_length
from .settings import evaluates_baseline, planned_atoms, qp_settings, statistics_method
from .statistics_cost import choose_sketch, count_statistics, drop_a_useless_sketch


# ---------------------------------------------------------------------- checks
def without_unchanged(plan: MergePlan) -> MergePlan:
    """The run's plan: the selected layers and tensors that no fine-tune changed (each fine-tune holds
    the base's very tensors there, so any merge leaves them as they are) left out, with a note, when
    some others changed; ``plan`` itself when none or all changed (a selection of unchanged layers
    alone is merged and reported as such). Reads the selected tensors, which the dry run does not.
    Before stop 48 a pattern over every block of fine-tunes of a few put every block into the QP (a
    review's: 3 changed ``o_proj`` of 30, a 160 GiB QP refused), and Fisher / RegMean computed
    statistics for every unchanged tensor. The plan keeps what it read (prompts, tokenizers, heads);
    only its sites, groups and memory estimate are redone."""
    keys = plan.merged_keys()
    changed = set(changed_keys(plan.base, plan.finetuned, keys))
    if not changed or len(changed) == len(keys):
        return plan
    sites = [s for s in plan.sites if changed & set(s.keys)]
    extra = [t for t in plan.extra_tensors if t in changed]
    dropped = [s.name for s in plan.sites if s not in sites] + [t for t in plan.extra_tensors if t not in changed]
    if not dropped:
        return plan
    cfg = plan.config.model_copy(update={"layers": [s.name for s in sites] + extra})
    # the sketch and the cost are decided again on the QPs the run solves (stop 57 review: a sketch
    # chosen for a QP of 64 coefficients was kept for the 32 left, whose exact statistics were cheap)
    new = replace(plan, config=cfg, sites=sites, extra_tensors=extra, groups=plan_groups(cfg, sites),
                  notes=[n for n in plan.notes if n not in plan.qp_notes], qp_notes=[], auto_sketch=None)
    choose_sketch(new)
    new.memory = estimate_memory(new)
    count_statistics(new)
    new.notes.append(f"{len(dropped)} selected layer(s) or tensor(s) are the base's in every fine-tuned model and "
                     f"were left so (not merged, no coefficients): {listing(dropped, 8)}")
    return new



def keeps_base_outside(plan: MergePlan) -> bool:
    """Whether the merged model holds the base's tensors outside the merged ones: every method but a
    QP mode started from a merge of every tensor (``hybrid``, a trust region's start, ``auto``)."""
    m = plan.config.method
    return not (m.is_qp and plan.mode.uses_start and m.start is not None)


def _check_sample_finite(checkpoint: Any, key: str, sample: Any, model: str) -> None:
    """NaN / inf in a flat ``sample`` of the tensor ``key`` named with its index in the whole tensor (read
    only then: the sample's own index, "(0,)" for a matrix, was named before; a QA review, stop 76)."""
    import torch

    if not bool(torch.isfinite(sample).all()):
        check_tensor_finite(key, checkpoint.get(key), model)
        check_tensor_finite(key, sample, model)  # (a tensor the whole read found finite: still the sample's word)


def changed_outside(plan: MergePlan, count: int = 256) -> list[str]:
    """Notes naming, per fine-tuned model, the floating-point tensors outside the merged ones that it
    changed: their first ``count`` entries differ from the base's, beyond the rounding to the
    fine-tune's stored dtype (a sample: a change elsewhere in a tensor is not seen). Meant for a
    merge that keeps the base's tensors outside its selection (a user who selected too few layers
    otherwise loses those changes without a word). Reads ``count`` entries per tensor."""
    notes = []
    for name, changed in _outside_changes(plan, count).items():
        chosen, other = _selected_unmerged(plan, changed)
        if other:
            notes.append(f"model {name!r} also changed {len(other)} tensor(s) outside the merged layers "
                         f"({listing(other, 4)}): the merged model keeps the base's there; select them in "
                         f"layers: to merge them too")
        if chosen:
            notes.append(f"model {name!r} also changed {len(chosen)} tensor(s) that layers: selects but a QP does "
                         f"not merge, since they are not a linear layer's weight or bias ({listing(chosen, 4)}): the "
                         f"merged model keeps the base's there; to merge them too, start the QP from a baseline "
                         f"merged on every tensor (mode: hybrid or trust_region with a start), or merge with a "
                         f"baseline method")
    return notes


def start_outside(plan: MergePlan, count: int = 256) -> list[str]:
    """The note of a QP mode whose start is merged on every tensor (``method: auto``, ``hybrid``, a
    trust region's ``start``): the tensors outside the selected layers that a fine-tune changed are
    the start's in the written model, not the base's, and the QP does not refine them; a baseline
    over the same ``layers`` keeps the base's there, so the two do not merge the same tensors (stop
    57 review: `auto` over two `down_proj` changed all twelve fine-tuned MLP tensors, with no word,
    beside baselines that kept ten of them as the base's). ``[]`` where no such tensor changed."""
    changed = sorted({k for keys in _outside_changes(plan, count).values() for k in keys})
    start = plan.config.method.start
    name = "the chosen start" if start is None or is_auto_start(start) else start.name
    chosen, other = _selected_unmerged(plan, changed)
    notes = []
    if other:
        notes.append(f"{name} is merged on every tensor: the merged model also changes {len(other)} tensor(s) outside "
                     f"the selected layers ({listing(other, 4)}), as the start left them (the QP refines only the "
                     f"selected layers); a baseline over the same layers keeps the base's there: to compare like with "
                     f"like, run it with these tensors in layers too")
    if chosen:  # (stop 60 review: these were called "outside the selected layers", which select them)
        notes.append(f"{name} is merged on every tensor: {len(chosen)} changed tensor(s) that layers: selects but a QP "
                     f"does not merge, since they are not a linear layer's weight or bias ({listing(chosen, 4)}), are "
                     f"the start's in the merged model (the QP refines only the linear layers), as a baseline over the "
                     f"same layers merges them")
    return notes


def _selected_unmerged(plan: MergePlan, keys: list[str]) -> tuple[list[str], list[str]]:
    """``keys`` split into those the ``layers`` patterns select but a QP does not merge
    (:attr:`MergePlan.qp_unmerged`) and those outside every pattern."""
    matched = set(plan.qp_unmerged)
    return [k for k in keys if k in matched], [k for k in keys if k not in matched]


def _outside_changes(plan: MergePlan, count: int) -> dict[str, list[str]]:
    """Per fine-tuned model, the floating-point tensors outside the merged ones whose first ``count``
    entries differ from the base's beyond the rounding to the fine-tune's stored dtype."""
    merged = set(plan.merged_keys())
    outside = [k for k in plan.float_keys() if k not in merged]
    base_samples: dict[str, Any] = {}
    out: dict[str, list[str]] = {}
    for name, ft in zip(plan.config.model_names(), plan.finetuned):
        changed = out.setdefault(name, [])
        for key in outside:
            if key not in ft:
                continue
            if key not in base_samples:
                base_samples[key] = plan.base.sample(key, count)
                # the merged model keeps the base's tensor here: NaN / inf named as the base's now, not as
                # the merged model's after the work (a QA review, stop 73)
                _check_sample_finite(plan.base, key, base_samples[key], f"the base ({plan.base.path})")
            theirs = ft.sample(key, count)
            # (NaN != NaN made such a tensor "changed" by every fine-tune)
            _check_sample_finite(ft, key, theirs, f"model {name!r} ({ft.path})")
            if not same_stored_value(base_samples[key], theirs):
                changed.append(key)
    return out


def _no_sites(base: Checkpoint, base_path: Path, model: Any) -> None:
    """Raise the reason why the model built from the base's ``config.json`` has no linear layer
    stored in the checkpoint: most often a config without ``architectures`` (``AutoModel`` builds the
    backbone, whose names lack the head model's prefix); the pattern is not to blame."""
    names = [n for n in base.names() if n.endswith(".weight")]
    if not names:
        raise ConfigError(f"base {base_path}: the checkpoint stores no weight tensor (no name ending in .weight)")
    live = [n for n, _ in model.named_parameters()]
    archs = (base.config or {}).get("architectures")
    why = ("its config.json names no `architectures`, so transformers.AutoModel built "
           f"{type(model).__name__}; add the class that saved the checkpoint, e.g. \"architectures\": "
           f"[\"{type(model).__name__.removesuffix('Model')}ForCausalLM\"]" if not archs else
           f"config.json names {archs}")
    raise ConfigError(f"base {base_path}: no linear layer of the model built from its config.json is stored in its "
                      f"checkpoint ({why}): the checkpoint holds e.g. {names[0]!r}, the model's parameters are named "
                      f"e.g. {live[0] if live else '(none)'!r}")


def _pattern_tensors(pattern: str, names: Sequence[str], site_keys: set[str]) -> list[str]:
    """The checkpoint tensors other than linear layers' that the layer ``pattern`` matches (by name, or
    by the module holding them)."""
    p = pattern.removesuffix(".weight")
    return [n for n in names if n not in site_keys
            and (fnmatch.fnmatchcase(n, pattern) or fnmatch.fnmatchcase(n.rsplit(".", 1)[0], p))]


def _select(cfg: MergeConfig, sites: list[LayerSite], names: list[str],
            shared: Mapping[str, str] | None = None) -> tuple[list[LayerSite], list[str]]:
    """Sites (QP) or sites + other checkpoint tensors (baselines) matched by the layer patterns
    (``shared``: the model's tied linear layers, named when a QP pattern matches only them)."""
    if cfg.method.is_qp:
        return match_sites(sites, cfg.layers, shared), []
    chosen: list[LayerSite] = []
    extra: list[str] = []
    site_keys = {k for s in sites for k in s.keys}
    for pattern in cfg.layers:
        p = pattern.removesuffix(".weight")
        hit_sites = [s for s in sites if site_matches(s, p)]
        hit_tensors = _pattern_tensors(pattern, names, site_keys)
        if not hit_sites and not hit_tensors:
            tied = tied_match(pattern, shared)
            if tied:  # (Gemma2's lm_head: the QP named the tie, a baseline said "matches no layer")
                raise ConfigError(f"{tied}: select the tensor it is tied to, to merge it")
            raise ConfigError(
                f"layer pattern {pattern!r} matches no layer or tensor{module_hint(sites, pattern)}; linear layers: "
                f"{listing([s.label for s in sites])}"
            )
        chosen.extend(s for s in hit_sites if s not in chosen)
        extra.extend(t for t in hit_tensors if t not in extra)
    order = {s.name: i for i, s in enumerate(sites)}
    return sorted(chosen, key=lambda s: order[s.name]), [n for n in names if n in set(extra)]


def _solver_name(cfg: MergeConfig, n: int) -> str:
    """The solver ``auto`` would pick for an ``n``-variable problem with these constraints; a named
    solver is checked now against its options and against the set (a solver that cannot take it is
    refused before any model is loaded)."""
    m = cfg.method
    K = len(cfg.models)
    if m.solver != "auto":
        try:
            solver = get_solver(m.solver)
            solver.check_options(m.solver_options)
        except MergeQPError as exc:
            raise ConfigError(f"method.solver: {exc}") from None
        try:
            why = declines(solver, _probe(K, n), as_constraint_set(_planned_sets(cfg, n // K) or None))
        except MergeQPError:
            why = None  # decided at solve time
        if why is not None:
            raise ConfigError(f"method.solver: {m.solver!r} cannot solve these QPs ({' & '.join(m.constraints)}): "
                              f"{why}; use solver: auto, or a solver that takes the set")
        return m.solver
    if m.solver_options:
        raise ConfigError("method.solver_options: name a solver (options differ between solvers), not 'auto'")
    try:
        sets = _planned_sets(cfg, n // K)
        return "auto -> " + choose_solver(_probe(K, n), as_constraint_set(sets or None)).name
    except MergeQPError:
        return "auto (decided at solve time)"


def _probe(K: int, n: int) -> MergeQP:
    """A stand-in for a planned QP of ``n`` variables: an explicit H of the real size, as the run has
    (a merge's statistics are always an explicit H), held as a read-only zero-stride view (no memory,
    no factorisation: the solvers' choice reads only n, the shape and that H is explicit)."""
    small = MergeQP(H=np.eye(K), g=np.zeros(K), shape=(K, 1))
    return small._derived(H=np.broadcast_to(np.zeros(1), (n, n)), g=np.zeros(n), shape=(K, n // K))


def _planned_sets(cfg: MergeConfig, n_atoms: int) -> list[Any]:
    """The QPs' constraint sets as planned for ``n_atoms`` coefficients per model (layer sets such as
    ``sign`` on stand-in residuals of as many rows), with the trust region's box for a step-bounded
    mode."""
    m = cfg.method
    deltas = np.ones((len(cfg.models), max(int(n_atoms), 1), 1))
    sets = [parse_constraint(s, {"deltas": deltas, "parametrisation": "rows"}) for s in m.constraints]
    if get_merge_mode(m.mode).step_bounded:  # (the trust region's box: closed_form cannot take it)
        sets.append(parse_constraint("box:-1,1"))
    return sets


def _check_output_field(cfg: MergeConfig, model: Any) -> None:
    """``output.field`` is one the model's output class declares, where the run compares outputs (the
    QP, an evaluated baseline, a model method) and the class is known (:func:`output_fields`). Stop 58
    review: GPT-2's ``last_hidden_state`` and a headless BERT's ``logits`` passed the dry run, and the
    run refused them at its first batch, after loading every model."""
    if not (cfg.method.is_qp or evaluates_baseline(cfg) or model_method_of(cfg) is not None):
        return
    declared = output_fields(model)
    if declared is None or cfg.output.field in declared[1]:
        return
    name, fields = declared
    tensors = [f for f in fields if f not in ("loss", "past_key_values", "hidden_states", "attentions",
                                              "cross_attentions")]
    raise ConfigError(f"output.field {cfg.output.field!r}: {type(model).__name__} returns {name}, which has no such "
                      f"field; it has {', '.join(tensors) or ', '.join(fields)} (a head model's outputs are its "
                      f"head's: merge with the backbone's class in the folders' config.json 'architectures' to "
                      f"compare its hidden states)")


def uses_prompts(cfg: MergeConfig) -> bool:
    """The run reads the calibration prompts: the QP, a method with calibration statistics, an
    evaluated baseline, a model method (:mod:`.model_methods`: e.g. ``output_space`` linearises its
    reference merge on them)."""
    return (cfg.method.is_qp or statistics_method(cfg) is not None or evaluates_baseline(cfg)
            or model_method_of(cfg) is not None)


def _without_prompts(cfg: MergeConfig) -> list[str]:
    """The names of the models that have no calibration prompts."""
    return [n for n, e in zip(cfg.model_names(), cfg.models) if e.prompts() is None]


def _check_method(cfg: MergeConfig) -> None:
    m = cfg.method
    if cfg.lazy and not m.is_qp:
        raise ConfigError(f"lazy: true keeps the blocks off a QP merge's linearised path on disk (method: qp, or "
                          f"the default auto); method {m.name!r} "
                          + (model_method.lazy_reason if (model_method := model_method_of(cfg)) is not None else
                             "already streams tensors in chunks (evaluate: false keeps models out of memory)"))
    stats = statistics_method(cfg)
    if stats is not None:
        missing = _without_prompts(cfg)
        if missing:
            raise ConfigError(f"{'method' if not m.is_qp else 'method.start'}: {stats!r} needs calibration prompts "
                              f"for every model (its statistics are computed on them); missing for {missing}")
    model_method = model_method_of(cfg)
    if model_method is not None:
        clash = baseline_clash(m.name)  # (a merge method registered after the model method)
        if clash is not None:
            raise ConfigError(f"method: {clash}")
        missing = _without_prompts(cfg)
        if missing:
            raise ConfigError(f"method: {m.name!r} needs calibration prompts for every model (it runs on the "
                              f"models' outputs on them); missing for {missing}")
        if model_method.fits_outputs and output_metric(cfg.output.metric).scores_data:
            classifies = cfg.output.pool != "none"  # class labels through each model's head
            scored = "class labels through each model's head" if classifies else "next tokens"
            remedy = ("drop the models' head and label_field and use metric: euclidean" if classifies
                      else "use metric: euclidean or kl")
            raise ConfigError(f"output.metric: {cfg.output.metric} scores the prompts' {scored}, which method: "
                              f"{m.name} does not fit (it fits the fine-tunes' outputs); {remedy}, or a QP "
                              f"method (e.g. mode: trust_region) with metric: {cfg.output.metric}")
        entry_call(model_method, "parse", model_method.parse, m.params, "method")
        return
    if not m.is_qp:
        _check_baseline(m.name, m.params, "method", len(cfg.models))
        return
    atom_stats = statistics_baselines(m.baseline_choices)
    if atom_stats:
        missing = _without_prompts(cfg)
        if missing:
            raise ConfigError(f"method.baselines: {atom_stats[0][0]!r} needs calibration prompts for every model (its "
                              f"statistics are computed on them); missing for {missing}")
    if is_auto_start(m.start):
        assert m.start is not None
        for cand in parse_auto_params(m.start.params).candidates:
            where = candidate_where(cand.label)
            entry = start_method(cand.name)
            if entry is not None:
                parse_candidate(entry, cand)
            elif cand.name in MODEL_METHODS:
                raise ConfigError(f"{where}: model method {cand.name!r} cannot be a start candidate: its entry has no "
                                  f"start fit (ModelMethod.start, docs/hf.md \"Model methods\"); run it as method: "
                                  f"{cand.name} instead")
            elif cand.name == QP_CANDIDATE:
                block = qp_candidate_block(cand.params, where)
                fitted = statistics_baselines(block.baseline_choices)
                if fitted:
                    raise ConfigError(f"{where}: baseline atoms with calibration statistics ({fitted[0][0]!r}) are not "
                                      "available to start candidates (they would be fitted on the held-out folds); "
                                      "use tensor-wise baselines there, or a run of its own")
                try:
                    _check_method(cfg.model_copy(update={"method": block}))
                except ConfigError as exc:
                    raise ConfigError(f"{where}: {exc}") from None
            else:
                _check_baseline(cand.name, cand.params, where, len(cfg.models))
    elif m.start is not None:
        _check_baseline(m.start.name, m.start.params, "method.start", len(cfg.models))
    for spec in m.constraints:
        name = layer_constraint(spec)
        if name is not None:
            if get_merge_mode(m.mode).spans_layers:
                raise ConfigError(f"method.constraints: {name!r} is per layer and cannot be used with mode: {m.mode}")
            try:  # the set needs the layer's deltas (solve time); its spelling is checked now on a stand-in
                # with the configured parametrisation (a set built per parametrisation may refuse it)
                entry = get_parametrisation(m.parametrisation)
                parse_constraint(spec, layer_context(np.ones((len(cfg.models), 1, 1)), m.parametrisation,
                                                     entry.parameter_atoms(1, 1)))
            except MergeQPError as exc:
                raise ConfigError(f"method.constraints: {exc}") from None
            continue
        try:
            parse_constraint(spec)
        except MergeQPError as exc:
            raise ConfigError(f"method.constraints: {exc}") from None
    param = get_parametrisation(m.parametrisation)
    if type(param).tangents is Parametrisation.tangents:  # (a user's entry written for in-memory statistics only)
        raise ConfigError(f"method.parametrisation: {m.parametrisation!r} has no tangent rule (tangents(Z, delta)), "
                          f"which checkpoint merging needs; it can be used with collect_statistics in Python")
    if param.needs_output_jacobian(m.parametrisation_options()):
        if output_metric(cfg.output.metric).scores_data:
            raise ConfigError(f"method.basis: {m.basis} (the optimal basis) is built from the residuals to the "
                              f"fine-tunes' outputs; output.metric: {cfg.output.metric} has none. Use basis: svd "
                              f"or random, or another parametrisation")
        try:
            parse_size(m.basis_max_size)
        except MergeQPError as exc:
            raise ConfigError(f"method.basis_max_size: {exc}") from None


def _check_output(cfg: MergeConfig) -> None:
    try:
        parse_size(cfg.max_shard_size)
    except MergeQPError as exc:
        raise ConfigError(f"max_shard_size: {exc}") from None


def _check_feasible_sets(cfg: MergeConfig, groups: Sequence[Any]) -> None:
    """The QP's constraint set (without the layer constraints such as 'sign', which need the
    deltas) is non-empty for every planned problem shape: an empty intersection fails now, not
    after the statistics."""
    specs = [s for s in cfg.method.constraints if layer_constraint(s) is None]
    if not specs:
        return
    cset = as_constraint_set([parse_constraint(s) for s in specs])
    K = len(cfg.models)
    origin = get_merge_mode(cfg.method.mode).origin_feasible
    for n in sorted({int(g.n_variables) for g in groups}):
        try:
            check_feasible(cset, (K, n // K))
        except MergeQPError as exc:
            raise ConfigError(f"method.constraints: {exc}") from None
        viol = cset.violation(np.zeros((K, n // K))) if origin else 0.0
        if viol > 1e-9:
            raise ConfigError(
                f"method.constraints: mode {cfg.method.mode} solves for corrections D from the start (D = 0), "
                f"which the constraints {cfg.method.constraints} exclude (violation {viol:.3g}); use a set that "
                f"contains 0, e.g. box:-1,1, or none")


def _check_baseline(name: str, params: dict[str, Any], where: str, K: int) -> None:
    """Known baseline (tensor-wise, or with calibration statistics) with valid parameters (checked
    by the method's own schema); a per-model ``weights`` list has one entry per fine-tune (``K``)."""
    if name in MODEL_METHODS and (name not in MERGE_METHODS or not get_merge_method(name).tensorwise):
        among = (f", or tries it as a start among others with 'start: {{name: auto, params: {{candidates: "
                 f"[{name}, ...]}}}}'" if start_method(name) is not None else "")
        raise ConfigError(
            f"{where}: {name!r} is a model method (it runs on the live models, not on tensors) and cannot be used "
            f"here: a merge config runs it as 'method: {name}'{among}"
        )
    if name not in MERGE_METHODS:
        if where == "method":
            known = ["qp", AUTO, *method_names()]
        else:  # a start: the baselines a merge runs on tensors; as a candidate also the QP and the model
            # methods with a start fit; as method.start the automatic choice (a review's find, stop 67:
            # 'start: qp' was refused with a list that offered 'qp', and 'auto' was missing)
            starts = [b for b in MERGE_METHODS if b not in MODEL_METHODS or get_merge_method(b).tensorwise]
            known = ([AUTO, *starts] if where == "method.start"
                     else [QP_CANDIDATE, *starts, *(e for e in MODEL_METHODS if start_method(e) is not None)])
        raise ConfigError(f"{where}: {unknown('start' if where == 'method.start' else 'merge method', name, known)}")
    method = get_merge_method(name)
    weights = params.get("weights")
    if isinstance(weights, (list, tuple)) and len(weights) != K:
        raise ConfigError(f"{where}.params.weights has {len(weights)} entries but there are {K} fine-tuned models "
                          f"(one weight per entry of models, in order)")
    if "include" in params or "exclude" in params:
        raise ConfigError(f"{where}.params: select tensors with the top-level 'layers', not include/exclude")
    if method.statistics is not None:
        check_params(name, params, where)
        return
    if not method.tensorwise:
        raise ConfigError(
            f"{where}: {name!r} needs calibration statistics of its own (not tensor-wise) and mergeqp merge "
            f"computes them only for {', '.join(statistics_methods())}: use it from Python with "
            f"merge_state_dicts, or use the QP"
        )
    try:
        method.parse(params)
    except MergeQPError as exc:
        raise ConfigError(f"{where}.params: {exc}") from None


def output_matrix(cfg: MergeConfig) -> np.ndarray | None:
    """``output.matrix`` read from its file (``None`` when the config names none)."""
    if cfg.output.matrix is None:
        return None
    return read_matrix(cfg.resolve(cfg.output.matrix), "output.matrix")



def _head_fields(cfg: MergeConfig, entry: Any, head: ClassifierHead | None, label_field: str | None) -> dict[str, Any]:
    """The plan's record of a model's classifier head (none: no fields)."""
    if head is None:
        return {}
    return {"head": str(cfg.resolve(entry.head)), "classes": head.classes, "label_field": label_field}


def model_heads(cfg: MergeConfig) -> list[ClassifierHead | None]:
    """Each model's classifier ``head`` read from its file (``None`` where it names none)."""
    heads: list[ClassifierHead | None] = []
    for name, m in zip(cfg.model_names(), cfg.models):
        if m.head is None:
            heads.append(None)
            continue
        where = f"models[{name}].head"
        try:
            weight, bias = read_head(cfg.resolve(m.head), where)
            heads.append(ClassifierHead.of(weight, bias, f"{where} ({m.head})"))
        except ValidationError as exc:
            raise ConfigError(str(exc)) from None
    return heads


def plan_groups(cfg: MergeConfig, sites: Sequence[LayerSite]) -> list[GroupPlan]:
    """The QPs a QP method solves over ``sites`` (its mode's groups, each one's variable count and
    solver), each checked to have a feasible set; none for a baseline."""
    if not cfg.method.is_qp:
        return []
    mode = get_merge_mode(cfg.method.mode)
    start = cfg.method.start
    at = mode.linearised_at(None if start is None else "chosen start" if is_auto_start(start) else start.name)
    K = len(cfg.models)
    groups = []
    for group in mode.groups(list(sites)):
        n = K * sum(planned_atoms(cfg, s) for s in group)
        groups.append(GroupPlan(tuple(s.name for s in group), n, _solver_name(cfg, n), at))
    _check_feasible_sets(cfg, groups)
    return groups


def check_config_object(cfg: Any, where: str) -> None:
    """A :class:`ValidationError` naming what ``where`` takes when ``cfg`` is not a merge config (a
    path or a mapping was a raw AttributeError from deep inside the plan)."""
    if isinstance(cfg, MergeConfig):
        return
    hint = (" (a path: read the file with mergeqp.load_config(path) first)" if isinstance(cfg, (str, os.PathLike))
            else " (mergeqp.load_config(path) reads a YAML file, mergeqp.config.parse_config(mapping) a mapping)")
    raise ValidationError(f"{where}: cfg must be a MergeConfig, got {type(cfg).__name__}{hint}")


def build_plan(cfg: MergeConfig) -> MergePlan:
    """Validate ``cfg`` against its inputs (no weights loaded) and return the plan."""
    check_config_object(cfg, "build_plan")
    check_paths(cfg)
    matrix = output_matrix(cfg)  # an unreadable or malformed matrix stops the run before any model is loaded
    heads = model_heads(cfg)
    _check_method(cfg)
    _check_output(cfg)
    names = cfg.model_names()
    base_path = cfg.resolve(cfg.base)
    try:
        base = open_checkpoint(base_path)
        fts = [open_checkpoint(cfg.resolve(m.path)) for m in cfg.models]
    except ValidationError as exc:
        raise ConfigError(str(exc)) from None
    if not base.is_hf_folder or base.config is None:
        raise ConfigError(f"base {base_path} must be a Hugging Face model folder (config.json + weights): "
                          f"its config gives the architecture")
    model = skeleton(base_path)
    check_decoder_inputs(model, base.config)
    fts = [stored_names(ck, base, model) for ck in fts]
    base, fts, align_notes = aligned_checkpoints(base, fts, model)
    config_notes = align_notes + check_architectures(base, list(zip(names, fts)))
    config_notes += [f"model {n!r}: {ck.path} holds weights but no config.json: it is read into the base's "
                     f"architecture, as a bare weight file is" for n, ck in zip(names, fts)
                     if ck.is_hf_folder and not ck.configured]
    not_causal = _not_causal(base.config)
    if not_causal is not None and output_metric(cfg.output.metric).scores_data and cfg.output.pool == "none":
        raise ConfigError(f"output.metric: cross_entropy scores next tokens (each position predicts the next "
                          f"token), but the base model is not a causal language model: {not_causal}; compare the "
                          f"fine-tunes' outputs instead (metric: euclidean or kl), or, for a classifier with a head "
                          f"per task, use pool: mean")

    if output_metric(cfg.output.metric).whitens and "logits" not in cfg.output.field.lower():
        # (a QA review, stop 76: kl on last_hidden_state ran, a softmax over 384 hidden features, and said nothing)
        config_notes.append(f"output.metric {cfg.output.metric} compares softmax distributions, taken here over "
                            f"the features of {cfg.output.field!r} as if they were logits; for hidden states the "
                            f"metric is euclidean (docs/hf.md)")

    tok_folder = cfg.resolve(cfg.tokenizer) if cfg.tokenizer else base_path
    needs_text = uses_prompts(cfg) and any(not is_tensor_file(m.prompts().path) for m in cfg.models if m.prompts())
    if needs_text and not has_tokenizer(tok_folder):
        hint = ("" if cfg.method.is_qp or statistics_method(cfg) or model_method_of(cfg) is not None
                else "; or set 'evaluate: false' to skip the evaluation")
        raise ConfigError(f"no tokenizer files in {tok_folder}: text prompts need the base model's tokenizer "
                          f"(or set 'tokenizer:' to a folder holding it){hint}")
    if has_tokenizer(tok_folder):
        check_tokenizers(tok_folder, [(n, ck.path) for n, ck in zip(names, fts) if ck.folder is not None])

    tasks = []
    all_texts: list[str] = []
    owners: list[str] = []  # whose prompt file each of all_texts came from
    holdout_notes: list[str] = []
    for i, (name, entry, ck) in enumerate(zip(names, cfg.models, fts)):
        src = entry.prompts()
        if src is None:
            tasks.append(TaskPlan(name, str(ck.path), None, 0, 0, 0, entry.weight,
                                  **_head_fields(cfg, entry, heads[i], None)))
            continue
        path = cfg.resolve(src.path)
        try:
            labels = None
            if is_tensor_file(path):
                data = read_tensor_inputs(path)
                if heads[i] is not None and src.label_field is not None:
                    labels = tensor_labels(data, src.label_field, str(path)).tolist()
                n = int(next(iter(data.values())).shape[0])
                if src.max_prompts is not None:
                    n = min(n, src.max_prompts)
            elif heads[i] is not None and src.label_field is not None:
                labels = read_labelled_prompts(path, src.field, src.label_field, src.max_prompts,
                                               classes=getattr(heads[i], "classes", None))[1]
                n = len(labels)
            else:
                texts = read_prompts(path, src.field, src.max_prompts)
                n = len(texts)
                all_texts.extend(texts)
                owners.extend([f"models[{name}].calibration ({src.path})"] * n)
                if cfg.evaluate and len(set(texts)) < n:
                    # (stop 56 review: 8 of 8 held-out prompts of a duplicated file were also fitted on);
                    # the run's own split (seeded), so only repeats on both sides are named
                    fitted, held_out = split_holdout(texts, cfg.holdout_for(i), cfg.seed + i)
                    both = set(fitted) & set(held_out)
                    if both:
                        holdout_notes.append(
                            f"models[{name}]: {len(both)} of the {len(held_out)} held-out prompts of {src.path} also "
                            f"stand among its fitted ones (the file repeats them): the held-out metrics are then "
                            f"not of unseen text (remove the repeats)")
            if labels and max(labels[:n]) >= heads[i].classes:
                at = int(np.argmax(np.asarray(labels[:n])))
                raise ValidationError(f"{path}: class label {labels[at]} (sample {at}, counted from 0) but the head has "
                                      f"{heads[i].classes} classes (labels are its row indices, 0 to "
                                      f"{heads[i].classes - 1})")
        except ValidationError as exc:
            raise ConfigError(f"models[{name}].calibration: {exc}") from None
        spec = cfg.holdout_for(i)
        held = holdout_count(n, spec) if cfg.evaluate else 0
        if cfg.evaluate and not (isinstance(spec, float) and not spec.is_integer()) and int(spec) > held:
            holdout_notes.append(
                f"models[{name}]: holdout {int(spec)} of {n} prompts would leave none for the "
                f"statistics; {held} held out, {n - held} used for calibration")
        elif cfg.evaluate and held == 0 and n > 0 and float(spec) > 0:
            # (stop 54 review: 1-3 prompts under the default 0.25 gave an empty held-out evaluation, silently)
            holdout_notes.append(
                f"models[{name}]: holdout {spec:g} of {n} prompt(s) is none: no held-out metric for this task "
                f"(more prompts, or calibration.holdout as a count, e.g. 1)")
        tasks.append(TaskPlan(name, str(ck.path), str(path), n, n - held, held, entry.weight,
                              **_head_fields(cfg, entry, heads[i], src.label_field)))

    all_sites = model_sites(model, base.names())
    if not all_sites:
        _no_sites(base, base_path, model)
    sites, extra = _select(cfg, all_sites, list(base.names()), shared_linear_layers(model))
    site_keys = {k for s in all_sites for k in s.keys}
    # what the patterns also match that a QP does not merge (stop 60 review: `layers: ["*"]` kept the norms
    # as the base's, and the note said to select them, which the user had done)
    qp_unmerged = ([] if not cfg.method.is_qp else
                   list(dict.fromkeys(t for pattern in cfg.layers for t in _pattern_tensors(pattern, base.names(),
                                                                                               site_keys))))
    _check_output_field(cfg, model)  # (after the layers: a config without architectures is named first)
    model_method = model_method_of(cfg)
    if model_method is not None and model_method.check_sites is not None:
        entry_call(model_method, "check_sites", model_method.check_sites, sites)
    vocab_key, vocab = config_int(base.config, "vocab_size") or ("vocab_size", None)  # (or in a text_config)
    groups: list[GroupPlan] = []
    notes: list[str] = [*config_notes, *holdout_notes]
    unprompted = _without_prompts(cfg)
    if (not cfg.method.is_qp and cfg.evaluate and not evaluates_baseline(cfg) and model_method is None
            and len(unprompted) < len(cfg.models)):  # (some have prompts: the user may expect one)
        notes.append(f"no evaluation: models {unprompted} have no calibration prompts (the calibration "
                     f"objective and the held-out error are measured only when every model has them)")
    if cfg.method.is_qp:
        mode = get_merge_mode(cfg.method.mode)
        entry = get_parametrisation(cfg.method.parametrisation)
        for site in sites:  # (a basis rank beyond a layer's rows was found after every target was computed)
            try:
                entry.check_site(site, cfg.method.parametrisation_options())
            except ValidationError as exc:
                raise ConfigError(f"method.parametrisation: {exc}") from None
        groups = plan_groups(cfg, sites)
        notes.extend(mode.plan_notes(qp_settings(cfg)))
        if (cfg.output.field == "logits" and cfg.output.restrict == "topk" and cfg.output.k is not None
                and isinstance(vocab, int) and cfg.output.k > vocab):
            raise ConfigError(f"output.k {cfg.output.k}: restrict topk keeps the k largest of the {vocab} logits per "
                              f"position ({vocab_key} in the base's config.json): k must be at most {vocab}")
        if (cfg.output.field == "logits" and cfg.output.restrict != "none" and cfg.output.k is not None and vocab
                and cfg.output.k >= vocab):
            notes.append(f"output.restrict {cfg.output.restrict} with k = {cfg.output.k} is not below the "
                         f"{vocab} compared values per position: it compares as many or more numbers than all of "
                         f"them (restrict: none is exact, and no larger)")
        arch = ((base.config or {}).get("architectures") or [""])[0] or ""
        if (cfg.output.field == "logits" and cfg.output.restrict == "none" and cfg.output.sketch is None and vocab
                and vocab > 4096 and not arch.endswith(CLASSIFIER_SUFFIXES)):  # (a classifier's logits are its labels)
            notes.append(f"vocabulary {vocab}: consider output.restrict projection|topk with k ~ 64..512 to keep "
                         f"the statistics tractable")
    if (matrix is not None and cfg.output.field == "logits" and cfg.output.pool == "none" and not any(heads)
            and not_causal is None and isinstance(vocab, int) and matrix.shape[0] != vocab):
        raise ConfigError(f"output.matrix {cfg.output.matrix}: it has {matrix.shape[0]} rows, but the compared output "
                          f"'logits' has {vocab} numbers per position ({vocab_key} in the base's config.json); the "
                          f"matrix needs one row per logit")
    _check_auto_batches(cfg, tasks)
    context = context_length(base.config or {})
    if context is not None and cfg.calibration.max_length > context[1]:
        notes.append(f"calibration.max_length {cfg.calibration.max_length} exceeds the model's context "
                     f"({context[0]} {context[1]}): prompts are truncated to {context[1]} tokens")
    plan = MergePlan(cfg, base, fts, ((base.config or {}).get("architectures") or ["?"])[0],
                     (base.config or {}).get("model_type"), sites, extra, tasks, groups, vocab,
                     str(tok_folder) if has_tokenizer(tok_folder) else None, notes=notes, skeleton=model,
                     output_matrix=matrix, heads=heads, not_causal=not_causal, qp_unmerged=qp_unmerged)
    if all_texts and has_tokenizer(tok_folder):
        plan.longest_prompt = _longest_prompt(tok_folder, all_texts, plan.max_length, owners)
    if cfg.method.is_qp and cfg.output.fold_head_flag is True:  # (found only after every target was computed)
        why = plan.output_spec().fold_obstacle()
        if why is not None:
            raise ConfigError(f"output.fold_head: true, but the head cannot be folded: {why}")
    choose_sketch(plan)
    drop_a_useless_sketch(plan)
    plan.memory = estimate_memory(plan)
    count_statistics(plan)
    jacobian, cap = plan.memory.get(OPTIMAL_JACOBIAN), cfg.method.basis_max_size
    if jacobian is not None and cap is not None and jacobian > parse_size(cap):
        plan.notes.append(f"method.basis_max_size {cap} is below the optimal basis's mean Jacobian at its upper "
                          f"bound ({human_bytes(jacobian)}, every prompt at the longest length): the run stops at "
                          f"the first layer whose Jacobian, with the real prompt lengths, exceeds it")
    return plan


def _not_causal(config: dict[str, Any]) -> str | None:
    """:func:`~.architectures.causal_lm_obstacle` of the base's ``config.json``, except for an
    architecture a user registered (its class name need not follow transformers' naming)."""
    archs = config.get("architectures") or []
    if archs and archs[0] in ARCHITECTURES:
        return None
    return causal_lm_obstacle(config)


def _longest_prompt(folder: Path, texts: Sequence[str], max_length: int, owners: Sequence[str] = ()) -> int | None:
    """Tokens of the longest of ``texts`` (at most ``max_length``) by the tokenizer in ``folder``, or
    ``None`` when it cannot say (the run names tokenizer errors itself). A prompt that tokenises to
    nothing is a :class:`ConfigError` naming its file (``owners[i]``: where ``texts[i]`` came from),
    as the run would say after loading every model (stop 55 review: ``--dry-run`` passed)."""
    try:
        tok = load_tokenizer(folder)
        ids = tok(list(texts), truncation=True, max_length=max_length)["input_ids"]
    except Exception:  # noqa: BLE001 - a tokenizer's own failure: the estimate falls back to max_length
        return None
    empty = [i for i, x in enumerate(ids) if len(x) == 0]
    if empty:
        where = owners[empty[0]] if len(owners) == len(texts) else "calibration"
        raise ConfigError(f"{where}: prompt(s) tokenise to nothing with the tokenizer of {folder}: "
                          f"{[texts[i] for i in empty[:3]]}")
    return max((len(x) for x in ids), default=None)


def _check_auto_batches(cfg: MergeConfig, tasks: Sequence[Any]) -> None:
    """``start: auto`` with folds needs two calibration batches per task, and a split that holds batches
    out (``start: auto`` with ``folds: 1``, a mode's early stopping such as ``trust_region``'s
    ``holdout``) a task with two or more: refused by the plan (so by ``--dry-run`` too), not after the
    models and the candidates' statistics were loaded (a review of stop 75: ``folds: 1``, which the
    first refusal suggested, and ``holdout`` passed the dry run and failed minutes into the run)."""
    m = cfg.method
    B = cfg.calibration.batch_size
    if not tasks:
        return
    some_two = any(calibration_batches(t.n_calibration, B) >= 2 for t in tasks)

    held = max((int(t.n_heldout) for t in tasks), default=0)

    def single(what: str) -> ConfigError:
        after = (f", after calibration.holdout kept up to {held} of each task's prompts for the held-out evaluation"
                 if held else "")
        return ConfigError(f"{what}: every task has a single calibration batch (at most calibration.batch_size = {B} "
                           f"prompts{after}), so none can be held out; use more prompts, a smaller "
                           f"calibration.batch_size{' or calibration.holdout' if held else ''}")

    if is_auto_start(m.start):
        assert m.start is not None
        params = parse_auto_params(m.start.params)
        folds = params.folds
        for t in tasks:
            n = too_few_batches(folds, t.n_calibration, B)
            if n is not None:
                held = (f", after calibration.holdout kept {t.n_heldout} of its prompts for the held-out evaluation"
                        if t.n_heldout else "")
                raise ConfigError(f"start: auto with {folds} folds: task {t.name!r} has {n} calibration batch(es) "
                                  f"({t.n_calibration} prompts in batches of {B}{held}), at least {MIN_FOLD_BATCHES} "
                                  f"are needed (more prompts, a smaller calibration.batch_size"
                                  f"{' or calibration.holdout' if held else ''}"
                                  f"{', or folds: 1' if some_two else ''})")
        if folds == 1 and not some_two:
            raise single(f"start: auto holdout {params.holdout:g}")
    fraction = get_merge_mode(m.mode).selection_holdout(m.mode_options) if m.name == "qp" else 0.0
    if fraction > 0 and not some_two:
        raise single(f"mode {m.mode}'s mode_options.holdout {fraction:g}")
