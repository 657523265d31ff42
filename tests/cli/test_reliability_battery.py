"""The published battery of bad inputs (docs/reliability.md): for each case the exit code, a
one-line message naming the culprit, every input byte-identical afterwards, and no output (not
even a temporary file) left behind. CLI cases run in-process through ``mergeqp.cli.main``."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from mergeqp.cli import main
from mergeqp.errors import BadDataError, ConfigError, UnknownNameError, ValidationError

W = "{w}"  # the folder of inputs
O = "{o}"  # a fresh output folder per case

PROBLEM_CASES = [
    ("missing", ["solve", f"{W}/nope.npz"], 2, "problem file not found"),
    ("garbage-bytes", ["solve", f"{W}/garbage.npz"], 2, "not a mergeqp problem file"),
    ("empty-file", ["solve", f"{W}/empty.npz"], 2, "not a mergeqp problem file"),
    ("text-file", ["solve", f"{W}/text.npz"], 2, "not a mergeqp problem file"),
    ("single-array", ["solve", f"{W}/single.npy"], 2, "holds a single array"),
    ("pickled-objects", ["solve", f"{W}/pickled.npz"], 2, "pickled Python objects"),
    ("folder", ["solve", f"{W}/folder.npz"], 2, "is a directory"),
    ("no-H", ["solve", f"{W}/no_H.npz"], 2, "lacks array(s) ['H']"),
    ("no-g", ["solve", f"{W}/no_g.npz"], 2, "lacks array(s) ['g']"),
    ("nan-H", ["solve", f"{W}/nan_H.npz"], 3, "nan_H.npz: H contains 1 non-finite"),
    ("inf-g", ["solve", f"{W}/inf_g.npz"], 3, "g contains 1 non-finite"),
    ("nan-c", ["solve", f"{W}/nan_c.npz"], 3, "c is not finite"),
    ("nonsquare-H", ["solve", f"{W}/nonsquare_H.npz"], 2, "nonsquare_H.npz: H"),
    ("short-g", ["solve", f"{W}/short_g.npz"], 2, "but g has length 11"),
    ("asymmetric-H", ["solve", f"{W}/asym_H.npz"], 2, "symmetric"),
    ("nonconvex-H", ["solve", f"{W}/nonconvex_H.npz"], 2, "nonconvex_H.npz"),
    ("bad-shape", ["solve", f"{W}/bad_shape.npz"], 2, "shape must be (K, n_atoms)"),
    ("wrong-shape", ["solve", f"{W}/wrong_shape.npz"], 2, "wrong_shape.npz: shape"),
    ("array-c", ["solve", f"{W}/array_c.npz"], 2, "c must be a scalar"),
    ("text-H", ["solve", f"{W}/text_H.npz"], 2, "H must be an array of real numbers"),
]

SOLVE_CASES = [
    ("unknown-constraint", ["solve", f"{W}/ok.npz", "--constraint", "boxx:0,1"], 2, "unknown constraint set 'boxx'"),
    ("box-one-bound", ["solve", f"{W}/ok.npz", "--constraint", "box:0"], 2, "box takes two bounds"),
    ("box-words", ["solve", f"{W}/ok.npz", "--constraint", "box:a,b"], 2, "box"),
    ("box-reversed", ["solve", f"{W}/ok.npz", "--constraint", "box:1,0"], 2, "box"),
    ("empty-intersection", ["solve", f"{W}/ok.npz", "--constraint", "box:0,0.1", "--constraint", "simplex"], 2,
     "is empty"),
    ("sign-without-deltas", ["solve", f"{W}/ok.npz", "--constraint", "sign"], 2, "'sign' needs the residual tensors"),
    ("l1-negative", ["solve", f"{W}/ok.npz", "--constraint", "l1:-1"], 2, "l1"),
    ("unknown-solver", ["solve", f"{W}/ok.npz", "--solver", "magic"], 2, "unknown solver 'magic'"),
    ("option-no-value", ["solve", f"{W}/ok.npz", "--option", "novalue"], 2, "expected KEY=VALUE"),
    ("option-unknown-key", ["solve", f"{W}/ok.npz", "--solver", "active_set", "--option", "foo=1"], 2,
     "active_set: unrecognised solver option(s) ['foo']"),
    ("option-under-auto", ["solve", f"{W}/ok.npz", "--option", "max_iter=5"], 2,
     "--solver auto chose closed_form"),
    ("option-wrong-type", ["solve", f"{W}/ok.npz", "--constraint", "box:0,1", "--solver", "active_set",
                           "--option", "max_iter=abc"], 2, "'max_iter' must be an integer"),
    ("negative-rel-tol", ["solve", f"{W}/ok.npz", "--rel-tol", "-1"], 2, "--rel-tol"),
    ("negative-feas-tol", ["solve", f"{W}/ok.npz", "--feas-tol", "-1"], 2, "--feas-tol"),
    ("negative-abs-tol", ["solve", f"{W}/ok.npz", "--abs-tol", "-1"], 2, "--abs-tol"),
    ("rel-tol-word", ["solve", f"{W}/ok.npz", "--rel-tol", "tiny"], 2, "invalid float value: 'tiny'"),
    ("unknown-flag", ["solve", f"{W}/ok.npz", "--frobnicate"], 2, "unrecognized arguments: --frobnicate"),
    ("no-problem-arg", ["solve"], 2, "the following arguments are required: PROBLEM.npz"),
    ("out-missing-folder", ["solve", f"{W}/ok.npz", "--out", f"{O}/no/such/sol.json"], 2,
     "cannot write the solution to"),
    ("out-is-folder", ["solve", f"{W}/ok.npz", "--out", O], 2, "is a folder"),
    ("out-is-input", ["solve", f"{W}/ok.npz", "--out", f"{W}/ok.npz"], 2, "would overwrite the input"),
    ("out-links-to-input", ["solve", f"{W}/link_to_ok.npz", "--out", f"{W}/ok.npz"], 2,
     "would overwrite the input"),
    ("out-is-link-to-input", ["solve", f"{W}/ok.npz", "--out", f"{W}/link_to_ok.npz"], 2,
     "would overwrite the input"),
    ("save-d-is-input", ["solve", f"{W}/ok.npz", "--save-d", f"{W}/ok.npz"], 2, "would overwrite the input"),
    ("save-d-missing-folder", ["solve", f"{W}/ok.npz", "--save-d", f"{O}/none/d.npy"], 2, "does not exist"),
    ("out-equals-save-d", ["solve", f"{W}/ok.npz", "--out", f"{O}/x", "--save-d", f"{O}/x"], 2,
     "would both be written"),
    ("unknown-command", ["frobnicate"], 2, "invalid choice: 'frobnicate'"),
]

CERTIFY_CASES = [
    ("point-missing", ["certify", f"{W}/ok.npz", "--point", f"{W}/none.npy"], 2, "point file not found"),
    ("point-transposed", ["certify", f"{W}/ok.npz", "--point", f"{W}/d_T.npy"], 2,
     "point has shape (4, 3), the problem needs d of shape (3, 4)"),
    ("point-short", ["certify", f"{W}/ok.npz", "--point", f"{W}/d_short.npy"], 2, "point has shape (11,)"),
    ("point-nan", ["certify", f"{W}/ok.npz", "--point", f"{W}/d_nan.npy"], 3, "d_nan.npy: d holds 1 non-finite"),
    ("point-garbage", ["certify", f"{W}/ok.npz", "--point", f"{W}/d_garbage.npy"], 2, "cannot read point file"),
    ("point-json-no-d", ["certify", f"{W}/ok.npz", "--point", f"{W}/d_nokey.json"], 2, "has no key 'd'"),
    ("point-bad-json", ["certify", f"{W}/ok.npz", "--point", f"{W}/d_bad.json"], 2, "cannot read point file"),
    ("point-words", ["certify", f"{W}/ok.npz", "--point", f"{W}/d_words.txt"], 2, "cannot read point file"),
    ("point-two-arrays", ["certify", f"{W}/ok.npz", "--point", f"{W}/d_two.npz"], 2, "name the point's array 'd'"),
    ("point-flag-missing", ["certify", f"{W}/ok.npz"], 2, "the following arguments are required: --point"),
    ("certify-out-is-point", ["certify", f"{W}/ok.npz", "--point", f"{W}/d_ok.npy", "--out", f"{W}/d_ok.npy"], 2,
     "would overwrite the input"),
    ("certify-out-is-problem", ["certify", f"{W}/ok.npz", "--point", f"{W}/d_ok.npy", "--out", f"{W}/ok.npz"], 2,
     "would overwrite the input"),
    ("certify-nan-problem", ["certify", f"{W}/nan_H.npz", "--point", f"{W}/d_ok.npy"], 3, "H contains"),
    ("certify-garbage-problem", ["certify", f"{W}/garbage.npz", "--point", f"{W}/d_ok.npy"], 2,
     "not a mergeqp problem file"),
    ("wrong-point-not-certified", ["certify", f"{W}/ok.npz", "--point", f"{W}/d_zero.npy"], 1, "NOT CERTIFIED"),
    ("infeasible-point", ["certify", f"{W}/ok.npz", "--point", f"{W}/d_far.npy", "--constraint", "box:0,1"], 1,
     "infeasible: constraint violation"),
]

BENCH_CASES = [
    ("bench-unknown-problem", ["bench", "--problems", "nope"], 2, "unknown problem 'nope'"),
    ("bench-unknown-solver", ["bench", "--problems", "tiny96", "--solvers", "gurobi"], 2, "unknown solver 'gurobi'"),
    ("bench-empty-problems", ["bench", "--problems", ","], 2, "--problems is empty"),
    ("bench-repeat-0", ["bench", "--problems", "tiny96", "--repeat", "0"], 2, "--repeat must be >= 1"),
    ("bench-opt-format", ["bench", "--problems", "tiny96", "--opt", "max_iter=3"], 2, "expected SOLVER.KEY=VALUE"),
    ("bench-opt-unknown-key", ["bench", "--problems", "tiny96", "--opt", "active_set.foo=1"], 2,
     "unrecognised solver option"),
    ("bench-opt-unknown-solver", ["bench", "--problems", "tiny96", "--opt", "nosuch.x=1"], 2,
     "unknown solver 'nosuch'"),
    ("bench-json-missing-folder", ["bench", "--problems", "tiny96", "--json", f"{O}/a/b.json"], 2, "does not exist"),
    ("bench-json-is-folder", ["bench", "--problems", "tiny96", "--json", O], 2, "is a folder"),
    ("bench-nothing-ran", ["bench", "--problems", "tiny96", "--solvers", "closed_form", "--constraint", "box:0,1"],
     2, "no cell of the benchmark ran"),
]

COLLECT = ["collect", "--factory", f"{W}/factory.py:make", "--layer", "2", "--quiet"]
GOOD_MODELS = ["--base", f"{W}/base.safetensors", "--finetuned", f"{W}/ft0.safetensors", f"{W}/ft1.safetensors",
               "--calibration", f"{W}/cal0.pt", f"{W}/cal1.pt"]
OUT = ["--out", f"{O}/stats.npz"]

COLLECT_CASES = [
    ("kwargs-not-json", [*COLLECT, *GOOD_MODELS, *OUT, "--factory-kwargs", "{{hidden"], 2,
     "--factory-kwargs is not valid JSON"),
    ("kwargs-not-object", [*COLLECT, *GOOD_MODELS, *OUT, "--factory-kwargs", "[1]"], 2, "must be a JSON object"),
    ("factory-no-colon", ["collect", "--factory", "factory.py", "--layer", "2", *GOOD_MODELS, *OUT], 2,
     "--factory must look like module:function"),
    ("factory-file-missing", ["collect", "--factory", f"{W}/nofactory.py:make", "--layer", "2", *GOOD_MODELS, *OUT],
     2, "file not found"),
    ("factory-module-missing", ["collect", "--factory", "no_such_module_xyz:make", "--layer", "2", *GOOD_MODELS,
                                *OUT], 2, "cannot import 'no_such_module_xyz'"),
    ("factory-no-function", ["collect", "--factory", f"{W}/factory.py:nothing", "--layer", "2", *GOOD_MODELS, *OUT],
     2, "has no callable 'nothing'"),
    ("base-missing", [*COLLECT, "--base", f"{W}/none.safetensors", "--finetuned", f"{W}/ft0.safetensors",
                      "--calibration", f"{W}/cal0.pt", *OUT], 2, "file not found: "),
    ("calibration-missing", [*COLLECT, "--base", f"{W}/base.safetensors", "--finetuned", f"{W}/ft0.safetensors",
                             "--calibration", f"{W}/none.pt", *OUT], 2, "none.pt"),
    ("base-is-folder", [*COLLECT, "--base", f"{W}/ckpt_folder", "--finetuned", f"{W}/ft0.safetensors",
                        "--calibration", f"{W}/cal0.pt", *OUT], 2, "ckpt_folder is a folder"),
    ("calibration-count", [*COLLECT, "--base", f"{W}/base.safetensors", "--finetuned", f"{W}/ft0.safetensors",
                           f"{W}/ft1.safetensors", "--calibration", f"{W}/cal0.pt", *OUT], 2,
     "--calibration has 1 file(s) but --finetuned has 2"),
    ("names-count", [*COLLECT, *GOOD_MODELS, *OUT, "--names", "a"], 2, "--names has 1 name(s)"),
    ("names-duplicate", [*COLLECT, *GOOD_MODELS, *OUT, "--names", "a", "a"], 2, "--names must be unique"),
    ("batch-size-0", [*COLLECT, *GOOD_MODELS, *OUT, "--batch-size", "0"], 2, "--batch-size must be >= 1"),
    ("parametrisation-unknown", [*COLLECT, *GOOD_MODELS, *OUT, "--parametrisation", "diagonal"], 2,
     "--parametrisation: unknown parametrisation 'diagonal'"),
    ("problem-parametrisation-unknown", [*COLLECT, *GOOD_MODELS, *OUT, "--problem-parametrisation", "diag"], 2,
     "unknown parametrisation (--problem-parametrisation) 'diag'"),
    ("problem-basis-unknown", [*COLLECT, *GOOD_MODELS, *OUT, "--problem-parametrisation", "magic:3"], 2,
     "unknown basis name (--problem-parametrisation) 'magic'"),
    ("problem-basis-p-word", [*COLLECT, *GOOD_MODELS, *OUT, "--problem-parametrisation", "optimal:x"], 2,
     "P (and SEED) must be integers"),
    ("problem-basis-p-0", [*COLLECT, *GOOD_MODELS, *OUT, "--problem-parametrisation", "optimal:0"], 2,
     "P must be >= 1"),
    ("task-weights-word", [*COLLECT, *GOOD_MODELS, *OUT, "--task-weights", "heavy"], 2,
     "--task-weights must be 'mean' or comma-separated numbers"),
    ("task-weights-count", [*COLLECT, *GOOD_MODELS, *OUT, "--task-weights", "1"], 2,
     "--task-weights has 1 weight(s) but there are 2 task(s)"),
    ("task-weights-negative", [*COLLECT, *GOOD_MODELS, *OUT, "--task-weights", "1,-1"], 2, "finite, >= 0"),
    ("task-weights-zero", [*COLLECT, *GOOD_MODELS, *OUT, "--task-weights", "0,0"], 2, "not all zero"),
    ("task-weights-nan", [*COLLECT, *GOOD_MODELS, *OUT, "--task-weights", "nan,1"], 2, "finite, >= 0"),
    ("device-meta", [*COLLECT, *GOOD_MODELS, *OUT, "--device", "meta"], 2, "cannot run the models"),
    ("device-nonsense", [*COLLECT, *GOOD_MODELS, *OUT, "--device", "nonsense"], 2, "unknown torch device"),
    ("dtype-float16", [*COLLECT, *GOOD_MODELS, *OUT, "--dtype", "float16"], 2, "invalid choice: 'float16'"),
    ("out-is-base", [*COLLECT, *GOOD_MODELS, "--out", f"{W}/base.safetensors"], 2,
     "--out " + W + "/base.safetensors would overwrite the input"),
    ("out-is-link-to-base", [*COLLECT, *GOOD_MODELS, "--out", f"{W}/link_to_base.safetensors"], 2,
     "would overwrite the input"),
    ("out-is-calibration", [*COLLECT, *GOOD_MODELS, "--out", f"{W}/cal1.pt"], 2, "would overwrite the input"),
    ("out-is-factory", [*COLLECT, *GOOD_MODELS, "--out", f"{W}/factory.py"], 2, "would overwrite the input"),
    ("problem-is-finetuned", [*COLLECT, *GOOD_MODELS, *OUT, "--problem", f"{W}/ft1.safetensors"], 2,
     "--problem " + W + "/ft1.safetensors: the problem is written as an .npz file"),
    ("problem-equals-out", [*COLLECT, *GOOD_MODELS, *OUT, "--problem", f"{O}/stats.npz"], 2, "are the same file"),
    ("out-missing-folder", [*COLLECT, *GOOD_MODELS, "--out", f"{O}/x/y/s.npz"], 2, "does not exist"),
    ("out-is-folder", [*COLLECT, *GOOD_MODELS, "--out", O], 2, "is a folder"),
    ("finetuned-nan", [*COLLECT, "--base", f"{W}/base.safetensors", "--finetuned", f"{W}/ft_nan.safetensors",
                       "--calibration", f"{W}/cal0.pt", *OUT], 3,
     "tensor '2.weight' of checkpoint " + W + "/ft_nan.safetensors has 1 non-finite value(s)"),
    ("calibration-inf", [*COLLECT, "--base", f"{W}/base.safetensors", "--finetuned", f"{W}/ft0.safetensors",
                         "--calibration", f"{W}/cal_nan.pt", *OUT], 3, "cal_nan.pt: the inputs hold 1 non-finite"),
    ("checkpoint-garbage", [*COLLECT, "--base", f"{W}/garbage.safetensors", "--finetuned", f"{W}/ft0.safetensors",
                            "--calibration", f"{W}/cal0.pt", *OUT], 2, "cannot read checkpoint"),
    ("checkpoint-wrong-model", [*COLLECT, "--base", f"{W}/wrong_model.pt", "--finetuned", f"{W}/ft0.safetensors",
                                "--calibration", f"{W}/cal0.pt", *OUT], 2, "does not fit the factory's model"),
    ("calibration-garbage", [*COLLECT, "--base", f"{W}/base.safetensors", "--finetuned", f"{W}/ft0.safetensors",
                             "--calibration", f"{W}/garbage_cal.npz", *OUT], 2, "cannot read calibration file"),
    ("layer-unknown", ["collect", "--factory", f"{W}/factory.py:make", "--layer", "9", "--quiet", *GOOD_MODELS,
                       *OUT], 2, "'9'"),
]

EXPERIMENT_CASES = [
    ("threads-0", ["experiment", "mnist", "--threads", "0", "--out", f"{O}/e"], 2, "--threads must be >= 1"),
    ("solver-unknown", ["experiment", "mnist", "--solver", "nope", "--out", f"{O}/e"], 2, "unknown solver 'nope'"),
    ("ridge-word", ["experiment", "mnist", "--qp-tr-ridge", "0,x", "--out", f"{O}/e"], 2,
     "--qp-tr-ridge expects comma-separated numbers"),
    ("ridge-negative", ["experiment", "mnist", "--qp-tr-ridge", "0,-1", "--out", f"{O}/e"], 2, "finite and >= 0"),
    ("idx-dir-missing", ["experiment", "mnist", "--idx-dir", f"{W}/none", "--out", f"{O}/e"], 2,
     "/none' is not a folder"),
    ("out-not-empty", ["experiment", "mnist", "--out", O], 2, "is not empty; pass --overwrite"),
    ("out-is-file", ["experiment", "mnist", "--out", f"{W}/ok.npz"], 2, "exists and is not a folder"),
    ("seed-negative", ["experiment", "mnist", "--seed", "-1", "--out", f"{O}/e"], 2, "seed must be an integer"),
    ("finetune-unknown", ["experiment", "mnist", "--finetune", "layer9", "--out", f"{O}/e"], 2,
     "invalid choice: 'layer9'"),
    ("experiment-unknown", ["experiment", "cifar", "--out", f"{O}/e"], 2, "invalid choice: 'cifar'"),
    ("merge-config-missing", ["merge", f"{W}/nope.yml", "--dry-run"], 2, "nope.yml"),
    ("merge-config-device", ["merge", "/dev/null", "--dry-run"], 2,
     "config /dev/null is not a regular file (a device, pipe or socket)"),
]

# the review of issue 14: links and '..' paths to inputs, infinite tolerances, damaged files
SOK = ["solve", f"{W}/ok.npz"]
CERT = ["certify", f"{W}/ok.npz"]
ONE_MODEL = ["--finetuned", f"{W}/ft0.safetensors", "--calibration", f"{W}/cal0.pt", *OUT]
REVIEW_CASES = [
    ("solve-out-hard-link-to-input", [*SOK, "--out", f"{W}/hard_ok.npz"], 2, "would overwrite the input"),
    ("solve-out-dotdot-to-input", [*SOK, "--out", f"{W}/sub/../ok.npz"], 2, "would overwrite the input"),
    ("solve-out-through-linked-folder", [*SOK, "--out", f"{W}/sub/up/ok.npz"], 2, "would overwrite the input"),
    ("solve-out-under-a-file", [*SOK, "--out", f"{W}/ok.npz/sol.json"], 2, "is a file, not a folder"),
    ("solve-save-d-hard-link-to-input", [*SOK, "--save-d", f"{W}/hard_ok.npz"], 2, "would overwrite the input"),
    ("solve-out-equals-save-d-dotdot", [*SOK, "--out", f"{O}/a.json", "--save-d", f"{O}/../out/a.json"], 2,
     "would both be written"),
    ("solve-rel-tol-inf", [*SOK, "--rel-tol", "inf"], 2, "must be finite and >= 0"),
    ("solve-feas-tol-inf", [*SOK, "--feas-tol", "inf"], 2, "must be finite and >= 0"),
    ("solve-abs-tol-nan", [*SOK, "--abs-tol", "nan"], 2, "must be finite and >= 0"),
    ("solve-box-nan", [*SOK, "--constraint", "box:nan,1"], 2, "box bounds contain NaN"),
    ("solve-l1-inf", [*SOK, "--constraint", "l1:inf"], 2, "radius must be finite"),
    ("solve-option-out-of-range", [*SOK, "--constraint", "box:0,1", "--solver", "active_set", "--option",
                                   "max_iter=-3"], 2, "max_iter=-3 is out of range"),
    ("solve-empty-safetensors", ["solve", f"{W}/empty.safetensors"], 2, "not a mergeqp problem file"),
    ("certify-rel-tol-inf", [*CERT, "--point", f"{W}/d_zero.npy", "--rel-tol", "inf"], 2, "must be finite"),
    ("certify-abs-tol-inf", [*CERT, "--point", f"{W}/d_zero.npy", "--abs-tol", "inf"], 2, "must be finite"),
    ("certify-feas-tol-inf", [*CERT, "--point", f"{W}/d_far.npy", "--constraint", "box:0,1", "--feas-tol", "inf"],
     2, "must be finite"),
    ("certify-point-empty-file", [*CERT, "--point", f"{W}/empty.npz"], 2, "cannot read point file"),
    ("certify-point-is-problem", [*CERT, "--point", f"{W}/ok.npz"], 2, "name the point's array 'd'"),
    ("certify-point-inf-json", [*CERT, "--point", f"{W}/d_inf.json"], 3, "d_inf.json: d holds 1 non-finite"),
    ("certify-out-hard-link-to-problem", [*CERT, "--point", f"{W}/d_ok.npy", "--out", f"{W}/hard_ok.npz"], 2,
     "would overwrite the input"),
    ("certify-out-dotdot-to-point", [*CERT, "--point", f"{W}/d_ok.npy", "--out", f"{W}/sub/../d_ok.npy"], 2,
     "would overwrite the input"),
    ("bench-json-under-a-file", ["bench", "--problems", "tiny96", "--json", f"{W}/ok.npz/b.json"], 2,
     "is a file, not a folder"),
    ("bench-repeat-negative", ["bench", "--problems", "tiny96", "--repeat", "-2"], 2, "--repeat must be >= 1"),
    ("bench-empty-box", ["bench", "--problems", "tiny96", "--constraint", "box:1,0"], 2,
     "box is empty: lower bound 1 > upper bound 0"),
    ("collect-out-hard-link-to-base", [*COLLECT, *GOOD_MODELS, "--out", f"{W}/hard_base.safetensors"], 2,
     "would overwrite the input"),
    ("collect-out-dotdot-to-base", [*COLLECT, *GOOD_MODELS, "--out", f"{W}/sub/../base.safetensors"], 2,
     "would overwrite the input"),
    ("collect-out-through-linked-folder", [*COLLECT, *GOOD_MODELS, "--out", f"{W}/sub/up/cal0.pt"], 2,
     "would overwrite the input"),
    ("collect-problem-link-to-base", [*COLLECT, *GOOD_MODELS, *OUT, "--problem", f"{W}/link_to_base.safetensors"],
     2, "the problem is written as an .npz file"),
    ("collect-problem-dotdot-to-finetuned", [*COLLECT, *GOOD_MODELS, *OUT, "--problem",
                                             f"{W}/sub/../ft0.safetensors"], 2, "is written as an .npz file"),
    ("collect-problem-equals-out-dotdot", [*COLLECT, *GOOD_MODELS, *OUT, "--problem", f"{O}/../out/stats.npz"], 2,
     "are the same file"),
    ("collect-out-under-a-file", [*COLLECT, *GOOD_MODELS, "--out", f"{W}/ok.npz/s.npz"], 2,
     "is a file, not a folder"),
    ("collect-base-empty-file", [*COLLECT, "--base", f"{W}/empty.safetensors", *ONE_MODEL], 2,
     "cannot read checkpoint"),
    ("collect-base-truncated", [*COLLECT, "--base", f"{W}/trunc.safetensors", *ONE_MODEL], 2,
     "cannot read checkpoint"),
    ("collect-finetuned-truncated", [*COLLECT, "--base", f"{W}/base.safetensors", "--finetuned",
                                     f"{W}/trunc.safetensors", "--calibration", f"{W}/cal0.pt", *OUT], 2,
     "trunc.safetensors"),
    ("collect-calibration-empty-file", [*COLLECT, "--base", f"{W}/base.safetensors", "--finetuned",
                                        f"{W}/ft0.safetensors", "--calibration", f"{W}/empty.npz", *OUT], 2,
     "cannot read calibration file"),
    ("collect-task-weights-inf", [*COLLECT, *GOOD_MODELS, *OUT, "--task-weights", "inf,1"], 2, "finite, >= 0"),
    ("collect-batch-size-negative", [*COLLECT, *GOOD_MODELS, *OUT, "--batch-size", "-1"], 2,
     "--batch-size must be >= 1"),
    ("collect-factory-kwargs-mismatch", [*COLLECT, *GOOD_MODELS, *OUT, "--factory-kwargs", '{{"hidden": 7}}'], 2,
     "does not fit the factory's model"),
    ("experiment-out-under-a-file", ["experiment", "mnist", "--out", f"{W}/ok.npz/e"], 2,
     "cannot create the output folder"),
    ("experiment-out-is-idx-dir", ["experiment", "mnist", "--idx-dir", f"{W}/sub", "--out", f"{W}/sub",
                                   "--overwrite"], 2, "overlaps input"),
    ("experiment-out-contains-idx-dir", ["experiment", "mnist", "--idx-dir", f"{W}/sub", "--out", W,
                                         "--overwrite"], 2, "overlaps input"),
    ("experiment-threads-negative", ["experiment", "mnist", "--threads", "-1", "--out", f"{O}/e"], 2,
     "--threads must be >= 1"),
]

CLI_CASES = [pytest.param(*c[1:], id=c[0]) for group in
             (PROBLEM_CASES, SOLVE_CASES, CERTIFY_CASES, BENCH_CASES, COLLECT_CASES, EXPERIMENT_CASES, REVIEW_CASES)
             for c in group]


@pytest.fixture(scope="module")
def world(build_world, tmp_path_factory) -> Path:
    return build_world(tmp_path_factory.mktemp("world"))


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse: usage errors
        code = exc.code
    out, err = capsys.readouterr()
    return int(code), out, err


@pytest.mark.parametrize("argv, code, message", CLI_CASES)
def test_cli_bad_input(digests, leftovers, world, tmp_path, capsys, argv, code, message):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("an earlier result")  # a non-empty folder, which must survive
    fill = {"w": str(world), "o": str(out_dir)}
    args = [a.format(**fill) for a in argv]
    before, before_out = digests(world), digests(out_dir)
    got, stdout, stderr = run_cli(capsys, args)
    message = message.format(**fill)
    assert got == code, f"exit {got}, expected {code}\n{stderr}"
    assert message in stderr, stderr
    assert "Traceback" not in stderr
    if code >= 2:  # one line naming the culprit (argparse adds its usage above it)
        errors = [ln for ln in stderr.splitlines() if "error:" in ln]
        assert len(errors) == 1, stderr
    assert digests(world) == before, "an input file changed"
    assert digests(out_dir) == before_out, "an output was written"
    assert leftovers(world) == [] and leftovers(out_dir) == []


def test_wrong_point_gets_no_abs_tol_hint(world, capsys):
    """d = 0 on a problem with c = 0: J(d) = 0 lies within the gap, but no tolerance could
    honestly accept it (the gap is as large as the problem's own terms)."""
    code, stdout, stderr = run_cli(capsys, ["certify", str(world / "ok.npz"), "--point", str(world / "d_zero.npy")])
    assert code == 1
    assert "--abs-tol" not in stdout + stderr


def test_bench_checks_constraints_before_the_table(capsys):
    code, stdout, stderr = run_cli(capsys, ["bench", "--problems", "tiny96", "--constraint", "box:1,0"])
    assert code == 2 and stdout == "" and "box is empty" in stderr


def test_bench_all_rows_failed_still_prints_the_table(world, capsys):
    code, stdout, stderr = run_cli(capsys, ["bench", "--problems", "tiny96", "--solvers", "closed_form",
                                            "--constraint", "box:0,1"])
    assert code == 2 and "not run" in stdout and "nothing was measured" in stderr


def test_option_names_the_solver_that_received_it(world, capsys):
    code, stdout, _ = run_cli(capsys, ["solve", str(world / "ok.npz"), "--constraint", "box:0,1",
                                       "--solver", "active_set", "--option", "max_iter=500"])
    assert code == 0 and "passed to solver active_set" in stdout


def test_save_d_writes_exactly_the_given_name(world, tmp_path, capsys):
    target = tmp_path / "coefficients"
    code, _, _ = run_cli(capsys, ["solve", str(world / "ok.npz"), "--save-d", str(target)])
    assert code == 0
    assert target.is_file() and not (tmp_path / "coefficients.npy").exists()
    assert np.load(target).shape == (3, 4)


# ---------------------------------------------------------------------- Python API
def _sd(seed: int, bad: float | None = None, where: str = "w") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(4, generator=g)}
    if bad is not None:
        sd[where][1] = bad
    return sd


METHODS = ["task_arithmetic", "soup", "ties", "dare", "dare_ties", "row_dare"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("who, bad", [("base", float("nan")), ("finetuned[1]", float("inf"))])
def test_merge_refuses_nonfinite_inputs(method, who, bad):
    from mergeqp.merge import merge_state_dicts

    base = _sd(0, bad if who == "base" else None)
    fts = [_sd(1), _sd(2, bad if who == "finetuned[1]" else None, where="b")]
    with pytest.raises(BadDataError, match=rf"tensor '(w|b)' of {re.escape(who)}.*non-finite"):
        merge_state_dicts(method, None if method == "soup" and who != "base" else base, fts)


def test_merge_refuses_a_nonfinite_result():
    from mergeqp.merge import merge_state_dicts

    base = {"w": torch.zeros(3, dtype=torch.float16)}
    fts = [{"w": torch.full((3,), 60000.0, dtype=torch.float16)}]
    with pytest.raises(BadDataError, match="tensor 'w' of the task_arithmetic merge"):
        merge_state_dicts("task_arithmetic", base, fts, scaling=10.0)


API_CASES = [
    ("mergeqp-nan-H", lambda w: __import__("mergeqp").MergeQP(H=np.full((2, 2), np.nan), g=np.zeros(2)),
     BadDataError, "H contains"),
    ("mergeqp-inf-g", lambda w: __import__("mergeqp").MergeQP(H=np.eye(2), g=np.array([np.inf, 0])),
     BadDataError, "g contains"),
    ("load-garbage", lambda w: __import__("mergeqp").MergeQP.load_npz(str(w / "garbage.npz")),
     ValidationError, "not a mergeqp problem file"),
    ("load-pickled", lambda w: __import__("mergeqp").MergeQP.load_npz(str(w / "pickled.npz")),
     ValidationError, "pickled"),
    ("load-stats-garbage", lambda w: __import__("mergeqp.stats").stats.load_stats(
        str(w / "garbage.npz")), ValidationError, "garbage.npz"),
    ("unknown-method", lambda w: __import__("mergeqp.merge").merge.merge_state_dicts("magic", _sd(0), [_sd(1)]),
     UnknownNameError, "unknown merge method 'magic'"),
    ("unknown-param", lambda w: __import__("mergeqp.merge").merge.merge_state_dicts("ties", _sd(0), [_sd(1)],
                                                                                   densty=0.2),
     ConfigError, "densty"),
    ("shape-mismatch", lambda w: __import__("mergeqp.merge").merge.merge_state_dicts(
        "soup", None, [_sd(0), {"w": torch.zeros(3, 3), "b": torch.zeros(4)}]), ValidationError, "tensor 'w' has shape"),
    ("writer-nan", lambda w: __import__("mergeqp.io").io.save_hf_folder(
        w / "never", iter([("a", torch.zeros(2)), ("b", torch.tensor([1.0, float("nan")]))])),
     BadDataError, "tensor 'b' of the merged model"),
    ("writer-over-input", lambda w: __import__("mergeqp.io").io.save_hf_folder(
        w / "ckpt_folder" / "sub", iter([("a", torch.zeros(2))]), protected=[w / "ckpt_folder"]),
     ValidationError, "overlaps input"),
    ("solve-rel-tol-inf", lambda w: __import__("mergeqp").solve(
        __import__("mergeqp").MergeQP(H=np.eye(2), g=-np.ones(2)), rel_tol=float("inf")), ValidationError,
     "must be finite and >= 0"),
    ("certify-abs-tol-inf", lambda w: __import__("mergeqp").certify(
        __import__("mergeqp").MergeQP(H=np.eye(2), g=-np.ones(2)), None, np.zeros(2), abs_tol=float("inf")),
     ValidationError, "must be finite and >= 0"),
    ("writer-over-its-source", lambda w: __import__("mergeqp.io").io.save_hf_folder(
        w / "ckpt_folder", iter([("a", torch.zeros(2))]), source_folder=w / "ckpt_folder", overwrite=True),
     ValidationError, "overlaps input"),
    ("open-truncated-checkpoint", lambda w: __import__("mergeqp.io.checkpoint").io.checkpoint.open_checkpoint(
        w / "trunc.safetensors"), ValidationError, "truncated or damaged safetensors file"),
    ("collect-statistics-nan-finetuned", lambda w: __import__("mergeqp.stats.collect").stats.collect.collect_statistics(
        _mlp(), [_mlp(nan=True)], "2", [torch.randn(8, 5)], progress=False), BadDataError,
     "its tensor '2.weight' holds NaN or inf"),
    ("experiment-out-is-idx-dir", lambda w: __import__("mergeqp.experiments.mnist").experiments.mnist
     .run_mnist_experiment(str(w / "sub"), idx_dir=str(w / "sub"), overwrite=True), ValidationError,
     "overlaps input"),
]


def _mlp(nan: bool = False) -> torch.nn.Module:
    """The factory's architecture (5 -> 6 -> 3), seeded; ``nan``: one NaN weight in layer 2."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    if nan:
        with torch.no_grad():
            model[2].weight[0, 0] = float("nan")
    return model


@pytest.mark.parametrize("call, exc, message", [pytest.param(*c[1:], id=c[0]) for c in API_CASES])
def test_api_bad_input(digests, leftovers, world, call, exc, message):
    before = digests(world)
    with pytest.raises(exc, match=message.replace("(", r"\(").replace("[", r"\[")):
        call(world)
    assert digests(world) == before
    assert not (world / "never").exists() and not (world / "ckpt_folder" / "sub").exists()
    assert leftovers(world) == []


# ---------------------------------------------------------------------- the published list
ROOT = Path(__file__).resolve().parents[2]


def test_every_case_and_exit_code_is_published():
    from mergeqp.errors import EXIT_CODES

    doc = (ROOT / "docs" / "reliability.md").read_text()
    readme = (ROOT / "README.md").read_text()
    missing = [p.id for p in CLI_CASES if f"| `{p.id}` |" not in doc]
    assert missing == [], f"cases not in docs/reliability.md: {missing}"
    for code, meaning in EXIT_CODES:
        assert f"| {code} | {meaning} |" in doc and f"| {code} | {meaning} |" in readme


@pytest.mark.parametrize("argv", [[], ["solve"], ["certify"], ["bench"], ["collect"], ["experiment"],
                                  ["experiment", "mnist"], ["merge"]])
def test_every_help_lists_the_exit_codes(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "exit codes:" in out and "130" in out and "I/O error" in out
