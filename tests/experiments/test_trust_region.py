"""``qp_tr``: sequential trust-region QPs. References: an exactly quadratic objective and an
exactly linear network (where qp_tr must reach the certified QP optimum), finite differences
of the true objective of a ReLU network (the re-linearised QP must match its value and
gradient at the current point), and monotone decrease."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import mergeqp as mq
from mergeqp.constraints import Box, Intersection, Simplex, Unconstrained
from mergeqp.errors import ValidationError
from mergeqp.experiments.trust_region import (
    TrustRegionConfig,
    calibration_error,
    calibration_targets,
    sequential_trust_region,
    split_calibration,
    trust_region_merge,
    trust_region_set,
)
from mergeqp.stats import apply_merge, collect_statistics


def _random_qp(seed: int, K: int = 3, n: int = 4) -> mq.MergeQP:
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((2 * K * n, K * n))
    b = rng.standard_normal(2 * K * n) * 3
    return mq.MergeQP(H=2 * A.T @ A, g=2 * A.T @ b, c=float(b @ b), shape=(K, n))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_quadratic_reaches_the_box_optimum(seed):
    problem = _random_qp(seed)
    box = Box(0.0, 1.0)
    exact = mq.solve(problem, box, solver="clarabel")
    result = sequential_trust_region(lambda d: problem, problem.objective, box, problem.soup_point(),
                                     TrustRegionConfig(max_qps=40, tol=1e-12), solver="clarabel",
                                     progress=False)
    assert result.all_certified
    assert all(s.accepted and abs(s.rho - 1) < 1e-6 for s in result.steps if np.isfinite(s.rho))
    assert result.objective == pytest.approx(exact.objective, rel=1e-7, abs=1e-7)
    assert result.objective <= problem.objective(problem.soup_point())


def _net(relu: bool, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    act = [nn.ReLU()] if relu else []
    return nn.Sequential(nn.Linear(6, 8), *act, nn.Linear(8, 7), *act, nn.Linear(7, 3)).to(torch.float64)


def _finetuned(base: nn.Module, layer: str, K: int, scale: float, seed: int) -> list[nn.Module]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(K):
        m = copy.deepcopy(base)
        with torch.no_grad():
            lin = m.get_submodule(layer)
            lin.weight.add_(scale * torch.randn(lin.weight.shape, generator=g, dtype=torch.float64))
            lin.bias.add_(scale * torch.randn(lin.bias.shape, generator=g, dtype=torch.float64))
        out.append(m)
    return out


def _calibration(K: int, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 6, generator=g, dtype=torch.float64) + k for k in range(K)]


def test_exactly_linear_network_reaches_the_certified_qp_optimum():
    base = _net(relu=False, seed=0)
    layer = "1"
    fts = _finetuned(base, layer, K=3, scale=0.5, seed=1)
    cal = _calibration(3, 20, seed=2)
    stats = collect_statistics(base, fts, layer, cal, progress=False)
    exact = mq.solve(stats.problem("rows"), Box(0.0, 1.0), solver="clarabel")
    assert exact.certificate.certified()
    result = trust_region_merge(base, fts, layer, cal, config=TrustRegionConfig(max_qps=40, tol=1e-12),
                                solver="clarabel", progress=False)
    assert result.all_certified
    assert result.objective == pytest.approx(exact.objective, rel=1e-7)
    np.testing.assert_allclose(result.d, exact.d, atol=1e-4)


def test_relinearised_qp_matches_true_objective_value_and_gradient():
    base = _net(relu=True, seed=3)
    layer = "2"
    K = 3
    fts = _finetuned(base, layer, K=K, scale=0.4, seed=4)
    cal = _calibration(K, 15, seed=5)
    rng = np.random.default_rng(6)
    d = rng.uniform(0.1, 0.9, (K, 7))
    merged = apply_merge(base, fts, layer, d)
    stats = collect_statistics(merged, fts, layer, cal, parametrisations=["rows"], reference_model=base,
                               progress=False)
    problem = stats.problem("rows", offset=d)
    targets = calibration_targets(fts, cal)

    def F(x):
        return calibration_error(apply_merge(base, fts, layer, x), cal, targets)

    assert problem.objective(d) == pytest.approx(F(d), rel=1e-10)
    direction = rng.standard_normal(d.shape)
    h = 1e-6
    fd = (F(d + h * direction) - F(d - h * direction)) / (2 * h)
    assert float(problem.gradient(d).ravel() @ direction.ravel()) == pytest.approx(fd, rel=1e-5)
    # at the base (d = 0) the re-linearised problem is the ordinary QP
    plain = collect_statistics(base, fts, layer, cal, parametrisations=["rows"], progress=False).problem("rows")
    np.testing.assert_allclose(plain.objective(d * 0), F(d * 0), rtol=1e-10)


def test_relu_network_decreases_monotonically_and_reports_steps():
    base = _net(relu=True, seed=7)
    layer = "2"
    fts = _finetuned(base, layer, K=3, scale=0.8, seed=8)
    cal = _calibration(3, 15, seed=9)
    cfg = TrustRegionConfig(max_qps=6)
    result = trust_region_merge(base, fts, layer, cal, config=cfg, solver="clarabel", progress=False)
    targets = calibration_targets(fts, cal)
    soup = np.full((3, 7), 1 / 3)
    assert result.start_objective == pytest.approx(
        calibration_error(apply_merge(base, fts, layer, soup), cal, targets), rel=1e-12)
    assert result.objective == pytest.approx(
        calibration_error(apply_merge(base, fts, layer, result.d), cal, targets), rel=1e-12)
    assert result.objective <= result.start_objective
    assert 1 <= result.n_qps <= cfg.max_qps and result.all_certified
    current = result.start_objective
    for step in result.steps:
        assert step.true_before == pytest.approx(current, rel=1e-12)
        assert step.step_norm <= step.delta * (1 + 1e-6) + 1e-9
        if step.accepted:
            assert step.true_after < step.true_before
            current = step.true_after
    assert np.all(result.d >= -1e-9) and np.all(result.d <= 1 + 1e-9)
    summary = result.to_dict()
    assert summary["n_qps"] == result.n_qps and len(summary["steps"]) == result.n_qps


def test_trust_region_sets_and_validation():
    center = np.array([[0.05, 0.5], [0.95, 0.2]])
    region = trust_region_set(Box(0.0, 1.0), center, 0.1)
    lo, hi = region.bounds(center.shape)
    np.testing.assert_allclose(lo, [[0.0, 0.4], [0.85, 0.1]])
    np.testing.assert_allclose(hi, [[0.15, 0.6], [1.0, 0.3]])
    free = trust_region_set(Unconstrained(), center, 0.5)
    np.testing.assert_allclose(free.bounds(center.shape)[0], center - 0.5)
    assert isinstance(trust_region_set(Simplex(1.0), center, 0.1), Intersection)
    with pytest.raises(ValidationError, match="outside the box"):
        trust_region_set(Box(0.0, 1.0), center + 2.0, 0.1)
    with pytest.raises(ValidationError, match="delta0"):
        TrustRegionConfig(delta0=0.0)
    with pytest.raises(ValidationError, match="shrink"):
        TrustRegionConfig(shrink=1.5)
    problem = _random_qp(0)
    with pytest.raises(ValidationError, match="violates the constraints"):
        sequential_trust_region(lambda d: problem, problem.objective, Box(0.0, 1.0),
                                np.full(problem.shape, 2.0), progress=False)


def test_split_calibration_is_a_seeded_disjoint_partition():
    cal = [torch.arange(10, dtype=torch.float64).reshape(10, 1), [torch.full((3, 1), 7.0), torch.full((2, 1), 9.0)]]
    fit, held = split_calibration(cal, 0.25, seed=3, batch_size=4)
    assert [int(x.shape[0]) for x in held] == [2, 1] and [int(x.shape[0]) for x in fit] == [8, 4]
    assert sorted(torch.cat([fit[0], held[0]]).ravel().tolist()) == list(range(10))
    again = split_calibration(cal, 0.25, seed=3, batch_size=4)
    assert all(torch.equal(a, b) for a, b in zip(fit + held, again[0] + again[1], strict=True))
    with pytest.raises(ValidationError, match="needs >= 2"):
        split_calibration([torch.ones(1, 6)], 0.5)
    with pytest.raises(ValidationError, match="holdout_fraction"):
        split_calibration(cal, 1.0)
    with pytest.raises(ValidationError, match="tensor inputs"):
        split_calibration([[{"input_ids": [1, 2]}]], 0.5)


def test_ridge_weight_is_chosen_on_held_out_samples():
    """The selection table equals independent runs on the same split, the chosen weight has
    the lowest held-out error, and the final merge is qp_tr on all samples with that weight."""
    base = _net(relu=True, seed=7)
    layer = "2"
    fts = _finetuned(base, layer, K=3, scale=0.8, seed=8)
    cal = _calibration(3, 16, seed=9)
    cfg = TrustRegionConfig(max_qps=4)
    relative = (0.0, 0.01, 1.0, 100.0)
    result = trust_region_merge(base, fts, layer, cal, config=cfg, solver="active_set", progress=False,
                                ridge_candidates=relative, holdout_fraction=0.25, seed=5)
    sel = result.ridge_selection
    assert sel is not None and sel.relative == relative and sel.scale > 0
    assert sel.n_fit == (12, 12, 12) and sel.n_heldout == (4, 4, 4)
    fit, held = split_calibration(cal, 0.25, seed=5)
    held_targets = calibration_targets(fts, held)
    errors = []
    for mu in sel.weights:
        run = trust_region_merge(base, fts, layer, fit, config=TrustRegionConfig(max_qps=4, ridge=mu),
                                 solver="active_set", progress=False)
        errors.append(calibration_error(apply_merge(base, fts, layer, run.d), held, held_targets))
    np.testing.assert_allclose(sel.heldout_errors, errors, rtol=1e-9)
    assert sel.chosen == sel.weights[int(np.argmin(errors))]
    assert len(set(np.round(errors, 9))) > 1  # the weight matters on this problem
    final = trust_region_merge(base, fts, layer, cal, config=TrustRegionConfig(max_qps=4, ridge=sel.chosen),
                               solver="active_set", progress=False)
    np.testing.assert_allclose(result.d, final.d, atol=1e-10)
    assert result.config.ridge == sel.chosen
    summary = result.to_dict()["ridge_selection"]
    assert summary["chosen_relative"] == sel.chosen_relative and len(summary["heldout_errors"]) == 4
    with pytest.raises(ValidationError, match="ridge_candidates"):
        trust_region_merge(base, fts, layer, cal, config=cfg, progress=False, ridge_candidates=[-1.0])


def test_an_uncertified_step_says_why():
    """(stop 46 review) The report's note said only "trust-region step(s) [0, 1] not certified"; the
    steps now keep their certificate's reason and the note gives the first."""
    from mergeqp.merge.trust_region import _steps_certificate

    problem = _random_qp(0)
    result = sequential_trust_region(lambda d: problem, problem.objective, Box(0.0, 1.0), problem.soup_point(),
                                     TrustRegionConfig(max_qps=2), solver="torch_fista",
                                     solver_options={"max_iter": 1}, progress=False)
    bad = [s for s in result.steps if not s.certified]
    assert bad and all(s.why_not_certified and "optimality gap" in s.why_not_certified for s in bad)
    assert all(s.why_not_certified is None for s in result.steps if s.certified)
    (reason,) = _steps_certificate(result)["reasons"]
    assert reason.startswith(f"trust-region step(s) {[s.iteration + 1 for s in bad]} not certified (step {bad[0].iteration + 1}: "
                             "optimality gap")
    assert "why_not_certified" in bad[0].to_dict()


def test_a_rejected_interior_step_is_not_repeated():
    """(stop 52 review) The model's step is interior (length 0.01 in a region of radius 0.5) and the
    true objective rejects it: the next radius is below the step's length, so no QP repeats the
    rejected step (the radius was halved from 0.5, and six QPs returned the same point)."""
    n, K = 4, 2
    d0 = np.full((K, n), 0.5)

    def linearise(d):  # J(d') = |d' - (d + 0.01)|^2: the model always moves every coordinate by +0.01
        target = (d + 0.01).ravel()
        return mq.MergeQP(H=2 * np.eye(K * n), g=-2 * target, c=float(target @ target), shape=(K, n))

    def true_objective(d):  # the same, plus a stiff term the model does not see
        return float(linearise(d0).objective(d) + 1e4 * np.sum((d - d0) ** 2))

    result = sequential_trust_region(linearise, true_objective, Box(0.0, 1.0), d0,
                                     TrustRegionConfig(delta0=0.5, max_qps=8, tol=1e-14), solver="active_set",
                                     progress=False)
    steps = result.steps
    assert not steps[0].accepted and steps[0].step_norm == pytest.approx(0.01)
    floor = TrustRegionConfig().delta_min  # (the smallest radius allowed is tried once, below)
    for a, b in zip(steps, steps[1:]):
        if not a.accepted:
            assert b.step_norm <= max(0.5 * a.step_norm, floor) * (1 + 1e-9)
    assert result.objective <= true_objective(d0)


def test_a_rejected_step_just_above_the_smallest_radius_still_tries_it():
    """The radius below the rejected step's length is never below ``delta_min`` while that step was
    longer: the smallest radius allowed gets its QP before the loop stops."""
    n, K = 2, 1
    d0 = np.full((K, n), 0.5)

    def linearise(d):  # every coordinate wants +1.5e-4
        target = (d + 1.5e-4).ravel()
        return mq.MergeQP(H=2 * np.eye(K * n), g=-2 * target, c=float(target @ target), shape=(K, n))

    def true_objective(d):  # rejects the full step, accepts one of length delta_min
        return float(linearise(d0).objective(d) + 2e4 * max(float(np.max(np.abs(d - d0))) - 1.2e-4, 0.0))

    result = sequential_trust_region(linearise, true_objective, Box(0.0, 1.0), d0,
                                     TrustRegionConfig(delta0=0.5, delta_min=1e-4, max_qps=6, tol=1e-14),
                                     solver="active_set", progress=False)
    steps = result.steps
    assert not steps[0].accepted and steps[1].delta == pytest.approx(1e-4) and steps[1].accepted
    assert result.objective < true_objective(d0)


def test_the_progress_bar_ends_full_when_a_rule_stops_early(capsys):
    """(stop 56 review) Stopped by a rule before max_qps QPs, the bar's last line said 1/8, as if the
    run had been cut short: it ends at the steps taken, 100%."""
    problem = _random_qp(0)
    result = sequential_trust_region(lambda d: problem, problem.objective, Box(0.0, 1.0), problem.soup_point(),
                                     TrustRegionConfig(max_qps=50, tol=1e-12), solver="clarabel", progress=True)
    n = len(result.steps)
    assert 1 <= n < 50 and "max_qps" not in result.stop_reason
    last = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if "qp_tr" in line][-1]
    assert f"{n}/{n}" in last and "100%" in last, last
