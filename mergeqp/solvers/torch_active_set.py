"""A primal-dual active-set solver for box-constrained merge QPs in PyTorch (CPU or CUDA).

The method of :mod:`mergeqp.solvers.active_set` (Hintermueller, Ito & Kunisch's PDAS on the
faces of the box, globalised by proximal-point regularisation when it cycles), reduced to the
box ``lo <= d <= hi`` (finite bounds) and written with torch tensors so that its dense work runs
where H is held: on a GPU the face solves (a gather of ``H[F, F]`` and one float64 Cholesky
each) and the products with H cost a small fraction of what they cost on the CPU. On an H100 a
float64 Cholesky of an n = 12288 H took 21 ms against 1.1-1.5 s on 16 CPU cores
(``benchmarks/gpu_solvers.py``, docs/solvers.md), while ``torch_fista`` needs thousands of products.

1. *Face solve*: variables at a bound stay there; the free ones ``F`` solve
   ``(H_FF + rho I) x_F = -(g + H x_fixed)_F + rho xc_F`` (one Cholesky of the gathered block, in
   float64, plus refinement steps against float64 products). A face whose block is singular
   (dead units, fewer samples than unknowns) gets a ridge ``ridge x max diag H`` and refinement
   against the unridged block.
   The first faces, while (nearly) all variables are free, are only approximated by
   ``cg_start`` conjugate-gradient steps (an exact unconstrained minimiser of an
   ill-conditioned H lies far outside the box and sends PDAS to the other extreme).
2. *PDAS update*: free variables that left the box become fixed at the bound they crossed;
   fixed variables whose multiplier (the gradient of the face objective) has the wrong sign
   are freed.
3. *Stop* when the Frank-Wolfe gap of the projected face minimiser is below ``tol x max(|J|,
   1e-8 (|c| + |x'Hx|/2 + |g'x|))`` (the certificate's test) or below its float64 rounding floor
   (the certificate's estimate, ``|x - s|_1`` times the gradient's rounding).
4. *Proximal PDAS*: when a face repeats, ``patience`` steps bring neither a decrease of J nor a
   face update that changes fewer coordinates than every earlier one, or a stable face does not
   certify even after a ten times longer refinement, PDAS runs on ``J(x) + rho/2 |x - xc|^2``
   from the best point, ``rho = prox_start x max diag H``. A solved subproblem (a stable face)
   becomes the next centre and ``rho`` shrinks by ``prox_decrease`` (down to ``prox_min x max
   diag H``); the same face accepted twice in a row jumps to the plain problem on it (once per
   face: a failed jump returns to the ``rho`` before it), and so does a proximal point whose gap
   is at the rounding floor (a second time there, it is returned). A subproblem that stalls (2
   steps without decrease, or ``prox_inner_max`` steps) restarts from its centre with ``rho``
   grown by ``prox_decrease``.

It returns the best feasible point seen; :func:`mergeqp.solve` certifies it on the host in
float64, as every solver's answer. Memory on the device: H (float64) plus up to two
``|F| x |F|`` blocks. ``auto`` chooses it on a CUDA device for box problems of at least
:data:`AUTO_MIN_N` variables (:data:`AUTO_MIN_N_STARTED` once the process has started CUDA) when H
and two blocks of its size fit in the device's free memory.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import numpy as np

from ..constraints import ConstraintSet
from ..errors import SolverError
from ..problem import GAP_ROUNDING_FACTOR, MergeQP, gradient_rounding
from ..solution import SolveStatus
from .active_set import set_structure
from .base import QPSolver, RawResult
from .torch_solvers import cuda_auto_declines, torch_device, torch_missing

FREE, LO, HI = 0, 1, 2

#: at most this many (nearly) all-free first faces are approximated by ``cg_start`` CG steps
CG_FACES = 2

#: ``auto`` chooses this solver on a CUDA device from this many variables on (box sets): on an
#: H100 it was 4.6-6.4x faster than ``active_set`` on 16 CPU cores at n = 12288 and 24576
#: (docs/solvers.md), the start of CUDA in the process included
AUTO_MIN_N = 12288
#: ... and from this many on once this process has started CUDA (a merge on ``device: cuda``):
#: with CUDA started it was faster than ``active_set`` at its best BLAS thread count on 16 CPU
#: cores, 1.7-5x at n = 1536 and 4-18x at 3072 and 6144 (docs/solvers.md); the first use of its
#: kernels in a process cost ~0.25 s more (n = 3072: 0.28 s against 0.04 s), which a single solve
#: at these sizes does not recover
AUTO_MIN_N_STARTED = 1536


def device_bytes(n: int) -> int:
    """Bytes a solve may hold on the device at most: H in float64 and two float64 blocks of its
    size (a face block and its Cholesky factor, when every variable is free)."""
    return 3 * 8 * n * n


class _BoxPDAS:
    """One solve on a device (see the module doc); tensors in float64."""

    def __init__(self, problem: MergeQP, lo: np.ndarray, hi: np.ndarray, device: Any, opts: dict[str, Any]):
        import torch  # optional heavy dependency: deferred so mergeqp imports without torch

        self.torch = torch
        self.opts = opts
        self.n = problem.n
        self.c = float(problem.c)
        f64 = torch.float64
        with warnings.catch_warnings():  # H is read-only and only ever read here: no host copy
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            self.H = torch.as_tensor(np.asarray(problem.H, dtype=np.float64), dtype=f64, device=device)
        self.g = torch.as_tensor(np.array(problem.g, dtype=np.float64), dtype=f64, device=device)
        self.lo = torch.as_tensor(lo, dtype=f64, device=device)
        self.hi = torch.as_tensor(hi, dtype=f64, device=device)
        eta = float(self.H.diagonal().abs().max()) if self.n else 1.0
        self.eta = eta if eta > 0 else 1.0
        # the rounding floor's bound on |H_ij x_j| (problem.curvature_reach)
        self.sqrt_diag = self.H.diagonal().abs().sqrt()
        self.sqrt_eta = float(self.sqrt_diag.max()) if self.n else 0.0
        self.g_inf = float(self.g.abs().max()) if self.n else 0.0
        self.rho = 0.0
        self.xc = torch.zeros(self.n, dtype=f64, device=device)
        self.factorisations = 0
        self.cg_faces = 0
        self.ridged = 0
        #: refine face solves ten times longer (a stable face whose minimiser did not certify)
        self.fine = False
        #: why the proximal mode was (re)started, one entry per restart
        self.why_proximal: list[str] = []
        self.proximal_restarts = 0

    # -- pieces
    def clip(self, x: Any) -> Any:
        return self.torch.minimum(self.torch.maximum(x, self.lo), self.hi)

    def grad(self, x: Any) -> Any:
        return self.H @ x + self.g

    def objective(self, x: Any, grad: Any) -> float:
        return float(0.5 * (x @ grad) + 0.5 * (self.g @ x)) + self.c

    def gap(self, x: Any, grad: Any) -> tuple[float, float]:
        """``max_{lo <= s <= hi} grad'(x - s)`` (the Frank-Wolfe gap) and ``|x - s|_1`` at the
        maximiser ``s`` (the width that the gap's rounding error scales with)."""
        s = self.torch.where(grad > 0, self.lo, self.hi)
        return float(grad @ (x - s)), float((x - s).abs().sum())

    def size(self, x: Any, grad: Any) -> float:
        """``|c| + |x'Hx|/2 + |g'x|``: the size of the terms that J sums (its rounding unit)."""
        lin = float(self.g @ x)
        quad = 0.5 * float(x @ grad) - 0.5 * lin
        return abs(self.c) + abs(quad) + abs(lin)

    def scale(self, J: float, x: Any, grad: Any) -> float:
        """The certificate's scale ``max(|J|, 1e-8 size)``."""
        return max(abs(J), 1e-8 * self.size(x, grad), np.finfo(float).tiny)

    def floor(self, x: Any, width: float) -> float:
        """The float64 rounding error of the gap at ``x`` (the certificate's estimate)."""
        reach = float((self.sqrt_diag * x.abs()).max()) if self.n else 0.0
        return GAP_ROUNDING_FACTOR * gradient_rounding(self.n, self.g_inf, self.sqrt_eta, reach) * width

    def face_of(self, x: Any, grad: Any) -> Any:
        """The face of a projected gradient step from ``x``."""
        y = x - grad / (self.eta + self.rho)
        status = self.torch.zeros(self.n, dtype=self.torch.int8, device=x.device)
        status[y <= self.lo] = LO
        status[y >= self.hi] = HI
        return status

    def face_solve(self, status: Any, x_prev: Any) -> tuple[Any, Any]:
        """The minimiser of ``J + rho/2 |x - xc|^2`` on the face's affine hull and the
        gradient of that objective there."""
        torch = self.torch
        x = torch.where(status == LO, self.lo, torch.where(status == HI, self.hi, x_prev))
        free = torch.nonzero(status == FREE).flatten()
        if free.numel() == 0:
            return x, self.grad(x) + self.rho * (x - self.xc)
        fixed = x.clone()
        fixed[free] = 0.0
        rhs = -(self.H @ fixed + self.g)[free] + self.rho * self.xc[free]
        M = self.H[free.unsqueeze(1), free.unsqueeze(0)]  # |F| x |F|, no |F| x n intermediate
        if self.rho > 0:
            M.diagonal().add_(self.rho)
        self.factorisations += 1
        L, info = torch.linalg.cholesky_ex(M)
        ridge = 0.0
        if int(info) != 0:
            ridge = float(self.opts["ridge"]) * self.eta
            M.diagonal().add_(ridge)
            L, info = torch.linalg.cholesky_ex(M)
            if int(info) != 0:
                raise SolverError("torch_active_set: a face block is not positive semidefinite even with a "
                                  "ridge (is H symmetric positive semidefinite?)")
            M.diagonal().sub_(ridge)
            self.ridged += 1
        y = torch.cholesky_solve(rhs.unsqueeze(1), L).squeeze(1)
        # refinement against the unridged block: with a ridge these are proximal steps that
        # converge to the minimiser on the face's range; without, they remove rounding
        steps = int(self.opts["refine_steps"]) * (4 if ridge else 1) * (10 if self.fine else 1)
        for _ in range(steps):
            r = rhs - M @ y
            if float(r.abs().max()) <= 1e-15 * (float(rhs.abs().max()) + 1e-300):
                break
            y = y + torch.cholesky_solve(r.unsqueeze(1), L).squeeze(1)
        x[free] = y
        return x, self.grad(x) + self.rho * (x - self.xc)

    def face_cg(self, status: Any, x_prev: Any, steps: int) -> tuple[Any, Any]:
        """``steps`` conjugate-gradient steps on the face's problem from ``x_prev`` (products
        with H only): an approximate face minimiser and the face objective's gradient there."""
        torch = self.torch
        x = torch.where(status == LO, self.lo, torch.where(status == HI, self.hi, x_prev))
        free = status == FREE
        grad = self.grad(x) + self.rho * (x - self.xc)
        r = torch.where(free, -grad, torch.zeros_like(grad))
        p = r.clone()
        rr = float(r @ r)
        for _ in range(steps):
            Hp = self.H @ p + self.rho * p
            curv = float(p @ Hp)
            if not curv > 0 or rr == 0:
                break
            alpha = rr / curv
            x = x + alpha * p
            r = r - alpha * torch.where(free, Hp, torch.zeros_like(Hp))
            rr_new = float(r @ r)
            p = r + (rr_new / rr) * p
            rr = rr_new
        return x, self.grad(x) + self.rho * (x - self.xc)

    def update(self, status: Any, xf: Any, gf: Any) -> Any:
        new = status.clone()
        free = status == FREE
        new[free & (xf < self.lo)] = LO
        new[free & (xf > self.hi)] = HI
        new[(status == LO) & (gf < 0)] = FREE
        new[(status == HI) & (gf > 0)] = FREE
        return new

    # -- the iteration
    def run(self, x0: np.ndarray) -> tuple[np.ndarray, SolveStatus, int, dict[str, Any]]:
        torch = self.torch
        opts = self.opts
        tol, patience = float(opts["tol"]), int(opts["patience"])
        x = self.clip(torch.as_tensor(x0, dtype=torch.float64, device=self.H.device))
        grad = self.grad(x)
        gap0, width = self.gap(x, grad)
        best_x, best_J, best_gap = x, self.objective(x, grad), gap0
        status_out = SolveStatus.MAX_ITERATIONS
        rho_min = float(opts["prox_min"]) * self.eta

        def converged(J: float, gap: float, width: float, x: Any, grad: Any) -> bool:
            # at the rounding floor only on the plain problem (a proximal point there is
            # refined by a plain solve on its face first, below)
            return gap <= tol * self.scale(J, x, grad) or (self.rho <= rho_min and gap <= self.floor(x, width))

        if converged(best_J, best_gap, width, x, grad):
            return best_x.cpu().numpy(), SolveStatus.OPTIMAL, 0, self._info(0, best_gap)
        rho_max = 1e4 * self.eta
        dec = float(opts["prox_decrease"])
        face = self.face_of(x, grad)
        for _ in range(CG_FACES):
            # (nearly) all free: the exact face minimiser of an ill-conditioned H lies far outside
            # the box and sends PDAS to the other extreme; a few CG steps find most bound
            # violations for less (as active_set's first faces)
            if not (int(opts["cg_start"]) and int((face == FREE).sum()) > 0.9 * self.n):
                break
            x, g_cg = self.face_cg(face, x, int(opts["cg_start"]))
            self.cg_faces += 1
            new_face = self.update(face, x, g_cg)
            if bool(torch.equal(new_face, face)):
                break
            face = new_face
        seen: set[bytes] = set()
        stall, inner_best, inner_it = 0, math.inf, 0
        fewest_changes = self.n + 1  # plain PDAS: the fewest coordinates a face update changed
        xc_J = best_J
        anchor: bytes | None = None  # the face of the last accepted proximal point
        jump_back = 0.0  # rho to return to when a jump to rho_min fails
        no_jump: bytes | None = None  # a face from which a jump failed
        floor_tried: set[bytes] = set()  # faces whose proximal point reached the rounding floor
        it = 0
        for it in range(1, int(opts["max_iter"]) + 1):
            key = face.cpu().numpy().tobytes()
            seen.add(key)
            xf, gf = self.face_solve(face, x)
            xp = self.clip(xf)
            inside = bool(torch.equal(xp, xf))
            gp = gf - self.rho * (xf - self.xc) if inside else self.grad(xp)
            Jp = self.objective(xp, gp)
            gap, width = self.gap(xp, gp)
            noise = 8.0 * np.finfo(float).eps * self.size(xp, gp)
            if Jp < best_J - noise or (Jp <= best_J + noise and gap < best_gap):
                best_x, best_J, best_gap = xp, Jp, gap
            if converged(Jp, gap, width, xp, gp):
                best_x, best_J, best_gap = xp, Jp, gap
                status_out = SolveStatus.OPTIMAL
                break
            new_face = self.update(face, xf, gf)
            if self.rho > rho_min and gap <= self.floor(xp, width):
                if key in floor_tried:
                    # a plain solve on this face did not improve on it: it is at the floor
                    best_x, best_J, best_gap = xp, Jp, gap
                    status_out = SolveStatus.OPTIMAL
                    break
                # a proximal point at the rounding floor: solve the plain problem on its face
                floor_tried.add(key)
                self.xc, xc_J, anchor = xp, Jp, key
                jump_back, self.rho = self.rho, rho_min
                seen.clear()
                stall, inner_best, inner_it = 0, math.inf, 0
                face, x = new_face, xp
                continue
            stable = bool(torch.equal(new_face, face))
            if stable and self.rho > 0:
                # the proximal subproblem is solved: its minimiser is the next centre
                if self.rho <= rho_min and Jp >= xc_J - noise:
                    status_out = SolveStatus.INACCURATE  # no progress at float64 resolution
                    break
                settled = key == anchor
                self.xc, xc_J, anchor = xp, Jp, key
                jump_back = 0.0
                if settled and self.rho > rho_min and key != no_jump:
                    # the same face twice in a row: try the plain problem on it at once
                    jump_back, self.rho = max(self.rho / dec, rho_min), rho_min
                else:
                    self.rho = max(self.rho / dec, rho_min)
                seen.clear()
                stall, inner_best, inner_it = 0, math.inf, 0
                x = xp
                continue
            if stable and self.rho == 0 and not self.fine:
                # a stable face whose minimiser does not certify: solve it again, refined longer
                self.fine = True
                x = xf
                continue
            self.fine = False
            Jr = Jp + 0.5 * self.rho * float(((xp - self.xc) ** 2).sum())
            if Jr < inner_best - 1e-15 * max(abs(Jr), 1e-300):
                inner_best, stall = Jr, 0
            else:
                stall += 1
            if self.rho == 0:
                # plain PDAS on a large problem converges with thousands of changes per step,
                # shrinking: a step that changes fewer coordinates than every earlier one is progress
                changes = int((new_face != face).sum())
                if changes < fewest_changes:
                    stall = 0
                fewest_changes = min(fewest_changes, changes)
            inner_it += 1
            # a stable face whose minimiser still does not certify (a singular block solved
            # with a ridge) also goes to the proximal mode
            cycled = new_face.cpu().numpy().tobytes() in seen
            failed = stable or cycled or stall >= (patience if self.rho == 0 else 2) or \
                (self.rho > 0 and inner_it >= int(opts["prox_inner_max"]))
            if failed:
                self.why_proximal.append("stable face" if stable else "cycle" if cycled else
                                         "no decrease" if stall else "inner steps")
                # cycling or stalling: (re)start proximal PDAS
                if self.rho >= rho_max:
                    status_out = SolveStatus.INACCURATE
                    break
                if self.rho == 0:
                    self.rho = float(opts["prox_start"]) * self.eta
                elif jump_back > 0:  # the jump failed: back, and never jump from this face again
                    self.rho, jump_back, no_jump = jump_back, 0.0, anchor
                else:
                    self.rho = min(dec * self.rho, rho_max)
                if best_J < xc_J - noise or anchor is None:
                    self.xc, xc_J = best_x, best_J  # restart from the best point
                x = self.xc
                face = self.face_of(x, self.grad(x))
                self.proximal_restarts += 1
                seen.clear()
                stall, inner_best, inner_it = 0, math.inf, 0
                continue
            face, x = new_face, xf
        return best_x.cpu().numpy().copy(), status_out, it, self._info(it, best_gap)

    def _info(self, it: int, gap: float) -> dict[str, Any]:
        return {"device": str(self.H.device), "face_iterations": it, "factorisations": self.factorisations,
                "cg_faces": self.cg_faces,
                "ridged_faces": self.ridged, "proximal_restarts": self.proximal_restarts,
                "why_proximal": list(self.why_proximal),
                "frank_wolfe_gap": gap, "tol": float(self.opts["tol"]), "final_rho": self.rho}


class TorchActiveSetSolver(QPSolver):
    """Primal-dual active-set method for box-constrained QPs in PyTorch, on a GPU when there is
    one (see the module doc).

    Options (defaults): ``device`` "auto" (CUDA when available), ``tol`` 1e-10 (the Frank-Wolfe
    gap relative to the certificate's scale), ``max_iter`` 300 face solves, ``patience`` 3
    non-improving PDAS steps before the proximal mode, ``prox_start`` 3e-2, ``prox_decrease``
    4, ``prox_min`` 1e-12 (all x max diag H), ``prox_inner_max`` 8 face solves per proximal
    subproblem, ``ridge`` 1e-10 (x max diag H, for singular face blocks), ``refine_steps`` 3 and
    ``cg_start`` 40 (conjugate-gradient steps instead of a factorisation for each of the first, at
    most two, faces with over 90% of the variables free; 0 switches it off).
    Sets: boxes with finite bounds (``box:lo,hi``). Needs an explicit H.
    """

    name = "torch_active_set"
    defaults = {"device": "auto", "tol": 1e-10, "max_iter": 300, "patience": 3, "prox_start": 3e-2,
                "prox_decrease": 4.0, "prox_min": 1e-12, "prox_inner_max": 8, "ridge": 1e-10,
                "refine_steps": 3, "cg_start": 40}

    def available(self) -> str | None:
        return torch_missing()

    @staticmethod
    def _box(problem: MergeQP, constraints: ConstraintSet) -> tuple[np.ndarray, np.ndarray] | str:
        """The box's flat bounds ``(lo, hi)``, or why this solver cannot take the problem."""
        if problem.H is None:
            return "needs an explicit H (use torch_fista for a matvec-only problem)"
        st = set_structure(constraints, problem.shape)
        if isinstance(st, str) or not st.bounds_only:
            # (not active_set's wording, which lists the sets that solver takes: a review of stop 75)
            other = "dense_ipm or torch_ipm" if isinstance(st, str) else "active_set"
            return f"handles boxes only, not {constraints.spec} (use {other})"
        if not (np.all(np.isfinite(st.lo)) and np.all(np.isfinite(st.hi))):
            return f"needs finite bounds, {constraints.spec} has an infinite side (use active_set)"
        return st.lo, st.hi

    def supports(self, problem: MergeQP, constraints: ConstraintSet) -> str | None:
        box = self._box(problem, constraints)
        return box if isinstance(box, str) else None

    def auto_declines(self, problem: MergeQP, constraints: ConstraintSet) -> str | None:
        return cuda_auto_declines(problem.n, AUTO_MIN_N, AUTO_MIN_N_STARTED, device_bytes(problem.n),
                                  "measured only from there on (active_set below)",
                                  "on the CPU active_set is faster", "H and two face blocks")

    def check_options(self, options: Any) -> dict[str, Any]:
        opts = super().check_options(options)
        rules = {
            "tol": lambda v: v >= 0, "max_iter": lambda v: v >= 1, "patience": lambda v: v >= 1,
            "prox_start": lambda v: v > 0, "prox_decrease": lambda v: v > 1,
            "prox_min": lambda v: 0 < v <= opts["prox_start"], "prox_inner_max": lambda v: v >= 1,
            "ridge": lambda v: v > 0, "refine_steps": lambda v: v >= 0, "cg_start": lambda v: v >= 0,
        }
        self.check_ranges(opts, rules)
        return opts

    def solve(self, problem: MergeQP, constraints: ConstraintSet, x0: np.ndarray | None = None,
              **options: Any) -> RawResult:
        opts = self.check_options(options)
        t0 = time.perf_counter()
        box = self._box(problem, constraints)
        if isinstance(box, str):
            raise SolverError(f"{self.name}: {box}")
        device = torch_device(str(opts["device"]))
        import torch  # torch_device imported it already

        try:
            engine = _BoxPDAS(problem, *box, device, opts)
            setup = time.perf_counter() - t0
            start = problem.soup_point().ravel() if x0 is None else np.asarray(x0, dtype=np.float64).ravel()
            x, status, it, info = engine.run(start)
        except torch.OutOfMemoryError:
            need = device_bytes(problem.n)
            raise SolverError(
                f"{self.name}: out of memory on {device}: n = {problem.n} needs up to {need / 1e9:.1f} GB "
                "(H in float64 and two face blocks of its size); use a device with more memory, "
                "device='cpu', or active_set / torch_fista") from None
        return RawResult(problem.unflat(x), status, it, info, setup_seconds=setup)
