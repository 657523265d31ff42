"""The model classes a merge can load: ``transformers``' own, and ones a user registers.

A Hugging Face folder names its class in ``config.json`` (``"architectures": ["LlamaForCausalLM"]``).
:func:`architecture_class` returns the class registered under that name with
:func:`register_architecture` first, then the ``transformers`` class of that name. A registered
class is any ``transformers.PreTrainedModel`` subclass with a ``config_class`` (so a custom torch
model in the Hugging Face format -- ``save_pretrained`` / ``from_pretrained`` -- is merged like a
library one, from Python or from a YAML config run through :func:`mergeqp.run_merge`)::

    class MyConfig(PretrainedConfig): model_type = "my-mlp"
    class MyModel(PreTrainedModel): config_class = MyConfig; ...
    mergeqp.register_architecture(MyModel)

:func:`lower_blocks` and :func:`every_block` say which blocks of a model stay on disk with
``lazy: true`` (:mod:`mergeqp.io.lazy_model`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import OWN_ENTRY_HINT, ConfigError, ValidationError
from ..merge.sites import site_module
from ..stats.prefix import block_stack, first_site_block

#: class name (as ``config.json`` lists it) -> a registered model class
ARCHITECTURES: dict[str, Any] = {}


def register_architecture(cls: Any, name: str | None = None) -> Any:
    """Register a ``transformers.PreTrainedModel`` subclass under ``name`` (default: its class
    name, which ``save_pretrained`` writes to ``config.json``). Returns ``cls`` (usable as a class
    decorator). Re-registering a name replaces the entry."""
    config_class = getattr(cls, "config_class", None)
    if not isinstance(cls, type) or not callable(getattr(cls, "from_pretrained", None)) or config_class is None \
            or not callable(getattr(config_class, "from_pretrained", None)):
        raise ValidationError(f"register_architecture: {cls!r} is not a model class with from_pretrained and a "
                              "config_class (a transformers.PreTrainedModel subclass)")
    ARCHITECTURES[name or cls.__name__] = cls
    return cls


def architecture_class(config: dict[str, Any] | None, where: str) -> Any:
    """The class named by ``config["architectures"][0]``: a registered one, else the
    ``transformers`` class of that name (``AutoModel`` if the config names none)."""
    import transformers  # optional heavy dependency, imported on first use (importing mergeqp stays light)

    archs = (config or {}).get("architectures") or []
    if archs:
        cls = ARCHITECTURES.get(archs[0]) or getattr(transformers, archs[0], None)
        if cls is None:
            known = f"; registered: {', '.join(sorted(ARCHITECTURES))}" if ARCHITECTURES else ""
            raise ConfigError(f"{where}: architecture {archs[0]!r} is not known to transformers "
                              f"{transformers.__version__} and not registered with "
                              f"mergeqp.register_architecture{known}; {OWN_ENTRY_HINT}")
        return cls
    return transformers.AutoModel


def model_config(folder: Path, config: dict[str, Any] | None) -> Any:
    """The config object of the model in ``folder`` (its ``config.json`` already read as
    ``config``): through the registered class's ``config_class`` where the architecture is
    registered (``AutoConfig`` does not know its ``model_type``), else ``AutoConfig``."""
    from transformers import AutoConfig  # optional heavy dependency, imported on first use

    archs = (config or {}).get("architectures") or []
    architecture_class(config, str(folder))  # an unknown class is named here, not by AutoConfig's model_type
    loader = ARCHITECTURES[archs[0]].config_class if archs and archs[0] in ARCHITECTURES else AutoConfig
    try:
        return loader.from_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"cannot read the model config of {folder}: {exc}") from None


def causal_lm_obstacle(config: Any) -> str | None:
    """Why a model config (a ``PretrainedConfig`` or its ``config.json`` as a dict) is not a causal
    language model (``None``: it is, or its config cannot tell): an encoder family (one with a
    masked-LM head, e.g. BERT) not configured as a decoder (``is_decoder``: its attention would see
    the tokens it predicts), or saved architectures none of which predicts next tokens
    (``...ForCausalLM``, ``...LMHeadModel``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    def read(key: str, default: Any = None) -> Any:
        return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)

    model_type = read("model_type")
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not read("is_decoder", False):
        return f"model_type {model_type!r} is an encoder with bidirectional attention (is_decoder is false)"
    archs = list(read("architectures") or [])
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return f"its architectures are {archs}, none a ...ForCausalLM or ...LMHeadModel"
    return None


def lower_blocks(sites: Sequence[Any]) -> Callable[[Any], list[Any]]:
    """``blocks(model)`` for :func:`load_lazy`: the blocks below the lowest one holding a site
    (the frozen prefix), none when a site lies outside the block stack."""
    def blocks(model: Any) -> list[Any]:
        stack = block_stack(model)
        first = first_site_block(stack, [site_module(model, s) for s in sites]) if stack is not None else None
        return list(stack)[:first] if first else []
    return blocks


def every_block(model: Any) -> list[Any]:
    """``blocks(model)`` for :func:`load_lazy`: the whole block stack (a model only run forward)."""
    stack = block_stack(model)
    return list(stack) if stack is not None else []


__all__ = ["ARCHITECTURES", "architecture_class", "causal_lm_obstacle", "every_block", "lower_blocks", "model_config", "register_architecture"]
