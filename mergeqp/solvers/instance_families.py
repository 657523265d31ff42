"""Seeded families of merge QPs with a planted optimum, for solver benchmarks (``mergeqp bench
--family NAME``).

Every instance keeps the structure of a real merge QP -- ``H = 2 (R'R) o (1 1' (x) L'L) + mu I``,
``K x K`` blocks of ``r x r`` (``n = K r``), from
:func:`~mergeqp.solvers.reference_problems.synthetic_factors` -- and controls what makes an
active-set solver work hard:

- ``cond``: the ridge ``mu = lambda_max(H_syn) / cond`` (``cond = inf``: no ridge; the synthetic
  H is singular when ``N c < n``);
- ``at_bounds``: the fraction of coordinates on a bound at the optimum (at ``0`` / ``1`` of the
  box, at ``0`` of the simplex, at the centre of the L1 ball);
- ``dead``: the fraction of rows (atoms) whose residual is zero in every model (dead units: zero
  rows and columns of H, as in the real MNIST QP ``mnist_real640``, 13% of its coordinates);
- the set: ``box`` (``[0, 1]``), ``simplex`` (per-atom: ``sum_k d[k, a] = 1``, ``d >= 0``),
  ``l1`` (``|d|_1 <= R``), ``sign`` (``[0, 1]`` box intersected with TIES sign consensus ``G d >= 0``).

For box, simplex and L1 the optimum ``d*`` is planted: ``g = -H d* + lam`` with multipliers
``lam`` of the right sign and strict complementarity (magnitudes on the scale of ``H``'s
diagonal times ``|d*|``), so ``d*`` is the unique minimiser when ``H`` is definite and exactly
``at_bounds`` of its coordinates lie on a bound. The sign family keeps the synthetic ``g``
(its optimum is whatever it is; ``d_star`` is ``None``). Everything is drawn from ``seed``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..constraints import Box, ConstraintSet, L1Ball, SignConsensus, Simplex, intersect
from ..errors import ValidationError, check_integer, check_new_name, did_you_mean, lookup
from ..problem import MergeQP
from .base import power_top_eigenvalue
from .reference_problems import merge_qp_from_factors, synthetic_factors

SET_TYPES = ("box", "simplex", "l1", "sign")


@dataclass(frozen=True)
class InstanceFamily:
    """A seeded family of merge QPs (see the module doc).

    ``K`` models, ``r`` rows (atoms; ``n = K r`` unknowns), ``c`` outputs and ``N`` calibration
    samples of the synthetic factors, ``cond`` the condition number set by the ridge (``inf``:
    none), ``at_bounds`` the fraction of coordinates on a bound at the planted optimum,
    ``set_type`` one of :data:`SET_TYPES`; ``planted`` False keeps the synthetic ``g`` (the
    merge QP's own: no planted optimum, ``at_bounds`` unused); ``dead`` the fraction of dead rows
    (zero rows of H; with a finite ``cond`` its ridge makes them nonzero)."""

    name: str
    K: int
    r: int
    set_type: str
    at_bounds: float = 0.8
    cond: float = 1e6
    c: int = 16
    N: int = 400
    planted: bool = True
    description: str = ""
    dead: float = 0.0

    def __post_init__(self) -> None:
        if self.set_type not in SET_TYPES:
            raise ValidationError(f"instance family {self.name!r}: set_type {self.set_type!r} is not one of "
                                  f"{', '.join(SET_TYPES)}")
        if not 0.0 <= self.at_bounds < 1.0:
            raise ValidationError(f"instance family {self.name!r}: at_bounds must lie in [0, 1), got {self.at_bounds}")
        if not 0.0 <= self.dead < 1.0:
            raise ValidationError(f"instance family {self.name!r}: dead must lie in [0, 1), got {self.dead}")
        if not self.cond > 1.0:
            raise ValidationError(f"instance family {self.name!r}: cond must be > 1, got {self.cond}")
        for what in ("K", "r", "c", "N"):
            check_integer(f"instance family {self.name!r}: {what}", getattr(self, what))

    @property
    def n(self) -> int:
        return self.K * self.r

    def with_n(self, n: int) -> InstanceFamily:
        """The same family with ``r = n / K`` rows (``n`` a multiple of ``K``)."""
        if n < self.K or n % self.K:
            raise ValidationError(f"instance family {self.name!r}: n = {n} must be a positive multiple of "
                                  f"K = {self.K}")
        return replace(self, r=n // self.K)


@dataclass(frozen=True)
class FamilyInstance:
    """One drawn instance: the problem, its constraint set, the planted optimum ``d_star``
    (``(K, r)``; ``None`` for the sign family) and its objective ``J*``."""

    family: InstanceFamily
    seed: int
    problem: MergeQP
    constraints: ConstraintSet
    d_star: np.ndarray | None
    objective: float | None


FAMILIES: dict[str, InstanceFamily] = {}


def register_family(family: InstanceFamily) -> None:
    """Add a family to :data:`FAMILIES` (explicitly; users may add their own)."""
    if not isinstance(family, InstanceFamily):
        raise ValidationError(f"register_family expects an InstanceFamily, got {type(family).__name__}")
    check_new_name("instance family", family.name, FAMILIES)
    FAMILIES[family.name] = family


#: the fields a family spelling may set, with their kinds (``FAMILY:key=value:key=value``)
SPEC_FIELDS: dict[str, type] = {"K": int, "r": int, "c": int, "N": int, "cond": float, "at_bounds": float,
                                "planted": bool, "set_type": str, "dead": float}


def get_family(name: str) -> InstanceFamily:
    """The registered family ``name``, or a variant of one spelt ``FAMILY:key=value:...`` (keys
    :data:`SPEC_FIELDS`: e.g. ``box:K=8:r=80:cond=1e9:c=4:N=30:at_bounds=0.95``, a low-rank box with a
    weak ridge; ``planted=false`` keeps the synthetic g), named by its spelling."""
    base, sep, rest = str(name).partition(":")
    family = lookup("instance family", base, FAMILIES)
    if not sep:
        return family
    changes: dict[str, Any] = {}
    for item in rest.split(":"):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if key not in SPEC_FIELDS:
            raise ValidationError(f"instance family {name!r}: unknown field {key!r}{did_you_mean(key, SPEC_FIELDS)}; "
                                  f"a variant is spelt FAMILY:key=value:... with keys {', '.join(SPEC_FIELDS)}")
        if not eq or not raw.strip():
            raise ValidationError(f"instance family {name!r}: {key!r} has no value (write {key}=VALUE)")
        kind, raw = SPEC_FIELDS[key], raw.strip()
        try:
            if kind is bool:
                if raw.lower() not in ("true", "false"):
                    raise ValueError
                value: Any = raw.lower() == "true"
            elif kind is int:
                value = int(raw)
            else:
                value = kind(raw)
        except ValueError:
            what = {int: "a whole number", float: "a number", bool: "true or false"}.get(kind, "a name")
            raise ValidationError(f"instance family {name!r}: {key} must be {what}, got {raw!r}") from None
        changes[key] = value
    described = ", ".join(f"{key} = {value}" for key, value in changes.items())
    return replace(family, name=str(name), description=f"a variant of {base}: {described}", **changes)


def _top_eigenvalue(H: np.ndarray, rng: np.random.Generator, steps: int = 60) -> float:
    """``lambda_max(H)`` of a PSD ``H`` by power iteration (a few per cent is enough here)."""
    return power_top_eigenvalue(lambda v: H @ v, rng.standard_normal(H.shape[0]), steps)


def _spread(rng: np.random.Generator, size: Any) -> np.ndarray:
    """Multiplier magnitudes in ``(1e-4, 1]``, log-uniform: many nearly degenerate bounds, as in
    real merge QPs (this is what makes the active set hard to identify)."""
    return 10.0 ** rng.uniform(-4.0, 0.0, size)


def _plant_box(rng: np.random.Generator, n: int, frac: float, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``d*`` in ``[0, 1]^n`` with ``frac`` of its coordinates at 0 or 1, and multipliers."""
    d = rng.uniform(0.05, 0.95, n)
    lam = np.zeros(n)
    bound = rng.permutation(n)[: round(frac * n)]
    upper = rng.random(bound.size) < 0.5
    d[bound] = np.where(upper, 1.0, 0.0)
    mag = scale[bound] * _spread(rng, bound.size)
    lam[bound] = np.where(upper, -mag, mag)  # grad <= 0 at the upper bound, >= 0 at the lower
    return d, lam


def _plant_simplex(rng: np.random.Generator, K: int, r: int, frac: float,
                   scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-atom simplex ``d*`` (``(K, r)``, columns sum to 1) with each entry at 0 with probability
    ``frac``, but one positive entry per atom: about ``frac (K - 1) / K`` of its entries at 0 (the
    families' descriptions said ``frac``: a review, stop 74), and ``grad = nu_a + mu``, ``mu >= 0`` on
    zeros."""
    zero = rng.random((K, r)) < frac
    keep = rng.integers(0, K, r)
    zero[keep, np.arange(r)] = False
    w = np.where(zero, 0.0, rng.uniform(0.1, 1.0, (K, r)))
    d = w / w.sum(axis=0, keepdims=True)
    s = scale.reshape(K, r)
    nu = rng.standard_normal(r) * s.mean(axis=0)
    mu = np.where(zero, s * _spread(rng, (K, r)), 0.0)
    return d.ravel(), (nu[None, :] + mu).ravel()


def _plant_l1(rng: np.random.Generator, n: int, frac: float, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """``d*`` with ``frac`` of its coordinates 0, on the sphere ``|d|_1 = R``; ``grad = -nu s``
    with ``s = sign(d)`` off zero and ``|grad_i| < nu`` on zeros."""
    d = rng.uniform(0.05, 1.0, n) * rng.choice([-1.0, 1.0], n)
    d[rng.permutation(n)[: round(frac * n)]] = 0.0
    nu = float(np.median(scale))
    lam = np.where(d != 0, -nu * np.sign(d), nu * rng.choice([-1.0, 1.0], n) * (1.0 - _spread(rng, n)))
    return d, lam, float(np.sum(np.abs(d)))


def draw(family: InstanceFamily | str, seed: int = 0, n: int | None = None) -> FamilyInstance:
    """Draw the instance ``seed`` of ``family`` (a name or an :class:`InstanceFamily`), with
    ``n`` unknowns when given (``r = n / K``). Deterministic in ``(family, seed, n)``."""
    fam = get_family(family) if isinstance(family, str) else family
    if n is not None:
        fam = fam.with_n(int(n))
    rng = np.random.default_rng([seed, fam.K, fam.r, SET_TYPES.index(fam.set_type)])
    factors = synthetic_factors(fam.K, fam.r, fam.c, fam.N, seed=int(rng.integers(2**31)), dead_rows=fam.dead)
    base = merge_qp_from_factors(factors)
    assert base.H is not None
    H = np.array(base.H)
    g0, c0 = base.g, base.c
    del base, factors  # one n x n array at a time beside the problem's own copy
    if np.isfinite(fam.cond):
        H[np.diag_indices_from(H)] += _top_eigenvalue(H, rng) / fam.cond
    shape = (fam.K, fam.r)
    # multipliers on the scale of a gradient entry at |d| ~ 1
    scale = np.sqrt(np.maximum(np.diag(H), 1e-300)) * float(np.sqrt(np.mean(np.diag(H))))
    meta: dict[str, Any] = {"family": fam.name, "seed": seed, "K": fam.K, "r": fam.r, "set": fam.set_type,
                            "at_bounds": fam.at_bounds, "cond": fam.cond, "c": fam.c, "N": fam.N, "dead": fam.dead}
    if fam.set_type == "sign" or not fam.planted:
        if fam.set_type == "sign":
            deltas = rng.standard_normal((fam.K, fam.r, 4))
            cset: ConstraintSet = intersect([Box(0.0, 1.0), SignConsensus.from_deltas(deltas, "rows")])
        elif fam.set_type == "box":
            cset = Box(0.0, 1.0)
        elif fam.set_type == "simplex":
            cset = Simplex(1.0)
        else:  # the ball through the soup's scale: |d|_1 <= n / (2 K)
            cset = L1Ball(0.5 * fam.r)
        problem = MergeQP(H, g0, c0, shape=shape, metadata=meta)
        return FamilyInstance(fam, seed, problem, cset, None, None)
    if fam.set_type == "box":
        d, lam = _plant_box(rng, fam.n, fam.at_bounds, scale)
        cset = Box(0.0, 1.0)
    elif fam.set_type == "simplex":
        d, lam = _plant_simplex(rng, fam.K, fam.r, fam.at_bounds, scale)
        cset = Simplex(1.0)
    else:
        d, lam, radius = _plant_l1(rng, fam.n, fam.at_bounds, scale)
        cset = L1Ball(radius)
    g = lam - H @ d
    c = float(0.5 * d @ (H @ d)) + 1.0  # J(d*) = c - 1/2 d'Hd + lam'd: keep J* away from 0
    problem = MergeQP(H, g, c, shape=shape, metadata=meta)
    return FamilyInstance(fam, seed, problem, cset, d.reshape(shape), problem.objective(d.reshape(shape)))


#: what :func:`untuned_variants` draws each variant's fields from (uniformly; ``planted`` true with
#: probability :data:`UNTUNED_PLANTED`): the sizes, conditionings and shares of coordinates at a bound
#: that real merge QPs span, none of them chosen for a solver (stop 75)
UNTUNED_CHOICES: dict[str, tuple[Any, ...]] = {
    "K": (2, 3, 4, 6, 8), "set_type": ("box", "simplex", "l1"), "cond": (1e4, 1e6, 1e8, 1e10, float("inf")),
    "at_bounds": (0.3, 0.5, 0.7, 0.85, 0.95), "c": (4, 8, 16), "N": (30, 60, 100, 200, 400),
}
UNTUNED_PLANTED = 0.6


def untuned_variants(count: int, n: int, seed: int = 0) -> list[str]:
    """``count`` variants of the box, simplex and L1 families with ``n`` unknowns, each field drawn from
    :data:`UNTUNED_CHOICES` (``K`` among the choices that divide ``n``), spelt ``FAMILY:key=value:...``
    (:func:`get_family` reads them back; ``mergeqp bench --family SPELLING`` reruns one). Deterministic
    in ``(count, n, seed)``: instances nobody tuned a solver for, to measure how it does in general
    (``mergeqp bench --untuned COUNT``)."""
    check_integer("untuned variants: count", count)
    check_integer("untuned variants: n", n)
    if n < 2:
        raise ValidationError(f"untuned variants: n must be >= 2, got {n}")
    ks = [k for k in UNTUNED_CHOICES["K"] if n % k == 0]
    if not ks:
        raise ValidationError(f"untuned variants: n = {n} must be a multiple of one of "
                              f"{', '.join(str(k) for k in UNTUNED_CHOICES['K'])} (the number of models K)")
    rng = np.random.default_rng([seed, n, 75])
    out = []
    for _ in range(count):
        K = int(rng.choice(ks))
        st = str(rng.choice(UNTUNED_CHOICES["set_type"]))
        cond = float(rng.choice(UNTUNED_CHOICES["cond"]))
        at = float(rng.choice(UNTUNED_CHOICES["at_bounds"]))
        c = int(rng.choice(UNTUNED_CHOICES["c"]))
        N = int(rng.choice(UNTUNED_CHOICES["N"]))
        planted = bool(rng.random() < UNTUNED_PLANTED)
        cond_s = "inf" if math.isinf(cond) else f"{cond:.0e}".replace("e+0", "e").replace("e+", "e")
        # (at_bounds only where an optimum is planted: the synthetic g's optimum is whatever it is)
        shares = f":at_bounds={at:g}" if planted else ":planted=false"
        out.append(f"{st}:K={K}:r={n // K}:c={c}:N={N}:cond={cond_s}{shares}")
    return out


#: the built-in families (n = 3072 = 4 x 768 but box_llama, 3 x 4096; ``mergeqp bench --family NAME --n N`` rescales them)
for _fam in (
    InstanceFamily("box", 4, 768, "box", 0.8, description="box [0,1], 80% at a bound, cond 1e6"),
    InstanceFamily("box_ill", 4, 768, "box", 0.7, cond=1e9, description="box [0,1], 70% at a bound, cond 1e9"),
    InstanceFamily("box_free", 4, 768, "box", 0.3, description="box [0,1], 30% at a bound, cond 1e6"),
    InstanceFamily("simplex", 4, 768, "simplex", 0.6, description="per-atom simplex, about 45% of entries at 0 (at_bounds 0.6 x (K-1)/K)"),
    InstanceFamily("l1", 4, 768, "l1", 0.8, description="L1 ball, 80% of coordinates at 0"),
    InstanceFamily("box_natural", 4, 768, "box", cond=float("inf"), planted=False,
                   description="box [0,1], the synthetic merge QP's own g, singular H (no ridge)"),
    InstanceFamily("simplex_natural", 4, 768, "simplex", cond=float("inf"), planted=False,
                   description="per-atom simplex, the synthetic g, singular H"),
    InstanceFamily("box_singular", 4, 768, "box", cond=float("inf"), c=8, N=100, planted=False,
                   description="box [0,1], the synthetic g, rank(H) <= 800 (N c < n): ~85% at a bound"),
    InstanceFamily("simplex_singular", 4, 768, "simplex", cond=float("inf"), c=8, N=100, planted=False,
                   description="per-atom simplex, the synthetic g, rank(H) <= 800"),
    InstanceFamily("box_dead", 4, 768, "box", cond=float("inf"), planted=False, dead=0.15,
                   description="box [0,1], the synthetic g, singular H with 15% dead rows (zero rows of H)"),
    InstanceFamily("simplex_dead", 4, 768, "simplex", cond=float("inf"), planted=False, dead=0.15,
                   description="per-atom simplex, the synthetic g, singular H with 15% dead atoms"),
    InstanceFamily("box_lowrank", 4, 768, "box", 0.5, cond=1e8, c=2, N=50,
                   description="box [0,1], 50% at a bound, H of rank c N = 100 plus a weak ridge (cond 1e8)"),
    InstanceFamily("simplex_lowrank", 4, 768, "simplex", 0.5, cond=1e8, c=2, N=50,
                   description="per-atom simplex, about 38% of entries at 0, H of rank 100 plus a weak ridge (cond 1e8)"),
    InstanceFamily("box_midrank", 4, 768, "box", 0.6, cond=1e8, c=4, N=84,
                   description="box [0,1], 60% at a bound, H of rank c N = 336 (n / 9 at n = 3072) plus a weak ridge"),
    InstanceFamily("l1_midrank", 4, 768, "l1", 0.6, cond=float("inf"), c=4, N=84,
                   description="L1 ball, 60% of coordinates at 0, H of rank 336 (n / 9 at n = 3072), no ridge"),
    InstanceFamily("simplex_pair", 2, 1536, "simplex", 0.8, cond=1e8, c=4, N=100,
                   description="per-atom simplex of two models (a merge of two fine-tunes), about 40% of entries at 0, "
                               "rank c N = 400 plus a weak ridge (cond 1e8)"),
    InstanceFamily("box_llama", 3, 4096, "box", 0.8,
                   description="box [0,1], 3 x 4096 (n = 12288, a Llama down_proj), 80% at a bound, cond 1e6"),
    InstanceFamily("sign", 4, 768, "sign", 0.0, description="box [0,1] and TIES sign consensus (no planted optimum)"),
):
    register_family(_fam)
