"""PyTorch first-order solvers: FISTA with adaptive restart, and the paper's Adam.

Both run on CPU or CUDA (``device=``) in float32 or float64 (``dtype=``), with H either
explicit (moved to the device once) or only as the problem's ``hessian_matvec`` callback (a
host round trip per product), so an H too large to store can still be solved. Iterates stay
feasible through exact projections (:mod:`mergeqp.solvers.torch_projections`). Progress is
judged in float64: the gradient ``H x + g`` at the host's projected iterate comes from a float64
product on the device when H is held there in float64 (else from the host), and the Frank-Wolfe
gap (or, for unbounded sets, the projected-gradient residual) is taken on the host, the same
quantity the certificate reports. The certificate itself recomputes everything on the host.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import numpy as np

from ..constraints import ConstraintSet
from ..errors import UnboundedError, UnsupportedError, ValidationError
from ..problem import MergeQP
from ..solution import SolveStatus
from .base import QPSolver, RawResult
from .torch_projections import checked_projection, torch_projection
from .unbounded import unbounded_claim

_DTYPES = ("float32", "float64")


def torch_device(name: str) -> Any:
    """``auto`` (CUDA when available), ``cpu``, ``cuda`` or ``cuda:N`` as a ``torch.device``; a
    :class:`ValidationError` for CUDA that is not available or an unknown name."""
    import torch  # optional heavy dependency: deferred so mergeqp imports without torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValidationError(f"device {name!r} requested but CUDA is not available here")
    try:
        return torch.device(name)
    except (RuntimeError, TypeError):
        raise ValidationError(f"unknown torch device {name!r} (use cpu, cuda, cuda:N or auto)") from None


def cuda_auto_declines(n: int, min_n: int, min_n_started: int, need_bytes: int, below: str, cpu: str,
                       held: str) -> str | None:
    """``auto``'s rule for a GPU solver: ``None`` (take it) on a CUDA machine from ``min_n``
    variables, or from ``min_n_started`` once this process has started CUDA, while ``need_bytes``
    fit in the GPU's free memory; else why not (``below``: what runs under ``min_n_started``;
    ``cpu``: why not on a machine without CUDA; ``held``: what the bytes hold)."""
    if n < min_n_started:  # first: no torch import for the common small problem
        return f"n = {n} < {min_n_started}: {below}"
    if n < min_n and "torch" not in sys.modules:
        # a process that has not imported torch has not started CUDA: asking would import it (1.6 s,
        # more than the solve at this size: stop 67, auto at n = 1536 on a box, 1.7 s against 0.3 s)
        return (f"n = {n} < {min_n} and this process has not started CUDA (torch is not imported): starting it "
                f"costs more than the GPU saves at this size")
    import torch  # the solver's available() ran first: torch is importable here

    if not torch.cuda.is_available():
        return f"auto chooses it on a CUDA device only ({cpu})"
    if n < min_n and not torch.cuda.is_initialized():
        return (f"n = {n} < {min_n} and this process has not started CUDA: starting it costs more than "
                f"the GPU saves at this size (from n = {min_n_started} once started)")
    free, _total = torch.cuda.mem_get_info()
    if need_bytes > free:
        return f"{held} need {need_bytes / 1e9:.1f} GB, the GPU has {free / 1e9:.1f} GB free"
    return None


def torch_missing() -> str | None:
    """``None`` when torch can be imported here, else why not (the torch solvers' ``available``)."""
    import importlib.util

    return None if importlib.util.find_spec("torch") is not None else "torch is not installed"


def _dtype(name: str, solver: str) -> Any:
    import torch  # optional heavy dependency: deferred so mergeqp imports without torch

    if name not in _DTYPES:
        raise ValidationError(f"{solver}: option dtype={name!r} must be one of {', '.join(_DTYPES)}")
    return getattr(torch, name)


class _TorchQP:
    """The problem on a device: ``hv(x)`` (H x), ``grad(x)``, the projection."""

    def __init__(self, problem: MergeQP, cset: ConstraintSet, device: Any, dtype: Any):
        import torch  # optional heavy dependency: deferred so mergeqp imports without torch


        self.problem = problem
        self.device, self.dtype = device, dtype
        self.g = torch.as_tensor(np.array(problem.g), dtype=dtype, device=device)
        self.H = None if problem.H is None else torch.as_tensor(np.array(problem.H), dtype=dtype, device=device)
        self.project = torch_projection(cset, problem.shape, device, dtype)

    def hv(self, x: Any) -> Any:
        import torch  # optional heavy dependency: deferred so mergeqp imports without torch

        if self.H is not None:
            return self.H @ x
        host = x.detach().to("cpu", torch.float64).numpy()
        return torch.as_tensor(self.problem.matvec(host), dtype=self.dtype, device=self.device)

    def grad(self, x: Any) -> Any:
        return self.hv(x) + self.g

    def float64_gradient(self, x: np.ndarray) -> np.ndarray | None:
        """``H x + g`` for a host point ``x``, computed where H is held when it is held in float64
        (float64 arithmetic as on the host, in another summation order; on a GPU this avoids an
        ``n x n`` product on the CPU at every progress check, which cost more than the
        iterations between two checks); ``None`` otherwise (float32 or matvec-only: the host
        computes it)."""
        import torch  # optional heavy dependency: deferred so mergeqp imports without torch

        if self.H is None or self.dtype != torch.float64:
            return None
        xd = torch.as_tensor(x, dtype=torch.float64, device=self.device)
        return self.to_host(self.H @ xd + self.g)

    def to_host(self, x: Any) -> np.ndarray:
        import torch  # optional heavy dependency: deferred so mergeqp imports without torch

        return x.detach().to("cpu", torch.float64).numpy().copy()

    def lipschitz(self, iters: int = 100, tol: float = 1e-6, seed: int = 0) -> float:
        """``lambda_max(H)`` by power iteration (from a fixed random start). Norms are taken with the
        largest entry factored out: at H ~ 1e-170 (float64; 1e-25 in float32) the squares underflowed,
        the estimate came back 0 and the solver ran all its iterations with a unit step."""
        import torch  # optional heavy dependency: deferred so mergeqp imports without torch

        def norm(u: Any) -> float:
            top = float(u.abs().max())
            return top if top == 0.0 or not math.isfinite(top) else top * float((u / top).norm())

        gen = torch.Generator(device="cpu").manual_seed(seed)
        v = torch.randn(self.problem.n, generator=gen, dtype=torch.float64).to(self.device, self.dtype)
        v /= v.norm()
        lam = 0.0
        for _ in range(iters):
            w = self.hv(v)
            lam_new = float(torch.dot(v, w))
            nw = norm(w)
            if nw == 0:
                return 0.0
            v = w / nw
            if abs(lam_new - lam) <= tol * abs(lam_new):
                lam = lam_new
                break
            lam = lam_new
        return max(lam, float(nw))


def _progress(problem: MergeQP, cset: ConstraintSet, x: np.ndarray, L: float,
              grad: np.ndarray | None = None) -> tuple[float, float, float]:
    """``(J(x), gap, size)`` in float64: the Frank-Wolfe gap, or for unbounded sets (where it
    is infinite, or the set declares no oracle) the gradient-mapping estimate ``||G|| max(1, ||x||)`` with
    ``G = L (x - P(x - grad/L))``; ``size = |c| + |x'Hx|/2 + |g'x|``, the magnitude of the
    terms that cancel in ``J`` (float64 roundoff in ``J`` and the gap is ~ eps * size).
    ``grad``: ``H x + g`` (``(n,)``, float64) when the caller has it (a float64 product on the
    device), else it is computed here on the host."""
    d = x.reshape(problem.shape)
    grad = problem.gradient(d) if grad is None else np.asarray(grad, dtype=np.float64).reshape(problem.shape)
    lin = float(problem.g @ x)
    quad = float(0.5 * np.sum(d * (grad - problem.g.reshape(problem.shape))))
    J = quad + lin + problem.c
    size = abs(problem.c) + abs(quad) + abs(lin)
    try:
        val, _ = cset.support(grad)
    except UnsupportedError:  # a set with a projection but no oracle: the gradient mapping
        val = -math.inf
    if math.isfinite(val):
        return J, float(np.sum(grad * d) - val), size
    G = L * (d - checked_projection(cset, d - grad / L))
    return J, float(np.linalg.norm(G)) * max(1.0, float(np.linalg.norm(x))), size


#: the FISTA stop also accepts a gap below this multiple of float64 roundoff in ``J``
#: (``eps * size``): where ``J* ~ 0`` the relative target ``tol * 1e-8 size`` lies below it
ROUNDOFF_FLOOR = 32.0 * float(np.finfo(float).eps)

#: on a set that is not known to be bounded, iterates this many times farther out than the start
#: (plus one) are tested for a ray of unbounded descent (:func:`_diverging_ray`)
FAR_OUT = 1e3


def _diverging_ray(problem: MergeQP, cset: ConstraintSet, solver: str, x: np.ndarray, before: np.ndarray,
                   start_norm: float) -> UnboundedError | None:
    """The verified :class:`UnboundedError` when the iterates left the start far behind and the
    step between two checks, ``x - before``, is a ray of the set along which J falls without bound
    (the registry's checks, :func:`~mergeqp.solvers.unbounded.unbounded_claim`); else ``None``."""
    if cset.bounded or not float(np.linalg.norm(x)) > FAR_OUT * (1.0 + start_norm):
        return None
    claim = unbounded_claim(problem, cset, solver, "its iterates diverge along a ray", x - before)
    return claim if isinstance(claim, UnboundedError) else None


def _start(problem: MergeQP, x0: np.ndarray | None, init: str) -> np.ndarray:
    if x0 is not None:
        return np.asarray(x0, dtype=np.float64).ravel()
    if init == "soup":
        return problem.soup_point().ravel()
    if init == "zeros":
        return np.zeros(problem.n)
    if init == "ones":
        return np.ones(problem.n)
    raise ValidationError(f"init must be soup, zeros or ones (or pass x0), got {init!r}")


class _TorchSolver(QPSolver):
    def supports(self, problem: MergeQP, constraints: ConstraintSet) -> str | None:
        if not constraints.has_projection:
            return f"needs a closed-form projection, which {constraints.spec} lacks"
        return None

    def available(self) -> str | None:
        return torch_missing()


class TorchFISTASolver(_TorchSolver):
    """FISTA (accelerated projected gradient) with gradient-based adaptive restart.

    Options (defaults): ``device`` "auto" (CUDA when available), ``dtype`` "float64"
    ("float32" halves memory traffic but its gradients limit the attainable gap to ~1e-7
    relative), ``max_iter`` 20000, ``tol`` 1e-9 (stop when the float64 Frank-Wolfe gap is
    below ``tol * max(|J|, 1e-8 size)``, the certificate's scale with ``size = |c| + |d'Hd|/2 +
    |g'd|``, or below float64 roundoff ``32 eps size`` (under the certificate's default 1e-6
    target) where ``J* ~ 0`` makes the relative target unreachable;
    ``info["stopped_at_roundoff"]`` says so), ``check_every`` 25 iterations, ``lipschitz`` None
    (power iteration estimate x 1.05; give a number to skip it), ``init`` "soup". The
    returned point is the best checked iterate, projected once more in float64. On a set not
    known to be bounded, iterates far out whose last step is a verified ray of unbounded descent
    raise :class:`~mergeqp.errors.UnboundedError` (as ``active_set`` does).
    """

    name = "torch_fista"
    large_n_benchmark = True
    defaults = {"device": "auto", "dtype": "float64", "max_iter": 20000, "tol": 1e-9,
                "check_every": 25, "lipschitz": None, "init": "soup"}

    def check_options(self, options: Any) -> dict[str, Any]:
        """Known names (base class) and admissible values; errors name the option."""
        opts = super().check_options(options)
        rules: dict[str, Any] = {"max_iter": lambda v: v >= 1, "tol": lambda v: v >= 0, "check_every": lambda v: v >= 1}
        if opts["lipschitz"] is not None:  # a bound on H's largest eigenvalue: positive
            rules["lipschitz"] = lambda v: v > 0
        self.check_ranges(opts, rules)
        return opts

    def solve(self, problem: MergeQP, constraints: ConstraintSet, x0: np.ndarray | None = None,
              **options: Any) -> RawResult:
        import torch  # optional heavy dependency: deferred so mergeqp imports without torch

        opts = self.check_options(options)
        t0 = time.perf_counter()
        device, dtype = torch_device(str(opts["device"])), _dtype(str(opts["dtype"]), self.name)
        qp = _TorchQP(problem, constraints, device, dtype)
        L = float(opts["lipschitz"]) if opts["lipschitz"] is not None else 1.05 * qp.lipschitz()
        if not L > 0:
            L = 1.0
        setup = time.perf_counter() - t0
        tol = float(opts["tol"])
        check = int(opts["check_every"])  # (>= 1: check_options)
        with torch.no_grad():
            x = qp.project(torch.as_tensor(_start(problem, x0, str(opts["init"])), dtype=dtype, device=device))
            y = x.clone()
            t = 1.0
            best_x, best_J, gap = qp.to_host(x), math.inf, math.inf
            start_norm, last_x = float(np.linalg.norm(best_x)), best_x
            restarts = 0
            at_roundoff = False
            status = SolveStatus.MAX_ITERATIONS
            it = 0
            for it in range(1, int(opts["max_iter"]) + 1):
                gy = qp.grad(y)
                x_new = qp.project(y - gy / L)
                if float(torch.dot(y - x_new, x_new - x)) > 0:  # momentum points uphill
                    t = 1.0
                    restarts += 1
                    y = x_new.clone()
                else:
                    t_new = 0.5 * (1.0 + math.sqrt(1.0 + 4.0 * t * t))
                    y = x_new + ((t - 1.0) / t_new) * (x_new - x)
                    t = t_new
                step, x = x_new - x, x_new
                if it % check == 0 or it == int(opts["max_iter"]):
                    # the last step's curvature is at most lambda_max: above L, the power iteration stopped
                    # short of it (near a smaller eigenvalue, from a start almost orthogonal to the top
                    # eigenvector) and the steps overshoot; on a bounded set the iterates then cycle
                    # between faces without diverging (stop 57: hypothesis, a 2-variable box, L 1.26
                    # against lambda_max 1.90, 100,000 iterations 0.7% off the optimum)
                    ss = float(torch.dot(step, step))
                    curvature = float(torch.dot(step, qp.hv(step))) / ss if ss > 0 else 0.0
                    if curvature > L:
                        L = 1.05 * curvature
                        y, t = x.clone(), 1.0
                        continue
                    xh = checked_projection(constraints, qp.to_host(x).reshape(problem.shape)).ravel()
                    J, gap, size = _progress(problem, constraints, xh, L, qp.float64_gradient(xh))
                    if J < best_J:
                        ray = _diverging_ray(problem, constraints, self.name, xh, last_x, start_norm)
                        if ray is not None:
                            raise ray
                        best_x, best_J = xh, J
                    last_x = xh
                    if not math.isfinite(J) or J > 1e6 * (abs(best_J) + abs(problem.c) + 1.0):
                        L *= 4.0  # diverging: the Lipschitz estimate was too small
                        x = torch.as_tensor(best_x, dtype=dtype, device=device)
                        y, t = x.clone(), 1.0
                        continue
                    target = tol * max(abs(J), 1e-8 * size, np.finfo(float).tiny)
                    if gap <= max(target, ROUNDOFF_FLOOR * size):
                        best_x, best_J = xh, J
                        status = SolveStatus.OPTIMAL
                        at_roundoff = gap > target
                        break
        info = {"device": str(device), "dtype": str(opts["dtype"]), "lipschitz": L, "restarts": restarts,
                "gap_estimate": gap, "tol": tol, "stopped_at_roundoff": at_roundoff,
                "matvec_only": problem.H is None}
        return RawResult(problem.unflat(best_x), status, it, info, setup_seconds=setup)


class TorchAdamSolver(_TorchSolver):
    """The paper's method: Adam on ``J(d)`` from the soup, projecting (for a box: clamping)
    after every step. Not an exact solver: it stops after ``steps``; see its certificate.

    Options (defaults): ``lr`` 1e-2, ``steps`` 500, ``init`` "soup" (or "zeros", "ones"; or
    pass ``x0``), ``device`` "auto", ``dtype`` "float32". The final iterate is projected
    once more in float64 (exactly feasible).
    """

    name = "torch_adam"
    defaults = {"lr": 1e-2, "steps": 500, "init": "soup", "device": "auto", "dtype": "float32"}

    def auto_declines(self, problem: MergeQP, constraints: ConstraintSet) -> str | None:
        return "the paper's Adam heuristic is only run by name (it has no stopping test)"

    def solve(self, problem: MergeQP, constraints: ConstraintSet, x0: np.ndarray | None = None,
              **options: Any) -> RawResult:
        import torch  # optional heavy dependency: deferred so mergeqp imports without torch

        opts = self.check_options(options)
        t0 = time.perf_counter()
        device, dtype = torch_device(str(opts["device"])), _dtype(str(opts["dtype"]), self.name)
        qp = _TorchQP(problem, constraints, device, dtype)
        lr, steps = float(opts["lr"]), int(opts["steps"])
        if not lr > 0 or steps < 0:
            raise ValidationError(f"torch_adam: lr must be > 0 and steps >= 0, got lr={lr}, steps={steps}")
        d = torch.as_tensor(_start(problem, x0, str(opts["init"])), dtype=dtype, device=device)
        with torch.no_grad():
            d = qp.project(d)
        d.requires_grad_(True)
        opt = torch.optim.Adam([d], lr=lr)
        setup = time.perf_counter() - t0
        for _ in range(steps):
            opt.zero_grad(set_to_none=False)
            with torch.no_grad():
                d.grad = qp.grad(d)  # dJ/dd = H d + g (the autograd gradient of the quadratic)
            opt.step()
            with torch.no_grad():
                d.copy_(qp.project(d))
        xh = checked_projection(constraints, qp.to_host(d).reshape(problem.shape)).ravel()
        info = {"device": str(device), "dtype": str(opts["dtype"]), "lr": lr, "steps": steps,
                "init": "x0" if x0 is not None else str(opts["init"])}
        return RawResult(problem.unflat(xh), SolveStatus.MAX_ITERATIONS, steps, info, setup_seconds=setup)
