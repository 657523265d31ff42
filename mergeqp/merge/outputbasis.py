"""The optimal basis (paper, Corollary 4.2) of a merge site of a Hugging Face model, by streaming.

Corollary 4.2 needs a Jacobian ``L`` (``(c, r)``) from the layer's output to the compared output
and the residual energy ``S = sum_j w_j b_j b_j'`` (``(c, c)``): with ``U_p`` the top-p
eigenvectors of ``S`` restricted to ``range(L)``, ``Q = orth(L^+ U_p)`` maximises the captured
energy ``tr(S P_{LQ})`` over every ``p``-dimensional basis (Ky Fan); the top eigenvectors of
``L'SL`` do not. For a model whose layer output is a sequence (``(T, r)``) the Jacobian varies
with the sample and acts on ``T r`` outputs, so -- as :func:`mergeqp.stats.optimal_basis` does --
``L`` is the **calibration-mean Jacobian summed over positions**::

    L e_i = sum_j w_j J_j (1_T (x) e_i) / sum_j w_j        (one column per output feature i)

the mean response of the compared output (``c`` = positions x restricted logits, padded
positions are zero) to the same perturbation ``e_i`` at every position of the layer output.
Each column is one ``torch.func.jvp`` per batch, vectorised over ``i`` (``r`` JVPs per batch,
fewer than the ``K r`` of the rows QP), so no per-sample ``(c, T r)`` Jacobian is formed.
``S`` is never formed either: the residuals ``b_j`` (``(N, c)``, as large as the targets the
pipeline already holds) are kept and, once ``L = U diag(s) V'`` is known, projected,
``S_L = (B U)'(B U)`` (``(rank, rank)``). Corollary 4.2 in the coordinates of ``range(L)``
(``L_red = diag(s) V'``, an isometric change of output coordinates) gives the same ``Q`` as the
full ``(c, c)`` computation (checked against :func:`mergeqp.stats.optimal_basis` in the tests).

Memory: ``L`` is ``c x r`` float64, ``c = T_max k`` for a language model (``T_max`` the longest
calibration prompt, ``k`` the compared outputs per position: the vocabulary, or
``output.restrict``'s ``k``). It must fit ``max_bytes`` (``method.basis_max_size``); otherwise
:class:`~mergeqp.errors.ValidationError` names the cap and the ways to shrink ``c``.

The captured-energy fraction reported with it, ``tr(S P_{L Q}) / tr(S)``, is the quantity the
basis maximises (the relaxed problem of Theorem 4.1 for the mean Jacobian); it is an
approximation of the per-sample fraction the pipeline reports for every QP, which has no closed
form optimum.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from ..errors import ValidationError
from ..io.memory import ACTIVATION_COPIES, TANGENT_COPIES, device_free_bytes, human_bytes, memory_budget
from ..lm import OutputSpec
from ..stats.bases import checked_build, complete_basis, optimal_basis, optimal_basis_from
from ..stats.basis import Basis
from ..stats.diagnostics import range_basis
from ..stats.hooks import hooked_layers
from ..stats.linearise import OutputDerivatives, perturbed_output, run_recorded
from .firstorder import batch_functions, widest_layer
from .sites import LayerSite, append_ones, site_module

DEFAULT_MAX_BYTES = 2 * 2**30
RANK_RTOL = 1e-10
JACOBIAN = "calibration-mean Jacobian summed over positions (the response to the same perturbation at every position)"


def jacobian_bytes(c: int, r: int) -> int:
    """Bytes of the ``(c, r)`` float64 mean Jacobian."""
    return int(c) * int(r) * 8


def check_jacobian_size(site: str, c: int, r: int, max_bytes: int) -> None:
    """Raise when the mean Jacobian of ``site`` would exceed ``max_bytes``."""
    need = jacobian_bytes(c, r)
    if need > max_bytes:
        raise ValidationError(
            f"basis: optimal at layer {site!r} needs its mean output Jacobian of shape (c, r) = ({c}, {r}) in "
            f"float64, {human_bytes(need)}, above method.basis_max_size ({human_bytes(max_bytes)}): "
            f"shrink c (output: {{restrict: projection, k: ...}} or a smaller calibration.max_length), raise "
            f"method.basis_max_size, or use basis: svd"
        )


def basis_pass_bytes(tokens: int, r: int, widest: int, itemsize: int, chunk: int) -> int:
    """Bytes of one chunk of the basis pass's vectorised JVPs: ``chunk`` tangents at the site
    (``tokens x r`` each) carried through layers at most ``widest`` features wide (the vocabulary head
    of a language model: the pass compares the model's outputs, the head is not folded), counted
    with the QP statistics' copies (:func:`mergeqp.io.memory.estimate_site_memory`)."""
    per_tangent = int(tokens) * (TANGENT_COPIES * int(r) + ACTIVATION_COPIES * int(widest)) * int(itemsize)
    return int(chunk) * per_tangent


def fitting_chunk(site: str, requested: int, tokens: int, r: int, widest: int, itemsize: int,
                  held: int = 0, device: Any = "cpu") -> int:
    """The most tangents (at most ``requested`` and ``r``) whose JVP chunk fits the memory budget
    (:func:`~mergeqp.io.memory.memory_budget`: ``max_memory`` or the free memory where ``device``
    allocates -- a CUDA device's own, else the machine's available memory -- less ``held`` bytes
    already allocated there); an error naming the site and what to change when one does not."""
    chunk = max(1, min(int(requested), int(r)))
    budget, what = memory_budget(*device_free_bytes(device))
    if budget is None:
        return chunk
    one = basis_pass_bytes(tokens, r, widest, itemsize, 1)
    fits = (budget - held) // one if one else chunk
    if fits < 1:
        raise ValidationError(
            f"basis: optimal at layer {site!r}: one JVP of the basis pass needs about {human_bytes(one)} "
            f"({tokens} tokens through layers {widest} features wide), more than {what}; use fewer tokens "
            f"per batch (calibration.batch_size, calibration.max_length), basis: svd, or raise max_memory "
            f"(--max-memory) if the machine has more")
    return int(min(chunk, fits))


@dataclass(frozen=True, eq=False)
class OutputBasisStats:
    """The statistics Corollary 4.2 needs at one site, in the coordinates of ``range(L)``.

    ``L``: ``(rank, r)`` = ``diag(s) V'`` of the mean Jacobian's thin SVD; ``S``: ``(rank,
    rank)`` = ``U' S U``; ``total``: ``tr(S) = sum_j w_j ||b_j||^2`` (all of it, not only the
    part in ``range(L)``); ``c``: compared outputs per sample; ``n_samples``; ``seconds``."""

    site: str
    L: np.ndarray
    S: np.ndarray
    total: float
    c: int
    r: int
    n_samples: int
    seconds: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return int(self.L.shape[0])

    def basis(self, p: int, build: Any = None, *, seed: int = 0) -> Any:
        """The :class:`~mergeqp.stats.parametrisation.Basis` with ``p`` directions that ``build`` (a
        registered basis builder with ``checkpoint_source="output_jacobian"``; ``None``: the optimal
        one) makes from these statistics, seen through :class:`JacobianView` (what the optimal builder
        reads of :class:`~mergeqp.stats.CalibrationStats`: ``r``, ``mean_jacobian``, ``S``). Before stop
        58 every such entry got the optimal basis, its own builder never called (an architecture
        review's find)."""
        if not 1 <= p <= self.r:
            raise ValidationError(f"basis rank {p} must be in [1, {self.r}] for layer {self.site!r}")
        if build is not None and build is not optimal_basis:
            made = checked_build(build, JacobianView(self), p,
                                 f"basis builder {getattr(build, '__name__', build)!r} at layer {self.site!r}",
                                 attribute_hint="an output_jacobian builder sees r, mean_jacobian(task_weights) and "
                                                "S(task_weights) (mergeqp.merge.outputbasis.JacobianView)", seed=seed)
            return Basis(made.Q, name=made.name,
                         info={**made.info, "jacobian": JACOBIAN, "output_size": self.c, "samples": self.n_samples})
        if self.rank == 0:
            Q, info = complete_basis(np.zeros((self.r, 0)), self.r, p), {"rank_L": 0, "captured_eigenvalues": []}
        else:
            Q, info = optimal_basis_from(self.L, self.S, p)
        info = {**info, "jacobian": JACOBIAN, "output_size": self.c, "samples": self.n_samples}
        if info.get("rank_L", p) < p:
            info["note"] = f"rank(L) = {info['rank_L']} < p = {p}: the extra directions capture no energy"
        return Basis(Q, name="optimal", info=info)

    def captured(self, Q: np.ndarray) -> float:
        """``tr(S P_{L Q})`` for an ``(r, p)`` basis ``Q``."""
        if self.rank == 0:
            return 0.0
        P = range_basis(self.L @ np.asarray(Q, dtype=np.float64))
        return float(np.einsum("ci,cd,di->", P, self.S, P))

    def energy_fraction(self, Q: np.ndarray) -> float:
        """``tr(S P_{L Q}) / tr(S)`` (the quantity the optimal basis maximises)."""
        return min(self.captured(Q) / self.total, 1.0) if self.total > 0 else 0.0


@dataclass(frozen=True, eq=False)
class JacobianView:
    """:class:`OutputBasisStats` as a basis builder sees statistics (the attributes the optimal builder
    reads of :class:`~mergeqp.stats.CalibrationStats`): ``r``; ``mean_jacobian(task_weights)``, the
    calibration-mean Jacobian ``(rank, 1, r)`` in the coordinates of its own range (``diag(s) V'``: the
    same row space and Gram matrix as the ``(c, r)`` Jacobian); ``S(task_weights)``, the residuals'
    second moment in those coordinates; ``jacobian_shared`` False (a mean over samples). Task weights
    are already applied."""

    stats: OutputBasisStats

    @property
    def r(self) -> int:
        return self.stats.r

    jacobian_shared = False

    def mean_jacobian(self, task_weights: Any = None) -> np.ndarray:
        return self.stats.L[:, None, :]

    def S(self, task_weights: Any = None) -> np.ndarray:  # noqa: N802 - CalibrationStats' name
        return self.stats.S


def collect_output_basis(
    model: Any,
    site: LayerSite,
    tasks: Sequence[Any],
    spec: OutputSpec,
    device: Any = "cpu",
    *,
    offset: Any = None,
    chunk_size: int = 256,
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: bool = False,
) -> OutputBasisStats:
    """Stream the calibration batches of ``tasks`` (:class:`~mergeqp.merge.firstorder.TaskTargets`)
    through ``model`` (unchanged) and return the statistics of the optimal basis at ``site``.

    ``offset``: ``W_cur - W_base`` (``(r, m1)``) when the model's site weight is not the base's
    (hybrid): its first-order effect is subtracted from the residuals, as in the QP."""
    import torch  # deferred: torch is heavy

    t0 = time.perf_counter()
    sizes = [tb.sample_size for task in tasks for tb in task.batches]
    if not sizes:
        raise ValidationError(f"basis: optimal at layer {site.name!r}: no calibration batches")
    c = max(sizes)
    r = site.r
    check_jacobian_size(site.name, c, r, max_bytes)
    L_sum = torch.zeros(c, r, dtype=torch.float64, device=device)
    residuals: list[Any] = []
    total = 0.0
    weight_sum = 0.0
    n_samples = 0
    widest = widest_layer(model)
    chunks_used = max(1, min(int(chunk_size), r))
    bar = tqdm(total=len(sizes), desc=f"optimal basis {site.name}"[:60], leave=False, disable=not progress)
    with hooked_layers(model, [site_module(model, site)]) as (hook,):
        for task in tasks:
            w = float(task.weight)
            for bi, tb in enumerate(task.batches):
                call, compared = batch_functions(model, spec, tb, device)
                out = run_recorded(call, [hook], [f"layer {site.name!r}"], f"task {task.name!r} batch {bi}")
                h = compared(out)
                B, cb = int(h.shape[0]), int(h.shape[1])
                b = h.to(torch.float64) - tb.target.to(device=device, dtype=torch.float64).reshape(B, -1)
                u0 = torch.zeros_like(hook.layer_output)
                derivatives = OutputDerivatives(perturbed_output(hook, call, compared), u0, cb, samples=B)
                if offset is not None:
                    Z = append_ones(hook.layer_input, site.has_bias)
                    off = Z @ offset.to(Z.dtype).to(Z.device).t()
                    b = b - derivatives.push(off.to(u0.dtype)).to(torch.float64)
                if not torch.all(torch.isfinite(b)):
                    raise ValidationError(f"non-finite outputs at layer {site.name!r} on task {task.name!r}")
                eye = torch.eye(r, dtype=u0.dtype, device=u0.device)
                lead = (1,) * (u0.dim() - 1)
                # the tangents' chunk shrinks to what the memory budget holds (each tangent carries the
                # batch's tokens through the unfolded vocabulary head)
                on_gpu = u0.device.type == "cuda"  # (the residuals are kept on the host)
                step = fitting_chunk(site.name, chunk_size, int(u0.numel()) // r, r, widest, u0.element_size(),
                                     held=L_sum.numel() * 8 + (0 if on_gpu else sum(x.numel() for x in residuals) * 8),
                                     device=u0.device)
                chunks_used = min(chunks_used, step)
                for start in range(0, r, step):
                    stop = min(start + step, r)
                    tang = eye[start:stop].reshape(stop - start, *lead, r).expand(stop - start, *u0.shape).contiguous()
                    cols = derivatives.along(tang).to(torch.float64)  # (n, B, cb)
                    if not torch.all(torch.isfinite(cols)):
                        raise ValidationError(f"non-finite Jacobian at layer {site.name!r} on task {task.name!r}")
                    L_sum[:cb, start:stop] += w * cols.sum(dim=1).t()
                total += w * float((b * b).sum())
                weight_sum += w * B
                n_samples += B
                padded = torch.zeros(B, c, dtype=torch.float64)
                padded[:, :cb] = math.sqrt(w) * b.cpu()
                residuals.append(padded)
                bar.update(1)
    bar.close()
    if weight_sum <= 0:
        raise ValidationError(f"basis: optimal at layer {site.name!r}: every task has weight 0")
    L = L_sum / weight_sum
    U, s, Vt = torch.linalg.svd(L, full_matrices=False)
    rank = int((s > RANK_RTOL * s[0]).sum()) if s.numel() and float(s[0]) > 0 else 0
    U = U[:, :rank].cpu()
    S_red = torch.zeros(rank, rank, dtype=torch.float64)
    for chunk in residuals:
        Y = chunk @ U
        S_red += Y.t() @ Y
    L_red = (s[:rank, None] * Vt[:rank]).cpu()
    return OutputBasisStats(site.name, L_red.numpy(), S_red.numpy(), total, c, r, n_samples,
                            time.perf_counter() - t0, {"singular_values_L": s[: min(rank, 8)].cpu().tolist(),
                                                       "jvp_chunk": chunks_used})


__all__ = ["DEFAULT_MAX_BYTES", "OutputBasisStats", "basis_pass_bytes", "check_jacobian_size", "collect_output_basis",
           "fitting_chunk", "jacobian_bytes"]
