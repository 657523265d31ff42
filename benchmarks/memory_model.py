"""The memory model (:mod:`mergeqp.io.memory`) against measured peak memory, at three site sizes.

Run::

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/memory_model.py [--sizes 500 1000 1400]

For each size ``I`` a fresh process builds a random float32 Llama (hidden 64, 2 blocks, MLP width
``I``) and two fine-tunes perturbed at ``model.layers.1.mlp.up_proj`` (``r = I`` rows), computes
the fine-tunes' targets on 8 random prompts of ``--tokens`` 16 tokens (batches of ``--batch`` 4,
compared output: a projection of the logits with k = 8, so ``c = 128`` per prompt; with
``--tokens 2 --batch 1`` the ``n x n`` matrices dominate instead of the atoms' tangents), then -- the part measured --
collects the site's first-order statistics with per-row atoms (``n = K r = 2 I`` coefficients,
:func:`~mergeqp.merge.firstorder.collect_first_order`; ``--jacobian-mode reverse``: by ``c`` VJPs,
the site's per-sample Jacobian instead of the atoms' tangents), builds the QP and solves it in the box
``[0, 1]`` (``solver: auto``), as one step of ``mergeqp merge`` does. The peak is the process's
resident-set high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs`` just before the
measured part) minus the resident set at that moment; the estimate is
:func:`~mergeqp.io.memory.estimate_site_memory` ``.peak``. Prints a markdown table with the ratio
estimate / measured (the goal: within 30%). Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

K = 2
HIDDEN = 64
PROMPTS, PROJECTION_K = 8, 8
LAYER = "model.layers.1.mlp.up_proj"
CHUNK = 256  # atoms per vectorised JVP (the merge's default chunk_size)


def _status(key: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def measure(width: int, tokens: int = 16, batch: int = 4, jacobian_mode: str = "forward") -> dict:
    """One size, in this process: estimate and measured peak (bytes) of statistics + solve."""
    import gc

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from mergeqp.constraints import parse_constraint
    from mergeqp.io.calibration import tensor_batches
    from mergeqp.io.memory import estimate_site_memory
    from mergeqp.lm import OutputSpec, backbone, teacher_forced_targets
    from mergeqp.merge.firstorder import SiteAtoms, TaskTargets, collect_first_order, widest_layer
    from mergeqp.merge.sites import match_sites, model_sites, read_augmented
    from mergeqp.solvers import solve
    from mergeqp.stats.parametrisation import as_parametrisation

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=HIDDEN, intermediate_size=width, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "eager"  # forward-mode derivatives need the eager attention
    base = LlamaForCausalLM(cfg).eval()
    site = match_sites(model_sites(base), [LAYER])[0]
    fts = []
    for k in range(K):
        ft = LlamaForCausalLM(cfg).eval()
        ft.load_state_dict(base.state_dict())
        with torch.no_grad():
            w = dict(ft.named_parameters())[f"{LAYER}.weight"]
            w.add_(0.3 * float(w.std()) * torch.randn(w.shape, generator=torch.Generator().manual_seed(k + 1)))
        fts.append(ft)
    ids = torch.randint(0, 128, (PROMPTS, tokens), generator=torch.Generator().manual_seed(9))
    batches = tensor_batches({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, range(PROMPTS), batch)
    spec = OutputSpec("logits", "projection", PROJECTION_K, 0)
    tasks = [TaskTargets(f"t{k}", 1.0, teacher_forced_targets(ft, batches, spec, "cpu")) for k, ft in enumerate(fts)]
    W0 = read_augmented(base, site)
    deltas = torch.stack([read_augmented(ft, site) - W0 for ft in fts])
    atoms = [SiteAtoms(site, as_parametrisation("rows"), deltas)]
    del fts
    gc.collect()
    n = K * atoms[0].n_atoms
    outputs = tokens * PROJECTION_K
    estimate = estimate_site_memory(site.name, n, len(tasks), samples=batch, outputs=outputs, itemsize=4,
                                    positions=tokens, site_width=site.r, chunk=CHUNK,
                                    widest=widest_layer(backbone(base)),
                                    **({"tangent_atoms": 0, "jacobian_width": site.r} if jacobian_mode == "reverse" else {}))

    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    t = time.perf_counter()
    stats = collect_first_order(base, atoms, tasks, spec, energy=False, chunk_size=CHUNK, jacobian_mode=jacobian_mode)
    t_stats = time.perf_counter() - t
    t = time.perf_counter()
    solution = solve(stats.problem(), parse_constraint("box:0,1"))
    t_solve = time.perf_counter() - t
    peak = _status("VmHWM") - before
    return {"width": width, "n": n, "estimate": estimate.peak, "statistics": estimate.statistics,
            "batch": estimate.batch, "solve": estimate.solve, "measured": peak,
            "seconds_statistics": t_stats, "seconds_solve": t_solve, "solver": solution.solver}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[500, 1000, 1400], help="MLP widths I (n = 2 I)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per prompt")
    parser.add_argument("--batch", type=int, default=4, help="prompts per batch")
    parser.add_argument("--jacobian-mode", choices=("forward", "reverse"), default="forward",
                        help="derivatives by the atoms' JVPs (forward) or the outputs' VJPs (reverse)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(measure(args.child, args.tokens, args.batch, args.jacobian_mode)))
        return
    rows = []
    for width in args.sizes:  # a fresh process per size: its high-water mark is its own
        out = subprocess.run([sys.executable, __file__, "--child", str(width), "--tokens", str(args.tokens),
                              "--batch", str(args.batch), "--jacobian-mode", args.jacobian_mode], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print("| n | statistics (MB) | batch (MB) | solve (MB) | estimate (MB) | measured peak (MB) | "
          "estimate / measured | statistics s | solve s (solver) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mb = lambda b: f"{b / 1e6:.0f}"  # noqa: E731
        print(f"| {r['n']} | {mb(r['statistics'])} | {mb(r['batch'])} | {mb(r['solve'])} | {mb(r['estimate'])} | "
              f"{mb(r['measured'])} | {r['estimate'] / r['measured']:.2f} | {r['seconds_statistics']:.1f} | "
              f"{r['seconds_solve']:.1f} ({r['solver']}) |")


if __name__ == "__main__":
    main()
