"""Statistics at language-model scale: cost and approximation quality of the output options.

Run (seeded, reproducible up to timing noise)::

    PYTHONPATH=. OMP_NUM_THREADS=2 python benchmarks/lm_statistics.py \\
        --model /tmp/mqcache/smollm2-135m-instruct --work /tmp/lmstats

What it does, on a Llama-style Hugging Face causal LM (float32):

1. Three fake fine-tunes: the base with seeded Gaussian noise (``--noise`` x each weight's std)
   on the MLP weights of the ``--layers`` blocks (default the last two), written as HF folders under
   ``--work``/``blocks-...`` (reused when present; the statistics swap those weights into one live
   model instead of loading copies).
2. ``--prompts`` calibration prompts of at most ``--tokens`` tokens (paragraphs of this
   repository's docs), in batches of ``--batch``.
3. Per site (per-row atoms, K = 3 -> 3 r atoms): the time of one forward pass and of one
   forward + JVP pass of the model along one tangent at the site (the issue's yardstick), and
   of the first-order statistics (``collect_first_order``, ``energy=False``) for each output
   option (``--options`` picks a subset); before / after on the first prompt only
   (``--before-tokens`` tokens, ``projection`` with ``--small-k``): the unfolded logits (slow:
   every JVP crosses the ``V x H`` head; ``--skip-before`` leaves it out) and the folded head.
4. Quality: ``J(d)`` of every option's QP at the soup, task arithmetic (``d = 0.3``), a seeded
   random point of the box, and each option's own box-constrained optimum, against the exact
   objective (the nonlinear full-vocabulary calibration squared error of the merged model;
   ``2 sum KL`` for the KL metric; both recomputed from the merged weights).
5. ``--prefix``: the statistics timed as the run layer runs them (the blocks below the site
   computed once per batch, :func:`mergeqp.stats.prefix.frozen_prefix`); the yardstick stays a
   full forward + JVP (or VJP, where forward-mode AD is not implemented) pass.

Prints one table per site (markdown). Nothing here is a unit test; timings on a shared machine
are noisy, so before / after are measured in the same process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import numpy as np
import torch
from torch.func import jvp, vjp

from mergeqp.io.calibration import load_tokenizer, tokenize_batches
from mergeqp.lm import OutputSpec, teacher_forced_targets
from mergeqp.merge.firstorder import SiteAtoms, TaskTargets, collect_first_order
from mergeqp.merge.sites import match_sites, model_sites
from mergeqp.solvers import solve
from mergeqp.stats.hooks import hooked_layers
from mergeqp.stats.prefix import frozen_prefix
from mergeqp.stats.parametrisation import as_parametrisation

K = 3


def prompts_from_docs(n: int) -> list[str]:
    root = Path(__file__).resolve().parents[1]
    paras = []
    for p in sorted((root / "docs").glob("*.md")) + [root / "README.md"]:
        paras += [s.strip().replace("\n", " ") for s in p.read_text().split("\n\n") if len(s.strip()) > 200]
    return paras[:n]


def fake_finetunes(model, work: Path, layers: list[int], noise: float) -> list[dict[str, torch.Tensor]]:
    """``K`` perturbed copies of the given blocks' MLP weights (``{name: tensor}``), saved as HF folders."""
    out = []
    for k in range(K):
        gen = torch.Generator().manual_seed(100 + k)
        weights = {}
        for name, p in model.named_parameters():
            if any(name.startswith(f"model.layers.{i}.mlp.") for i in layers):
                weights[name] = p.detach() + noise * float(p.std()) * torch.randn(p.shape, generator=gen)
        out.append(weights)
        folder = work / f"ft{k}"
        if not (folder / "config.json").exists():
            original = {n: p.detach().clone() for n, p in model.named_parameters() if n in weights}
            swap(model, weights)
            model.save_pretrained(str(folder))
            swap(model, original)
    return out


def swap(model, weights: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, w in weights.items():
            params[n].copy_(w)


def timed(fn, repeat: int = 1) -> tuple[float, object]:
    best, value = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - t)
    return best, value


def pass_times(model, batches, module) -> tuple[float, float, str]:
    """Seconds of one forward pass and of one forward + JVP pass (one tangent at ``module``'s
    output, full logits) over all ``batches``, and which derivative pass was timed: ``"JVP"``, or
    ``"VJP"`` (a forward + one vector-Jacobian product with a random cotangent on the logits) where
    forward-mode AD is not implemented between the site and the logits (PyTorch's CPU
    scaled-dot-product attention, for a site below an attention layer)."""
    fwd = jv = 0.0
    kind = "JVP"
    with hooked_layers(model, [module]) as (hook,):
        for b in batches:
            inputs = b.inputs
            fwd += timed(lambda: model(**inputs).logits, 2)[0]
            hook.record = True
            with torch.no_grad():
                model(**inputs)
            hook.record = False
            u = hook.layer_output
            v = torch.randn_like(u)

            def f(p):
                hook.perturbation = p
                try:
                    return model(**inputs).logits
                finally:
                    hook.perturbation = None

            def reverse():
                out, pullback = vjp(f, torch.zeros_like(u))
                return pullback(torch.randn_like(out))[0]

            if kind == "JVP":
                try:
                    jv += timed(lambda: jvp(f, (torch.zeros_like(u),), (v,))[1], 2)[0]
                    continue
                except NotImplementedError:
                    if jv:
                        raise  # forward AD worked on an earlier batch of the same model: not this case
                    kind = "VJP"
            jv += timed(reverse, 2)[0]
    return fwd, jv, kind


def exact_objectives(model, site, base_w, deltas, d, batches, fts):
    """The merged model's exact calibration squared error over the full logits and its ``2 sum KL``."""
    param = as_parametrisation("rows")
    module = dict(model.named_modules())[site.name]
    merged = base_w + torch.from_numpy(param.update(d, deltas.numpy())).to(base_w.dtype)
    sq = kl = 0.0
    with torch.no_grad():
        module.weight.copy_(merged)
        for b in batches:
            x = model(**b.inputs).logits.double()
            m = b.mask.bool()
            for ft in fts:
                y = ft[id(b)]  # the fine-tune's full logits
                sq += float(((x - y)[m] ** 2).sum())
                log_p, log_q = torch.log_softmax(y[m], -1), torch.log_softmax(x[m], -1)
                kl += 2.0 * float((log_p.exp() * (log_p - log_q)).sum())
        module.weight.copy_(base_w)
    return sq, kl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="/tmp/mqcache/smollm2-135m-instruct")
    ap.add_argument("--work", default="/tmp/lmstats")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--noise", type=float, default=0.05)
    ap.add_argument("--layers", type=int, nargs="+", default=None,
                    help="the blocks whose down_proj is a site, and whose MLPs the fake fine-tunes perturb "
                         "(default: the model's last two, last first; 29 28 on SmolLM2-135M)")
    ap.add_argument("--before-batches", type=int, default=1)
    ap.add_argument("--before-tokens", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--sketch", type=int, default=64)
    ap.add_argument("--small-k", type=int, default=None, help="k of the first-batch before/after rows (default --k)")
    ap.add_argument("--skip-before", action="store_true", help="only the folded first-batch row (the unfolded one is slow)")
    ap.add_argument("--prefix", action="store_true",
                    help="time the statistics as the run layer runs them: the blocks below the site computed once "
                         "per batch (mergeqp.stats.prefix.frozen_prefix); the yardstick stays a full pass")
    ap.add_argument("--json", default=None)
    ap.add_argument("--options", type=json.loads, default={},
                    help='JSON {layer: [option indices]} to run a subset, e.g. \'{"28": [4, 6]}\'')
    args = ap.parse_args()
    args.options = {int(a): set(b) for a, b in args.options.items()}
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM  # deferred: heavy

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    tok = load_tokenizer(Path(args.model))
    blocks = int(model.config.num_hidden_layers)
    if args.layers is None:
        args.layers = [blocks - 1, blocks - 2] if blocks >= 2 else [0]
    bad = [i for i in args.layers if not 0 <= i < blocks]
    if bad:  # (a review of stop 75: the blocks were 28 and 29 whatever the model, a KeyError on smaller ones)
        ap.error(f"--layers {bad}: the model has {blocks} blocks (0 to {blocks - 1})")
    # (the fine-tunes' folder names the perturbed blocks: folders made for other blocks are not reused)
    fts = fake_finetunes(model, work / ("blocks-" + "-".join(str(i) for i in sorted(set(args.layers)))),
                         sorted(set(args.layers)), args.noise)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if n in fts[0]}
    texts = prompts_from_docs(args.prompts)
    batches = tokenize_batches(tok, texts, args.tokens, args.batch)
    small = tokenize_batches(tok, texts[:1], args.before_tokens, 1)[: args.before_batches]
    results = {}
    for layer in args.layers:
        name = f"model.layers.{layer}.mlp.down_proj"
        site = match_sites(model_sites(model), [name])[0]
        module = dict(model.named_modules())[name]
        base_w = module.weight.detach().clone()
        deltas = torch.stack([ft[name + ".weight"] - base_w for ft in fts]).double()
        atoms = [SiteAtoms(site, as_parametrisation("rows"), deltas)]
        t_fwd, t_jvp, pass_kind = pass_times(model, batches, module)
        t_fwd_small, t_jvp_small, _ = pass_times(model, small, module)
        k, s_ = args.k, args.sketch
        options = {  # label: (spec, jacobian mode)
            "none (folded), forward": (OutputSpec(fold_head=True), "forward"),
            f"projection k={k}, forward": (OutputSpec(restrict="projection", k=k, fold_head=True), "forward"),
            f"topk k={k}, forward": (OutputSpec(restrict="topk", k=k, fold_head=True), "forward"),
            f"kl topk k={k}, forward": (OutputSpec(restrict="topk", k=k, metric="kl", fold_head=True), "forward"),
            f"none (folded) + sketch {s_}, reverse": (OutputSpec(fold_head=True, sketch=s_), "reverse"),
            f"projection k={k} + sketch {s_}, reverse": (OutputSpec(restrict="projection", k=k, fold_head=True,
                                                                    sketch=s_), "reverse"),
            f"kl topk k={k} + sketch {s_}, reverse": (OutputSpec(restrict="topk", k=k, metric="kl", fold_head=True,
                                                                 sketch=s_), "reverse"),
        }
        wanted = args.options.get(layer)
        if wanted is not None:
            options = {lb: v for i, (lb, v) in enumerate(options.items()) if i in wanted}
        rows = []

        def targets(spec, on):
            tasks = []
            for i, ft in enumerate(fts):
                swap(model, ft)
                tasks.append(TaskTargets(f"ft{i}", 1.0, teacher_forced_targets(model, on, spec, "cpu")))
                swap(model, base)
            return tasks

        # before / after on the first batch: projection k, forward mode, unfolded then folded
        kb = args.small_k or k
        for label, fold in (("before: projection k=%d unfolded, forward (first batch)" % kb, False),
                            ("after: projection k=%d folded, forward (first batch)" % kb, True)):
            if args.skip_before and not fold:
                continue
            spec = OutputSpec(restrict="projection", k=kb, fold_head=fold)
            tasks = targets(spec, small)
            t, _ = timed(lambda: collect_first_order(model, atoms, tasks, spec, chunk_size=args.chunk,
                                                     jacobian_mode="forward", energy=False))
            rows.append({"option": label, "seconds": t, "x_fwd_jvp": t / t_jvp_small})
            print(json.dumps(rows[-1]), flush=True)
        # full-logit targets of every fine-tune (for the exact objectives)
        full = [{} for _ in fts]
        for i, ft in enumerate(fts):
            swap(model, ft)
            with torch.no_grad():
                for b in batches:
                    full[i][id(b)] = model(**b.inputs).logits.double()
            swap(model, base)
        rng = np.random.default_rng(0)
        n_atoms = int(base_w.shape[0])
        points = {"soup": np.full((K, n_atoms), 1.0 / K), "TA 0.3": np.full((K, n_atoms), 0.3),
                  "random": rng.uniform(0.0, 1.0, (K, n_atoms))}
        exact_at = {p: exact_objectives(model, site, base_w, deltas, d, batches, full) for p, d in points.items()}
        print(json.dumps({"exact": exact_at}), flush=True)
        for label, (spec, mode) in options.items():
            tasks = targets(spec, batches)
            with frozen_prefix(model, [module]) if args.prefix else contextlib.nullcontext():
                t, stats = timed(lambda: collect_first_order(model, atoms, tasks, spec, chunk_size=args.chunk,
                                                             jacobian_mode=mode, energy=False))
            qp = stats.problem()
            row = {"option": label, "seconds": t, "x_fwd_jvp": t / t_jvp}
            which = 1 if spec.metric == "kl" else 0
            for p, d in points.items():
                row[f"relerr J({p})"] = qp.objective(d) / exact_at[p][which] - 1.0
            sol = solve(qp, "box:0,1")
            d_opt = np.asarray(sol.d).reshape(K, n_atoms)
            exact_opt = exact_objectives(model, site, base_w, deltas, d_opt, batches, full)[which]
            row["relerr J(opt)"] = qp.objective(d_opt) / exact_opt - 1.0
            row["exact(opt)/exact(soup)"] = exact_opt / exact_at["soup"][which]
            rows.append(row)
            print(json.dumps(row), flush=True)
        results[name] = {"forward_s": t_fwd, "forward_jvp_s": t_jvp, "derivative_pass": pass_kind,
                         "forward_small_s": t_fwd_small,
                         "forward_jvp_small_s": t_jvp_small, "exact": exact_at, "rows": rows}
        print(f"\n### {name}: {len(batches)} batches of <= {args.batch} x {args.tokens} tokens; "
              f"forward {t_fwd:.2f} s, forward+{pass_kind} {t_jvp:.2f} s (first batch: {t_jvp_small:.2f} s; "
              f"the column x_fwd_jvp divides by forward+{pass_kind})\n")
        keys = list(dict.fromkeys(k for r in rows for k in r))
        print("| " + " | ".join(keys) + " |")
        print("|" + "---|" * len(keys))
        for r in rows:
            print("| " + " | ".join(f"{r[k]:.3g}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
