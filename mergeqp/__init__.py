"""mergeqp: merge fine-tuned checkpoints by convex optimisation, with optimality certificates.

The public API is re-exported here lazily (importing ``mergeqp`` does not import torch or
cvxpy until a name that needs them is used).
"""

from __future__ import annotations

from ._lazy import lazy_exports

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # numerical core
    "MergeQP": "mergeqp.problem",
    "ConstraintSet": "mergeqp.constraints",
    "Box": "mergeqp.constraints",
    "Simplex": "mergeqp.constraints",
    "GlobalSimplex": "mergeqp.constraints",
    "L1Ball": "mergeqp.constraints",
    "SignConsensus": "mergeqp.constraints",
    "UserConstraints": "mergeqp.constraints",
    "Unconstrained": "mergeqp.constraints",
    "Intersection": "mergeqp.constraints",
    "parse_constraint": "mergeqp.constraints",
    "parse_constraints": "mergeqp.constraints",
    "register_constraint": "mergeqp.constraints",
    "check_feasible": "mergeqp.constraints",
    "as_constraint_set": "mergeqp.constraints",
    "CONSTRAINT_SETS": "mergeqp.constraints",
    "Solution": "mergeqp.solution",
    "SolveStatus": "mergeqp.solution",
    "Certificate": "mergeqp.certificate",
    "certify": "mergeqp.certificate",
    "solve": "mergeqp.solvers.registry",
    "SOLVERS": "mergeqp.solvers.registry",
    "available_solvers": "mergeqp.solvers.registry",
    "register_solver": "mergeqp.solvers.registry",
    "cvxpy_problem": "mergeqp.solvers.cvxpy_solvers",
    "load_problem_file": "mergeqp.problem",
    "load_reference_problem": "mergeqp.solvers.reference_problems",
    # errors
    "MergeQPError": "mergeqp.errors",
    "ValidationError": "mergeqp.errors",
    "NotConvexError": "mergeqp.errors",
    "InfeasibleError": "mergeqp.errors",
    "UnknownNameError": "mergeqp.errors",
    "SolverError": "mergeqp.errors",
    "UnboundedError": "mergeqp.errors",
    "ConfigError": "mergeqp.errors",
    # statistics (issue: calibration statistics)
    "CalibrationStats": "mergeqp.stats",
    "collect_statistics": "mergeqp.stats",
    "optimal_basis": "mergeqp.stats",
    "apply_merge": "mergeqp.stats",
    "apply_merge_state_dict": "mergeqp.stats",
    "Basis": "mergeqp.stats",
    "BASES": "mergeqp.stats",
    "make_basis": "mergeqp.stats",
    "energy_report": "mergeqp.stats",
    "save_stats": "mergeqp.stats",
    "load_stats": "mergeqp.stats",
    # baselines (issue: baseline merge methods)
    "merge_state_dicts": "mergeqp.merge",
    "MERGE_METHODS": "mergeqp.merge",
    "merge_tensors": "mergeqp.merge",
    "register_merge_method": "mergeqp.merge",
    "MergeMethod": "mergeqp.merge",
    "CalibrationStatistics": "mergeqp.merge.method",
    # registry entries a user can add (used from Python and from a YAML merge)
    "Parametrisation": "mergeqp.stats.parametrisation",
    "register_parametrisation": "mergeqp.stats.parametrisation",
    "MergeMode": "mergeqp.merge.modes",
    "register_merge_mode": "mergeqp.merge.modes",
    "register_basis": "mergeqp.stats.bases",
    "OutputMetric": "mergeqp.output_metrics",
    "OUTPUT_METRICS": "mergeqp.output_metrics",
    "register_output_metric": "mergeqp.output_metrics",
    "ModelMethod": "mergeqp.run.model_method",
    "MethodOutcome": "mergeqp.run.model_method",
    "StartFit": "mergeqp.run.model_method",
    "register_model_method": "mergeqp.run.model_methods",
    "MODEL_METHODS": "mergeqp.run.model_methods",
    # experiments (issue: MNIST reproduction)
    "run_mnist_experiment": "mergeqp.experiments",
    "trust_region_merge": "mergeqp.experiments",
    # Hugging Face folders and multi-layer merging
    "MergeConfig": "mergeqp.config",
    "register_architecture": "mergeqp.run.architectures",
    "load_config": "mergeqp.config",
    "open_checkpoint": "mergeqp.io",
    "save_hf_folder": "mergeqp.io",
    "run_merge": "mergeqp.run",
    "build_plan": "mergeqp.run",
    "MergeReport": "mergeqp.run",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports('mergeqp', globals(), _EXPORTS)
