"""The MNIST experiment's :class:`~.models.MLP` as a Hugging Face model, so that the run layer's
merges (``mergeqp merge``'s ``method: auto`` above all) run on it exactly as on a library model.

:class:`MlpForClassification` holds the same ``layer1..layer3`` modules (the state-dict keys are
the MLP's), reads ``pixel_values`` ``(B, d_in)`` and returns ``logits``; it is registered with
:func:`mergeqp.run.architectures.register_architecture` on import. :func:`save_mlp` writes an
:class:`~.models.MLP` as such a folder, :func:`to_mlp` turns a merged one back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput

from ..run.architectures import register_architecture
from .models import MLP


class MlpConfig(PretrainedConfig):
    """The sizes of :class:`~.models.MLP`."""

    model_type = "mergeqp-mnist-mlp"

    def __init__(self, d_in: int = 784, h1: int = 256, h2: int = 128, n_classes: int = 10, **kwargs: Any):
        self.d_in, self.h1, self.h2, self.n_classes = d_in, h1, h2, n_classes
        super().__init__(**kwargs)


class MlpForClassification(PreTrainedModel):
    """:class:`~.models.MLP` in the Hugging Face format (``pixel_values`` -> ``logits``)."""

    config_class = MlpConfig
    base_model_prefix = "mlp"
    main_input_name = "pixel_values"

    def __init__(self, config: MlpConfig):
        super().__init__(config)
        self.layer1 = nn.Linear(config.d_in, config.h1)
        self.layer2 = nn.Linear(config.h1, config.h2)
        self.layer3 = nn.Linear(config.h2, config.n_classes)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """Weights come from the checkpoint; the modules keep torch's initialisation until then."""

    def forward(self, pixel_values: torch.Tensor, **_: Any) -> SequenceClassifierOutput:
        h = torch.relu(self.layer1(pixel_values))
        h = torch.relu(self.layer2(h))
        return SequenceClassifierOutput(logits=self.layer3(h))


register_architecture(MlpForClassification)


def save_mlp(model: MLP, folder: str | Path) -> Path:
    """Write ``model`` (its dtype kept) as a Hugging Face folder of :class:`MlpForClassification`."""
    config = MlpConfig(d_in=model.layer1.in_features, h1=model.layer1.out_features,
                       h2=model.layer2.out_features, n_classes=model.layer3.out_features,
                       architectures=[MlpForClassification.__name__])
    dtype = next(model.parameters()).dtype
    hf = MlpForClassification(config).to(dtype)
    hf.load_state_dict(model.state_dict())
    hf.save_pretrained(str(folder))
    return Path(folder)


def to_mlp(model: Any) -> MLP:
    """A :class:`~.models.MLP` with the weights (and dtype) of an :class:`MlpForClassification`."""
    c = model.config
    mlp = MLP(d_in=c.d_in, h1=c.h1, h2=c.h2, n_classes=c.n_classes).to(next(model.parameters()).dtype)
    mlp.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
    return mlp.eval()


__all__ = ["MlpConfig", "MlpForClassification", "save_mlp", "to_mlp"]
