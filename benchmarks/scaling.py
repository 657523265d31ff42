"""Constants for ``docs/scaling.md``: statistics time per token and site, solve time against n,
and the speed-up of ``mergeqp collect`` on two processes (``torchrun``, gloo) on this machine.

Run::

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/scaling.py [--part statistics solve torchrun]

- ``statistics``: a random float32 Llama (hidden 256, MLP 688, 4 blocks, vocabulary 512), two
  fine-tunes perturbed at ``model.layers.2.mlp.down_proj`` (r = 256 rows: n = 512 per-row
  atoms), 16 prompts of 64 tokens per task in batches of 4, a 16-dimensional projection of the
  logits; the seconds of :func:`~mergeqp.merge.firstorder.collect_first_order` (forward JVPs,
  chunks of 256 atoms, energy off) per token of calibration and per atom.
- ``solve``: the box-constrained QP of a random convex ``H`` (rank ``n / 2`` plus a small ridge)
  at n = 500 ... 4000, ``solver: auto``, seconds (median of 1; the certificate included).
- ``torchrun``: ``mergeqp collect`` on a random Llama (hidden 64, MLP 172, 4 blocks, vocabulary
  32; the site's full ``(c = 16 x 32) x (T r = 16 x 64)`` Jacobian per prompt), 64 prompts of 16
  tokens per task, batches of 4, under ``torchrun --nproc-per-node`` 1 and 2 (wall seconds
  of the whole command, start-up included, and the collection seconds rank 0 reports).

Prints markdown tables. Timings on a shared machine are noisy; the machine's load average is
printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def statistics_part() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from mergeqp.io.calibration import tensor_batches
    from mergeqp.lm import OutputSpec, teacher_forced_targets
    from mergeqp.merge.firstorder import SiteAtoms, TaskTargets, collect_first_order
    from mergeqp.merge.sites import match_sites, model_sites, read_augmented
    from mergeqp.stats.parametrisation import as_parametrisation

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    cfg._attn_implementation = "eager"
    base = LlamaForCausalLM(cfg).eval()
    layer = "model.layers.2.mlp.down_proj"
    site = match_sites(model_sites(base), [layer])[0]
    prompts, tokens, batch = 16, 64, 4
    ids = torch.randint(0, 512, (prompts, tokens), generator=torch.Generator().manual_seed(3))
    batches = tensor_batches({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, range(prompts), batch)
    spec = OutputSpec("logits", "projection", 16, 0)
    tasks, deltas = [], []
    W0 = read_augmented(base, site)
    for k in range(2):
        ft = LlamaForCausalLM(cfg).eval()
        ft.load_state_dict(base.state_dict())
        with torch.no_grad():
            w = dict(ft.named_parameters())[f"{layer}.weight"]
            w.add_(0.3 * float(w.std()) * torch.randn(w.shape, generator=torch.Generator().manual_seed(k)))
        tasks.append(TaskTargets(f"t{k}", 1.0, teacher_forced_targets(ft, batches, spec, "cpu")))
        deltas.append(read_augmented(ft, site) - W0)
    atoms = [SiteAtoms(site, as_parametrisation("rows"), torch.stack(deltas))]
    t = time.perf_counter()
    collect_first_order(base, atoms, tasks, spec, energy=False, chunk_size=256)
    seconds = time.perf_counter() - t
    n_tokens = 2 * prompts * tokens
    n = 2 * atoms[0].n_atoms
    print("| site | n atoms | tokens (2 tasks) | seconds | us per token | us per token and atom |")
    print("|---|---|---|---|---|---|")
    print(f"| {layer} (r = {site.r}) | {n} | {n_tokens} | {seconds:.1f} | {1e6 * seconds / n_tokens:.0f} | "
          f"{1e6 * seconds / n_tokens / n:.2f} |")


def solve_part(sizes: list[int]) -> None:
    from mergeqp.constraints import parse_constraint
    from mergeqp.problem import MergeQP
    from mergeqp.solvers import solve

    print("| n | seconds | solver | certified |")
    print("|---|---|---|---|")
    for n in sizes:
        rng = np.random.default_rng(n)
        A = rng.standard_normal((n // 2, n))
        H = A.T @ A / n + 1e-3 * np.eye(n)
        d_star = rng.uniform(-0.5, 1.5, n)  # about a quarter of the bounds active
        problem = MergeQP(H=H, g=-H @ d_star, c=0.0, shape=(2, n // 2))
        t = time.perf_counter()
        sol = solve(problem, parse_constraint("box:0,1"))
        seconds = time.perf_counter() - t
        print(f"| {n} | {seconds:.2f} | {sol.solver} | {sol.certificate.certified()} |")


FACTORY = """
from transformers import LlamaConfig, LlamaForCausalLM

def make():
    cfg = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)
"""


def torchrun_part(procs: list[int]) -> None:
    import torch
    from safetensors.torch import save_file

    work = Path(tempfile.mkdtemp(prefix="mergeqp-scaling-"))
    (work / "factory.py").write_text(textwrap.dedent(FACTORY))
    ns: dict = {}
    exec(compile(textwrap.dedent(FACTORY), "factory.py", "exec"), ns)  # noqa: S102
    torch.manual_seed(0)
    base = ns["make"]().eval()
    layer = "model.layers.2.mlp.down_proj"
    save_file({k: v.contiguous() for k, v in base.state_dict().items()}, str(work / "base.safetensors"))
    gen = torch.Generator().manual_seed(1)
    for k in range(2):
        sd = {n: v.clone().contiguous() for n, v in base.state_dict().items()}
        sd[f"{layer}.weight"] += 0.3 * sd[f"{layer}.weight"].std() * torch.randn(sd[f"{layer}.weight"].shape,
                                                                                  generator=gen)
        save_file(sd, str(work / f"ft{k}.safetensors"))
        torch.save(torch.randint(0, 32, (64, 16), generator=gen), work / f"cal{k}.pt")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print("| processes | wall seconds (with start-up) | collection seconds (rank 0) | speed-up (collection) |")
    print("|---|---|---|---|")
    first = None
    for p in procs:
        cmd = [torchrun, "--standalone", "--nproc-per-node", str(p), "-m", "mergeqp", "collect",
               "--factory", f"{work / 'factory.py'}:make", "--base", str(work / "base.safetensors"),
               "--finetuned", str(work / "ft0.safetensors"), str(work / "ft1.safetensors"), "--layer", layer,
               "--calibration", str(work / "cal0.pt"), str(work / "cal1.pt"), "--batch-size", "4",
               "--parametrisation", "rows", "--out", str(work / f"s{p}.npz"),
               "--quiet"]
        t = time.perf_counter()
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        wall = time.perf_counter() - t
        seconds = float(re.search(r"collected in ([0-9.]+) s", out.stdout).group(1))
        first = first or seconds
        print(f"| {p} | {wall:.1f} | {seconds:.1f} | {first / seconds:.2f} |")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", nargs="+", default=["statistics", "solve", "torchrun"],
                        choices=["statistics", "solve", "torchrun"])
    parser.add_argument("--sizes", type=int, nargs="+", default=[500, 1000, 2000, 4000])
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    print(json.dumps({"threads": os.environ.get("OMP_NUM_THREADS"), "cores": os.cpu_count()}))
    if "statistics" in args.part:
        statistics_part()
    if "solve" in args.part:
        solve_part(args.sizes)
    if "torchrun" in args.part:
        torchrun_part(args.procs)


if __name__ == "__main__":
    main()
