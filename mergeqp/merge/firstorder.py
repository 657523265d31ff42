"""First-order merge statistics at one or several layers of a live model, by Jacobian-vector products.

Given a model at a linearisation point (the base, a partially merged model, or a baseline merge),
merge sites ``l = 1..L`` with their *original* residuals ``delta_k^(l) = W_k^(l) - W_base^(l)``
(``(K, r_l, m1_l)``, augmented with the bias column) and a parametrisation per site, the compared
output of sample ``j`` is, to first order in every site's update at once,

    h_j(d) ~= h_j + sum_l A_j^(l) (d^(l) - d0^(l)),

where ``A_j^(l)[:, (k, a)]`` is the output's directional derivative along the layer-output
perturbation ``B_(k,a)^(l) z_j^(l)`` (the atom's activation). The derivatives come from the
linearisation core (:mod:`mergeqp.stats.linearise`), through a forward hook that adds a
perturbation to the site's output. By default one ``torch.func.jvp`` per atom (vectorised over
atoms with ``vmap``), so no ``(c, T r)`` Jacobian is ever formed: the cost is ``n`` JVPs per
batch for ``n`` atoms; ``jacobian_mode="reverse"`` (or ``"auto"`` when ``c <= n``) takes ``c``
VJPs for ``c`` compared outputs instead. When the model's site weight is not the base weight (hybrid
merging), its offset ``W_cur - W_base`` is pushed forward too and subtracted, so that the
quadratic model is expressed in the absolute coefficients ``d`` (merged weight
``W_base + sum d_a B_a``) while being accurate around the current weights.

With ``b_j = h_j - y_j - A_j^off`` the statistics per task ``t`` are ``H_t = 2 sum A_j'A_j``,
``g_t = 2 sum A_j'b_j``, ``c_t = sum ||b_j||^2`` (float64), so that
``J(d) = sum_t w_t (1/2 d'H_t d + g_t'd + c_t)``. With several sites the QP is *joint*: its
Hessian holds the cross-layer blocks ``A^(l)'A^(l')``; it is convex (a Gram matrix) and is the
first-order model of the non-convex multi-layer objective.

The layout of ``d`` is ``(K, N)`` with ``N = sum_l n_atoms_l`` (sites concatenated along atoms),
row-major, as :class:`~mergeqp.problem.MergeQP` requires.

Energy fraction (reported per site and jointly): ``sum_j ||P_j b_j||^2 / sum_j ||b_j||^2`` with
``P_j`` the projector onto ``range(A_j)``, the output directions the atoms can reach with
per-sample coefficients (the relaxed problem of the paper's Theorem 4.1 for the atoms' span).
For a vector-valued layer output (``T = 1``) ``range(A_j) = span{L_j q}``, the paper's
definition; for sequences the coefficients are shared across positions, so the span is that of
the ``K n_atoms`` atom responses rather than all of ``range(L_j)``. ``c_t (1 - fraction)``
lower-bounds the (per-sample relaxed) objective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from ..errors import ValidationError
from ..io.distributed import agree_everywhere, current_group
from ..io.memory import (  # noqa: F401 - DESIGN_COPIES_FLOAT64: re-exported for the design check's callers
    ADVICE,
    DESIGN_COPIES_FLOAT64,
    SiteMemory,
    available_memory_bytes,
    check_site_memory,
    design_bytes,
    estimate_site_memory,
    human_bytes,
    memory_budget,
)
from ..lm import (
    MAX_SKETCH_ENTRIES,
    CrossEntropyExpansion,
    FoldedHead,
    OutputSpec,
    TargetBatch,
    backbone,
    data_logits,
    fold_decision,
    last_hidden,
    prepare_fold,
)
from ..problem import MergeQP
from ..stats.gauss_newton import GaussNewtonSums
from ..stats.parametrisation import checked_design, checked_tangents, tie_statistics
from ..stats.hooks import hooked_layers
from ..stats.linearise import (
    OutputDerivatives,
    check_mode,
    choose_mode,
    leads_with_samples,
    perturbed_output,
    run_recorded,
)
from .sites import LayerSite, append_ones, site_module


@dataclass(frozen=True, eq=False)
class SiteAtoms:
    """One site's atoms: its parametrisation (a :class:`mergeqp.stats.parametrisation.Parametrisation`),
    original deltas ``(K, r, m1)`` (float64 torch), and the offset ``W_cur - W_base`` of the
    model's current weight (``(r, m1)``) or ``None`` when the model holds the base weight."""

    site: LayerSite
    param: Any
    deltas: Any
    offset: Any = None

    def __post_init__(self) -> None:
        K, r, m1 = (int(s) for s in self.deltas.shape)
        if (r, m1) != (self.site.r, self.site.m1):
            raise ValidationError(f"deltas of {self.site.name!r} have shape {(K, r, m1)}, expected (K, {self.site.r}, {self.site.m1})")
        self.param.check(r, m1)

    @property
    def K(self) -> int:
        return int(self.deltas.shape[0])

    @property
    def n_atoms(self) -> int:
        return int(self.param.n_atoms(self.site.r, self.site.m1))

    def atom_names(self) -> tuple[str, ...]:
        return tuple(self.param.atom_names(self.site.r, self.site.m1, self.site.has_bias))

    def tangents(self, Z: Any, k: int) -> Any:
        """Layer-output perturbations of model ``k``'s atoms: ``(n_atoms, *Z.shape[:-1], r)``
        from augmented layer inputs ``Z`` (``(..., m1)``)."""
        delta = self.deltas[k].to(Z.dtype).to(Z.device)  # (r, m1)
        return checked_tangents(self.param, Z, delta)

    def offset_tangent(self, Z: Any) -> Any:
        if self.offset is None:
            return None
        return Z @ self.offset.to(Z.dtype).to(Z.device).t()


@dataclass(frozen=True)
class TaskTargets:
    """A task's calibration batches with targets, its name and objective weight."""

    name: str
    weight: float
    batches: Sequence[TargetBatch]


@dataclass(frozen=True, eq=False)
class FirstOrderStats:
    """Per-task statistics of the joint first-order model (see the module docstring).

    ``H``: ``(n_tasks, n, n)``, ``g``: ``(n_tasks, n)``, ``c``: ``(n_tasks,)``, float64, with
    ``n = K * N``. ``site_names`` / ``site_atoms`` give each site's block of the ``N`` atoms.
    ``energy``: per task, ``{"current": sum ||h - y||^2`` (the model's exact objective),
    ``"total": sum ||b||^2, "joint": sum ||P_A b||^2, site: ...}``.
    """

    H: np.ndarray
    g: np.ndarray
    c: np.ndarray
    K: int
    site_names: tuple[str, ...]
    site_atoms: tuple[int, ...]
    atom_names: tuple[str, ...]
    model_names: tuple[str, ...]
    task_names: tuple[str, ...]
    task_weights: tuple[float, ...]
    counts: tuple[int, ...]
    energy: tuple[dict[str, float], ...]
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def N(self) -> int:
        return int(sum(self.site_atoms))

    def site_slice(self, site: str) -> slice:
        i = self.site_names.index(site)
        start = int(sum(self.site_atoms[:i]))
        return slice(start, start + self.site_atoms[i])

    def problem(self, weights: Sequence[float] | None = None) -> MergeQP:
        """The merge QP ``sum_t w_t J_t(d)`` over ``d`` of shape ``(K, N)``."""
        w = np.asarray(self.task_weights if weights is None else weights, dtype=np.float64)
        if w.shape != (len(self.task_names),):
            raise ValidationError(f"task weights: expected {len(self.task_names)}, got {w.shape}")
        H = np.einsum("t,tij->ij", w, self.H)
        return MergeQP(
            H=0.5 * (H + H.T), g=w @ self.g, c=float(w @ self.c), shape=(self.K, self.N),
            model_names=self.model_names, atom_names=self.atom_names,
            metadata={"sites": list(self.site_names), "site_atoms": list(self.site_atoms),
                      "tasks": list(self.task_names), "task_weights": w.tolist(), **self.metadata},
        )

    def energy_fraction(self, site: str | None = None, weights: Sequence[float] | None = None) -> float:
        """Weighted captured-energy fraction of one site's atoms (``None``: all sites jointly)."""
        w = np.asarray(self.task_weights if weights is None else weights, dtype=np.float64)
        key = "joint" if site is None else site
        total = float(sum(wi * e["total"] for wi, e in zip(w, self.energy)))
        got = float(sum(wi * e[key] for wi, e in zip(w, self.energy)))
        return got / total if total > 0 else 0.0


def batch_functions(model: Any, spec: OutputSpec, tb: TargetBatch,
                    device: Any) -> tuple[Callable[[], Any], Callable[[Any], Any]]:
    """For one batch with targets, its inputs, mask and positions moved to ``device``:
    ``call()`` runs ``model`` on the inputs; ``compared(output)`` is the compared output that
    ``spec`` selects (with the batch's mask, target positions and distribution), flattened to ``(B, c)``."""
    inputs = {k: v.to(device) for k, v in tb.batch.inputs.items()}
    mask, index, probs = tb.selection(device)

    def call() -> Any:
        return model(**inputs)

    def compared(out: Any) -> Any:
        o = spec.select(spec.raw(out), mask, index, probs)
        return o.reshape(o.shape[0], -1)

    return call, compared


def folded_batch_functions(model: Any, fold: FoldedHead, tb: TargetBatch,
                           device: Any) -> tuple[Callable[[], Any], Callable[[Any], Any], Any]:
    """:func:`batch_functions` through a folded head: ``call()`` runs the model's backbone (no
    head, no ``(B, T, V)`` logits), ``compared(output)`` is ``fold`` of its last hidden state,
    ``(B, c)`` with ``c = T q``; and the target ``fold(n*)`` of the fine-tune's hidden state
    (``(B, c)``, float64)."""
    import torch  # deferred: torch is heavy

    inner = backbone(model)
    inputs = {k: v.to(device) for k, v in tb.batch.inputs.items()}
    mask, index, probs = tb.selection(device)

    def call() -> Any:
        return inner(**inputs)

    def compared(out: Any) -> Any:
        o = fold.compared(last_hidden(out), mask, index, probs)
        return o.reshape(o.shape[0], -1)

    with torch.no_grad():
        target = compared(tb.hidden.to(device=device, dtype=fold.weight.dtype)).to(torch.float64)
    return call, compared, target


def data_call(model: Any, fold: FoldedHead | None, tb: TargetBatch, device: Any) -> Callable[[], Any]:
    """``call()`` for a metric that scores the prompts' tokens: the model (or, folded, its backbone)
    on the batch's inputs moved to ``device``."""
    inputs = {k: v.to(device) for k, v in tb.batch.inputs.items()}
    runner = model if fold is None else backbone(model)
    return lambda: runner(**inputs)


def data_expansion(spec: OutputSpec, fold: FoldedHead | None, tb: TargetBatch, out: Any) -> CrossEntropyExpansion:
    """The Gauss-Newton model (:class:`~mergeqp.lm.CrossEntropyExpansion`) of the loss at the
    model output ``out`` of :func:`data_call` (logits, or the backbone's output when folded)."""
    if tb.labels is None:
        raise ValidationError(f"the {spec.metric} metric needs next-token or class labels (mergeqp.lm.label_targets)")
    if fold is None:
        return CrossEntropyExpansion.at(spec, tb.labels, logits=data_logits(spec, tb, out))
    return CrossEntropyExpansion.at(spec, tb.labels, hidden=last_hidden(out), weight=fold.weight, bias=fold.bias)


def _batch_output(model: Any, spec: OutputSpec, fold: FoldedHead | None, tb: TargetBatch, device: Any,
                  run: Callable[[Callable[[], Any]], Any]) -> tuple[Any, Any, Any, Any, Any]:
    """``(call, compared, y, expansion, out)`` of one batch as the statistics see it: ``call`` runs
    the model (or, folded, its backbone), ``run(call)`` gives its output ``out``, ``compared(out)``
    the compared output and ``y`` its target; ``expansion``: the cross-entropy metric's model at this
    point (``None`` for a fine-tune's targets)."""
    import torch

    if spec.scores_data:  # the Gauss-Newton model of the loss at this point
        call = data_call(model, fold, tb, device)
        out = run(call)
        expansion = data_expansion(spec, fold, tb, out)
        return call, _of_output(spec, fold, expansion, tb), expansion.target, expansion, out
    if fold is None:
        call, compared = batch_functions(model, spec, tb, device)
        y = tb.target.to(device=device, dtype=torch.float64)
    else:
        call, compared, y = folded_batch_functions(model, fold, tb, device)
    return call, compared, y, None, run(call)


def check_first_design(model: Any, groups: Sequence[tuple[Sequence[Any], int]], tasks: Sequence[TaskTargets],
                       spec: OutputSpec, device: Any) -> None:
    """The design check :func:`collect_first_order` makes at its first batch (and at any larger
    one: :func:`check_design_memory`), for each of ``groups`` (``(sites, n)``: a QP's sites and its
    variables), made before any statistics: one forward pass of the largest of the given batches
    (:func:`largest_design_batch`) gives its compared outputs per prompt (the fold, the metric's
    expansion and the sketch as the statistics take them), so that a design that cannot fit is
    refused before the minutes a start selection or earlier QPs take. CPU only, as the check it
    anticipates."""
    import torch

    given = [tb for t in tasks for tb in t.batches]
    if not given or not groups or not str(device).startswith("cpu"):
        return
    largest = largest_design_batch([tb.batch for tb in given], spec)
    first = next(tb for tb in given if tb.batch is largest)
    modules = [site_module(model, site) for sites, _ in groups for site in sites]
    fold = prepare_fold(model, spec, [first], device, modules)
    with torch.no_grad():
        _, compared, _, _, out = _batch_output(model, spec, fold, first, device, lambda call: call())
        h = compared(out)
    outputs = int(h.shape[1]) if spec.sketch is None else int(spec.sketch)
    for sites, n in groups:
        check_design_memory(int(h.shape[0]), outputs, int(n), h.element_size(), [s.name for s in sites])


def _of_output(spec: OutputSpec, fold: FoldedHead | None, expansion: CrossEntropyExpansion,
               tb: TargetBatch) -> Callable[[Any], Any]:
    """The expansion's compared output of a model output (its logits, or a classification head's
    class logits of its pooled output) or, folded, of a backbone output (its last hidden state)."""
    if fold is None:
        return lambda out: expansion.compared(data_logits(spec, tb, out))
    return lambda out: expansion.compared(last_hidden(out))


def _exact_gradient(sites: Sequence[tuple[SiteAtoms, Callable[[Any], Any], Any, Any]], b: Any, K: int) -> Any:
    """``A'b`` (``(K N,)`` float64, row-major ``(k, atom)`` over the sites' atoms) from one VJP per
    site with cotangent ``b`` (``(B, c)``): the pulled-back ``w = (d f)' b`` (``(B, T, r)``) gives
    ``cross = sum_(j,t) w_jt z_jt'``, from which the parametrisation's own gradient rule gives
    ``2 A'b`` (no tangents are formed)."""
    import torch  # deferred: torch is heavy
    from torch.func import vjp  # deferred: torch is heavy

    parts = []
    for a, f, Z, u0 in sites:
        _, pull = vjp(f, u0)
        (w,) = pull(b.to(u0.dtype))  # (B, *positions, r)
        B = int(w.shape[0])
        cross = torch.einsum("btr,btm->rm", w.reshape(B, -1, w.shape[-1]).to(torch.float64),
                             Z.reshape(B, -1, Z.shape[-1]).to(torch.float64))
        g = a.param.gradient(a.deltas.numpy(), cross.cpu().numpy())
        parts.append(torch.from_numpy(np.asarray(g, dtype=np.float64) / 2.0).reshape(K, a.n_atoms))
    return torch.cat(parts, dim=1).reshape(-1).to(b.device)


def _atom_combinations(atoms: Sequence[SiteAtoms], K: int) -> dict[int, np.ndarray] | None:
    """The joint QP's combined atoms (:meth:`~mergeqp.stats.parametrisation.Parametrisation.atom_combinations`
    of each site, in the joint indices ``k * N + atom``); ``None`` where no site has any."""
    parts = [a.param.atom_combinations(K, int(a.site.r), int(a.site.m1)) for a in atoms]
    if all(not p for p in parts):
        return None
    N = int(sum(a.n_atoms for a in atoms))
    out: dict[int, np.ndarray] = {}
    offset = 0
    for a, part in zip(atoms, parts):
        n = int(a.n_atoms)
        if part:
            idx = np.array([k * N + offset + i for k in range(K) for i in range(n)])  # site order (k, atom)
            for t, column in part.items():
                joint = np.zeros(K * N)
                joint[idx] = column
                out[int(idx[t])] = joint
        offset += n
    return out


def _reverse_design(derivatives: OutputDerivatives, a: SiteAtoms, Z: Any) -> Any:
    """The site's design rows ``(B, c, K, n_atoms)`` (float64) from its per-sample Jacobian ``L``
    (``(B, c, T, r)``, ``c`` VJPs) by the parametrisation's design rule, with ``R_k = Z delta_k'``."""
    import torch  # deferred: torch is heavy

    L = derivatives.jacobian("reverse")
    B = int(L.shape[0])
    Zf = Z.reshape(B, -1, Z.shape[-1])
    deltas = a.deltas.to(device=Zf.device, dtype=L.dtype)
    R = torch.einsum("btm,krm->bktr", Zf.to(L.dtype), deltas)
    return checked_design(a.param, L, R, Zf.to(L.dtype), deltas).to(torch.float64)


def _captured(A: Any, b: Any, rcond: float = 1e-10) -> float:
    """``sum_j ||P_{range A_j} b_j||^2`` for ``A`` ``(B, c, n)``, ``b`` ``(B, c)`` (float64).

    The projection onto the range of ``A_j`` comes from the eigendecomposition of the smaller of
    the two Grams: ``A_j A_j'`` (``c x c``, when ``c <= n``: ``||P b||^2 = sum (u_i'b)^2`` over
    its eigenvectors with a nonzero eigenvalue) or ``A_j'A_j`` (``n x n``: ``v'G^+v`` with
    ``v = A_j'b``). Both have the same nonzero eigenvalues, so the rank cut (``rcond`` times the
    largest) is the same; the cost is ``min(c, n)^3`` per sample instead of ``n^3``."""
    import torch  # deferred: torch is heavy

    c, n = int(A.shape[1]), int(A.shape[2])
    if c <= n:
        evals, evecs = torch.linalg.eigh(A @ A.transpose(1, 2))  # (B, c, c)
        top = evals.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(A.dtype).tiny)
        keep = evals > rcond * top
        proj = (evecs.transpose(1, 2) @ b.unsqueeze(-1)).squeeze(-1)  # (B, c)
        return float((proj * proj * keep).sum())
    G = A.transpose(1, 2) @ A  # (B, n, n)
    v = (A.transpose(1, 2) @ b.unsqueeze(-1)).squeeze(-1)  # (B, n)
    evals, evecs = torch.linalg.eigh(G)
    top = evals.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(G.dtype).tiny)
    inv = torch.where(evals > rcond * top, 1.0 / evals, torch.zeros_like(evals))
    proj = (evecs.transpose(1, 2) @ v.unsqueeze(-1)).squeeze(-1)
    return float((proj * proj * inv).sum())


def largest_design_batch(batches: Sequence[Any], spec: OutputSpec) -> Any:
    """The batch (:class:`~mergeqp.io.calibration.Batch`) of ``batches`` with the largest design:
    the most prompts x positions, or the most prompts where the compared outputs per prompt do not
    depend on positions (a sketch, a pooled output); the first of equals."""
    per_prompt = spec.sketch is not None or spec.pool != "none"
    return max(batches, key=lambda b: b.size if per_prompt else b.positions)


def check_design_memory(samples: int, outputs: int, atoms: int, itemsize: int, sites: Sequence[str],
                        available: int | None = None) -> None:
    """Refuse, before any allocation, a batch whose design ``A`` (``samples x outputs x atoms``,
    with its copies: :data:`DESIGN_COPIES_FLOAT64`) needs more memory than the machine has
    available (:func:`mergeqp.io.memory.available_memory_bytes`), or than the ``max_memory`` cap
    (:func:`mergeqp.io.memory.memory_limit`); no check when neither is known.
    Raises :class:`ValidationError` naming the sites and what to change."""
    free, what = memory_budget(available_memory_bytes() if available is None else available)
    need = design_bytes(samples, outputs, atoms, itemsize)
    if free is None or need <= free:
        return
    prompts, width = _what_fits(free, samples, outputs, atoms, itemsize)
    raise ValidationError(
        f"statistics at {', '.join(sites)}: one calibration batch's design ({samples} prompts x {outputs} "
        f"compared outputs each x {atoms} atoms) needs about {human_bytes(need)}, more than {what}. Lower "
        f"calibration.batch_size{f' (the design alone fits with at most {prompts})' if prompts else ''}, "
        f"compare fewer outputs (output.restrict: projection|topk with a small k, or output: {{sketch: s}}"
        f"{f': the design and the sketch fit with s at most {width}' if width else ''}), or use fewer atoms "
        f"(method.parametrisation); the statistics' other memory comes on top")


def _what_fits(free: int, samples: int, outputs: int, atoms: int, itemsize: int) -> tuple[int, int]:
    """``(prompts, width)``: the most prompts per batch with which the design alone fits in ``free``
    bytes, and the largest sketch (compared outputs per prompt) with which the design and the
    sketch itself (``prompts x s x outputs``, drawn in float64 and cast; at most
    :data:`~mergeqp.lm.MAX_SKETCH_ENTRIES` entries:
    :meth:`OutputSpec.sketch_matrix`) fit at this batch; 0 for one that is not smaller than now or
    does not fit even at 1. Each is an upper bound: the statistics' other memory (sums, tangents)
    comes on top."""
    one = design_bytes(1, 1, 1, itemsize)
    prompts = free // (outputs * atoms * one)
    width = min(free // (samples * (atoms * one + outputs * (8 + itemsize))), MAX_SKETCH_ENTRIES // (samples * outputs))
    return (prompts if 1 <= prompts < samples else 0), (width if 1 <= width < outputs else 0)


def widest_layer(model: Any) -> int:
    """The most output features of any ``nn.Linear`` (or Conv1D-like ``nf``) in ``model``: the
    widest activation a JVP through it carries per token (0 when there is none)."""
    widths = [int(getattr(m, "out_features", getattr(m, "nf", 0)) or 0) for m in model.modules()]
    return max(widths, default=0)


def _site_mode(jacobian_mode: str, outputs: int, a: SiteAtoms, layer_output: Any, samples: int) -> str:
    """The derivative mode of one site: :func:`choose_mode`'s, except that a layer whose output does
    not lead with the batch (the model flattened batch and positions before it) takes forward mode,
    the only exact one there (``jacobian_mode: reverse`` is then an error naming the layer)."""
    if leads_with_samples(layer_output, samples):
        return choose_mode(jacobian_mode, outputs, a.K * a.n_atoms)
    if jacobian_mode == "reverse":
        raise ValidationError(f"site {a.site.name}: its output has shape {tuple(layer_output.shape)} for a batch of "
                              f"{samples} (the model flattens the batch before it); reverse-mode statistics need "
                              "per-sample outputs: use jacobian_mode forward or auto")
    return "forward"


def site_memory(model: Any, atoms: Sequence[SiteAtoms], hooks: Sequence[Any], n_tasks: int, outputs: int,
                itemsize: int, chunk_size: int, jacobian_mode: str = "forward", samples: int | None = None) -> SiteMemory:
    """The memory model (:func:`mergeqp.io.memory.estimate_site_memory`) of the QP over ``atoms``
    once the first batch has run (``hooks`` hold its layer outputs): ``outputs`` compared outputs
    per prompt, derivatives of ``itemsize`` bytes, JVP / VJP chunks of ``chunk_size`` through
    ``model`` (the part the derivatives run through); each site's derivatives counted in the mode
    ``jacobian_mode`` chooses for it (forward: its atoms' tangents; reverse: its Jacobian); ``samples``:
    the batch's prompts (default: the layer output's first dimension)."""
    out0 = hooks[0].layer_output  # (B, *positions, r)
    reverse = [_site_mode(jacobian_mode, outputs, a, h.layer_output,
                          int(h.layer_output.shape[0]) if samples is None else samples) == "reverse"
               for a, h in zip(atoms, hooks)]
    return estimate_site_memory(
        ", ".join(a.site.name for a in atoms), atoms[0].K * sum(a.n_atoms for a in atoms), n_tasks,
        samples=int(out0.shape[0]), outputs=outputs, itemsize=itemsize,
        positions=int(out0[0].numel()) // int(out0.shape[-1]), site_width=max(a.site.r for a in atoms),
        chunk=chunk_size, widest=widest_layer(model),
        tangent_atoms=sum(a.K * a.n_atoms for a, rev in zip(atoms, reverse) if not rev),
        jacobian_width=max((a.site.r for a, rev in zip(atoms, reverse) if rev), default=0))


def collect_first_order(
    model: Any,
    atoms: Sequence[SiteAtoms],
    tasks: Sequence[TaskTargets],
    spec: OutputSpec,
    device: Any = "cpu",
    *,
    model_names: Sequence[str] | None = None,
    chunk_size: int = 256,
    progress: bool = False,
    energy: bool = True,
    jacobian_mode: str = "forward",
) -> FirstOrderStats:
    """Linearise ``model`` (in eval mode, unchanged) at ``atoms``' sites jointly on every task's
    batches and accumulate the statistics (see the module docstring).

    ``jacobian_mode``: how each site's ``K n_atoms`` directional derivatives are computed
    (:meth:`mergeqp.stats.linearise.OutputDerivatives.along`): ``forward`` (one JVP per atom,
    the default), ``reverse`` (one VJP per compared output, then contracted; needs samples that
    do not interact inside the model) or ``auto`` (the fewer of the two,
    :func:`mergeqp.stats.linearise.choose_mode`)."""
    import torch  # deferred: torch is heavy

    if not atoms:
        raise ValidationError("no merge sites given")
    check_mode(jacobian_mode)
    K = atoms[0].K
    if any(a.K != K for a in atoms):
        raise ValidationError("every site needs the same number of models K")
    names = tuple(model_names) if model_names is not None else tuple(f"model{k}" for k in range(K))
    N = sum(a.n_atoms for a in atoms)
    n = K * N
    group_name = ", ".join(a.site.name for a in atoms)
    # before the sums are allocated; under torchrun a refusal of any rank stops every rank here
    agree_everywhere(current_group(), lambda: check_site_memory(estimate_site_memory(group_name, n, len(tasks))))
    sums = GaussNewtonSums(len(tasks), n, device)
    counts = []
    energies = []
    total_batches = sum(len(t.batches) for t in tasks)
    group = current_group()  # under torchrun: this rank's share of the batches, sums reduced below
    bar = tqdm(total=len(range(group.rank, total_batches, group.world_size)),
               desc="statistics " + ",".join(a.site.name for a in atoms)[:60],
               leave=False, disable=not progress or not group.is_writer())
    index = 0  # batches over every task in order; rank `index mod world_size` handles batch `index`
    # the largest design (prompts x outputs) and batch (prompts x positions) checked: a larger one
    # is checked before it is built. Under torchrun an error (a refused design, non-finite outputs, a
    # model that raises) stops this rank's batches and is raised on every rank after them (the others
    # would otherwise wait for it in the reduction)
    checked = (0, 0)
    failed: Exception | None = None
    modules = [site_module(model, a.site) for a in atoms]
    labels = [f"layer {a.site.name!r}" for a in atoms]
    fold, not_folded = fold_decision(model, spec, [tb for t in tasks for tb in t.batches], device, modules,
                                     [f"target batch {j} of model {t.name!r}" for t in tasks for j in range(len(t.batches))])
    # a refusal of the unfolded statistics says why the head was not folded (fold_head: auto)
    advice = ADVICE if not_folded is None else (
        f"{ADVICE}; output.fold_head: auto did not fold the model's head into the final hidden state "
        f"({not_folded}), so the vocabulary-size logits are compared")

    def add_batch(hooks: Sequence[Any], ti: int, bi: int, task: TaskTargets, tb: Any, e: dict[str, float]) -> None:
        """Linearise the model at batch ``bi`` of task ``ti`` (``tb``) and add it to the sums and to
        the task's energies ``e``."""
        nonlocal checked
        call, compared, y, expansion, out = _batch_output(
            model, spec, fold, tb, device, lambda c: run_recorded(c, hooks, labels, f"task {task.name!r} batch {bi}"))
        h = compared(out)
        Bsz = h.shape[0]
        b = h.to(torch.float64) - y.reshape(Bsz, -1).to(device=h.device, dtype=torch.float64)
        if expansion is None:
            e["current"] += float((b * b).sum())
        else:  # J at this point is the exact loss: the model's constant is loss - ||r||^2
            e["current"] += expansion.loss
            sums.c[ti] += expansion.loss - float((b * b).sum())
        S = None if spec.sketch is None else spec.sketch_matrix(Bsz, int(h.shape[1]), (ti, bi), h.dtype, device)
        outputs = int(h.shape[1]) if S is None else int(S.shape[1])
        size = (Bsz * outputs, tb.batch.positions)
        if (size[0] > checked[0] or size[1] > checked[1]) and str(device).startswith("cpu"):  # before its allocation
            check_design_memory(Bsz, outputs, n, h.element_size(), [a.site.name for a in atoms])
            check_site_memory(site_memory(model if fold is None else backbone(model), atoms, hooks,
                                          len(tasks), outputs, h.element_size(), chunk_size,
                                          jacobian_mode, samples=Bsz), advice=advice)
            checked = (max(size[0], checked[0]), max(size[1], checked[1]))
        blocks = []
        exact_f = []  # with a sketch: each site's unsketched f, for the exact g
        for a, hook in zip(atoms, hooks):
            Z = append_ones(hook.layer_input, a.site.has_bias)
            u0 = torch.zeros_like(hook.layer_output)
            f = perturbed_output(hook, call, compared)
            derivatives = OutputDerivatives(f, u0, int(h.shape[1]) if S is None else int(S.shape[1]),
                                            chunk_size=chunk_size, rows=S, samples=int(h.shape[0]))
            off = a.offset_tangent(Z)
            if off is not None:
                push = derivatives if S is None else OutputDerivatives(f, u0, int(h.shape[1]), samples=int(h.shape[0]))
                b = b - push.push(off.to(u0.dtype)).to(torch.float64)
            if _site_mode(jacobian_mode, derivatives.c, a, hook.layer_output, Bsz) == "reverse":
                # c VJPs give the per-sample Jacobian; the parametrisation's own design rule
                # contracts it (no (K n, B, T, r) tangents are formed)
                blocks.append(_reverse_design(derivatives, a, Z))  # (B, c, K, n_atoms)
            else:  # all K * n_atoms tangents, model-major
                tang = torch.cat([a.tangents(Z, k) for k in range(K)]).to(u0.dtype)  # (K n, B, ..., r)
                cols = derivatives.along(tang, "forward")  # (K n, B, c) (c = s with a sketch)
                cols = cols.to(torch.float64).reshape(K, a.n_atoms, Bsz, -1)
                blocks.append(cols.permute(2, 3, 0, 1))  # (B, c, K, n_atoms)
            if S is not None:
                exact_f.append((a, f, Z, u0))
        A = torch.cat(blocks, dim=3).reshape(Bsz, -1, n)  # (B, c, K*N), row-major (k, atom)
        if not torch.all(torch.isfinite(A)) or not torch.all(torch.isfinite(b)):
            raise ValidationError(f"non-finite outputs or Jacobians on task {task.name!r}")
        sums.add_residual(ti, b)  # c exact, sketch or not
        if S is None:
            sums.add_design(ti, A, b)
        else:  # unbiased H from the sketched rows; g exact: one VJP per site with cotangent b
            sums.add_design(ti, A, torch.zeros(A.shape[:2], dtype=torch.float64, device=A.device))
            sums.g[ti] += 2.0 * _exact_gradient(exact_f, b, K)
            b = torch.einsum("bsc,bc->bs", S.to(torch.float64), b)  # the energy is the sketched one
        if energy:
            e["total"] += float((b * b).sum())
            e["joint"] += _captured(A, b)
            if len(atoms) > 1:
                offset = 0
                A4 = A.reshape(Bsz, -1, K, N)
                for a in atoms:
                    sub = A4[:, :, :, offset:offset + a.n_atoms].reshape(Bsz, A.shape[1], -1)
                    e[a.site.name] += _captured(sub, b)
                    offset += a.n_atoms
            else:
                e[atoms[0].site.name] = e["joint"]
    with hooked_layers(model, modules) as hooks:
        for ti, task in enumerate(tasks):
            e = {"current": 0.0, "total": 0.0, "joint": 0.0, **{a.site.name: 0.0 for a in atoms}}
            count = 0
            for bi, tb in enumerate(task.batches):
                index += 1
                if failed is not None or not group.owns(index - 1):
                    continue
                _, failed = group.held(lambda: add_batch(hooks, ti, bi, task, tb, e))
                if failed is not None:
                    continue
                count += tb.count
                bar.update(1)
            counts.append(count)
            energies.append(e)
    bar.close()
    if group.distributed:  # every statistic is a sum over batches: add the ranks' parts
        group.raise_first(failed)  # a rank that failed a batch: its error on every rank (rank 0 prints it)
        group.all_reduce_sum([sums.H, sums.g, sums.c])
        keys = list(energies[0]) if energies else []
        flat = group.reduce_floats([*counts, *(e[k] for e in energies for k in keys)])
        counts = [int(round(x)) for x in flat[:len(counts)]]
        energies = [dict(zip(keys, flat[len(counts) + i * len(keys):len(counts) + (i + 1) * len(keys)]))
                    for i in range(len(energies))]
    atom_names = tuple(f"{a.site.name}:{nm}" if len(atoms) > 1 else nm for a in atoms for nm in a.atom_names())
    H, g, c = sums.numpy()
    tie = _atom_combinations(atoms, K)
    if tie is not None:  # atoms that are exact combinations of others: their statistics made exact too
        H, g = tie_statistics(H, g, tie)
    return FirstOrderStats(
        H=H, g=g, c=c, K=K,
        site_names=tuple(a.site.name for a in atoms), site_atoms=tuple(a.n_atoms for a in atoms),
        atom_names=atom_names, model_names=names, task_names=tuple(t.name for t in tasks),
        task_weights=tuple(float(t.weight) for t in tasks), counts=tuple(counts), energy=tuple(energies),
        metadata={"parametrisations": [a.param.to_json() for a in atoms],
                  "output": {"field": spec.field, "restrict": spec.restrict, "k": spec.k,
                             **({} if spec.pool == "none" else {"pool": spec.pool})},
                  **({} if fold is None else {"folded_head_width": fold.width}),
                  **({} if not_folded is None else {"head_not_folded": not_folded}),
                  **({} if spec.sketch is None else {"sketch": spec.sketch})},
    )
