"""What one calibration batch's QP statistics cost, as the plan counts it without loading a weight, and the
choices made from it: ``output.sketch: auto``, a plan note where the cost is large, and a sketch left out
where it would compare no fewer numbers than the exact statistics (``docs/hf.md``)."""

from __future__ import annotations

from dataclasses import replace

from ..lm import MAX_SKETCH_ENTRIES
from ..stats.linearise import choose_mode
from .merge_plan import MergePlan, StatisticsWork, compared_width, counts_outputs, design_outputs, hidden_and_folds
from .settings import planned_atoms


#: multiply-adds per calibration batch of forming a QP's H above which the plan says what they cost,
#: and ``output.sketch: auto`` takes a sketch (a stop 56 review, SmolLM2 on 2 CPU cores: 21-24 s per
#: batch at 3.7e11 (one down_proj), 150-180 s at 1.5e12 (two))
STATISTICS_BUDGET = 3e11
#: ``output.sketch: auto``'s ``s`` where it sketches: H's relative error about ``sqrt(2 / s)`` (9%)
#: per prompt, averaging over the prompts (docs/hf.md)
AUTO_SKETCH = 256


def statistics_work(plan: MergePlan, sketch: int | None) -> StatisticsWork | None:
    """:class:`StatisticsWork` of the plan's statistics with ``sketch`` (``None``: exact), at its
    upper bound (every prompt at the longest length); ``None`` for a method without QP statistics."""
    cfg = plan.config
    width = compared_width(plan)
    if not cfg.method.is_qp or not plan.groups or width is None:
        return None
    spec = replace(plan.output_spec(), sketch=sketch)
    hidden, folds = hidden_and_folds(plan, spec)
    per, per_prompt = width
    outputs = design_outputs(spec, folds, 1 if per_prompt else plan.batch_length, per, hidden)
    return StatisticsWork(plan.batch_prompts, outputs, max(g.n_variables for g in plan.groups),
                          derivative_work(plan, outputs, folds, hidden))


def derivative_work(plan: MergePlan, outputs: int, folds: bool, hidden: int) -> float | None:
    """Multiply-adds of one calibration batch's derivative passes for the plan's costliest QP, every
    prompt at the longest length: at each site of the QP, in the mode the run takes there
    (:func:`choose_mode`), ``outputs`` VJPs (reverse) or ``K x atoms`` JVPs (forward), each through
    the matrix products after the site in the model's module order (:attr:`MergePlan.matmul_layers`;
    the backbone's where the head ``folds``, plus the fold's projection from the final ``hidden``
    width), for every prompt and
    position, plus one forward pass of the model per site and the site's own products (the models'
    changes applied to its input; in reverse mode the Jacobian's contraction with them). Module order
    approximates what lies downstream; attention's own products are not counted. ``None`` without a
    skeleton. (Stop 57: the README's merge of four ``down_proj`` spent 214 s per trust-region step in
    these passes, while H's formation, the one cost the plan counted, was a tenth of its note's
    threshold.)"""
    if plan.skeleton is None or not plan.groups:
        return None
    layers = plan.matmul_layers
    order = {name: i for i, (name, _, _) in enumerate(layers)}
    model_madds = sum(madds for _, madds, _ in layers)
    cfg = plan.config
    K = len(cfg.models)
    by_name = {s.name: s for s in plan.sites}
    tokens = plan.batch_prompts * plan.batch_length
    best = 0.0
    for g in plan.groups:
        work = 0.0
        for name in g.sites:
            site = by_name.get(name)
            if site is None or name not in order:
                continue
            tangents = K * planned_atoms(cfg, site)
            reverse = choose_mode(cfg.method.jacobian_mode, outputs, tangents) == "reverse"
            passes = outputs if reverse else tangents
            after = sum(madds for _, madds, in_backbone in layers[order[name] + 1:] if in_backbone or not folds)
            # the site's own products: each model's change applied to the layer's input (K r m1), and in
            # reverse mode the per-sample Jacobian contracted with it (outputs x K r; stop 58 review: the
            # last down_proj, with nothing after it, was 3.6x under without it)
            own = K * site.r * site.m1 + (outputs * K * site.r if reverse else 0)
            work += float(tokens) * (passes * after + model_madds + own)
            if folds:  # each pass's hidden states through the folded head's projection (hidden x its width)
                work += float(plan.batch_prompts) * passes * outputs * hidden
        best = max(best, work)
    return best


def choose_sketch(plan: MergePlan) -> None:
    """``output.sketch: auto``: a sketch of :data:`AUTO_SKETCH` per prompt where the exact
    statistics of one batch would cost more than :data:`STATISTICS_BUDGET` multiply-adds, the
    sketch compares fewer numbers than the prompt and at least halves that cost; exact otherwise. A note says which, and why.
    (Stop 57: docs/hf.md's example, ``restrict: projection, k: 256`` on two of SmolLM2's
    ``down_proj``, formed H from 124,928 rows per batch, 150-180 s each, half an hour per
    trust-region step.) The work counted is :attr:`StatisticsWork.total` (H and the derivative passes);
    a sketch that would not halve it (forward-mode JVPs, which it does not shrink, dominating) is not
    taken."""
    cfg = plan.config
    if cfg.output.sketch != "auto" or not cfg.method.is_qp or not plan.groups:
        return
    if not counts_outputs(plan):
        plan.add_qp_note("output.sketch auto: the statistics are exact (the plan counts the compared numbers of "
                          "a language model's logits only, and this output is another: give output.sketch: s to "
                          "sketch it)")
        return
    exact = statistics_work(plan, None)
    if exact is None:
        return
    entries = exact.prompts * AUTO_SKETCH * exact.outputs
    sketched = statistics_work(plan, AUTO_SKETCH)
    assert sketched is not None
    why = None
    if exact.total <= STATISTICS_BUDGET:
        why = f"about {exact.total:.2g} multiply-adds per batch, within {STATISTICS_BUDGET:.0g}"
    elif AUTO_SKETCH >= exact.outputs:
        why = f"a sketch of {AUTO_SKETCH} is not below the {exact.outputs:,} numbers each prompt compares"
    elif entries > MAX_SKETCH_ENTRIES:
        why = (f"a sketch of {AUTO_SKETCH} of {exact.outputs:,} compared outputs per prompt would draw {entries:,} "
               f"entries per batch, above {MAX_SKETCH_ENTRIES:,}: restrict the output first (restrict: "
               f"projection|topk) or use smaller batches")
    elif sketched.total > 0.5 * exact.total:
        why = (f"a sketch of {AUTO_SKETCH} would cut a batch's {exact.total:.2g} multiply-adds to {sketched.total:.2g} "
               f"only: the derivative passes, {exact.derivatives or 0:.2g}, do not shrink with it (one JVP per "
               f"coefficient direction in forward mode)")
    if why is not None:
        plan.add_qp_note(f"output.sketch auto: the statistics are exact ({why})")
        return
    plan.auto_sketch = AUTO_SKETCH
    plan.add_qp_note(
        f"output.sketch auto: a sketch of {AUTO_SKETCH} per prompt, since the exact statistics would cost about "
        f"{exact.total:.2g} multiply-adds per batch (above {STATISTICS_BUDGET:.0g}; {exact.parts()}); "
        f"sketched: {sketched.total:.2g} ({sketched.parts()}). H is then an unbiased estimate (relative error "
        f"about {(2 / AUTO_SKETCH) ** 0.5:.0%} per prompt, averaging over the prompts), g and c exact, and each QP's "
        f"certificate is of the sketched QP; the calibration objective the modes measure (the trust region's "
        f"true decrease, the report's) is exact. output.sketch: none keeps the statistics exact")


#: what reviews measured the statistics to take per batch on 2 CPU cores (SmolLM2-135M, 8 prompts of up
#: to 61 tokens; their multiply-adds counted by :func:`statistics_work` at the plan's upper bound)
MEASURED_COST = ("reviews measured 21-24 s per batch at 4.4e11 (one down_proj, projection k 256), 150-180 s at "
                 "4.6e12 (two, forward-mode JVPs) and 14-20 s at 9.5e11 (four, cross-entropy top 16, sketch 64) on "
                 "2 CPU cores")


def count_statistics(plan: MergePlan) -> None:
    """Count one calibration batch's statistics (:func:`statistics_work` with the sketch the run takes)
    into :attr:`MergePlan.statistics`, which the dry run prints, and add a plan note when they need more than
    :data:`STATISTICS_BUDGET` multiply-adds (:func:`statistics_work`: H's formation from the batch's
    design of ``prompts x compared outputs`` rows and n columns, rows x n^2, and the derivative passes
    that give it), at the plan's upper bound (every prompt at the longest length), for every batch of
    every linearisation. (Stop 56 review: a real two-layer merge ran 150-180 s per batch, half an hour
    per trust-region step, with no word from ``--dry-run``; stop 57: four layers' derivative passes, 214
    s per step, were not counted.)"""
    cost = plan.statistics = statistics_work(plan, plan.sketch)
    if cost is None or cost.total <= STATISTICS_BUDGET:
        return
    size = plan.config.calibration.batch_size
    batches = sum(-(-t.n_calibration // size) for t in plan.tasks)
    # (under sketch: auto its own note says why it stayed exact)
    advice = (f"; output: {{sketch: auto}} (or sketch: s) makes it {cost.prompts} x s rows (docs/hf.md)"
              if plan.sketch is None and plan.config.output.sketch != "auto" else "")
    plan.add_qp_note(
        f"statistics cost: each calibration batch costs about {cost.total:.2g} multiply-adds with every prompt at the "
        f"longest length "
        f"({cost.parts()}; {MEASURED_COST}), for each of {batches} batches of every linearisation (each "
        f"sequential layer, each trust-region step){advice}")


def drop_a_useless_sketch(plan: MergePlan) -> None:
    """Leave ``output.sketch: s`` out, with a note, where a language model's prompts compare at most
    ``s`` numbers each (positions x compared numbers per position, after restriction, not counting
    a fold of the head, which the run may refuse): the exact statistics are then cheaper and exact. (Stop 54 review: `sketch: 100000` on a tiny model
    whose prompts compare 192 numbers took 2 minutes and 5.7 GB instead of 5 s, with no word.)"""
    cfg = plan.config
    s = cfg.output.sketch
    if not cfg.method.is_qp or s is None or s == "auto" or cfg.output.field != "logits" or not plan.vocab_size:
        return
    spec = plan.output_spec()
    hidden, _ = hidden_and_folds(plan, spec)
    # counted unfolded: the run may still refuse to fold the head (a fine-tune that changed it, a
    # merge site outside the backbone), and then compares every logit (stop 54 review)
    exact = design_outputs(replace(spec, sketch=None), False, plan.batch_length, plan.per_position, hidden)
    if s >= exact:
        plan.sketch_dropped = True
        plan.notes.append(f"output.sketch {s} is not below the {exact} numbers each prompt compares at most "
                          f"({plan.batch_length} positions x {exact // max(plan.batch_length, 1)}, after "
                          f"restriction, before any fold of the head): the statistics are computed exactly instead "
                          f"(cheaper, and without the sketch's noise)")
