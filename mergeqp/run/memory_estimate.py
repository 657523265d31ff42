"""The plan's peak-memory estimate, by item, and each QP's memory model at the plan's upper bounds (what
``mergeqp merge --dry-run`` prints and warns of; ``docs/hf.md``), from metadata alone."""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from ..io.checkpoint import DTYPE_BYTES
from ..io.memory import SiteMemory, design_bytes, estimate_site_memory
from ..lm import OutputSpec, keeps_head_targets, linear_head
from ..merge.baseline_residuals import statistics_baselines
from ..merge.calibrated import statistics_methods, statistics_of
from ..merge.outputbasis import basis_pass_bytes, jacobian_bytes
from ..merge.sites import model_sites
from ..stats.linearise import choose_mode
from ..stats.parametrisation import get_parametrisation
from .architectures import lower_blocks
from .auto import held_out_fit, is_auto_start, parse_auto_params, statistics_candidates
from .merge_plan import MergePlan, design_outputs, hidden_and_folds
from .model_methods import entry_call, model_method_of, start_statistics
from .settings import DEFAULT_CHUNK_BYTES, evaluates_baseline, planned_atoms, qp_settings, statistics_method


def _targets_bytes(plan: MergePlan, spec: OutputSpec, prompts: int, held: int, T: int, per_pos: int) -> int:
    """The fine-tunes' targets of ``spec`` on the calibration and held-out prompts (float64): ``per_pos``
    compared numbers per position, every logit on the held-out ones, or the final hidden state
    where the targets are kept as it (:class:`~mergeqp.lm.HeadTargets`: a linear head much wider
    than its input, every logit compared), and a whitening metric's distributions; the fold's hidden states beside restricted targets
    are not counted."""
    head = linear_head(plan.skeleton) if plan.skeleton is not None else None
    held_spec = plan.heldout_spec()

    def width(s: OutputSpec, whole: int) -> int:
        if head is not None and keeps_head_targets(s, int(head.out_features), int(head.in_features)):
            return int(head.in_features)
        return whole

    # a whitening metric's distributions beside the targets: one number per entry before any projection
    # (stop 59 review: left out, the dry run passed what the run's own memory check refused)
    spread = 0
    if spec.output_metric.whitens:
        spread = int(spec.k) if spec.restrict == "topk" else (plan.vocab_size or per_pos) if spec.field == "logits" \
            else per_pos
    return (prompts * T * (width(spec, per_pos) + spread) * 8
            + held * T * width(held_spec, plan.vocab_size or per_pos) * 8)


def qp_site_memory(plan: MergePlan) -> list[SiteMemory]:
    """Each QP's memory model (:func:`mergeqp.io.memory.estimate_site_memory`: the check the run makes
    at its first batch, with the sizes it measures) at the plan's upper bounds: batches of
    ``calibration.batch_size`` prompts at the longest length, each site's derivatives in the mode the
    run takes for it (``jacobian_mode``; ``auto`` counts, as the run does: ``K x atoms`` JVPs against
    one VJP per compared output), through the layers the run differentiates (the backbone's where the
    head folds: stop 57 review, a SmolLM2 dry run counted VJP chunks 49,152 wide, the vocabulary, and
    warned of 57.2 GiB where the run's own check, through 1,536-wide layers, passed). ``[]`` for a
    baseline."""
    cfg = plan.config
    if not cfg.method.is_qp:
        return []
    T = plan.batch_length
    spec = plan.output_spec()
    hidden, folds = hidden_and_folds(plan, spec)
    outputs = design_outputs(spec, folds, T, plan.per_position, hidden)
    batch = {"samples": plan.batch_prompts, "outputs": outputs, "itemsize": DTYPE_BYTES[cfg.dtype], "positions": T,
             "chunk": cfg.method.chunk_size, "widest": plan.derivative_width(folds)}
    by_name = {s.name: s for s in plan.sites}
    K = len(cfg.models)
    out = []
    for g in plan.groups:
        sites = [by_name[name] for name in g.sites if name in by_name]
        reverse = [choose_mode(cfg.method.jacobian_mode, outputs, K * planned_atoms(cfg, s)) == "reverse" for s in sites]
        out.append(estimate_site_memory(
            ", ".join(g.sites), g.n_variables, K, site_width=max((s.r for s in sites), default=0),
            tangent_atoms=sum(K * planned_atoms(cfg, s) for s, rev in zip(sites, reverse) if not rev),
            jacobian_width=max((s.r for s, rev in zip(sites, reverse) if rev), default=0), **batch))
    return out


#: the memory estimate's item of one batch's derivatives (the largest QP's, as its memory model counts them)
DERIVATIVES = ("derivatives (one batch: the atoms' tangents or the sites' Jacobians, and one vectorised JVP / VJP "
               "chunk)")
#: the memory estimate's item of the optimal basis's mean Jacobian (the largest layer's)
OPTIMAL_JACOBIAN = "optimal-basis mean Jacobian (one layer)"
#: the memory estimate's item of the optimal basis's pass (one chunk of ``chunk_size`` tangents)
BASIS_PASS = "optimal-basis pass (a chunk of vectorised JVPs through the head, shrunk at run time to fit)"


def basis_pass_tangent(plan: MergePlan) -> int | None:
    """Bytes of one tangent of the optimal basis's pass at the plan's upper bounds (``None``: no such
    pass): its estimate's chunk over the chunk's tangents (the dry run warns when not one fits)."""
    chunk_bytes = plan.memory.get(BASIS_PASS)
    if chunk_bytes is None:
        return None
    tangents = min(plan.config.method.chunk_size, max((s.r for s in plan.sites), default=0))
    return chunk_bytes // tangents if tangents else chunk_bytes


def estimate_memory(plan: MergePlan) -> dict[str, int]:
    """Peak-memory estimate in bytes, by item (see ``docs/hf.md``)."""
    cfg = plan.config
    elem = DTYPE_BYTES[cfg.dtype]
    numel = sum(plan.base.info(n).numel for n in plan.base.names())
    K = len(cfg.models)
    T = plan.batch_length
    B = plan.batch_prompts
    per_pos = plan.per_position
    prompts = sum(t.n_calibration for t in plan.tasks)
    held = sum(t.n_heldout for t in plan.tasks)
    spec = plan.output_spec()
    targets = _targets_bytes(plan, spec, prompts, held, T, per_pos)
    stats_method = statistics_method(cfg)
    if not cfg.method.is_qp:  # streamed in chunks: K + 2 copies of one chunk
        merged = sum(plan.base.info(k).nbytes for k in plan.merged_keys())
        out = {"merged tensors (one chunk)": min(merged, DEFAULT_CHUNK_BYTES) * (K + 2)}
        model_method = model_method_of(cfg)
        if stats_method is not None or evaluates_baseline(cfg) or model_method is not None:
            out["models (one at a time)"] = numel * elem
        if stats_method is not None:
            out[f"{stats_method} statistics"] = _statistics_bytes(plan, stats_method, plan.merged_keys())
        if model_method is not None and model_method.memory is not None:
            parsed = entry_call(model_method, "parse", model_method.parse, cfg.method.params, "method")
            def statistics_bytes(name: str) -> int:
                if statistics_of(name) is None:
                    raise ConfigError(f"model method {model_method.name!r}: memory asked for the statistics of "
                                      f"{name!r}, which declares none (those that do: "
                                      f"{', '.join(statistics_methods())})")
                return _statistics_bytes(plan, name, plan.merged_keys())

            items = entry_call(model_method, "memory", model_method.memory, parsed, statistics_bytes)
            if not isinstance(items, dict) or not all(isinstance(k, str) and isinstance(v, (int, np.integer))
                                                      and not isinstance(v, bool) and v >= 0 for k, v in items.items()):
                raise ConfigError(f"model method {model_method.name!r}: memory(parsed, statistics_bytes) must return a "
                                  f"dict of item name -> bytes (an integer >= 0), got {items!r:.120}")
            out.update({k: int(v) for k, v in items.items()})
        if evaluates_baseline(cfg) or model_method is not None:
            out["targets"] = targets
        return out
    m = cfg.method
    mode = plan.mode
    resident = numel
    if cfg.lazy and plan.skeleton is not None:  # the blocks below the sites stay on disk, one read at a time
        sizes = [sum(p.numel() for p in b.parameters()) for b in lower_blocks(plan.sites)(plan.skeleton)]
        resident = numel - sum(sizes) + max(sizes, default=0)
    out = {"models" + (" (resident: lazy)" if cfg.lazy else ""):
           mode.models_in_memory(qp_settings(cfg)) * resident * elem}
    if is_auto_start(m.start):
        assert m.start is not None
        auto = parse_auto_params(m.start.params)
        fits, held_fit = held_out_fit(auto, mode.start_holdout(m.mode_options))
        out["start candidates (the best, its fit without the held-out batches, the current; all tensors)"] = (
            (2 if held_fit is None else 3) * plan.base.total_bytes)
        for need in statistics_candidates(auto, statistics_of, plan.start_skips, start_statistics):
            label = (f"{need.label} statistics ({fits} fit(s), if every tensor differs from the base: the run "
                     f"collects them for those that do)")
            out[label] = fits * _statistics_bytes(plan, need.name, plan.float_keys())
    elif mode.uses_start and m.start is not None:
        # a start fitted to data is also fitted without the batches the mode holds out from it
        held = stats_method is not None and mode.start_holdout(m.mode_options) > 0
        out["start merge (all tensors" + (", and its fit without the held-out batches)" if held else ")")] = (
            (2 if held else 1) * plan.base.total_bytes)
        if stats_method is not None:
            out[f"{stats_method} statistics (all tensors" + (", 2 fits)" if held else ")")] = (
                (2 if held else 1) * _statistics_bytes(plan, stats_method, plan.float_keys()))
    site_keys = plan.site_keys()
    for name, _ in statistics_baselines(m.baseline_choices):
        out[f"{name} statistics (baseline atoms)"] = _statistics_bytes(plan, name, site_keys)
        out[f"{name} merge (baseline atoms)"] = sum(plan.base.info(k).nbytes for k in site_keys)
    if get_parametrisation(m.parametrisation).needs_output_jacobian(m.parametrisation_options()):
        # upper bound: prompts of max_length tokens; tensor inputs: per-sample outputs unknown here
        out[OPTIMAL_JACOBIAN] = max((jacobian_bytes(T * per_pos, s.r) for s in plan.sites), default=0)
        out["optimal-basis residuals"] = prompts * T * per_pos * 8
        # its pass carries up to chunk_size tangents through the unfolded head at once (the run shrinks
        # the chunk to what the memory holds, down to one tangent)
        r_max = max((s.r for s in plan.sites), default=0)
        out[BASIS_PASS] = basis_pass_bytes(B * T, r_max, plan.widest, elem, min(m.chunk_size, r_max))
    n_max = max((g.n_variables for g in plan.groups), default=0)
    n_tasks = len(cfg.models)
    out["statistics"] = n_tasks * n_max * n_max * 8
    hidden, folds = hidden_and_folds(plan, spec)
    out["design (one batch: prompts x compared outputs x n, with its float64 copies)"] = design_bytes(
        B, design_outputs(spec, folds, T, per_pos, hidden), n_max, elem)
    deltas = max((K * s.r * s.m1 * 8 for s in plan.sites), default=0)
    out["deltas"] = deltas * mode.deltas_in_memory(len(plan.sites))
    out["targets"] = targets
    # the QPs' own memory model (what --dry-run's warning and the run's first-batch check count), its
    # derivatives part: the atoms' tangents or the sites' Jacobians and one JVP / VJP chunk (stop 57
    # review: an estimate of its own here said 8.6 GiB beside a warning's 57.2 GiB batch)
    out[DERIVATIVES] = max((site.derivatives for site in qp_site_memory(plan)), default=0)
    return out


def _statistics_bytes(plan: MergePlan, method: str, keys: list[str]) -> int:
    """Float64 bytes of K models' calibration statistics of ``method`` for ``keys`` (its own rule)."""
    spec = statistics_of(method)
    assert spec is not None
    sites = model_sites(plan.skeleton, plan.base.names()) if plan.skeleton is not None else plan.sites
    return spec.nbytes(len(plan.config.models), keys, lambda k: plan.base.info(k).numel, sites)
