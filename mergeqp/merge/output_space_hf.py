"""The output-space merge (:mod:`.output_space`) on a live model with the run layer's compared output.

``mergeqp merge`` with ``method: {name: output_space}`` starts from the *reference merge*
(RegMean or the soup, loaded into the base architecture) and treats the selected linear sites
one at a time, in module order (:func:`solve_sites`): each is linearised at the model as it
stands (the reference plus the earlier sites' accepted updates) and
:func:`~mergeqp.merge.output_space.output_space_solve` gives its free weight change ``E``
(``(r, m1)``, bias as last column), ridged toward the current weight; the update is accepted
with the largest step of ``1, 1/2, ...`` that does not raise the true calibration error (else
the site keeps its weight), so the merge is never worse than the reference on calibration data. The data of one site, for every calibration batch of every
task (:class:`~mergeqp.merge.firstorder.TaskTargets`, sample weight = the task's weight):

- ``x_(s,t)``: the site's augmented input at every position (recorded by a forward hook);
- ``t_s = y_s - h_s``: the fine-tune's compared output minus the reference's (``(c,)``, the
  run layer's :class:`~mergeqp.lm.OutputSpec`: logits with restrict / top-k / projection / kl,
  ``last_hidden_state``, mean pooling; through the folded head when it applies);
- ``f``: the compared output as a function of a perturbation added to the site's output
  (:func:`~mergeqp.stats.linearise.perturbed_output`).

Two ways to apply the normal operator ``N E = sum_s w_s L_s*(L_s E)``, ``L_s E = sum_t A_(s,t) E x_(s,t)``:

- **formed** (the rule: when every batch's per-sample Jacobian ``(B, c, T, r)`` together take at
  most ``jacobian_max_bytes`` float64 bytes, default 64 MiB): the Jacobians are formed once
  (:meth:`~mergeqp.stats.linearise.OutputDerivatives.jacobian`, ``min(c, T r)`` products per
  batch) and the batches are padded into one :class:`~mergeqp.merge.output_space.OutputSpaceSamples`
  (zero rows add nothing), exactly the statistics of the ``output_space`` method of
  :func:`mergeqp.merge_state_dicts`; each CG step is two einsums;
- **matrix-free** (otherwise): :class:`ModelLinearisation`; ``L E`` is one Jacobian-vector
  product of ``f`` per batch along the layer-output tangent ``Delta x = x E'`` and ``L* V`` one
  vector-Jacobian product with cotangent ``w V`` contracted with the inputs, so each CG step runs
  the model forward (JVP) and forward + backward (VJP) once per batch and nothing of size
  ``c x T r`` is ever formed. The preconditioner (the Kronecker-eigenbasis diagonal of
  :class:`~mergeqp.merge.output_space.KroneckerPreconditioner`, as for the formed path) and the
  ridge unit (the mean diagonal of ``N``) come from ``probes`` Rademacher cotangents per batch
  (Hutchinson: ``E[(A'v)(A'v)'] = A'A``, so ``E[(A'v)_i^2] = ||A e_i||^2``), seeded, so a run is
  reproducible.

The ridge is relative (``mu = ridge x`` the mean diagonal of ``N``); the CG tolerance and the
certificate's threshold follow the model's precision (:func:`precision_tolerances`): float64
certifies at the relative normal-equation residual ``1e-6`` like the Python method, float32 at
``1e3 eps``. Linear sites and GPT-2's ``Conv1D`` (read and written in the augmented ``(r, m1)``
layout) are supported; a tied or shared weight is never a site (the plan does not offer it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import ConfigError, ValidationError, parse_params
from ..lm import OutputSpec, prepare_fold, squared_error
from ..stats.hooks import hooked_layers
from ..stats.linearise import NotBatchMajor, OutputDerivatives, leads_with_samples, perturbed_output, run_recorded
from .firstorder import TaskTargets, batch_functions, folded_batch_functions
from .output_space import (CERT_TOL, KRONECKER_MAX_SIDE, KroneckerPreconditioner, OutputSpaceSamples,
                           OutputSpaceSolution, output_space_solve)
from .output_space_damped import DampingOptions, damped_output_space
from .sites import LayerSite, append_ones, read_augmented, site_module, stored_tensors, write_augmented

#: site kinds the run-layer output-space merge solves (augmented ``(r, m1)`` weights)
SUPPORTED_KINDS = ("linear", "conv1d")


class OutputSpaceRunParams(BaseModel):
    """``method.params`` of ``output_space`` in a ``mergeqp merge`` config.

    ``reference``: the merge linearised at and ridged toward (``regmean`` or ``soup``);
    ``ridge``: relative ridge weight (``>= 0``); ``radius``: optional Frobenius bound on
    ``||W - W_ref||`` per layer (absolute, weight units); ``alpha``: RegMean's off-diagonal
    scaling for the reference; ``max_iter``: CG iterations per solve; ``backtracks``: step
    halvings tried when a layer's full step raises the true calibration error; ``jacobian_max_bytes``:
    the size up to which per-sample Jacobians are formed (0: always matrix-free); ``probes``:
    Hutchinson probes per batch for the matrix-free preconditioner; ``seed``: their seed.

    ``steps``: solves per site. ``1`` (default): one solve at the reference, accepted with
    ``backtracks``. ``> 1``: damped Gauss-Newton (Levenberg-Marquardt) per site
    (:func:`damped_site`): each solve is linearised at the current weight and adds the proximal
    term ``prox x scale x ||W - W_t||^2`` to the ridge toward the reference; a solve is accepted
    when the true calibration error plus the ridge term falls (then ``prox`` is divided by
    ``relax``), else ``prox`` is multiplied by ``damping`` and the solve retried; it stops after
    ``steps`` solves or when an accepted one gains less than ``tol`` relative. ``radius`` is a
    one-solve option."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    reference: Literal["regmean", "soup"] = "regmean"
    ridge: float = Field(0.1, ge=0.0)
    radius: float | None = Field(None, gt=0.0)
    alpha: float = Field(0.9, ge=0.0, le=1.0)
    max_iter: int = Field(500, ge=1)
    backtracks: int = Field(3, ge=0)
    jacobian_max_bytes: float = Field(float(2 ** 26), ge=0.0)
    probes: int = Field(8, ge=1)
    seed: int = 0
    steps: int = Field(1, ge=1)
    prox: float = Field(16.0, gt=0.0)
    damping: float = Field(4.0, gt=1.0)
    relax: float = Field(1.5, ge=1.0)
    tol: float = Field(1e-4, ge=0.0)

    @model_validator(mode="after")
    def _one_solve_radius(self) -> OutputSpaceRunParams:
        if self.radius is not None and self.steps > 1:
            raise ValueError("'radius' bounds one solve: use it with steps: 1 (the damped steps of steps > 1 "
                             "are kept near the current weight by 'prox' instead)")
        return self


def parse_run_params(params: Mapping[str, Any], where: str = "method") -> OutputSpaceRunParams:
    """Validate ``params``; :class:`ConfigError` naming the bad key and listing the valid ones."""
    return parse_params(OutputSpaceRunParams, params, where, "'output_space'")


def check_sites(sites: Sequence[LayerSite]) -> None:
    """Raise :class:`ConfigError` unless every site is a kind :data:`SUPPORTED_KINDS` lists and there is one."""
    bad = [s for s in sites if s.kind not in SUPPORTED_KINDS]
    if bad:
        raise ConfigError(f"method 'output_space' solves linear layers ({', '.join(SUPPORTED_KINDS)}); "
                          f"{bad[0].label!r} is a {bad[0].kind} layer: leave it out of 'layers'")
    if not sites:
        raise ConfigError("method 'output_space': 'layers' selects no linear layer (every selected tensor would "
                          "just be the reference)")


def precision_tolerances(dtype: Any) -> tuple[float, float]:
    """``(cg_tol, cert_tol)`` for a model computing in ``dtype``: float64 ``(1e-10, 1e-6)``; a
    lower precision ``(100 eps, 1000 eps)`` (the operator itself is only that accurate)."""
    import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

    eps = float(torch.finfo(dtype).eps)
    if eps <= 1e-15:
        return 1e-10, CERT_TOL
    return 100.0 * eps, max(CERT_TOL, 1000.0 * eps)


@dataclass(frozen=True, eq=False)
class _SiteBatch:
    """One calibration batch at one site: augmented inputs ``Z`` (``(B, *positions, m1)``, model
    dtype), the perturbed-output function ``f`` and its derivatives at ``zero``, the targets ``t``
    (``(B, c)`` float64 numpy) and the task's weight."""

    Z: Any
    derivatives: OutputDerivatives
    target: np.ndarray
    weight: float


class ModelLinearisation:
    """The matrix-free linear map ``L: E (r, m1) -> (L_s E)_s`` of one site of a live model on its
    calibration batches (module docstring), with the operator interface of
    :class:`~mergeqp.merge.output_space.OutputSpaceSamples` that
    :func:`~mergeqp.merge.output_space.output_space_solve` uses. Output changes are one flat
    float64 vector over every batch's ``(B, c)`` block. Valid only while the batches' hook is
    registered (inside :func:`~mergeqp.stats.hooks.hooked_layers`)."""

    def __init__(self, batches: Sequence[_SiteBatch], shape: tuple[int, int], probes: int = 8, seed: int = 0):
        if not batches:
            raise ValidationError("the output-space merge needs at least one calibration batch")
        self.batches = list(batches)
        self._shape = shape
        self.probes = probes
        self.seed = seed
        self.sizes = [b.target.size for b in self.batches]
        self.target = np.concatenate([b.target.reshape(-1) for b in self.batches])
        self._diagonal: np.ndarray | None = None
        self._factor_B: np.ndarray | None = None
        self._kronecker: KroneckerPreconditioner | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """``(r, m1)``: the site's augmented weight."""
        return self._shape

    def _blocks(self, V: np.ndarray) -> list[np.ndarray]:
        return np.split(V, np.cumsum(self.sizes)[:-1])

    def apply(self, E: np.ndarray) -> np.ndarray:
        """``L E``: one JVP per batch along ``x E'``; flat float64."""
        import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

        out = []
        for b in self.batches:
            Et = torch.as_tensor(E, dtype=b.Z.dtype, device=b.Z.device)
            v = (b.Z @ Et.t()).reshape(b.derivatives.zero.shape)
            out.append(b.derivatives.push(v).to(torch.float64).reshape(-1).cpu().numpy())
        return np.concatenate(out)

    def _pull(self, b: _SiteBatch, cot: Any) -> Any:
        """``(d f)' cot``: ``(B, *positions, r)`` for a cotangent ``(B, c)``."""
        from torch.func import vjp  # optional heavy dependency, imported on first use

        _, pull = vjp(b.derivatives.f, b.derivatives.zero)
        return pull(cot.to(b.derivatives.zero.dtype))[0]

    def adjoint(self, V: np.ndarray) -> np.ndarray:
        """``L*(w V)``: one VJP per batch with cotangent ``w V``, contracted with the inputs; ``(r, m1)``."""
        import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

        r, m1 = self.shape
        total = np.zeros((r, m1))
        for b, block in zip(self.batches, self._blocks(V)):
            cot = torch.from_numpy(b.weight * block.reshape(b.target.shape)).to(b.Z.device)
            g = self._pull(b, cot).reshape(-1, r).to(torch.float64)
            total += (g.t() @ b.Z.reshape(-1, m1).to(torch.float64)).cpu().numpy()
        return total

    def normal(self, E: np.ndarray) -> np.ndarray:
        """``N E = L*W L E`` (``(r, m1)``)."""
        return self.adjoint(self.apply(E))

    def normal_diagonal(self) -> np.ndarray:
        """``(r, m1)``: the Hutchinson estimate of ``sum_(s,t) w_s ||A_(s,t) e_i||^2 x_(s,t,j)^2``
        (what :meth:`OutputSpaceSamples.normal_diagonal` computes exactly), ``probes`` seeded
        Rademacher cotangents per batch; computed once."""
        import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

        if self._diagonal is None:
            r, m1 = self.shape
            diag = np.zeros((r, m1))
            B = np.zeros((r, r)) if r <= KRONECKER_MAX_SIDE else None  # (the preconditioner's factor)
            for b, g in self._probes():
                Z2 = b.Z.reshape(-1, m1).to(torch.float64) ** 2
                diag += b.weight / self.probes * ((g * g).t() @ Z2).cpu().numpy()
                if B is not None:
                    B += b.weight / self.probes * (g.t() @ g).cpu().numpy()
            self._diagonal, self._factor_B = diag, B
        return self._diagonal

    def _probes(self) -> Iterator[tuple[_SiteBatch, Any]]:
        """Each batch with each of its ``probes`` pulled-back Rademacher cotangents ``(B T, r)``
        (float64); the same probes at every call (seeded by ``seed``)."""
        import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

        r = self.shape[0]
        gen = torch.Generator().manual_seed(self.seed)
        for b in self.batches:
            for _ in range(self.probes):
                v = torch.randint(0, 2, b.target.shape, generator=gen).to(torch.float64) * 2.0 - 1.0
                yield b, self._pull(b, v.to(b.Z.device)).to(torch.float64).reshape(-1, r)

    def kronecker_preconditioner(self) -> KroneckerPreconditioner:
        """:class:`~mergeqp.merge.output_space.KroneckerPreconditioner` from the same probes as
        :meth:`normal_diagonal` (the factor ``B`` as their expected Gram matrix, the rotated diagonal
        from a second pass over them): ``2 probes`` VJPs per batch in all; computed once."""
        import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

        if self._kronecker is None:
            diag = self.normal_diagonal()
            r, m1 = self.shape
            C = None
            if m1 <= KRONECKER_MAX_SIDE:
                C = np.zeros((m1, m1))
                for b in self.batches:
                    Z = b.Z.reshape(-1, m1).to(torch.float64)
                    C += b.weight * (Z.t() @ Z).cpu().numpy()

            def rotated(U: np.ndarray | None, V: np.ndarray | None) -> np.ndarray:
                if U is None and V is None:  # both sides too long: the plain diagonal, no second pass
                    return diag
                out = np.zeros((r, m1))
                for b, g in self._probes():
                    Z = b.Z.reshape(-1, m1).to(torch.float64)
                    Q2 = (Z if V is None else Z @ torch.from_numpy(V).to(Z.device)) ** 2
                    P = g if U is None else g @ torch.from_numpy(U).to(g.device)
                    out += b.weight / self.probes * ((P ** 2).t() @ Q2).cpu().numpy()
                return out

            self._kronecker = KroneckerPreconditioner.from_factors(self._factor_B, C, rotated)
        return self._kronecker

    def error(self, E: np.ndarray) -> float:
        """``sum_s w_s ||L_s E - t_s||^2``."""
        res = self.apply(E) - self.target
        return float(sum(b.weight * float(np.sum(blk ** 2)) for b, blk in zip(self.batches, self._blocks(res))))

    def ridge_scale(self) -> float:
        """Mean of :meth:`normal_diagonal`: the unit of the relative ridge."""
        return float(np.mean(self.normal_diagonal()))


def formed_samples(batches: Sequence[_SiteBatch]) -> OutputSpaceSamples:
    """The batches' per-sample Jacobians formed and padded (zeros) to common ``T`` and ``c``, as
    :class:`~mergeqp.merge.output_space.OutputSpaceSamples` (exact linearisation, same operator)."""
    import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

    T = max(b.derivatives.T for b in batches)
    c = max(b.target.shape[1] for b in batches)
    X, A, t, w = [], [], [], []
    for b in batches:
        B, cb, Tb = b.target.shape[0], b.target.shape[1], b.derivatives.T
        jac = b.derivatives.jacobian("auto").to(torch.float64).cpu().numpy()  # (B, c_b, T_b, r)
        Z = b.Z.reshape(B, Tb, -1).to(torch.float64).cpu().numpy()
        X.append(np.pad(Z, ((0, 0), (0, T - Tb), (0, 0))))
        A.append(np.pad(jac, ((0, 0), (0, c - cb), (0, T - Tb), (0, 0))))
        t.append(np.pad(b.target, ((0, 0), (0, c - cb))))
        w.append(np.full(B, b.weight))
    return OutputSpaceSamples(np.concatenate(X), np.concatenate(A), np.concatenate(t), np.concatenate(w))


def jacobian_bytes_of(batches: Sequence[_SiteBatch]) -> int:
    """Float64 bytes of every batch's per-sample Jacobian ``(B, c, T, r)``."""
    return sum(8 * b.target.size * b.derivatives.T * b.derivatives.r for b in batches)


@dataclass(frozen=True)
class OutputSpaceLayer:
    """One solved site: the solution (``E`` ``(r, m1)``, from the weight it was linearised at;
    with damped steps the last accepted one's, ``None`` when none was) and its record
    (:func:`solve_site` / :func:`damped_site`; :func:`solve_sites` adds the accepted step)."""

    site: LayerSite
    solution: OutputSpaceSolution | None
    record: dict[str, Any]


@contextmanager
def site_linearisation(model: Any, site: LayerSite, tasks: Sequence[TaskTargets], spec: OutputSpec,
                       device: Any) -> Iterator[list[_SiteBatch]]:
    """The calibration batches of every task linearised at ``site`` of ``model`` (unchanged): one
    recorded forward pass per batch; the batches' derivatives are valid inside the ``with`` block
    only (the site's hook is removed on exit)."""
    import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

    check_sites([site])
    module = site_module(model, site)
    fold = prepare_fold(model, spec, [tb for t in tasks for tb in t.batches], device, [module])
    with hooked_layers(model, [module]) as hooks:
        batches: list[_SiteBatch] = []
        for task in tasks:
            for bi, tb in enumerate(task.batches):
                if fold is None:
                    call, compared = batch_functions(model, spec, tb, device)
                    y = tb.target.to(device=device, dtype=torch.float64)
                else:
                    call, compared, y = folded_batch_functions(model, fold, tb, device)
                out = run_recorded(call, hooks, [f"layer {site.name!r}"], f"task {task.name!r} batch {bi}")
                h = compared(out)
                B = int(h.shape[0])
                target = (y.reshape(B, -1) - h.to(torch.float64)).cpu().numpy()
                if not np.all(np.isfinite(target)):
                    raise ValidationError(f"output_space at {site.name!r}: non-finite compared outputs on task "
                                          f"{task.name!r} batch {bi}")
                Z = append_ones(hooks[0].layer_input, site.has_bias).detach()
                zero = torch.zeros_like(hooks[0].layer_output)
                f = perturbed_output(hooks[0], call, compared)
                batches.append(_SiteBatch(Z, OutputDerivatives(f, zero, int(h.shape[1]), samples=B), target, float(task.weight)))
        if not batches:
            raise ValidationError(f"output_space at {site.name!r}: no calibration batch")
        yield batches


class JacobianTooLarge(ValidationError):
    """The per-sample Jacobians of a site exceed ``jacobian_max_bytes`` where a matrix-free solve
    was not allowed (``matrix_free=False``)."""


@contextmanager
def _linearised(model: Any, site: LayerSite, tasks: Sequence[TaskTargets], spec: OutputSpec, device: Any,
                params: OutputSpaceRunParams, matrix_free: bool) -> Iterator[tuple[Any, bool, float]]:
    """``(operator, formed, reference_objective)`` of ``site`` linearised at ``model``: formed
    Jacobians (:func:`formed_samples`, valid after the block) when they fit
    ``params.jacobian_max_bytes``, else :class:`ModelLinearisation` (valid inside the block only);
    ``reference_objective`` = the exact calibration error of the compared output at ``model``."""
    with site_linearisation(model, site, tasks, spec, device) as batches:
        size = jacobian_bytes_of(batches)
        # a layer that sees the batch flattened (OPT's fc1 / fc2: (B T, r)) has no per-sample Jacobian
        # to form: the matrix-free operator's products (forward mode) are exact there (stop 55: auto's
        # output_space candidates stopped the run with advice it could not follow)
        per_sample = all(leads_with_samples(b.derivatives.zero, b.target.shape[0]) for b in batches)
        formed = size <= params.jacobian_max_bytes and per_sample
        if not formed and not matrix_free and size > params.jacobian_max_bytes:
            raise JacobianTooLarge(f"the per-sample Jacobians at {site.name!r} take {size / 2 ** 20:.0f} MiB, above "
                                   f"jacobian_max_bytes ({params.jacobian_max_bytes / 2 ** 20:.0f} MiB)")
        operator: Any = None
        if formed:
            try:
                operator = formed_samples(batches)
            except NotBatchMajor:  # rows not each sample's own: the matrix-free products need no such layout
                formed = False
        if operator is None:
            operator = ModelLinearisation(batches, (site.r, site.m1), params.probes, params.seed)
        yield operator, formed, float(sum(b.weight * float(np.sum(b.target ** 2)) for b in batches))


def solve_site(model: Any, site: LayerSite, tasks: Sequence[TaskTargets], spec: OutputSpec, device: Any,
               params: OutputSpaceRunParams, *, matrix_free: bool = True) -> OutputSpaceLayer:
    """Linearise ``model`` (unchanged) at ``site`` on every task's batches
    (:func:`site_linearisation`) and solve the site's output-space least squares (module
    docstring). The record holds the
    linearised objective at ``model``'s weights (``objective_before``, = the exact calibration
    error of the compared output there) and at the solution (``objective_after``: fit + ridge
    term; ``fit_solution``: the fit alone), the certificate (``normal_residual``, ``certified``,
    ``cert_tol``; with a radius ``feasibility`` / ``complementarity``), CG ``iterations`` and
    ``seconds``. ``matrix_free=False``: raise :class:`JacobianTooLarge` instead of solving
    matrix-free when the Jacobians exceed ``params.jacobian_max_bytes``."""
    t0 = time.perf_counter()
    cg_tol, cert_tol = precision_tolerances(next(model.parameters()).dtype)
    with _linearised(model, site, tasks, spec, device, params, matrix_free) as (operator, formed, reference_objective):
        scale = operator.ridge_scale()
        sol = output_space_solve(operator, ridge=params.ridge * scale, radius=params.radius, tol=cg_tol,
                                 max_iter=params.max_iter, cert_tol=cert_tol)
    seconds = time.perf_counter() - t0
    record = {"layer": site.name, "operator": "formed" if formed else "matrix-free",
              "objective_before": reference_objective, "objective_after": sol.objective,
              "fit_solution": sol.fit, "ridge_relative": params.ridge, "ridge_absolute": sol.ridge,
              "radius": sol.radius, "multiplier": sol.multiplier, "normal_residual": sol.residual,
              "feasibility": sol.feasibility, "complementarity": sol.complementarity,
              "cert_tol": sol.cert_tol, "certified": sol.certified(), "iterations": sol.iterations,
              "change_norm": float(np.linalg.norm(sol.E)), "seconds": seconds, "notes": list(sol.notes)}
    return OutputSpaceLayer(site, sol, record)


def damped_site(model: Any, site: LayerSite, tasks: Sequence[TaskTargets], spec: OutputSpec, device: Any,
                params: OutputSpaceRunParams, error: float, *, matrix_free: bool = True) -> OutputSpaceLayer:
    """Levenberg-Marquardt at ``site`` (``params.steps > 1``;
    :func:`~.output_space_damped.damped_output_space`): minimises ``F(W) + mu ||W - W_ref||^2``
    (``F`` the true calibration error, ``error`` = ``F`` at ``model`` as it stands, ``W_ref`` the
    site's weight there) by damped solves, each linearised at the current weight; accepted only
    when that falls, so ``F`` at the result is at most ``error``. Formed Jacobians are reused after
    a rejected solve; matrix-free ones are linearised again. ``model`` is left holding the result;
    the record is :func:`solve_site`'s (of the last accepted solve) with ``steps`` (each solve:
    ``prox`` (absolute), true ``error_before`` / ``error_after``, linearised ``predicted``,
    ``accepted``, certificate), ``accepted_steps`` and ``calibration_after``."""
    import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

    t0 = time.perf_counter()
    cg_tol, cert_tol = precision_tolerances(next(model.parameters()).dtype)
    W_ref = read_augmented(model, site)
    operators: list[str] = []

    def put(W: np.ndarray) -> None:
        write_augmented(model, site, torch.from_numpy(W).to(W_ref.dtype))

    @contextmanager
    def linearised(W: np.ndarray) -> Iterator[tuple[Any, bool]]:
        put(W)
        with _linearised(model, site, tasks, spec, device, params, matrix_free) as (operator, formed, _):
            operators.append("formed" if formed else "matrix-free")
            yield operator, formed

    def true_error(W: np.ndarray) -> float:
        put(W)
        return calibration_error(model, tasks, spec, device)

    ref = W_ref.to(torch.float64).cpu().numpy()
    result = damped_output_space(ref, error, linearised, true_error, DampingOptions(
        ridge=params.ridge, prox=params.prox, damping=params.damping, relax=params.relax, steps=params.steps,
        tol=params.tol, cg_tol=cg_tol, max_iter=params.max_iter, cert_tol=cert_tol))
    put(result.W)
    steps = [st.record("prox") for st in result.steps]
    last = result.last
    record = {"layer": site.name, "operator": "formed" if set(operators) == {"formed"} else "matrix-free",
              "objective_before": error, "objective_after": result.value, "fit_solution": result.error,
              "ridge_relative": params.ridge, "ridge_absolute": result.mu, "radius": None, "multiplier": 0.0,
              "normal_residual": last.residual if last else None, "feasibility": 0.0, "complementarity": 0.0,
              "cert_tol": cert_tol, "certified": result.certified(), "iterations": sum(s["iterations"] for s in steps),
              "change_norm": float(np.linalg.norm(result.W - ref)),
              "seconds": time.perf_counter() - t0, "notes": list(last.notes) if last else [],
              "steps": steps, "accepted_steps": result.accepted, "calibration_after": result.error}
    return OutputSpaceLayer(site, last, record)


def calibration_error(model: Any, tasks: Sequence[TaskTargets], spec: OutputSpec, device: Any) -> float:
    """The true calibration objective ``sum_t w_t sum_j ||h_j - y_j||^2`` of ``model`` (compared output)."""
    return float(sum(t.weight * squared_error(model, t.batches, spec, device)[0] for t in tasks))


def solve_sites(model: Any, sites: Sequence[LayerSite], tasks: Sequence[TaskTargets], spec: OutputSpec,
                device: Any, params: OutputSpaceRunParams, log: Callable[[str], None] | None = None, *,
                matrix_free: bool = True) -> tuple[list[OutputSpaceLayer], dict[str, Any]]:
    """Solve the sites one at a time, in order (Gauss-Seidel): each is linearised at ``model`` as
    it stands, which holds the reference and the earlier sites' accepted updates, so no output
    error is corrected twice. A site's update ``W + step E`` is accepted with the first step of
    ``1, 1/2, ...`` (``params.backtracks`` halvings) that does not raise the *true* calibration
    error, else the site keeps its weight (``step`` 0): the merged model's calibration error is
    never above the reference's. With ``params.steps > 1`` each site takes :func:`damped_site`'s
    damped solves instead (accepted on the same true error plus the ridge term, so never above it
    either). ``model`` is left holding the merge; returns the layers (records with
    ``calibration_before`` / ``calibration_after`` / ``step`` / ``accepted``) and the sites'
    checkpoint tensors (stored layout, float64)."""
    import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

    check_sites(sites)
    say = log or (lambda msg: None)
    layers: list[OutputSpaceLayer] = []
    tensors: dict[str, Any] = {}
    current = calibration_error(model, tasks, spec, device)
    for site in sites:
        if params.steps > 1:
            layer = damped_site(model, site, tasks, spec, device, params, current, matrix_free=matrix_free)
            r = layer.record
            r.update(calibration_before=current, step=1.0, accepted=r["accepted_steps"] > 0)
            say(f"output_space {site.name}: {r['accepted_steps']} of {len(r['steps'])} damped solves accepted; "
                f"true calibration error {current:.6g} -> {r['calibration_after']:.6g} ({r['seconds']:.1f} s)")
            current = r["calibration_after"]
            tensors.update(stored_tensors(site, read_augmented(model, site)))
            layers.append(layer)
            continue
        layer = solve_site(model, site, tasks, spec, device, params, matrix_free=matrix_free)
        W0 = read_augmented(model, site)
        E = torch.from_numpy(layer.solution.E)
        step, value = 1.0, current
        for _ in range(params.backtracks + 1):
            write_augmented(model, site, W0 + step * E)
            value = calibration_error(model, tasks, spec, device)
            if value <= current:
                break
            step /= 2.0
        accepted = value <= current
        if not accepted:
            write_augmented(model, site, W0)
            step, value = 0.0, current
        r = layer.record
        r.update(calibration_before=current, calibration_after=value, step=step, accepted=accepted)
        say(f"output_space {site.name}: objective {r['objective_before']:.6g} -> {r['objective_after']:.6g} "
            f"(linearised), residual {r['normal_residual']:.2g}, {r['iterations']} CG iterations, "
            f"{r['operator']}; true calibration error {current:.6g} -> {value:.6g} (step {step:g}) "
            f"({r['seconds']:.1f} s)")
        current = value
        tensors.update(stored_tensors(site, read_augmented(model, site)))
        layers.append(layer)
    return layers, tensors


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.2g}"


def uncertified_notes(layers: Sequence[OutputSpaceLayer]) -> list[str]:
    """A report note naming the layers whose solve is not certified (none when all are)."""
    bad = [f"{x.site.name} (residual {_g(x.record['normal_residual'])} > {x.record['cert_tol']:.2g})"
           for x in layers if not x.record["certified"]]
    if not bad:
        return []
    return [f"output_space solution NOT certified at {', '.join(bad)}: raise method.params.max_iter or the ridge"]


__all__ = ["JacobianTooLarge", "ModelLinearisation", "OutputSpaceLayer", "OutputSpaceRunParams", "SUPPORTED_KINDS", "calibration_error",
           "check_sites", "formed_samples", "parse_run_params", "precision_tolerances", "site_linearisation",
           "solve_site", "solve_sites", "uncertified_notes"]
