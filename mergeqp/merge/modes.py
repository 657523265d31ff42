"""Merge modes of the multi-layer QP merge, as registry entries (see :mod:`.multilayer` for the maths).

A :class:`MergeMode` owns everything that differs between modes: which sites form one QP
(:meth:`~MergeMode.groups`), where each QP is linearised (:meth:`~MergeMode.linearised_at`), the
config requirements (:attr:`~MergeMode.uses_start`, :attr:`~MergeMode.spans_layers`), what it
keeps in memory, how it runs on a live model (:meth:`~MergeMode.run`), its notes and the extra
fields of its report (:meth:`~MergeMode.prepare`, :meth:`~MergeMode.report_fields`).

Built in: ``single``, ``sequential``, ``hybrid`` and ``joint``. :func:`register_merge_mode` adds
one (then ``method.mode: NAME`` selects it in a ``mergeqp merge`` config).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import ValidationError, unknown
from .multilayer import (
    LayerRecord,
    MergeContext,
    apply_weights,
    calibration_objective,
    say,
    solve_group,
    with_exact,
)
from .sites import LayerSite, read_augmented, write_augmented

#: ``evaluate(model) -> {"calibration_objective": float, "heldout_mse": {task: float}}``
Evaluator = Callable[[Any], dict[str, Any]]


class MergeMode:
    """A registered merge mode. Subclass it and override what differs (at least :meth:`run`).

    ``name``: the config's ``method.mode``; ``description``: one line for docs and errors;
    ``uses_start``: the mode starts from a baseline merged on every tensor (``method.start``
    is required, and the model holds that merge when :meth:`run` is called); ``spans_layers``:
    one QP may couple several layers (per-layer constraints such as ``sign`` cannot be used).
    """

    name: str = ""
    description: str = ""
    uses_start: bool = False
    spans_layers: bool = False

    # ------------------------------------------------------------------ planning
    def groups(self, sites: Sequence[LayerSite]) -> list[tuple[LayerSite, ...]]:
        """The sites solved together, one tuple per QP, in solve order (default: one per site)."""
        return [(s,) for s in sites]

    def linearised_at(self, start: str | None) -> str:
        """Where each QP is linearised, for the plan (``start``: the hybrid start's method name)."""
        return "the base model"

    def plan_notes(self, settings: Any) -> list[str]:
        """Notes for the plan, from the QP settings (:class:`~.multilayer.QPSettings`)."""
        return []

    def models_in_memory(self, settings: Any) -> int:
        """Full models held at once (the working model, one fine-tuned model, any copies)."""
        return 2

    def deltas_in_memory(self, n_sites: int) -> int:
        """Sites whose residuals are held at once."""
        return 1

    # ------------------------------------------------------------------ running
    def prepare(self, ctx: MergeContext) -> Any:
        """Called before :meth:`run`; what it returns is given to :meth:`report_fields`."""
        return None

    def run(self, ctx: MergeContext, sites: Sequence[LayerSite]) -> list[LayerRecord]:
        """Merge ``sites`` in the live ``ctx.model`` (modified in place); one record per site."""
        raise NotImplementedError(f"merge mode {self.name!r} does not define run")

    def notes(self, records: Sequence[LayerRecord], constraints: Sequence[str], start: str | None) -> list[str]:
        """Notes for the report: the QP objective rose at some layer (d = 0 infeasible, or uncertified)."""
        worse = [r.layer for r in records
                 if r.objective_after > r.objective_before + 1e-9 * abs(r.objective_before)]
        if not worse:
            return []
        return [f"the QP objective rose at {worse}: the starting point (the current weights, d = 0) "
                f"is not in the constraint set {list(constraints)}, so its optimum can lie above "
                f"it (an L1 ball or simplex away from 0), or the solve was not certified"]

    def report_fields(self, ctx: MergeContext, sites: Sequence[LayerSite], records: Sequence[LayerRecord],
                      prepared: Any, merged: Mapping[str, Any], evaluate: Evaluator) -> dict[str, Any]:
        """Extra top-level fields of ``report.json`` (``merged``: the merged model's evaluation)."""
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def _solve_one_by_one(ctx: MergeContext, sites: Sequence[LayerSite], mode: str, relinearise: bool) -> list[LayerRecord]:
    """Sites in model order; each solved at the current model and applied before the next."""
    out: list[LayerRecord] = []
    for i, site in enumerate(sites):
        res = solve_group(ctx, [site], mode=mode, group=i, relinearise_offsets=relinearise)
        apply_weights(ctx, [site], res.new_weights)
        t = time.perf_counter()
        exact = calibration_objective(ctx)
        out.extend(with_exact(res.records, exact, time.perf_counter() - t))
        r = out[-1]
        say(ctx, f"[{mode} {i + 1}/{len(sites)}] {site.name}: J {r.objective_before:.6g} -> "
                 f"{r.objective_after:.6g} (exact {exact:.6g}), gap {r.certificate.get('fw_gap')}")
    return out


class SingleMode(MergeMode):
    """Each site linearised at the base model and solved on its own; all applied at the end. The
    exact objective after is measured with that site alone applied."""

    name = "single"
    description = "every layer solved independently at the base model"

    def run(self, ctx: MergeContext, sites: Sequence[LayerSite]) -> list[LayerRecord]:
        results = [solve_group(ctx, [site], mode=self.name, group=i, relinearise_offsets=False)
                   for i, site in enumerate(sites)]
        out: list[LayerRecord] = []
        for site, res in zip(sites, results):
            before = read_augmented(ctx.model, site)
            apply_weights(ctx, [site], res.new_weights)
            t = time.perf_counter()
            exact = calibration_objective(ctx)
            write_augmented(ctx.model, site, before)
            out.extend(with_exact(res.records, exact, time.perf_counter() - t))
        for site, res in zip(sites, results):
            apply_weights(ctx, [site], res.new_weights)
        return out


class SequentialMode(MergeMode):
    """The paper's scheme: layer by layer, statistics recomputed on the partially merged model."""

    name = "sequential"
    description = "layer by layer, each linearised at the partially merged model"

    def linearised_at(self, start: str | None) -> str:
        return "the partially merged model"

    def run(self, ctx: MergeContext, sites: Sequence[LayerSite]) -> list[LayerRecord]:
        return _solve_one_by_one(ctx, sites, self.name, relinearise=False)


class HybridMode(MergeMode):
    """A baseline merged on every tensor first (``start``), then the selected sites refined
    sequentially, linearised at the baseline's weights (its offset accounted for)."""

    name = "hybrid"
    description = "the 'start' baseline on all tensors, then the layers refined sequentially"
    uses_start = True

    def linearised_at(self, start: str | None) -> str:
        return f"the {start or ''} merge"

    def run(self, ctx: MergeContext, sites: Sequence[LayerSite]) -> list[LayerRecord]:
        return _solve_one_by_one(ctx, sites, self.name, relinearise=True)

    def notes(self, records: Sequence[LayerRecord], constraints: Sequence[str], start: str | None) -> list[str]:
        worse = [r.layer for r in records if r.objective_after_exact > r.objective_before]
        if not worse:
            return []
        return [f"hybrid: the QP step raised the exact calibration objective at {worse}: the QP's merged weight "
                f"is W_base + sum_a d_a B_a, and the {start} weight of a layer is a feasible point "
                f"only when it has that form (task arithmetic / soup with rows or scalar, not TIES, DARE, "
                f"Fisher or RegMean); the linearisation error can do it too"]


class JointMode(MergeMode):
    """One first-order QP over every site's coefficients, linearised at the base; optionally
    compared with the sequential QP on a copy of the model (``compare_sequential``)."""

    name = "joint"
    description = "one QP over all layers' coefficients, linearised at the base model"
    spans_layers = True

    def groups(self, sites: Sequence[LayerSite]) -> list[tuple[LayerSite, ...]]:
        return [tuple(sites)]

    def plan_notes(self, settings: Any) -> list[str]:
        return ["joint mode also runs the sequential QP on the same layers for the report's comparison"
                if settings.compare_sequential else "joint mode: no sequential comparison (compare_sequential: false)"]

    def models_in_memory(self, settings: Any) -> int:
        return 2 + (1 if settings.compare_sequential else 0)

    def deltas_in_memory(self, n_sites: int) -> int:
        return n_sites

    def prepare(self, ctx: MergeContext) -> Any:
        return copy.deepcopy(ctx.model) if ctx.settings.compare_sequential else None

    def run(self, ctx: MergeContext, sites: Sequence[LayerSite]) -> list[LayerRecord]:
        res = solve_group(ctx, list(sites), mode=self.name, group=0, relinearise_offsets=False)
        apply_weights(ctx, sites, res.new_weights)
        t = time.perf_counter()
        exact = calibration_objective(ctx)
        records = with_exact(res.records, exact, time.perf_counter() - t)
        say(ctx, f"[joint] {len(sites)} layers, {res.records[0].n_variables} variables: J "
                 f"{records[0].objective_before:.6g} -> {records[0].objective_after:.6g} (exact {exact:.6g})")
        return records

    def report_fields(self, ctx: MergeContext, sites: Sequence[LayerSite], records: Sequence[LayerRecord],
                      prepared: Any, merged: Mapping[str, Any], evaluate: Evaluator) -> dict[str, Any]:
        if prepared is None:
            return {}
        t = time.perf_counter()
        seq_ctx = MergeContext(prepared, ctx.weights, ctx.tasks, ctx.spec, ctx.settings, ctx.device,
                               ctx.model_names, ctx.progress, ctx.log)
        seq_records = get_merge_mode("sequential").run(seq_ctx, sites)
        seq_eval = evaluate(prepared)
        return {"joint_vs_sequential": {
            "joint": {"calibration_objective": merged["calibration_objective"],
                      "heldout_mse": merged["heldout_mse"],
                      "qp_objective": records[0].objective_after,
                      "seconds": records[0].seconds},
            "sequential": {"calibration_objective": seq_eval["calibration_objective"],
                           "heldout_mse": seq_eval["heldout_mse"],
                           "layers": [r.to_json() for r in seq_records],
                           "seconds": time.perf_counter() - t},
        }}


MERGE_MODES: dict[str, MergeMode] = {}


def register_merge_mode(mode: MergeMode) -> MergeMode:
    """Add ``mode`` under ``mode.name`` (explicit registration; a duplicate name is an error).
    Once registered, ``method.mode: NAME`` selects it in a ``mergeqp merge`` config."""
    if not isinstance(mode, MergeMode):
        raise ValidationError(f"register_merge_mode expects a MergeMode instance, got {type(mode).__name__}")
    if not mode.name or mode.name in MERGE_MODES:
        raise ValidationError(f"merge mode name {mode.name!r} is empty or already taken")
    MERGE_MODES[mode.name] = mode
    return mode


def get_merge_mode(name: str) -> MergeMode:
    """The registered mode ``name`` (an unknown name lists the valid ones)."""
    if name not in MERGE_MODES:
        raise unknown("merge mode", name, MERGE_MODES)
    return MERGE_MODES[name]


def run_mode(ctx: MergeContext, mode: str, sites: Sequence[LayerSite]) -> list[LayerRecord]:
    """Run the registered mode ``mode`` on ``sites`` of the live model."""
    entry = get_merge_mode(mode)
    if not sites:
        raise ValidationError("no layers to merge")
    return entry.run(ctx, sites)


for _mode in (SingleMode(), SequentialMode(), HybridMode(), JointMode()):
    register_merge_mode(_mode)
del _mode

__all__ = ["MERGE_MODES", "HybridMode", "JointMode", "MergeMode", "SequentialMode", "SingleMode",
           "get_merge_mode", "register_merge_mode", "run_mode"]
