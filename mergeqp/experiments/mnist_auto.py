"""``auto``: the MNIST experiment's merge by ``mergeqp merge``'s own default, ``method: auto``.

The base and fine-tuned MLPs are written as Hugging Face folders (:mod:`.hf_mlp`, a registered
architecture) with each task's calibration digits as a ``pixel_values`` tensor file, and merged
by :func:`mergeqp.run.run_merge` from a config with no ``method`` key (or the experiment's
``auto_method`` block): the start chosen among the candidates by k-fold cross-validation over the
calibration batches, then the trust-region QP over the merged layer (docs/hf.md, "The
recommended merge"). Every calibration digit is fitted (``evaluate: false``: the run holds none
out for its own metrics); the test digits are never seen. The merged folder is read back as an
:class:`~.models.MLP` and returned with the run's report (start selection, trust-region steps).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..io.atomic import save_safetensors
from ..run.pipeline import run_merge
from ..run.schema import MergeConfig
from .hf_mlp import MlpForClassification, save_mlp, to_mlp
from .models import MLP


@dataclass(frozen=True, eq=False)
class AutoMerge:
    """The merged model, the run's ``report.json`` mapping, the wall time of the run and the
    config's ``method`` block (``None``: the config had none, i.e. the default ``method: auto``)."""

    model: MLP
    report: dict[str, Any]
    seconds: float
    method: dict[str, Any] | None = None

    @property
    def start_objective(self) -> float:
        """The chosen start's true calibration error (the run's objective at its start)."""
        return float(self.report["evaluation"]["start"]["calibration_objective"])

    @property
    def objective(self) -> float:
        """The result's true calibration error."""
        return float(self.report["evaluation"]["merged"]["calibration_objective"])

    def to_dict(self) -> dict[str, Any]:
        tr = self.report.get("trust_region") or {}
        return {"method": self.method if self.method is not None else "auto (no method key: the default)",
                "seconds": self.seconds,
                "start": self.report["evaluation"]["start"].get("method"),
                "start_params": self.report["evaluation"]["start"].get("params"),
                "start_objective": self.start_objective, "objective": self.objective,
                "start_selection": self.report.get("start_selection"),
                "trust_region": {k: tr.get(k) for k in ("n_steps", "n_accepted", "stop_reason", "holdout")},
                "notes": list(self.report.get("notes") or [])}


def auto_merge(base: MLP, finetuned: Sequence[MLP], task_names: Sequence[str], calibration: Sequence[Any],
               layers: Sequence[str], *, method: Mapping[str, Any] | None = None, batch_size: int = 10,
               seed: int = 0, progress: bool = False) -> AutoMerge:
    """Merge ``finetuned`` into ``base`` at ``layers`` through the run layer (module docstring).
    ``calibration``: each task's calibration inputs ``(N_k, d_in)`` (the models' dtype);
    ``method``: a config ``method`` block (``None``: the config has none, so ``method: auto``
    with its defaults); ``batch_size``: calibration digits per batch (the folds are made of
    batches)."""
    import torch  # deferred: heavy

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mergeqp-mnist-auto-") as tmp:
        root = Path(tmp)
        save_mlp(base, root / "base")
        models = []
        for k, (name, model, x) in enumerate(zip(task_names, finetuned, calibration, strict=True)):
            save_mlp(model, root / f"model{k}")
            save_safetensors({"pixel_values": x.contiguous()}, str(root / f"calibration{k}.safetensors"))
            models.append({"name": name, "path": str(root / f"model{k}"),
                           "calibration": str(root / f"calibration{k}.safetensors")})
        config: dict[str, Any] = {"base": str(root / "base"), "models": models, "layers": list(layers),
                                  "calibration": {"batch_size": batch_size, "holdout": 0},
                                  "dtype": "float64", "device": "cpu", "evaluate": False, "seed": seed}
        if method is not None:
            config["method"] = dict(method)
        log = None
        if progress:
            from tqdm.auto import tqdm  # deferred: only a run with progress prints

            log = lambda msg: tqdm.write(f"auto: {msg}")  # noqa: E731 - the run's messages, prefixed
        result = run_merge(MergeConfig(**config), root / "merged", progress=progress, log=log)
        # the written checkpoint, read back: what a user of the merged folder gets
        merged = to_mlp(MlpForClassification.from_pretrained(str(root / "merged"), dtype=torch.float64))
        report = result.report
    return AutoMerge(merged, report, time.perf_counter() - t0, None if method is None else dict(method))


__all__ = ["AutoMerge", "auto_merge"]
