"""Float64 sums of the first-order (Gauss-Newton) model, streamed batch by batch.

For a linearised compared output ``h_j(d) ~= h_j + A_j d`` and residual ``b_j = h_j - y_j``,
one task's objective ``sum_j ||A_j d + b_j||^2 = 1/2 d'H d + g'd + c`` has

    H_t = 2 sum_j A_j'A_j,    g_t = 2 sum_j A_j'b_j,    c_t = sum_j ||b_j||^2.

Every producer of statistics (:mod:`mergeqp.stats.collect`, :mod:`mergeqp.merge.firstorder`)
adds its design rows ``A`` here, however it obtained them (from a full Jacobian or from
directional derivatives, :class:`~mergeqp.stats.linearise.OutputDerivatives`).
"""

from __future__ import annotations

from typing import Any


class GaussNewtonSums:
    """Running ``H`` (``(n_tasks, n, n)``), ``g`` (``(n_tasks, n)``) and ``c``
    (``(n_tasks,)``), float64 torch tensors on ``device``; ``n`` is the number of
    coefficients (``K`` models times atoms)."""

    def __init__(self, n_tasks: int, n: int, device: Any = "cpu") -> None:
        import torch  # deferred: torch is heavy

        z = {"dtype": torch.float64, "device": device}
        self.H = torch.zeros(n_tasks, n, n, **z)
        self.g = torch.zeros(n_tasks, n, **z)
        self.c = torch.zeros(n_tasks, **z)

    def add_design(self, task: int, A: Any, b: Any) -> None:
        """Add design rows ``A`` with residuals ``b`` (float64): ``H_t += 2 A'A``,
        ``g_t += 2 A'b``. ``b``'s dimensions index the rows (e.g. ``(B, c)``) and lead ``A``'s,
        whose remaining dimensions flatten, row-major, to the ``n`` coefficients (e.g.
        ``(B, c, K, n_atoms)``)."""
        b = b.reshape(-1)
        A = A.reshape(b.shape[0], -1)
        self.H[task] += 2.0 * (A.T @ A)
        self.g[task] += 2.0 * (A.T @ b)

    def add_residual(self, task: int, b: Any) -> None:
        """``c_t += ||b||^2`` for residuals ``b`` (any shape, float64)."""
        self.c[task] += (b * b).sum()

    def numpy(self) -> tuple[Any, Any, Any]:
        """``(H, g, c)`` as numpy arrays (copied to the CPU)."""
        return self.H.cpu().numpy(), self.g.cpu().numpy(), self.c.cpu().numpy()
