"""Loading the models of a merge: the device, a checkpoint as a live model (eager, or lazy with its lower
blocks on disk), tensors into a live model, and what a failure on the calibration inputs means."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .schema import is_device_name
from ..errors import ValidationError
from ..io import verified
from ..io.checkpoint import Checkpoint, read_config
from ..io.lazy_model import LazyModel, lazy_parameters, load_lazy_model
from ..io.writer import check_tensor_finite
from ..merge.sites import checkpoint_names
from .architectures import architecture_class, model_config
from .fused import fused_view, remember_source
from .checkpoints import ENCODER_DECODER_INPUTS


def resolve_device(name: str) -> tuple[str, str | None]:
    """``(device, note)``: ``auto`` -> CUDA when available; ``cuda`` without CUDA -> CPU with a note;
    another name (the Python APIs take any string) is an error naming the valid ones."""
    import torch  # optional heavy dependency: the merge runs on torch

    if not is_device_name(name):
        raise ValidationError(f"unknown device {name!r}; valid: cpu, cuda, auto (or cuda:N)")
    if name == "auto":
        return ("cuda" if torch.cuda.is_available() else "cpu"), None
    if name.startswith("cuda") and not torch.cuda.is_available():
        return "cpu", f"device {name!r} requested but CUDA is not available: ran on CPU"
    return name, None


def load_model(ckpt: Checkpoint, base_folder: Path, dtype: Any, device: str) -> Any:
    """A model in eval mode from a Hugging Face folder, or the base architecture filled from a
    bare safetensors / torch state dict (tied weights may be absent from the file)."""
    own = ckpt.configured
    cls = architecture_class((ckpt.config if own else None) or _read_cfg(base_folder), str(base_folder))
    try:
        if own:
            model = _from_pretrained(cls, ckpt.path, dtype)
        else:
            model = _from_pretrained(cls, base_folder, dtype)
            live = live_names(model)
            state = {live.get(k, k): v.to(dtype) if v.is_floating_point() else v
                     for k, v in ckpt.state_dict().items()}
            missing, unexpected = model.load_state_dict(state, strict=False)
            if unexpected:
                raise ValidationError(f"{ckpt.path}: tensors not in the architecture: {unexpected[:5]}")
            # tensors absent from the file must be tied to ones present (e.g. lm_head = embeddings)
            ident = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}
            present = {ident[k] for k in state if k in ident}
            untied = [k for k in missing if k in ident and ident[k] not in present]
            if untied:
                raise ValidationError(f"{ckpt.path} lacks tensors {untied[:5]} of the architecture")
    except ValidationError:
        raise
    except Exception as exc:  # noqa: BLE001 - a broken checkpoint: report which
        raise ValidationError(f"cannot load model {ckpt.path}: {type(exc).__name__}: {exc}") from None
    def finite() -> None:  # NaN / inf named before any statistics
        for name, tensor in model.state_dict().items():
            check_tensor_finite(name, tensor, f"checkpoint {ckpt.path}")

    verified.once(("finite model", verified.signature(ckpt.path),  # once per process for unchanged files
                   None if own else verified.signature(base_folder), str(dtype)), finite)
    model.to(device)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    remember_source(model, ckpt)
    return model


def load_lazy(ckpt: Checkpoint, base_folder: Path, dtype: Any, device: str,
              blocks: Callable[[Any], Sequence[Any]]) -> LazyModel:
    """A model like :func:`load_model`'s whose blocks ``blocks(model)`` stay on disk until they
    run (:mod:`mergeqp.io.lazy_model`): only the rest is read now."""
    own = ckpt.configured
    config_dict = (ckpt.config if own else None) or _read_cfg(base_folder)
    folder = ckpt.path if own else base_folder
    cls = architecture_class(config_dict, str(folder))
    config = model_config(folder, config_dict)

    def build() -> Any:  # eager attention, as _from_pretrained
        make = cls.from_config if cls.__name__ == "AutoModel" else cls._from_config
        return _eager(lambda **kw: make(config, dtype=dtype, **kw))

    try:
        lazy = load_lazy_model(build, ckpt, checkpoint_names, dtype, device, blocks)
    except ValidationError:
        raise
    except Exception as exc:  # noqa: BLE001 - a broken checkpoint: report which
        raise ValidationError(f"cannot load model {ckpt.path} lazily: {type(exc).__name__}: {exc}") from None
    for name, tensor in lazy.model.state_dict().items():  # NaN / inf of what is resident, named
        if not tensor.is_meta:
            check_tensor_finite(name, tensor, f"checkpoint {ckpt.path}")
    return lazy


def live_names(model: Any) -> dict[str, str]:
    """Checkpoint name -> live state-dict name (the inverse of ``sites.checkpoint_names``)."""
    return {stored: live for live, stored in checkpoint_names(model).items()}


def _eager(make: Callable[..., Any]) -> Any:
    """``make(attn_implementation="eager")`` where the model supports choosing its attention, else
    ``make()``: the fused SDPA kernels have no forward-mode derivative, which the statistics need
    (``torch.func.jvp``)."""
    try:
        return make(attn_implementation="eager")
    except (ValueError, TypeError) as exc:
        if "attn_implementation" not in str(exc) and "eager" not in str(exc):
            raise
        return make()


def _from_pretrained(cls: Any, folder: Path, dtype: Any) -> Any:
    """``from_pretrained`` with eager attention where the model supports choosing it (:func:`_eager`)."""
    return _eager(lambda **kw: cls.from_pretrained(str(folder), dtype=dtype, **kw))


def _read_cfg(folder: Path) -> dict[str, Any] | None:
    return read_config(folder)


def collect_if_held(alive: weakref.ref) -> None:
    """Collect a dropped model that a reference cycle keeps alive (``alive()`` not ``None``); not
    unconditionally: a full collection cost ~0.3 s in a large process."""
    if alive() is not None:
        gc.collect()


def out_of_memory(exc: BaseException) -> bool:
    """A failed allocation (CPU or device), not a model rejecting its inputs."""
    import torch

    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("tried to allocate" in text or "DefaultCPUAllocator" in text
                                              or "out of memory" in text)


def failure_hint(message: str, model: Any, dtype: str | None) -> str:
    """What to check when the model failed on its calibration inputs with ``message``: the config's
    dtype where the model's kernels refused it (Mixtral's grouped expert products take no float64),
    an encoder-decoder model that needs decoder inputs (T5: mergeqp feeds the prompts as
    ``input_ids`` only; BART derives its decoder's inputs from them), else the inputs."""
    config = getattr(model, "config", None)
    if dtype == "float64" and any(w in message for w in ("Double", "double", "float64")):
        return ("a kernel of this model does not take float64 (the config's dtype: float64): set dtype: float32 "
                "(or bfloat16)")
    if getattr(config, "is_encoder_decoder", False) and "input_ids" in message:
        return (f"{getattr(config, 'model_type', 'this')} is an encoder-decoder model whose decoder needs inputs of "
                f"its own; {ENCODER_DECODER_INPUTS}")
    return "check the prompts / input tensors (names, shapes, dtype) against the model"


def load_into(model: Any, tensors: dict[str, Any]) -> None:
    """Copy checkpoint-named ``tensors`` into the live model (renamed as ``transformers`` does)."""
    import torch  # optional heavy dependency: the merge runs on torch

    state = model.state_dict()
    live = live_names(model)
    lazy = lazy_parameters(model)  # blocks kept on disk take the tensors as overrides
    with torch.no_grad():
        for k, v in tensors.items():
            name = live.get(k, k)
            if name in lazy:
                block, path = lazy[name]
                block.override(path, v)
                continue
            target = state.get(name)
            if target is None:
                target = fused_view(model, k, state)  # a mixture-of-experts weight stacked into one parameter
            if target is None:
                raise ValidationError(f"merged tensor {k!r} is not a parameter of the loaded model")
            target.copy_(v.to(dtype=target.dtype))
