"""``lazy: true`` against a resident merge: peak memory and time of the same merge, and the result.

Run::

    PYTHONPATH=. python benchmarks/lazy_memory.py [--layers 32] [--hidden 512] [--work DIR]

Builds a random float32 Llama whose weights dominate its memory (``--layers`` blocks of hidden
size ``--hidden``, MLP width 2.75x, a 256-token vocabulary, so the activations of the statistics
are small next to the weights), two fine-tunes that differ from it in the last block's MLP, and
8 random prompts of 16 tokens each (a tensor file of ``input_ids``), then runs the same
``mergeqp merge`` (``mode: single`` over the last block's ``down_proj``, rows, box [0, 1]) twice
in fresh processes: resident and ``lazy: true``. The peak is sampled every 20 ms from
``/proc/PID/status`` as ``RssAnon + RssFile`` (anonymous memory plus mapped file pages: a
resident ``from_pretrained`` model is file-backed). Prints a markdown table and checks that the
two merged checkpoints are equal. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml


def build(work: Path, layers: int, hidden: int) -> dict[str, Path]:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=int(2.75 * hidden),
                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                      max_position_embeddings=64, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(work / "base")
    last = layers - 1
    folders = {"base": work / "base"}
    for k in range(2):
        gen = torch.Generator().manual_seed(100 + k)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.startswith(f"model.layers.{last}.mlp."):
                    p.add_(torch.randn(p.shape, generator=gen) * 0.3 * float(p.std()))
        model.save_pretrained(work / f"ft{k}")
        folders[f"ft{k}"] = work / f"ft{k}"
        model = LlamaForCausalLM.from_pretrained(str(work / "base"))
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))
    save_file({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, str(work / "inputs.safetensors"))
    return folders


def config(work: Path, folders: dict[str, Path], layers: int, lazy: bool) -> Path:
    cfg = {"base": str(folders["base"]),
           "models": [{"path": str(folders[f"ft{k}"]), "calibration": str(work / "inputs.safetensors")}
                      for k in range(2)],
           "layers": [f"model.layers.{layers - 1}.mlp.down_proj"],
           "method": {"name": "qp", "mode": "single", "parametrisation": "rows"},
           "calibration": {"batch_size": 4, "holdout": 0}, "output": {"restrict": "topk", "k": 8},
           "device": "cpu", "max_shard_size": "64MB", "lazy": lazy}
    path = work / f"{'lazy' if lazy else 'resident'}.yml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def measure(path: Path, out: Path) -> tuple[float, float, float]:
    """``(peak MB, peak anonymous MB, seconds)`` of one merge in a fresh process."""
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "mergeqp", "merge", str(path), "--out", str(out), "--overwrite"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = anon_peak = 0.0
    status = Path(f"/proc/{proc.pid}/status")
    while proc.poll() is None:
        try:
            fields = {line.split(":")[0]: line.split()[1] for line in status.read_text().splitlines()
                      if line.startswith(("RssAnon", "RssFile"))}
        except (OSError, IndexError):
            break
        anon, file = int(fields.get("RssAnon", 0)) / 1024, int(fields.get("RssFile", 0)) / 1024
        peak, anon_peak = max(peak, anon + file), max(anon_peak, anon)
        time.sleep(0.02)
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        raise SystemExit(f"merge {path} failed ({proc.returncode}):\n{err[-2000:]}")
    return peak, anon_peak, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--work", default=None)
    args = ap.parse_args()
    import torch

    import mergeqp

    work = Path(args.work or tempfile.mkdtemp(prefix="lazy-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    folders = build(work, args.layers, args.hidden)
    size = mergeqp.open_checkpoint(folders["base"]).total_bytes / 2**20
    rows = []
    for lazy in (False, True):
        rows.append((lazy, *measure(config(work, folders, args.layers, lazy), work / f"out_{lazy}")))
    a, b = mergeqp.open_checkpoint(work / "out_False"), mergeqp.open_checkpoint(work / "out_True")
    diff = max(float((a.get(n) - b.get(n)).abs().max()) for n in a.names())
    print(f"model: {args.layers} blocks, hidden {args.hidden}, {size:.0f} MiB of float32 weights; torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| merge | peak RSS (anon + file) MiB | peak anonymous MiB | seconds |")
    print("|---|---|---|---|")
    for lazy, peak, anon, sec in rows:
        print(f"| {'lazy' if lazy else 'resident'} | {peak:.0f} | {anon:.0f} | {sec:.1f} |")
    print(f"\nlargest difference between the two merged checkpoints: {diff:.3g}")


if __name__ == "__main__":
    main()
