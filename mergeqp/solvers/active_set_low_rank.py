"""A ridge plus a low-rank H: the active-set solver's path through ``r``-dimensional algebra (:mod:`.active_set`).

When a merge QP has fewer calibration samples times outputs than unknowns, ``H = A'A + sigma I``
(a data term of rank ``r`` much below ``n`` and a ridge). Its faces larger than ``r`` are
ill-conditioned (``cond ~ lambda_max / sigma``), and the primal active-set engine crawls along
the flat directions in its proximal levels: 40 faces and 27 factorisations of 1,536 free
coordinates on an n = 3072 box with ``r = 100`` and ``cond = 1e8`` (8.6x one Cholesky of H). The
structure gives a problem of ``r`` unknowns instead:

- **Detection** (:func:`ridge_low_rank`). The eigenvalues of a sampled principal submatrix
  ``H_SS`` (``m`` rows, ``4/3`` of the rank limit, 64 to :data:`SAMPLE`; one ``O(m^3)``
  eigendecomposition) show a cluster at its smallest, ``sigma`` (``H_SS = sigma I + U_S U_S'``
  has ``m - r`` eigenvalues equal to ``sigma`` when ``r < m``; a full-rank H shows none, and the
  test ends there). Then a pivoted partial Cholesky
  of ``H - sigma I`` (``O(n r^2)``, reading ``r`` rows of H) must end within ``max_rank`` steps
  with a residual diagonal below :data:`RESIDUAL` ``sigma``: ``H = sigma I + U U' + E`` with
  ``trace E`` reported. Anything else (no cluster, a rank above the limit, a residual that does
  not vanish) declines, and the engine solves as before; a cluster at zero is H without a ridge
  (below).
- **The dual** (:func:`solve_ridge_low_rank`). ``1/2 x'U U'x = max_nu nu'U'x - 1/2 |nu|^2``, so
  ``min_C J = max_nu min_{x in C} sigma/2 |x|^2 + (g + U nu)'x - 1/2 |nu|^2``, whose inner minimiser
  is a projection, ``x(nu) = P_C(-(g + U nu) / sigma)`` (the shared exact kernel). The dual
  function is concave with ``r`` unknowns; it is maximised by a semismooth Newton method (the
  Newton matrix ``I + U'JU / sigma``, ``J`` the projection's generalised Jacobian: the free
  coordinates, less each sum group's mean; an Armijo search on the dual, or on the residual
  ``|nu - U'x(nu)|`` where the dual's decrease is below its rounding), which changes any number
  of bounds per step. With a weak ridge the dual is as ill-conditioned as H, so it is solved on
  proximal problems first (``rho/2 |x - xc|^2`` added, ``rho`` from ``1e-2 max diag H`` down by
  :data:`DECREASE` per stage), the final stage on J itself; each stage starts at the ``nu`` that
  reproduces the last stage's point on its free coordinates as far as ``U`` allows
  (:func:`_restart`), and a stage that does not settle within :data:`STAGE_STEPS` Newton steps is
  tried again from the last settled one with a smaller step down (:data:`RETRIES`).
- **The face.** A primal-dual active set on ``sigma I + U U'`` (:func:`_face_pdas`: the engine's own
  face bookkeeping and update, :mod:`.active_set_faces`, since stop 65 on every set; a copy of
  its rule for bounds and sums was here before) then starts from
  the dual's point, each face solved by the Woodbury identity in ``O(|F| r^2)``: one face solve
  confirms a settled dual; where the stages did not settle it may still finish the job.
- **Polish.** ``x(nu)`` and the Woodbury solves divide by ``sigma``, which costs digits
  (``eps |g| / sigma``), so the free coordinates are corrected by Newton steps on the face with
  residuals computed from the true H, keeping the face's sums.

On sets with sum groups (per-atom, global or capped simplices) the dual's late stages do not
settle on natural instances (their free sets flip by tens of coordinates per Newton step), so
there the proximal problems are solved in the primal instead (:func:`_proximal_faces`): the same
face active set, each stage a ridge ``sigma + rho`` plus ``U U'`` whose faces the Woodbury identity
solves, ``rho`` falling by :data:`PROX_DECREASE` per stage and rising again after a stage that does
not converge. (On boxes that primal version failed on 6 of 18 natural instances where the dual
did not; docs/solvers.md, "Stop 62"; it is tried there only where the dual reached no optimum.)

**The rank limit** (:func:`rank_limit`): an eighth of the set's dimension (n less one per sum
group), at least ``n / 12``: ``n / 8`` on boxes and L1 balls, ``(K - 1) n / (8 K)`` on per-atom
simplices of K coefficients, ``n / 12`` for K <= 3 (until stop 64 ``n / 12`` everywhere; from
``n / 12`` to ``n / 8`` the path halved the time of untuned boxes, L1 balls and simplices of 8
coefficients and was slower on 9 of 12 simplices of 2; docs/solvers.md, "Stop 64"). On an L1
ball alone (no bounds) with a weak ridge (``sigma <=`` :data:`WEAK_RIDGE` ``max diag H``) or none,
up to ``n / 4`` (:func:`ball_low_rank`, stop 67): there the engine crawls through its proximal
levels on faces larger than the rank, and the path took 0.34-0.93x its time (median 0.61) on 16
untuned instances at n = 640-3072 (stop 75 tried 0.4 n and went back: docs/solvers.md "Stop 75"); a
pre-test (LAPACK's pivoted Cholesky of the sampled block, stopped at the weak ridge's level) keeps the
cost of declining small: 0.5 ms at n = 640, 25 ms at n = 3072 (about 6% of one Cholesky of H). A face
whose free coordinates number at most half the rank is solved in its own coordinates rather than by
the Woodbury identity (stop 75). Where the engine, started at the path's point, ends short of its
test, it runs again from its own start (:func:`~.active_set._from_own_start`, stop 75).

**Without a ridge** (``H = U U'`` of rank ``r`` within the limit: the merge QP with fewer calibration
samples times outputs than unknowns and no ridge; the sample's smallest eigenvalues then cluster at
their rounding, and the pivoted Cholesky of H itself must end with a residual diagonal below
:data:`NO_RIDGE_RESIDUAL` ``max diag H``), ``sigma = 0`` and every stage is a proximal one: the
schedule ends at ``rho =`` :data:`NO_RIDGE_RHO` ``max diag H``, where the last stage (the dual's,
and since stop 64 the proximal faces') is repeated, centred at its point, while its face differs
from its centre's, unless the gradient already vanishes (:data:`NO_RIDGE_REPEATS`,
:func:`_repeat_last_stage`: one rule for both since stop 65), and J's own
faces (singular) are never solved. The polish (:func:`_polish_singular`) finishes instead: Newton
steps on the last face, each the solution of ``V U_F' dx = -r`` (many solutions: H is singular
there) of least norm weighted by each coordinate's room to its bound, so the face holds; on an
interpolating problem (``J* = 0``, where the engine alone wanders for thousands of faces because
its gap is relative to ``|J| ~ 0``) one or two steps bring the gradient to its rounding, which the
engine's test (the certificate's floor) accepts. The proximal faces back up after a failed stage
as with a ridge, except where the gradient already vanishes everywhere (``J* = 0``,
:func:`_interpolating`): there they end and the last converged stage is polished; where no stage
converged on sums the dual runs (it settles on interpolating simplices), and on boxes the proximal
faces run where the dual does not settle. Such H takes the path from n = :data:`NO_RIDGE_MIN_N`
(64; a ridge plus low rank from :data:`LOW_RANK_MIN_N`): below 256 the engine alone still ends
uncertified on some of them.

**A weak ridge** (between ``1e3 eps`` and :data:`SIGMA_MIN` of the sample's top eigenvalue: cond
1e10-1e13) is taken as none (``H - weak I = U U'``, the ridge left in the residual and kept as
``RidgeLowRank.weak``). Where the point of that path has a gap not within the engine's ``tol`` (it
fails the engine's test, or meets it at the rounding floor alone) on a set of bounds alone and the
gradient of ``U U'`` vanishes there (:func:`weak_ridge_decides`: the low-rank
part's minimum is reached on a flat set of points and the weak ridge is what picks the optimum among
them, an interpolating problem with ``J* ~ 0``), the path runs again with the weak ridge as its ridge
(:func:`solve_with_weak_ridge`: the dual on ``weak + rho``, whose late stages reach the ridge's
level, its point polished as without the ridge; kept where the first failed the test, or where its
gap is within ``tol`` or its J lower) and the engine starts from the point kept. Stop 68: such
boxes at n = 1152-2304 (cond 1e11-3e12) went from 0.2-1.6 s uncertified (the engine's faces are
ill-conditioned at the ridge's level, and it wandered until its wait ran out) to 0.08-0.22 s,
certified or at the certificate's floor, and boxes whose first point met the test at the floor alone
(the floor's estimate is loose there) came to J up to 16% lower; on L1 balls and sums the retry did not
help and is not taken.

The engine then starts at the result: where it meets the engine's stopping test (the
certificate's gap) it returns at once, without a factorisation; else the engine continues from
it (its face as the first guess). So the path never changes what is certified, only how fast.
On an L1 ball (alone or with a box) the proximal faces run as on sums (:func:`_proximal_faces`):
the engine's own face bookkeeping (:mod:`.active_set_faces`: centres, signs, the ball's activation
and release), which since stop 65 every set's face active set uses, with the same Woodbury face
solves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import numpy as np
import scipy.linalg as sla
from scipy import sparse

from ..constraints.kernels import SetStructure, project_structure
from ..matrix_cache import matrix_values
from .active_set_faces import FREE, FaceBookkeeping

__all__ = ["RidgeLowRank", "ridge_low_rank", "ball_low_rank", "sampled_rank", "rank_limit", "solve_ridge_low_rank",
           "polish_at_zero", "weak_ridge_decides", "solve_with_weak_ridge",
           "LOW_RANK_MIN_N", "NO_RIDGE_MIN_N", "LOW_RANK_KEY"]

#: problems smaller than this are left to the engine (its faces cost little there) ...
LOW_RANK_MIN_N = 256
#: ... except H without a ridge, taken from this size: there the engine alone ended uncertified on
#: 13 of 108 untuned instances at n = 120-240 (docs/solvers.md, "Stop 63"), the path on none
NO_RIDGE_MIN_N = 64
#: rows of the sampled principal submatrix whose eigenvalues are tested for a ridge cluster, at
#: most (fewer where the rank limit allows: ``4/3 max_rank + 1``, at least 64: 513 at n = 3072,
#: 2,049 at n = 12288, about 4% of one Cholesky of H either way); it bounds the rank found at
#: ``3/4`` of it (3,072) above n = 24,576. (Capped at 384 until stop 64, which left a rank-800 H at
#: n = 12288 to the engine: 112.7 s = 7.9x one Cholesky, against 5.7 s = 0.40x through the path.)
SAMPLE = 4096
#: the largest rank handled, as a share of the set's dimension (n less one per sum group, whose
#: equation takes a direction; the dual's Newton steps cost ``O(n r^2)`` each) ...
MAX_RANK_SHARE = 1.0 / 8.0
#: ... and never below this share of n (the limit on every set until stop 64)
MIN_RANK_SHARE = 1.0 / 12.0
#: on an L1 ball alone (no bounds) whose H has a weak ridge or none, the path takes ranks up to this
#: share of n (:func:`ball_low_rank`; stop 67: from n / 8 to n / 4 it took 0.21-1.10x the engine's
#: time on the selection sweep's such balls, 0.34-0.93x on 16 validation cells, where the engine
#: crawls through its proximal levels; with a stronger ridge, on balls with a box and on boxes it
#: lost as often as it won; stop 75 tried 0.4 n: a third less time on 36 balls of the untuned families,
#: but a review's balls of a flat spectrum were slower (median 2.5x) and, with a ridge of 1e-11 of the
#: top, ended uncertified at twice the optimum: back to n / 4; docs/solvers.md "Stop 75")
BALL_RANK_SHARE = 1.0 / 4.0
#: a weak ridge: ``sigma`` at most this share of ``max diag H`` (the sampled block's, for the
#: pre-test: LAPACK's pivoted Cholesky ``dpstrf`` with this tolerance counts its rank)
WEAK_RIDGE = 1e-7
#: a cluster: eigenvalues within this relative distance of the smallest (plus their rounding)
CLUSTER = 1e-6
#: the cluster must hold at least this share of the sample (else H is not a ridge plus low rank)
CLUSTER_SHARE = 0.25
#: ``sigma`` below this share of the sample's largest eigenvalue: no usable ridge (``x(nu)`` would
#: lose every digit); H is then tested as low-rank without one (``sigma = 0``)
SIGMA_MIN = 1e-10
#: the pivoted Cholesky of ``H - sigma I`` ends when its residual diagonal is below this times sigma
RESIDUAL = 1e-4
#: ... and, without a ridge, below this times ``max diag H``
NO_RIDGE_RESIDUAL = 1e-11
#: without a ridge the proximal stages end at ``rho`` = this times ``max diag H`` (there is no
#: stage on J itself: its faces are singular); the polish finishes on the last stage's face
NO_RIDGE_RHO = 1e-7
#: the polish without a ridge: least-norm Newton steps on the face at most
NO_RIDGE_POLISH = 8
#: Newton steps of :func:`polish_at_zero`, and the largest face it takes (an eigendecomposition of
#: the free block per step)
POLISH_STEPS = 6
POLISH_MAX_FREE = 2048
#: ... and the last stage (the dual's; since stop 64 the proximal faces' too) repeated, centred at
#: its point, while its face differs from its centre's, at most (stop 65: the dual's repeated its
#: first last stage always and then compared consecutive ones; on 30 random no-ridge boxes its rule
#: taken from the proximal faces' took 6 stages instead of 7-16 on the interpolating ones, the same
#: elsewhere, 9.74 -> 9.43 s in all, every one certified or at the floor)
NO_RIDGE_REPEATS = 10
#: without a ridge, a gradient below this share of ``max |g|`` everywhere marks an interpolating
#: problem (``J* = 0``): the proximal faces end at their first failed stage and polish the last one
INTERPOLATING = 1e-6
#: ``rho`` falls by this factor per proximal stage of the dual
DECREASE = 10.0
#: Newton steps per stage at most (a stage that needs more is tried again, :data:`RETRIES`; then
#: the face active set, and where that fails the engine, take over)
STAGE_STEPS = 60
#: a stage that does not settle is tried again this many times in all, each from the last settled
#: stage with the square root of the previous step down in rho
RETRIES = 3
#: face solves of the primal-dual active set that follows the dual at most
PDAS_STEPS = 40
#: sets with sums: ``rho`` falls by this factor per proximal stage of the face active set
PROX_DECREASE = 4.0
#: ... and rises by it after a stage whose active set did not converge, at most this many times
PROX_FAILS = 8
#: ... and at most this many times at one level of rho: a level that fails again after the stage
#: above it settled is a barrier the schedule does not pass (stop 65: the stages went on alternating
#: between a settled level and the failed one below it until PROX_FAILS ran out, 26 stages where 12-16
#: gave the same point, 0.43-0.91x the time on the 3 of 40 random cells where it happened)
LEVEL_FAILS = 1
#: the structure found for an H array, kept with its values (:mod:`mergeqp.matrix_cache`)
LOW_RANK_KEY = "active_set.low_rank"
#: ... and the wider limit's pre-test (:func:`ball_low_rank`)
BALL_KEY = "active_set.low_rank.ball"
EPS = float(np.finfo(float).eps)
#: face equations ``sum_G a_i x_i = t_G``: each coordinate's group, ``a`` and the totals
Equations = tuple[np.ndarray, np.ndarray, np.ndarray]
#: a face: its free coordinates and its equations (``None``: none)
Face = tuple[np.ndarray, "Equations | None"]


@dataclass(frozen=True)
class RidgeLowRank:
    """``H = sigma I + U U' + E``: ``U`` ``(n, r)``, ``sigma >= 0`` (0: no ridge, H of rank ``r``
    up to E), ``residual`` = ``trace E`` (the pivoted Cholesky's remaining diagonal), ``rank`` = ``r``.
    ``weak``: with ``sigma = 0``, a ridge too weak to use that was taken out of the factor (``H -
    weak I = U U'``) and counted in ``residual``; 0 where there is none."""

    U: np.ndarray
    sigma: float
    residual: float
    weak: float = 0.0

    @property
    def rank(self) -> int:
        return int(self.U.shape[1])

    def with_weak_ridge(self) -> RidgeLowRank | None:
        """The same factor with its weak ridge as the ridge (``sigma = weak``: the dual and the face
        solves then divide by it), ``None`` where there is none."""
        if not self.weak > 0:
            return None
        return RidgeLowRank(self.U, self.weak, max(self.residual - self.U.shape[0] * self.weak, 0.0))


def weak_ridge_decides(lr: RidgeLowRank, st: SetStructure, g: np.ndarray, x: np.ndarray | None) -> bool:
    """Whether the path taken without ``lr``'s weak ridge should run again with it
    (:meth:`RidgeLowRank.with_weak_ridge`): on a set of bounds alone (the dual's case; on sums and L1
    balls the retry was measured not to help, stop 68), where there is one and at the path's point
    ``x`` the gradient of ``U U'`` vanishes everywhere (:func:`_interpolating`: the low-rank part's
    minimum 0 is reached on a flat set of points, and the weak ridge is what picks the optimum among
    them), or the path reached no point."""
    return (lr.weak > 0 and st.group is None and st.center is None
            and (x is None or _interpolating(lr, g, x)))


def rank_limit(n: int, st: SetStructure | None = None) -> int:
    """The largest rank the path takes on ``n`` unknowns in the set ``st``: :data:`MAX_RANK_SHARE`
    of the set's dimension (``n`` less one per sum group; ``n`` without ``st``), at least
    :data:`MIN_RANK_SHARE` of ``n``. On boxes and L1 balls ``n / 8``; on per-atom simplices of K
    coefficients ``(K - 1) n / (8 K)``, ``n / 12`` for K <= 3. (Stop 64: from rank ``n / 12`` to
    ``n / 8`` the path cut the time of 84 untuned instances at n = 3072 by half, except on per-atom
    simplices of two coefficients, where it was slower on 9 of 12; docs/solvers.md.)"""
    groups = 0 if st is None or st.totals is None else int(st.totals.size)
    return int(max(n * MIN_RANK_SHARE, (n - groups) * MAX_RANK_SHARE))


def ridge_low_rank(H: np.ndarray, *, sample: int | None = None, max_rank: int | None = None,
                   seed: int = 0, notes: dict[str, Any] | None = None) -> RidgeLowRank | None:
    """``H`` as ``sigma I + U U'`` (see the module doc), or ``None`` when it is not one: no
    cluster of smallest eigenvalues in a sampled principal submatrix, no ridge, a rank above
    ``max_rank`` (default :func:`rank_limit` of n: ``n / 8``), or a residual that does not
    vanish. Deterministic in ``seed``; ``sample`` rows are tested (default :data:`SAMPLE`). Kept
    with the values of a read-only H (a sequence of solves on one H detects once). ``notes``, if
    given, receives ``sample_ratio`` and ``sample_top``: the sampled block's smallest over largest
    eigenvalue and its largest (absent where no block was sampled), which
    :func:`~.low_rank_ipm.ipm_low_rank` reads."""
    n = int(H.shape[0])
    sample = int(sample if sample is not None else SAMPLE)
    max_rank = int(max_rank if max_rank is not None else rank_limit(n))
    shared = matrix_values(H)
    key = (LOW_RANK_KEY, sample, max_rank, seed)
    note_key = (LOW_RANK_KEY + ".notes", sample, max_rank, seed)
    if shared is not None and key in shared:
        if notes is not None:
            notes.update(shared.get(note_key, {}))
        return shared[key]
    local: dict[str, Any] = {}
    found = _detect(H, sample, max_rank, seed, local)
    if shared is not None:
        shared[key] = found
        shared[note_key] = local
    if notes is not None:
        notes.update(local)
    return found


def ball_low_rank(H: np.ndarray, st: SetStructure, *, seed: int = 0) -> RidgeLowRank | None:
    """On an L1 ball alone (no finite bound), ``H`` as a weak ridge (``sigma <=`` :data:`WEAK_RIDGE`
    ``max diag H``) or none plus a rank between :func:`rank_limit` and :data:`BALL_RANK_SHARE` of
    n; ``None`` otherwise (other sets, a stronger ridge, a higher rank: the engine's case). A
    pre-test decides cheaply: LAPACK's pivoted Cholesky of the sampled principal block that
    :func:`ridge_low_rank` would take at this limit, stopped where its remaining diagonal falls to
    the weak ridge's level, counts the block's rank, roughly (its trailing diagonal there is the
    ridge's Schur complement, several times the ridge on some rows, so a few pivots more than the
    rank: the count only has to be within the limit); a
    full-rank block, the usual case, costs one pivoted Cholesky of ``n / 3`` rows (25 ms at n =
    3072, about 6% of one Cholesky of H). Only where that count is within the limit does
    :func:`ridge_low_rank` look (its eigenvalues and the pivoted Cholesky of H). Kept with the
    values of a read-only H, as there."""
    n = int(H.shape[0])
    max_rank = int(n * BALL_RANK_SHARE)
    if st.center is None or max_rank <= rank_limit(n, st) or bool(np.any(np.isfinite(st.lo))) \
            or bool(np.any(np.isfinite(st.hi))):
        return None
    shared = matrix_values(H)
    key = (BALL_KEY, max_rank, seed)
    if shared is not None and key in shared:
        return shared[key]
    found = None
    if sampled_rank(H, max_rank, seed, WEAK_RIDGE) is not None:
        found = ridge_low_rank(H, max_rank=max_rank, seed=seed)
        if found is not None and found.sigma > WEAK_RIDGE * float(np.max(np.diag(H))):
            found = None
    if shared is not None:
        shared[key] = found
    return found


def sampled_rank(H: np.ndarray, max_rank: int, seed: int, share: float, top_at_least: float = 0.0) -> int | None:
    """The rank LAPACK's pivoted Cholesky counts in the principal block that :func:`ridge_low_rank` would
    sample at the limit ``max_rank``, stopped where the remaining diagonal falls below ``share`` of the
    block's largest diagonal entry (or of ``top_at_least``, if larger); ``None`` where it did not stop
    early, or counted above ``max_rank`` or above the share of the block that leaves a cluster to find.
    The pre-test of :func:`ball_low_rank` and of :func:`~.low_rank_ipm.ipm_candidate`: a full-rank
    block costs one pivoted Cholesky of its rows."""
    idx = _sample(int(H.shape[0]), SAMPLE, max_rank, seed)
    if idx is None:
        return None
    S = np.array(H[np.ix_(idx, idx)], dtype=np.float64)
    top = max(float(np.max(np.diag(S))), float(top_at_least))
    if not (math.isfinite(top) and top > 0):
        return None
    _, _, rank, info = sla.lapack.dpstrf(S, tol=share * top, overwrite_a=True)
    # info 1: stopped early, the block has rank ``rank`` above the tolerance
    if info == 1 and rank <= max_rank and rank <= (1.0 - CLUSTER_SHARE) * idx.size:
        return int(rank)
    return None


def _sample(n: int, sample: int, max_rank: int, seed: int) -> np.ndarray | None:
    """The rows of the principal block tested for a rank up to ``max_rank`` (``None``: too few)."""
    # a rank up to max_rank leaves a quarter of the sample in the cluster once m >= 4/3 max_rank
    m = min(n, int(sample), max(64, -(-4 * max_rank // 3) + 1))
    if m < 16 or max_rank < 1:
        return None
    return np.sort(np.random.default_rng([seed, n]).choice(n, m, replace=False))


def _detect(H: np.ndarray, sample: int, max_rank: int, seed: int,
            notes: dict[str, Any] | None = None) -> RidgeLowRank | None:
    idx = _sample(int(H.shape[0]), sample, max_rank, seed)
    if idx is None:
        return None
    m = idx.size
    try:
        w = np.linalg.eigvalsh(H[np.ix_(idx, idx)])
    except np.linalg.LinAlgError:
        return None
    top = float(w[-1])
    if not (math.isfinite(top) and top > 0):
        return None
    if notes is not None:
        notes["sample_ratio"] = float(w[0]) / top
        notes["sample_top"] = top
    sigma = float(w[0])
    weak = 0.0  # a ridge too weak to use (below SIGMA_MIN): H is taken as low rank without one, and
    # the weak ridge joins the null space's cluster (stop 67: between 1e3 eps and SIGMA_MIN of the
    # top, it was neither, and such H went to the engine: an interpolating box at cond 1e12, n = 768,
    # ended INACCURATE there, auto 0.38 s through dense_ipm; now 0.083 s)
    if not sigma > SIGMA_MIN * top:
        sigma, weak = 0.0, max(sigma, 0.0)
    cluster = int(np.count_nonzero(w <= (sigma + weak) * (1.0 + CLUSTER) + 1e3 * EPS * top))
    if cluster < CLUSTER_SHARE * m or m - cluster > max_rank:
        return None
    if sigma > 0:
        return _pivoted_cholesky(H, sigma, max_rank, RESIDUAL * sigma)
    # without a ridge; a weak one is taken out of the factor (H - weak I = U U': its Schur complement
    # would otherwise be several times it on some rows, and those pivoted too) and left in the residual
    found = _pivoted_cholesky(H, weak, max_rank, NO_RIDGE_RESIDUAL * float(np.max(np.diag(H))) + RESIDUAL * weak)
    if found is None:
        return None
    # (kept as a ridge to retry with only where it is above the rounding of the sample's eigenvalues)
    usable = weak if weak > 1e3 * EPS * top else 0.0
    return RidgeLowRank(found.U, 0.0, found.residual + H.shape[0] * weak, usable)


def _pivoted_cholesky(H: np.ndarray, sigma: float, max_rank: int, stop: float) -> RidgeLowRank | None:
    """``H - sigma I = U U' + E`` by greedy diagonal pivoting, ending once the residual diagonal
    is at most ``stop`` everywhere (``None`` if that takes more than ``max_rank`` steps or the
    residual goes below ``-stop``: sigma is not the ridge)."""
    n = int(H.shape[0])
    d = np.diag(H).astype(np.float64) - sigma
    L = np.zeros((max_rank, n))
    j = 0
    while True:
        i = int(np.argmax(d))
        if d[i] <= stop:
            break
        if j == max_rank:
            return None
        col = np.array(H[i], dtype=np.float64)
        col[i] -= sigma
        if j:
            col -= L[:j, i] @ L[:j]
        col /= math.sqrt(d[i])
        L[j] = col
        d -= col * col
        d[i] = 0.0
        j += 1
    if float(np.min(d)) < -stop:
        return None
    return RidgeLowRank(np.ascontiguousarray(L[:j].T), sigma, float(np.sum(np.abs(d))))


# ---------------------------------------------------------------------- faces
def _less_group_means(M: np.ndarray, UF: np.ndarray, grp: np.ndarray, a: np.ndarray, n_groups: int) -> None:
    """``M -= B'(A A')^-1 B`` in place, ``B = A U_F``: the rows ``A`` of the equations ``sum_G a_i
    x_i`` on the free coordinates (``grp``: each one's group, ``a`` its coefficient) projected out
    of the free rows' Gram matrix ``M = U_F'U_F`` (``U_F'P U_F``, ``P`` the projection on their null
    space; groups with no free coordinate skipped)."""
    member = sparse.csr_matrix((a, (grp, np.arange(grp.size))), shape=(n_groups, grp.size))
    B = np.asarray(member @ UF)
    norm2 = np.bincount(grp, a * a, minlength=n_groups)  # A A' (the count where a = +-1)
    ok = norm2 > 0
    M -= (B[ok] / norm2[ok, None]).T @ B[ok]


def _sum_equations(st: SetStructure) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The set's sums as face equations ``sum_G a_i x_i = t_G`` (``a = 1``; ``None`` without sums),
    in the form :func:`_equation_null` and :func:`_affine_face_point` take (the engine's
    ``FaceBookkeeping.equations`` gives the same for a face of such a set)."""
    if st.group is None:
        return None
    assert st.totals is not None
    return st.group, np.ones(st.group.size), st.totals


def _free(st: SetStructure, x: np.ndarray) -> np.ndarray:
    return (x > st.lo) & (x < st.hi)


class _FreeGram:
    """``U_F' U_F`` for the free coordinates ``F`` of successive points or faces (``O(|F| r^2)``
    afresh), updated by the rows that changed (``O(k r^2)`` for ``k`` changes; consecutive faces
    of the path differ in tens of coordinates, or none), recomputed where more than a third of them
    changed or once the updates since the last fresh sum reach its rows (their rounding then stays
    within about twice a fresh sum's)."""

    def __init__(self, U: np.ndarray):
        self.U = U
        self.free: np.ndarray | None = None
        self.gram = np.zeros((U.shape[1], U.shape[1]))
        self.updates = 0

    def __call__(self, free: np.ndarray) -> np.ndarray:
        """The Gram matrix of the rows of ``U`` where ``free`` (a boolean mask) holds (not to be
        written: it is kept for the next call)."""
        U = self.U
        rows = max(int(np.count_nonzero(free)), 1)
        changed = None if self.free is None else np.flatnonzero(free != self.free)
        if changed is None or 3 * changed.size > rows or self.updates + changed.size > rows:
            Uf = U[free]
            self.gram, self.updates = Uf.T @ Uf, 0
        elif changed.size:
            Uc = U[changed]
            self.gram = self.gram + (Uc * np.where(free[changed], 1.0, -1.0)[:, None]).T @ Uc
            self.updates += int(changed.size)
        self.free = free.copy()
        return self.gram


# ---------------------------------------------------------------------- the dual
class _Jacobian:
    """``U'JU`` for the projection's generalised Jacobian at a projected point (the free
    coordinates, each sum group's mean removed), from the free coordinates' Gram matrix
    (:class:`_FreeGram`)."""

    def __init__(self, U: np.ndarray, st: SetStructure):
        self.U, self.st = U, st
        self.gram = _FreeGram(U)

    def matrix(self, x: np.ndarray) -> np.ndarray:
        U, st = self.U, self.st
        free = _free(st, x)
        M = self.gram(free).copy()
        F = np.flatnonzero(free)
        if st.group is not None and F.size:
            assert st.totals is not None
            _less_group_means(M, U[F], st.group[F], np.ones(F.size), int(st.totals.size))
        return M


def _stage(lr: RidgeLowRank, g: np.ndarray, st: SetStructure, rho: float, xc: np.ndarray, nu: np.ndarray,
           tol: float, jac: _Jacobian) -> tuple[np.ndarray, np.ndarray, int, bool]:
    """Semismooth Newton on the dual of ``min_C J + rho/2 |x - xc|^2``, from ``nu``. Returns
    ``(x, nu, steps, converged)``."""
    U = lr.U
    a = lr.sigma + rho
    h = g - rho * xc if rho > 0 else g
    r = U.shape[1]

    def at(nu: np.ndarray) -> tuple[np.ndarray, float, float]:  # x(nu), the dual's value (negated), its size
        q = h + U @ nu
        x = project_structure(st, -q / a)
        qx = q * x
        half = 0.5 * float(nu @ nu)
        sq = 0.5 * a * float(x @ x)
        return x, half - (sq + float(np.sum(qx))), half + sq + float(np.sum(np.abs(qx)))

    x, psi, terms = at(nu)
    row = np.sqrt(np.einsum("ij,ij->i", U, U))
    for step in range(STAGE_STEPS):
        res = nu - U.T @ x  # the dual's gradient (negated): zero at the stage's optimum
        size = float(np.linalg.norm(res))
        # the rounding of U'x(nu): each x_i = -(h_i + U_i nu) / a is off by eps (|h_i| + |U_i| |nu|) / a
        floor = 16.0 * EPS * float(np.linalg.norm(row * (np.abs(h) + row * float(np.linalg.norm(nu))))) / a
        if size <= max(tol * (1.0 + float(np.linalg.norm(nu))), floor):
            return x, nu, step, True
        M = np.eye(r) + jac.matrix(x) / a
        try:
            dnu = -sla.cho_solve(sla.cho_factor(M), res)
        except (np.linalg.LinAlgError, ValueError):
            return x, nu, step, False
        slope = float(res @ dnu)
        # the dual's values round at ~eps times its terms; where its Newton decrease is below
        # that, the search asks for a smaller residual instead (a descent direction for |F|^2)
        noisy = -slope < 1e4 * EPS * terms
        t = 1.0
        while True:
            nu1 = nu + t * dnu
            x1, psi1, terms1 = at(nu1)
            if (psi1 <= psi + 1e-4 * t * slope) if not noisy else (
                    float(np.linalg.norm(nu1 - U.T @ x1)) <= (1.0 - 1e-4 * t) * size):
                break
            t *= 0.5
            if t < 1e-10:
                return x, nu, step, False
        nu, x, psi, terms = nu1, x1, psi1, terms1
    return x, nu, STAGE_STEPS, False


def _restart(lr: RidgeLowRank, g: np.ndarray, st: SetStructure, x: np.ndarray) -> np.ndarray:
    """The next stage's start: the ``nu`` at which its unprojected point equals ``x`` on ``x``'s free
    coordinates (up to each sum group's shift), by least squares ``U_F nu = -(g + sigma x)_F`` on
    the face's null space, so that the stage starts where the last one ended instead of a projected
    gradient step of ``1 / (sigma + rho)`` away from it."""
    U = lr.U
    F = np.flatnonzero(_free(st, x))
    nu = U.T @ x
    if not F.size:
        return nu
    null = _equation_null(F, _sum_equations(st))[0]
    V = null(U[F])
    res = null(-(g[F] + lr.sigma * x[F] + U[F] @ nu))
    M = V.T @ V
    M[np.diag_indices_from(M)] += 1e-12 * float(np.trace(M)) + np.finfo(float).tiny
    try:
        return nu + sla.cho_solve(sla.cho_factor(M), V.T @ res)
    except (np.linalg.LinAlgError, ValueError):
        return nu


# ---------------------------------------------------------------------- the face
def _face_pdas(lr: RidgeLowRank, g: np.ndarray, st: SetStructure, x: np.ndarray,
               book: FaceBookkeeping | None = None, gram: _FreeGram | None = None) -> tuple[np.ndarray | None, int]:
    """Primal-dual active set (Hintermueller, Ito & Kunisch) on ``sigma I + U U'`` from the face of
    the feasible ``x``, with the engine's own face bookkeeping and update (``book``; by default a
    :class:`_PathFaces` of ``st``: bounds, sums, an L1 ball's centre and signs), each face solved by
    the Woodbury identity (:func:`_affine_face_point`; ``gram``, kept by the caller across stages:
    the free rows' Gram matrix, updated from face to face). Returns the optimum, put exactly on the set
    (``None`` when a face repeats, cannot be solved, its fixed point is off the set, or
    :data:`PDAS_STEPS` pass) and the face solves taken."""
    if book is None:
        book = _PathFaces(st, x.size)
    if gram is None:
        gram = _FreeGram(lr.U)
    U, sigma = lr.U, lr.sigma
    face, seen = book.identify(x), set()
    for k in range(1, PDAS_STEPS + 1):
        seen.add(face.key())
        y = _affine_face_point(lr, g, face.status == FREE, book.fixed_values(face, x), book.equations(face), gram)
        if y is None:
            return None, k
        new = book.update_face(face, y, sigma * y + U @ (U.T @ y) + g)
        if new.key() == face.key():
            return _on_set(st, y), k
        if new.key() in seen:
            return None, k
        face = new
    return None, PDAS_STEPS


def _polish(H: np.ndarray, g: np.ndarray, lr: RidgeLowRank, F: np.ndarray,
            null: Callable[[np.ndarray], np.ndarray], x: np.ndarray, steps: int = 3) -> np.ndarray:
    """Newton steps on the free coordinates ``F`` of ``x``'s face (``null``: the projection onto its
    equations' null space) with residuals from the true H, solved with ``sigma I + U U'`` by the
    Woodbury identity."""
    if not F.size:
        return x
    V = null(lr.U[F])
    try:
        cf = sla.cho_factor(lr.sigma * np.eye(lr.rank) + V.T @ V)
    except (np.linalg.LinAlgError, ValueError):
        return x
    y = x.copy()
    for _ in range(steps):
        res = null((H @ y)[F] + g[F])
        y[F] -= null(res - V @ sla.cho_solve(cf, V.T @ res)) / lr.sigma  # (null again: the equations' rounding)
    return y


def solve_ridge_low_rank(H: np.ndarray, g: np.ndarray, st: SetStructure, lr: RidgeLowRank,
                         x0: np.ndarray, eta: float) -> tuple[np.ndarray | None, dict[str, Any]]:
    """The path (module doc) from the feasible start ``x0``; ``eta`` = ``max diag H``: the dual on
    bounds only (:func:`_dual`), the proximal faces on sum groups (:func:`_proximal_faces`; without a
    ridge, the dual where no stage of theirs converged; on bounds the proximal faces where the dual
    reached no optimum) and on an L1 ball (:func:`_proximal_faces` too). Returns the polished point
    (``None`` where it reached no optimum) and what it did (``info["method"]``).

    :mod:`.active_set` passes ``1/K`` projected even for a warm-started solve: tried as the face
    active set's first face, the last solution of a sequence (``g`` moved by 0.01-1% of its size)
    freed hundreds of coordinates whose multipliers changed sign, and the unregularised face steps
    oscillated between faces of 100 and 1,000 free coordinates without converging; as the first
    stage's centre it cost 1.3-1.5x the Newton steps of ``1/K``."""
    if st.center is not None:
        return _proximal_faces(H, g, st, lr, x0, eta)
    first, second = (_dual, _proximal_faces) if st.group is None else (_proximal_faces, _dual)
    x, info = first(H, g, st, lr, x0, eta)
    if x is None and (lr.sigma == 0 or st.group is None):
        # each can fail where the other settles: the proximal faces on interpolating sums without
        # a ridge (J* ~ 0: their faces wander from the first stage on), the dual on boxes whose
        # face comes near the rank (its last stages do not settle: with a weak ridge at rank
        # 276 / 336 of n = 3072 the fallback took 1.59 -> 1.41 s and 3.05 -> 1.95 s, stop 64; on
        # sums with a ridge the dual is not tried, its late stages do not settle there)
        x, other = second(H, g, st, lr, x0, eta)
        info = {**info, **other, "method": f"{info['method']}, then {other['method']}",
                "stages": info["stages"] + other["stages"],
                "face_solves": info.get("face_solves", 0) + other.get("face_solves", 0)}
        if x is not None:
            info.pop("failed", None)
    return x, info


def solve_with_weak_ridge(H: np.ndarray, g: np.ndarray, st: SetStructure, lr: RidgeLowRank, x0: np.ndarray,
                          eta: float) -> tuple[np.ndarray | None, dict[str, Any]]:
    """The path (:func:`solve_ridge_low_rank`) from ``x0`` with ``lr``'s weak ridge as its ridge
    (:meth:`RidgeLowRank.with_weak_ridge`; ``None`` and no info where it has none), its point then
    polished as without the ridge (:func:`_polish_singular` on its face, with the true H). The dual's
    ``x(nu)`` divides its rounding by the weak ridge, and ``U U'`` sees that error: where the face
    active set after the dual did not converge, its point had a gap of 0.2-0.5 at ``J ~ 5e-10`` on
    boxes at cond 1e12 (n = 1152-1536); the polish without the ridge, which divides by nothing that
    small, brought them to the certificate's floor (stop 68)."""
    ridged = lr.with_weak_ridge()
    if ridged is None:
        return None, {}
    y, info = solve_ridge_low_rank(H, g, st, ridged, x0, eta)
    return (None if y is None else _finish(H, g, lr, st, y)), info


def _dual(H: np.ndarray, g: np.ndarray, st: SetStructure, lr: RidgeLowRank, x0: np.ndarray,
          eta: float) -> tuple[np.ndarray | None, dict[str, Any]]:
    """The dual's proximal stages (module doc), then (with a ridge) the face active set, then the
    polish. Returns the point (``None`` where neither settled) and what it did."""
    jac = _Jacobian(lr.U, st)
    xc = np.asarray(x0, dtype=np.float64)
    nu = _restart(lr, g, st, xc)
    rho, step_down = 1e-2 * eta, DECREASE
    settled_rho: float | None = None  # rho of the last settled stage (its point is the centre xc)
    stages = steps = retries = repeats = 0
    settled = True
    while True:
        final = _last_stage(lr, rho, eta)
        x, _, k, ok = _stage(lr, g, st, _shift(lr, rho, final), xc, nu, 1e-13 if final else 1e-9, jac)
        stages, steps = stages + 1, steps + k
        if not ok and settled_rho is not None and retries < RETRIES:
            retries += 1  # again from the last settled stage, with a smaller step down
            step_down = math.sqrt(step_down)
            rho = settled_rho / step_down
            continue
        if not ok:
            settled = False
            break
        if final:
            # without a ridge the last stage is a proximal one: again, centred at its point, while
            # that changes its face (a face with a flat descent direction is not the optimum's)
            if not _repeat_last_stage(lr, g, xc, x, lambda y: _free(st, y), repeats):
                break
            repeats += 1
        else:
            settled_rho = rho
            rho /= step_down
        xc = x
        nu = _restart(lr, g, st, x)
    info: dict[str, Any] = {"rank": lr.rank, "sigma": lr.sigma, "residual": lr.residual, "method": "dual",
                            "stages": stages, "newton_steps": steps, "stage_retries": retries,
                            "dual_settled": settled}
    # without a ridge J's faces are singular: the polish finishes on the last stage's face instead
    face, info["face_solves"] = _face_pdas(lr, g, st, x) if lr.sigma > 0 else (None, 0)
    info["face_converged"] = face is not None
    if face is not None:
        x = face
    elif not settled:
        info["failed"] = True
        return None, info
    return _finish(H, g, lr, st, x), info


def _last_stage(lr: RidgeLowRank, rho: float, eta: float) -> bool:
    """Whether the stage at ``rho`` is the last: with a ridge, once ``rho`` is below a thousandth
    of it (that stage is on J itself); without one, at ``rho`` = :data:`NO_RIDGE_RHO` ``eta`` (a
    proximal stage still: J's own faces are singular)."""
    if lr.sigma > 0:
        return rho <= 1e-3 * lr.sigma
    return rho <= NO_RIDGE_RHO * eta * (1.0 + 1e-9)


def _shift(lr: RidgeLowRank, rho: float, final: bool) -> float:
    """The proximal weight of a stage: ``rho``, but 0 on the last stage where there is a ridge."""
    return 0.0 if final and lr.sigma > 0 else rho


def _proximal_stages(lr: RidgeLowRank, g: np.ndarray, x0: np.ndarray, eta: float,
                     stage: Callable[[RidgeLowRank, np.ndarray, np.ndarray], tuple[np.ndarray | None, int]],
                     face_of: Callable[[np.ndarray], Face] | None = None) -> tuple[np.ndarray | None, dict[str, Any]]:
    """The proximal schedule shared by the face paths: ``stage(lr_s, h, x)`` minimises
    ``1/2 y'(sigma_s I + U U')y + h'y`` (``sigma_s = sigma + rho``, ``h = g - rho x``: J plus
    ``rho/2 |y - x|^2``) from the face of ``x`` and returns ``(y or None, face solves)``; ``rho`` from
    ``1e-2 eta`` down by :data:`PROX_DECREASE` per stage, each centred at the last stage's optimum,
    up by it after a stage that fails (at most :data:`PROX_FAILS` times, :data:`LEVEL_FAILS` at one
    ``rho``: a level that fails again ends the schedule), the last stage on J. Without
    a ridge the schedule ends at :data:`NO_RIDGE_RHO` (a proximal stage), or at a stage that fails
    once the gradient vanishes everywhere (:func:`_interpolating`), and where the failures run out
    the last converged stage's point is returned; that last stage is repeated, centred at its point,
    while its face (``face_of``'s free coordinates) differs from its centre's, at most
    :data:`NO_RIDGE_REPEATS` times, unless the gradient vanishes (stop 64: on ``l1_midrank`` seed 0
    the face of the first last stage gave a point the engine then corrected in 16 faces, 1.19 s; with
    one repeat none, 0.78 s). Returns the last stage's optimum (``None`` where it failed or the
    failures ran out, or no stage converged) and what it did."""
    x = np.asarray(x0, dtype=np.float64)
    rho = 1e-2 * eta
    level = 0  # rho = 1e-2 eta / PROX_DECREASE ** level
    failed_at: dict[int, int] = {}
    stages = faces = fails = 0
    advanced = False  # a stage has converged (without a ridge its point is the fallback)
    repeats = 0
    while True:
        final = _last_stage(lr, rho, eta)
        shift = _shift(lr, rho, final)
        y, k = stage(RidgeLowRank(lr.U, lr.sigma + shift, lr.residual), g - shift * x, x)
        stages, faces = stages + 1, faces + k
        if y is None:
            fails += 1
            failed_at[level] = failed_at.get(level, 0) + 1
            if (final or fails > PROX_FAILS or failed_at[level] > LEVEL_FAILS
                    or (lr.sigma == 0 and advanced and _interpolating(lr, g, x))):
                break
            rho *= PROX_DECREASE  # back up: a larger proximal term
            level -= 1
            continue
        if final and face_of is not None and _repeat_last_stage(lr, g, x, y, lambda z: face_of(z)[0], repeats):
            x, advanced, repeats = y, True, repeats + 1  # the last stage again, centred at its point
            continue
        x, advanced = y, True
        if final:
            break
        rho /= PROX_DECREASE
        level += 1
    info: dict[str, Any] = {"rank": lr.rank, "sigma": lr.sigma, "residual": lr.residual, "method": "proximal faces",
                            "stages": stages, "face_solves": faces, "stage_failures": fails,
                            "face_converged": y is not None}
    if y is None and lr.sigma == 0 and advanced:
        # without a ridge every stage is a proximal one: the last converged one's point is near an
        # optimum, and the polish (and the engine after it) start there
        return x, info
    if y is None:
        info["failed"] = True
    return y, info


def _repeat_last_stage(lr: RidgeLowRank, g: np.ndarray, centre: np.ndarray, y: np.ndarray,
                       free_of: Callable[[np.ndarray], np.ndarray], repeats: int) -> bool:
    """Whether a last stage without a ridge (a proximal one) runs again, centred at its optimum
    ``y``: while ``y``'s face (``free_of``: its free coordinates) differs from its centre's, at most
    :data:`NO_RIDGE_REPEATS` times, and not where the gradient vanishes (:func:`_interpolating`)."""
    return (lr.sigma == 0 and repeats < NO_RIDGE_REPEATS and not np.array_equal(free_of(centre), free_of(y))
            and not _interpolating(lr, g, y))


def _interpolating(lr: RidgeLowRank, g: np.ndarray, x: np.ndarray) -> bool:
    """Whether the gradient of J at ``x`` vanishes everywhere, bound coordinates included (to
    :data:`INTERPOLATING` of ``g``): ``J* = 0`` without a ridge, where the proximal faces' late
    stages wander over a flat set of optima and the polish is all that remains (on the cells
    measured: 1e-8 to 1e-12 of ``g`` there, 5e-3 to 7e-3 where ``J* > 0``)."""
    grad = lr.U @ (lr.U.T @ x) + g
    return float(np.max(np.abs(grad), initial=0.0)) <= INTERPOLATING * float(np.max(np.abs(g), initial=0.0))


def _proximal_faces(H: np.ndarray, g: np.ndarray, st: SetStructure, lr: RidgeLowRank, x0: np.ndarray,
                    eta: float) -> tuple[np.ndarray | None, dict[str, Any]]:
    """Sets with sum groups, boxes whose dual failed, and sets with an L1 ball: the face active set
    (:func:`_face_pdas`, the engine's own face update with Woodbury face solves) on the proximal
    problems (:func:`_proximal_stages`), each a ridge ``sigma + rho`` plus ``U U'``; then the polish
    on the last face (its free coordinates and sums, :func:`_bounds_face`, or with an L1 ball the
    active ball's equation, :func:`_ball_face`). Returns the point (``None`` where the stages failed)
    and what it did."""
    book, gram = _PathFaces(st, H.shape[0]), _FreeGram(lr.U)
    face_of: Callable[[np.ndarray], Face] = (
        (lambda y: _ball_face(book, y)) if st.center is not None else (lambda y: _bounds_face(st, y)))
    x, info = _proximal_stages(lr, g, x0, eta, lambda lr_s, h, xc: _face_pdas(lr_s, h, st, xc, book, gram),
                               face_of)
    return (None if x is None else _finish(H, g, lr, st, x, face_of)), info


class _PathFaces(FaceBookkeeping):
    """The engine's face bookkeeping (:mod:`.active_set_faces`: faces of bounds, sums and an L1
    ball's centre and signs, the primal-dual update) without the engine, for the path's face active
    set (:func:`_face_pdas`)."""

    def __init__(self, st: SetStructure, n: int):
        self.st, self.n = st, n


def _equation_null(F: np.ndarray, eq: tuple[np.ndarray, np.ndarray, np.ndarray] | None) -> tuple[
        Callable[[np.ndarray], np.ndarray], np.ndarray, np.ndarray]:
    """For a face's free coordinates ``F`` and equations ``sum_G a_i x_i = t_G`` (``a = +-1`` on
    them): the orthogonal projection onto the equations' null space, the count of free coordinates
    per group and ``a`` on ``F`` (the identity, and empty arrays, without equations)."""
    if eq is None:
        return (lambda v: v), np.zeros(0), np.zeros(0)
    group, a, totals = eq
    cnt = np.bincount(group[F], minlength=totals.size).astype(np.float64)
    return _weighted_null(F, eq, np.ones(F.size)), cnt, a[F]  # unit weights: the orthogonal projection


#: a face with at most this share of the rank free coordinates is solved in its own coordinates (its
#: ``|F| x |F|`` system) instead of by the Woodbury identity's ``r x r`` capacitance (stop 75: an L1 ball
#: of rank 960 with 154 free coordinates at its optimum paid an ``r x r`` Cholesky per face)
SMALL_FACE_SHARE = 0.5


def _affine_face_point(lr: RidgeLowRank, h: np.ndarray, free: np.ndarray, x: np.ndarray,
                       eq: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
                       gram: _FreeGram | None = None) -> np.ndarray | None:
    """The minimiser of ``1/2 x'(sigma I + U U')x + h'x`` over the affine hull of a face given by its
    free coordinates, the fixed values in ``x`` and its equations ``sum_G a_i x_i = t_G`` (``a = +-1``
    on free coordinates; the active ball's), by the Woodbury identity, or where the face has at most
    :data:`SMALL_FACE_SHARE` of the rank free coordinates by its own ``|F| x |F|`` system (stop 75).
    ``None`` where an equation has no free coordinate and is not met. With ``P`` the orthogonal projection on the equations'
    null space and ``V = P U_F``, the capacitance ``V'V`` is ``U_F'U_F - B'(A A')^-1 B`` with
    ``B = A U_F`` the groups' sums of those rows; ``U_F'U_F`` from ``gram`` where given (updated
    from the last face: the ``O(|F| r^2)`` product was most of a face solve, stop 67), else afresh.
    (``V`` itself is still formed, ``O(|F| r)``, for the products: with ``U_F`` in its place, equal
    in exact arithmetic, the path took 1.1-6.8x the face solves on 10 of 13 instances: the
    equations' rounding, divided by a weak ``sigma``.)"""
    U, sigma = lr.U, lr.sigma
    y = x.copy()
    F = np.flatnonzero(free)
    y[F] = 0.0
    UF = U[F]
    c = -(h[F] + UF @ (U.T @ y))
    null, cnt, aF = _equation_null(F, eq)
    xp = np.zeros(F.size)
    if eq is not None:
        group, a, totals = eq
        fixed = ~free
        need = totals - np.bincount(group[fixed], (a * y)[fixed], minlength=totals.size)
        if bool(np.any((cnt == 0) & (np.abs(need) > 1e-12 * (1.0 + np.abs(totals))))):
            return None
        xp = aF * need[group[F]] / np.maximum(cnt, 1.0)[group[F]]
    V = null(UF)
    rhs = null(c - sigma * xp - UF @ (UF.T @ xp))
    if SMALL_FACE_SHARE * lr.rank >= F.size:
        # a face smaller than the rank: its own |F| x |F| system, sigma P + (I - P) + V V' (P the equations'
        # projection; the (I - P) term makes it definite off their null space, where rhs is 0 and so is z)
        P = null(np.eye(F.size))
        M = V @ V.T + sigma * P
        M += np.eye(F.size) - P
        try:
            cf = sla.cho_factor(M)
        except (np.linalg.LinAlgError, ValueError):
            return None
        y[F] = xp + null(sla.cho_solve(cf, rhs))
        return y
    VV = (_FreeGram(U) if gram is None else gram)(free).copy()
    if eq is not None and F.size:
        _less_group_means(VV, UF, eq[0][F], aF, int(eq[2].size))
    try:
        cf = sla.cho_factor(sigma * np.eye(lr.rank) + VV)
    except (np.linalg.LinAlgError, ValueError):
        return None
    y[F] = xp + null(rhs - V @ sla.cho_solve(cf, V.T @ rhs)) / sigma  # (null again: the equations' rounding)
    return y


def _ball_face(book: _PathFaces, y: np.ndarray) -> Face:
    """The face of ``y`` on a set with an L1 ball: its free coordinates and its equations (the
    active ball's)."""
    face = book.identify(y)
    return np.flatnonzero(face.status == FREE), book.equations(face)


def _finish(H: np.ndarray, g: np.ndarray, lr: RidgeLowRank, st: SetStructure, x: np.ndarray,
            face_of: Callable[[np.ndarray], Face] | None = None) -> np.ndarray:
    """``x`` polished on its face (``face_of(x)`` = ``(F, equations)``; by default its free
    coordinates and their sums) and put exactly on the set: with a ridge by :func:`_polish` (``x``
    itself where that left the set: its face was not the optimum's, and the engine goes on from
    ``x``), without one by :func:`_polish_singular`."""
    if face_of is None:
        face_of = lambda y: _bounds_face(st, y)  # noqa: E731
    if lr.sigma == 0:
        return _polish_singular(H, g, lr, st, x, face_of)
    F, eq = face_of(x)
    yp = _on_set(st, _polish(H, g, lr, F, _equation_null(F, eq)[0], x))
    return x if yp is None else yp


def _bounds_face(st: SetStructure, y: np.ndarray) -> Face:
    """The face of ``y`` on a set of bounds and sums: its free coordinates and the sums."""
    return np.flatnonzero(_free(st, y)), _sum_equations(st)


def _room(st: SetStructure, y: np.ndarray, F: np.ndarray) -> np.ndarray:
    """How far each free coordinate ``F`` of ``y`` is from the nearest bound (or the L1 ball's
    centre, which a free coordinate of the ball's face does not cross), capped at ``1 + |y|``."""
    yF = y[F]
    room = np.minimum(np.minimum(yF - st.lo[F], st.hi[F] - yF), 1.0 + np.abs(yF))
    if st.center is not None:
        room = np.minimum(room, np.abs(yF - st.center[F]))
    return np.maximum(room, np.finfo(float).tiny)


def _weighted_null(F: np.ndarray, eq: Equations | None, w: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """``v -> v - W A'(A W A')^-1 A v`` for the face equations ``A`` (rows ``a`` on each group's free
    coordinates) and ``W = diag(w)``: ``N W`` is symmetric and ``A N = 0``, so ``N W u`` is the
    ``W``-weighted least-norm direction along ``u`` that keeps the equations (unit weights: the
    orthogonal projection of :func:`_equation_null`)."""
    if eq is None:
        return lambda v: v
    group, a, totals = eq
    grp, aF = group[F], a[F]
    member = sparse.csr_matrix((aF, (grp, np.arange(F.size))), shape=(totals.size, F.size))
    denom = np.maximum(np.bincount(grp, w * aF * aF, minlength=totals.size), np.finfo(float).tiny)
    wa = w * aF

    def null(v: np.ndarray) -> np.ndarray:
        coef = np.asarray(member @ v) / denom.reshape((-1,) + (1,) * (v.ndim - 1))
        return v - wa.reshape((-1,) + (1,) * (v.ndim - 1)) * coef[grp]

    return null


def _polish_singular(H: np.ndarray, g: np.ndarray, lr: RidgeLowRank, st: SetStructure, x: np.ndarray,
                     face_of: Callable[[np.ndarray], Face]) -> np.ndarray:
    """Without a ridge (``H = U U' + E``): Newton steps on the face of ``x`` whose equation
    ``V U_F' dx = -r`` (``V = U_F`` in the face equations' null space, ``r`` the projected gradient
    from the true H) has many solutions: the one of least norm weighted by each coordinate's room
    to its bound (:func:`_room`), so that coordinates near a bound hardly move and the face holds
    (:func:`_newton_on_face`). On an interpolating problem (``J* ~ 0``) this brings the gradient to its
    rounding, where the engine's test (the certificate's floor) accepts it; a proximal stage alone
    leaves it ``rho |x - xc|`` away."""

    def step(F: np.ndarray, eq: Equations | None, null: Callable[[np.ndarray], np.ndarray], y: np.ndarray,
             res: np.ndarray) -> np.ndarray:
        UF = lr.U[F]
        Q, R = np.linalg.qr(null(UF))
        z = _triangular_if_definite(R, Q.T @ res)  # U_F' dx must be -z: V z = r
        if z is None:
            A, S, Bt = np.linalg.svd(R, full_matrices=False)
            keep = S > 1e-7 * float(S[0]) if S.size and S[0] > 0 else np.zeros(S.size, dtype=bool)
            z = Bt[keep].T @ ((A[:, keep].T @ (Q.T @ res)) / S[keep])
        w = _room(st, y, F)
        B = _weighted_null(F, eq, w)(w[:, None] * UF)
        M = UF.T @ B
        u = _cholesky_if_definite(M, z)
        if u is not None:
            return -(B @ u)
        Mw, Pw = np.linalg.eigh(M)
        ok = Mw > 1e-12 * float(Mw[-1]) if Mw.size and Mw[-1] > 0 else np.zeros(Mw.size, dtype=bool)
        return -(B @ (Pw[:, ok] @ ((Pw[:, ok].T @ z) / Mw[ok])))

    return _newton_on_face(H, g, st, x, face_of, step, NO_RIDGE_POLISH)


#: the polish's triangular solve and Cholesky replace its SVD and eigendecomposition (a tenth of the flops;
#: most of the polish's time at high ranks, stop 75) where LAPACK's estimate of the reciprocal 1-norm
#: condition number is at least these times the order ``r``: the 2-norm condition number is at most ``r``
#: times the 1-norm one, so, with a factor 10 for the estimate, every singular value then lies above the
#: truncations (1e-7 of the largest for ``R``, 1e-12 for ``M``) and both give the same answer up to rounding
POLISH_TRIANGULAR_RCOND = 1e-6
POLISH_CHOLESKY_RCOND = 1e-11


def _triangular_if_definite(R: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """``R^-1 b`` for the upper triangular ``R``, or ``None`` where ``R`` is near singular (a condition
    estimate below :data:`POLISH_TRIANGULAR_RCOND` times its order, or a non-finite answer)."""
    if R.shape[0] != R.shape[1] or not R.size:
        return None
    rcond, info = sla.lapack.dtrcon(R, norm="1", uplo="U", diag="N")
    if info != 0 or not rcond >= POLISH_TRIANGULAR_RCOND * R.shape[0]:
        return None
    x = sla.solve_triangular(R, b, lower=False, check_finite=False)
    return x if bool(np.all(np.isfinite(x))) else None


def _cholesky_if_definite(M: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """``M^-1 b`` for the symmetric ``M`` by Cholesky, or ``None`` where it fails or ``M`` is near singular
    (a condition estimate below :data:`POLISH_CHOLESKY_RCOND` times its order)."""
    if not M.size:
        return None
    Ms = 0.5 * (M + M.T)
    anorm = float(np.max(np.sum(np.abs(Ms), axis=0)))
    try:
        c, low = sla.cho_factor(Ms, lower=False, check_finite=False)
    except (np.linalg.LinAlgError, ValueError):
        return None
    rcond, info = sla.lapack.dpocon(c, anorm, uplo="U")
    if info != 0 or not rcond >= POLISH_CHOLESKY_RCOND * M.shape[0]:
        return None
    x = sla.cho_solve((c, low), b, check_finite=False)
    return x if bool(np.all(np.isfinite(x))) else None


def polish_at_zero(H: np.ndarray, g: np.ndarray, st: SetStructure, x: np.ndarray,
                   face_of: Callable[[np.ndarray], Face]) -> np.ndarray | None:
    """The active-set engine's point on an interpolating problem (``J* ~ 0``: J at its rounding,
    the gap not yet at the certificate's floor) polished by Newton steps on its face with the
    explicit H: the least-norm solution of ``P H_FF P dx = -P grad_F`` (``P`` the projection onto
    the face equations' null space; an eigendecomposition of the free block, so only up to
    :data:`POLISH_MAX_FREE` free coordinates), each step put back on the set (:func:`_newton_on_face`);
    ``None`` where the face is larger. Measured (stop 66): an L1 ball of n = 768 (rank 120 of 692,
    no ridge) that the engine left at a gap of 2.9e-9, 1.4e4 times its floor, reached the floor in
    four steps."""
    if face_of(x)[0].size > POLISH_MAX_FREE:
        return None

    def step(F: np.ndarray, eq: Equations | None, null: Callable[[np.ndarray], np.ndarray], y: np.ndarray,
             res: np.ndarray) -> np.ndarray:
        K = null(null(H[np.ix_(F, F)]).T)
        w, V = np.linalg.eigh(0.5 * (K + K.T))
        ok = w > 1e-12 * float(w[-1]) if w.size and w[-1] > 0 else np.zeros(w.size, dtype=bool)
        return -null(V[:, ok] @ ((V[:, ok].T @ res) / w[ok]))

    return _newton_on_face(H, g, st, x, face_of, step, POLISH_STEPS)


def _newton_on_face(H: np.ndarray, g: np.ndarray, st: SetStructure, x: np.ndarray,
                    face_of: Callable[[np.ndarray], Face],
                    step: Callable[..., np.ndarray], steps: int) -> np.ndarray:
    """Newton steps ``y[F] += step(F, equations, null, y, r)`` on the face of the current point
    (``null``: the projection onto the face equations' null space, :func:`_equation_null`; ``r``
    the gradient projected by it), each put back on the set, until
    two steps in a row move no coordinate off it (at most ``steps``). Returns the point with the
    smallest projected gradient."""
    y = x
    best, best_size = x, math.inf
    clean = 0
    for k in range(steps + 1):
        F, eq = face_of(y)
        null = _equation_null(F, eq)[0]
        res = null((H @ y)[F] + g[F]) if F.size else np.zeros(0)
        size = float(np.linalg.norm(res))
        if size < best_size:
            best, best_size = y, size
        if not F.size or clean >= 2 or k == steps:
            break
        y1 = y.copy()
        y1[F] += step(F, eq, null, y, res)
        on_set = _on_set(st, y1)  # None: the step moved a coordinate off the set
        clean = 0 if on_set is None else clean + 1
        y = project_structure(st, y1) if on_set is None else on_set
    return best


def _on_set(st: SetStructure, y: np.ndarray) -> np.ndarray | None:
    """``y`` put exactly on the set where it is off it by no more than rounding (``1e-12`` of its
    size: the equations' rounding), else ``None`` (its face was not an optimum's)."""
    yp = project_structure(st, y)
    if float(np.max(np.abs(yp - y), initial=0.0)) > 1e-12 * (1.0 + float(np.max(np.abs(y), initial=0.0))):
        return None
    return yp
