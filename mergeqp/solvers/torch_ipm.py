"""``torch_ipm``: ``dense_ipm``'s interior point with its dense work in PyTorch, on CUDA or the CPU.

The iteration, its options and its answers are those of :mod:`mergeqp.solvers.dense_ipm` (every
polyhedral set: sign consensus, simplex, L1 ball, intersections, users' ``linear_form`` sets);
only where the ``n x n`` work runs differs (:class:`~.ipm_linalg.TorchLinalg`): H is copied to
the device once, and each iteration forms the normal matrix ``H + C'WC`` there, factorises it
(``torch.linalg.cholesky_ex``, float32 scaled to a unit diagonal while the gap is large, float64
after, as on the host) and solves with it; the products with H of the iteration and of its
refinement steps run there too. Vectors of length n cross between host and device. The
crossover's face solves and the certificate stay on the host (float64, NumPy); on bounded sets it
runs by default only from an iterate whose residual stopped falling short of ``tol``
(``crossover`` "auto" = "stalled" there).

This is the GPU path for the sets ``torch_active_set`` (boxes only) does not take. ``auto``
chooses it on a CUDA device for sets that would go to ``dense_ipm`` from :data:`AUTO_MIN_N`
variables (:data:`AUTO_MIN_N_STARTED` once the process has started CUDA), while its device
arrays (:func:`device_bytes`) fit in the GPU's free memory. On the CPU (``device="cpu"``) it
runs the same code, which is how it is tested; there ``dense_ipm`` is the solver to use.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..constraints import ConstraintSet
from ..errors import SolverError, ValidationError
from ..problem import MergeQP
from .base import RawResult
from .dense_ipm import DenseIpmSolver
from .ipm_linalg import TorchLinalg
from .torch_solvers import cuda_auto_declines, torch_device, torch_missing

#: ``auto`` chooses this solver on a CUDA device from this many variables on (sets that go to
#: ``dense_ipm``), the start of CUDA in the process included (docs/solvers.md)
AUTO_MIN_N = 6144
#: ... and from this many on once this process has started CUDA (docs/solvers.md)
AUTO_MIN_N_STARTED = 1536


def device_bytes(n: int) -> int:
    """Bytes a solve may hold on the device at most: H in float64 and in float32, the float64
    normal matrix and its Cholesky factor."""
    return int(3.5 * 8 * n * n)


class TorchIpmSolver(DenseIpmSolver):
    """``dense_ipm`` with its dense work in PyTorch on ``device`` (see the module doc).

    Options: those of ``dense_ipm``, with the same defaults except ``crossover`` ("auto" here:
    "stalled" on a bounded set, i.e. only from an iterate whose residual stopped falling short of
    ``tol``, since the face solves run on the host; on for an unbounded one, whose certificate
    needs the face's exact minimiser; true gives points exactly on their face, as
    ``dense_ipm``'s), and ``device`` "auto" (CUDA if present; "cpu", "cuda", "cuda:N").
    ``threads`` caps the host's BLAS (the crossover's face solves)."""

    name = "torch_ipm"
    #: ``crossover`` "auto": "stalled" on a bounded set (the crossover's face solves run on the host,
    #: and on an H100 they were 32-82% of the solve at n = 6144, 80-86% at 12288, docs/solvers.md, while
    #: the 0-3 more iterations that reach the gap without it cost little on the device); on for an
    #: unbounded one (nonneg & sign), where the Frank-Wolfe certificate cannot bound the gap of an
    #: interior point and needs the exact face minimiser. "stalled": an interior point whose dual
    #: residual stopped at 7e-10 lay 1e-9 off its face, and the certificate's first-order gap was
    #: then 4e-8 of |J| (a random rank-deficient L1 & sign problem, n = 12)
    defaults = {**DenseIpmSolver.defaults, "device": "auto", "crossover": "auto"}

    def available(self) -> str | None:
        return torch_missing()

    def auto_declines(self, problem: MergeQP, constraints: ConstraintSet) -> str | None:
        return cuda_auto_declines(problem.n, AUTO_MIN_N, AUTO_MIN_N_STARTED, device_bytes(problem.n),
                                  "dense_ipm on the host below",
                                  "on the CPU dense_ipm runs the same iteration faster",
                                  "H, its float32 copy, the normal matrix and its factor")

    def auto_fallback(self, problem: MergeQP, constraints: ConstraintSet) -> float | None:
        return None  # (dense_ipm's rank is its own: auto's fallbacks run on the host)

    def linalg(self, opts: dict[str, Any]) -> Any:
        device = torch_device(str(opts["device"]))
        return lambda H: TorchLinalg(H, device)

    def check_options(self, options: Any) -> dict[str, Any]:
        opts = super().check_options(options)
        c = opts["crossover"]
        if not (isinstance(c, (bool, np.bool_)) or (isinstance(c, str) and c in ("auto", "stalled"))):
            raise ValidationError(f"{self.name}: option crossover={opts['crossover']!r} must be true, false, "
                                  "'stalled' or 'auto' (default: 'stalled' on a bounded set, on for an unbounded "
                                  "one)")
        return opts

    def solve(self, problem: MergeQP, constraints: ConstraintSet, x0: np.ndarray | None = None,
              **options: Any) -> RawResult:
        import torch  # available() ran first: torch is importable here

        if self.check_options(options)["crossover"] == "auto":
            options = {**options, "crossover": "stalled" if constraints.bounded else True}
        try:
            raw = super().solve(problem, constraints, x0, **options)
        except torch.OutOfMemoryError:
            n = problem.n
            raise SolverError(
                f"{self.name}: out of memory on device {options.get('device', 'auto')!r}: n = {n} needs up "
                f"to {device_bytes(n) / 1e9:.1f} GB (H in float64 and float32, the normal matrix and its "
                "factor); use a device with more memory, device='cpu', or dense_ipm") from None
        return raw
