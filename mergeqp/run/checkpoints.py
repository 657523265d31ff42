"""Whether the checkpoints of a merge can be merged, read from their files alone (no weights beyond
what a comparison needs): the fine-tunes' ``config.json`` against the base's (settings that change
the function a model computes are refused), their tokenizers, the model's structure on the ``meta``
device (:func:`skeleton`), stored names aligned with the loaded model's (tied and derived tensors),
and which selected tensors a fine-tune changed (:func:`changed_keys`, :func:`same_stored_value`).
Split from :mod:`.plan` (stop 58), which calls these while it plans.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .architectures import architecture_class, model_config
from ..errors import ConfigError, first_line
from ..io import verified
from ..io.calibration import load_tokenizer
from ..io.checkpoint import PEFT_ADVICE, PEFT_CONFIG, Checkpoint, is_peft_adapter, read_config
from ..merge.sites import checkpoint_names, listing, tied_parameters

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt",
                   "merges.txt", "tokenizer.model", "spiece.model", "special_tokens_map.json")


#: ``config.json`` settings that change the function a model computes without changing a tensor's
#: shape (attention heads, norms' epsilons, rotary settings, activations): a fine-tune that differs
#: from the base in one of them computes its targets with another function than the merged model
#: (which is written with the base's config), so it is refused
FUNCTION_CONFIG_KEYS = (
    "model_type", "architectures", "num_attention_heads", "num_key_value_heads", "head_dim", "n_head",
    "multi_query", "hidden_act", "activation_function", "hidden_activation", "rms_norm_eps", "layer_norm_eps",
    "layer_norm_epsilon", "norm_eps", "rope_theta", "rope_scaling", "partial_rotary_factor", "rotary_pct",
    "position_embedding_type", "attention_bias", "mlp_bias",
    "tie_word_embeddings", "scale_attn_weights", "attn_logit_softcapping", "final_logit_softcapping",
    "query_pre_attn_scalar",
    # transformers 5 (and recent 4.x) names: the rotary settings live in ``rope_parameters``, the
    # per-layer attention kinds in ``layer_types``
    "rope_parameters", "layer_types", "sliding_window", "use_sliding_window", "max_window_layers",
    "no_rope_layers", "use_qk_norm", "qk_layernorm", "clip_qkv", "use_parallel_residual", "parallel_attn",
)
#: parts of a setting's name that mark it as function-defining wherever the architecture puts it
#: (``text_config.rope_theta``, ``local_rope_theta``, ``attention_multiplier``, ``norm_epsilon`` ...)
FUNCTION_CONFIG_PARTS = ("rope", "rotary", "_eps", "epsilon", "window", "softcap", "multiplier", "alibi",
                         "activation", "hidden_act", "layer_types", "logit_scal", "embed_scale", "scale_embedding")
#: settings that fine-tuning or saving commonly changes without changing the function of the merged
#: layers (identity, dtype, caching, generation ids, dropout, labels of a head the merge does not touch)
BENIGN_CONFIG_KEYS = (
    "_name_or_path", "name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache", "id2label",
    "label2id", "num_labels", "problem_type", "finetuning_task", "bos_token_id", "eos_token_id", "pad_token_id",
    "sep_token_id", "decoder_start_token_id", "output_attentions", "output_hidden_states", "return_dict",
    "initializer_range", "attn_implementation", "_attn_implementation", "_attn_implementation_autoset",
    "tokenizer_class", "task_specific_params", "auto_map", "_commit_hash", "gradient_checkpointing",
    "pretraining_tp", "chunk_size_feed_forward", "max_position_embeddings", "generation_config", "tf_legacy_loss",
)


def _flat_config(cfg: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``config.json`` with the sub-configs of composite models (``text_config``, ``vision_config``
    ...) flattened to dotted keys; a function-defining setting holding a mapping (``rope_parameters``,
    ``rope_scaling``) stays one value."""
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        if isinstance(value, dict) and key.endswith("_config") and key != "quantization_config":
            out.update(_flat_config(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _defines_function(key: str) -> bool:
    leaf = key.rsplit(".", 1)[-1]
    if "dropout" in leaf or "initializer" in leaf:  # (``activation_dropout``: training only)
        return False
    return leaf in FUNCTION_CONFIG_KEYS or any(part in leaf for part in FUNCTION_CONFIG_PARTS)


def _benign(key: str) -> bool:
    leaf = key.rsplit(".", 1)[-1]
    return leaf in BENIGN_CONFIG_KEYS or "dropout" in leaf or leaf.startswith("_")


def check_architectures(base: Checkpoint, others: list[tuple[str, Checkpoint]]) -> list[str]:
    """Same model type / architecture and function-defining settings (:data:`FUNCTION_CONFIG_KEYS`
    and names with :data:`FUNCTION_CONFIG_PARTS`, when configs exist) and the same tensor names and
    shapes; the error names the model and the first difference. Returns notes naming the other
    settings in which a fine-tune's ``config.json`` differs (neither known to change the function nor
    known to be harmless: the merged model is written with the base's values)."""
    bcfg = _flat_config(_comparable_config(base) or {})
    order = {k: i for i, k in enumerate(FUNCTION_CONFIG_KEYS)}  # model_type and architectures first
    notes: list[str] = []
    for name, ck in others:
        cfg = _comparable_config(ck)
        theirs_cfg = _flat_config(cfg) if cfg is not None and base.config is not None else {}
        changed = [key for key in dict.fromkeys([*bcfg, *theirs_cfg])
                   if bcfg.get(key, _MISSING) != theirs_cfg.get(key, _MISSING) and theirs_cfg]
        differ = sorted((key for key in changed if _defines_function(key) and theirs_cfg.get(key) is not None
                         and bcfg.get(key) is not None), key=lambda k: order.get(k, len(order)))
        unknown = [key for key in changed if key not in differ and not _benign(key)]
        if unknown:
            shown = ", ".join(f"{k} ({_config_value(theirs_cfg, k)} vs the base's {_config_value(bcfg, k)})"
                              for k in unknown[:4])
            notes.append(f"the config.json of model {name!r} differs from the base's in {shown}"
                         + (f" and {len(unknown) - 4} more" if len(unknown) > 4 else "")
                         + ": settings mergeqp does not know to change the function; the merged model is "
                           "written with the base's values")
        for key in differ:
            if key in ("model_type", "architectures"):
                raise _config_difference(name, key, theirs_cfg[key], bcfg[key])
        ref, theirs = base.shapes(), ck.shapes()
        missing = [k for k in ref if k not in theirs]
        extra = [k for k in theirs if k not in ref]
        if missing or extra:
            what = (f"lacks tensor {missing[0]!r} of the base" if missing else f"has tensor {extra[0]!r} that the base lacks")
            tie = ("tie_word_embeddings", bcfg.get("tie_word_embeddings"), theirs_cfg.get("tie_word_embeddings"))
            if theirs_cfg and tie[1] != tie[2]:  # (stop 56 review: the message did not say why a head was extra)
                what += f"; {tie[0]} is {tie[1]} in the base and {tie[2]} in this model (one ties its head, one not)"
            adapter = ck.path is not None and is_peft_adapter(ck.path)
            raise ConfigError(
                f"model {name!r} ({ck.path}) {what} ({len(missing)} missing, {len(extra)} extra): "
                + (f"it is a PEFT adapter ({PEFT_CONFIG}): {PEFT_ADVICE}" if adapter else
                   "all models must share the base's architecture")
            )
        for k, shape in ref.items():
            if theirs[k] != shape:
                raise ConfigError(
                    f"tensor {k!r} has shape {theirs[k]} in model {name!r} but {shape} in the base: "
                    f"all models must share the base's architecture"
                )
        kinds = [k for k in ref if base.info(k).floating != ck.info(k).floating]
        if kinds:  # (stop 56 review: an integer copy of a float tensor passed --dry-run, and unselected it was
            k = kinds[0]  # read into the fine-tune's targets as integers cast back)
            raise ConfigError(
                f"tensor {k!r} is stored as {ck.info(k).dtype} in model {name!r} but as {base.info(k).dtype} in the "
                f"base ({len(kinds)} such tensor(s)): a floating-point weight saved as integers (or the reverse) is "
                f"not a fine-tune of it; re-save that model from its float weights")
        if differ:  # (after the shapes: a tensor of another shape is the plainer message)
            raise _config_difference(name, differ[0], theirs_cfg[differ[0]], bcfg[differ[0]])
    return notes


_MISSING = object()


def _comparable_config(ck: Checkpoint) -> dict[str, Any] | None:
    """A folder's ``config.json`` as ``transformers`` reads it (every default filled in, old names
    such as ``rope_theta`` moved to where this version keeps them), so that two folders saved by
    different versions compare by what they compute; the file's own mapping when ``transformers``
    cannot read it."""
    if ck.config is None:
        return None
    if ck.folder is not None:
        try:
            from transformers import AutoConfig

            return AutoConfig.from_pretrained(str(ck.folder)).to_dict()
        except Exception:  # noqa: BLE001 - an unknown model type: the raw file is compared
            pass
    return ck.config


def _config_value(cfg: dict[str, Any], key: str) -> str:
    return repr(cfg[key]) if key in cfg else "not set"


def _config_difference(name: str, key: str, theirs: Any, base: Any) -> ConfigError:
    kind = ("is a different architecture" if key in ("model_type", "architectures") else
            "computes another function than the base")
    return ConfigError(f"model {name!r} {kind}: its config.json has {key} {theirs!r} but the base's has {base!r} "
                       f"(as transformers reads them; the merge computes every model's outputs with its own config "
                       f"and writes the base's)")


def has_tokenizer(folder: Path) -> bool:
    return folder.is_dir() and any((folder / f).is_file() for f in TOKENIZER_FILES)


def check_tokenizers(base_folder: Path, others: list[tuple[str, Path]]) -> None:
    """Every fine-tuned folder that ships a tokenizer must have the base's vocabulary and
    special tokens (identical files are accepted without loading; a pair of unchanged folders is
    compared once per process)."""
    base = functools.cache(lambda: load_tokenizer(base_folder))  # loaded only if some files differ
    base_files = verified.signature(base_folder, TOKENIZER_FILES)
    for name, folder in others:
        if has_tokenizer(folder):
            verified.once(("tokenizers", base_files, verified.signature(folder, TOKENIZER_FILES)),
                          functools.partial(_same_tokenizer, name, folder, base_folder, base))


def _same_tokenizer(name: str, folder: Path, base_folder: Path, base: Callable[[], Any]) -> None:
    """Raise :class:`ConfigError` unless ``folder``'s tokenizer has the base's (``base()``)
    vocabulary and special tokens."""
    same = all(
        ((base_folder / f).is_file() == (folder / f).is_file())
        and (not (folder / f).is_file() or (base_folder / f).read_bytes() == (folder / f).read_bytes())
        for f in TOKENIZER_FILES
    )
    if same:
        return
    ref, tok = base(), load_tokenizer(folder)
    v_ref, v = ref.get_vocab(), tok.get_vocab()
    if v_ref != v:
        only_theirs = sorted(set(v) - set(v_ref))[:3]
        only_base = sorted(set(v_ref) - set(v))[:3]
        moved = sorted(t for t in set(v) & set(v_ref) if v[t] != v_ref[t])[:3]
        detail = (f"tokens only in it: {only_theirs}" if only_theirs else
                  f"tokens missing from it: {only_base}" if only_base else f"tokens with other ids: {moved}")
        raise ConfigError(
            f"tokenizer mismatch: model {name!r} ({folder}) has a vocabulary of {len(v)} tokens, "
            f"the base tokenizer ({base_folder}) {len(v_ref)}; {detail}. All models must share the "
            f"base's tokenizer for teacher-forced targets"
        )
    if ref.all_special_tokens != tok.all_special_tokens:
        theirs, base_ = set(tok.all_special_tokens), set(ref.all_special_tokens)
        detail = "; ".join(part for part in (
            f"special only in it: {sorted(theirs - base_)}" if theirs - base_ else "",
            f"special only in the base: {sorted(base_ - theirs)}" if base_ - theirs else "",
            "the same special tokens in another order" if theirs == base_ else "") if part)
        raise ConfigError(
            f"tokenizer mismatch: model {name!r} ({folder}) has the base's vocabulary but other special tokens "
            f"({detail}). If they differ only in such a designation (e.g. a pad token only the fine-tunes set), "
            f"name the folder whose tokenizer to use, 'tokenizer: <folder>': the fine-tunes' folders are then "
            f"checked against it"
        )


def skeleton(folder: Path) -> Any:
    """The model built on the ``meta`` device (module structure and shapes, no storage)."""
    import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

    config = model_config(folder, read_config(folder))
    cls = architecture_class(config.to_dict(), str(folder))
    try:
        with torch.device("meta"):
            return cls(config) if cls.__name__ != "AutoModel" else cls.from_config(config)
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"cannot build the architecture of {folder}: {type(exc).__name__}: {exc}") from None


#: why an encoder-decoder model whose decoder needs inputs of its own cannot be merged (plan and run)
ENCODER_DECODER_INPUTS = ("mergeqp feeds each prompt as input_ids only (models that derive the decoder's inputs "
                          "from them, like BART, work): not supported")


def check_decoder_inputs(model: Any, config: Mapping[str, Any] | None) -> None:
    """A :class:`ConfigError` for an encoder-decoder model that cannot run on a prompt's
    ``input_ids`` alone (T5's decoder needs inputs of its own; BART derives them), found by one
    forward pass of the ``meta``-device skeleton (no weights, no data). Before stop 55 the run failed
    after loading every model, blaming the prompts. Any other failure of that pass is left to the run."""
    if not (config or {}).get("is_encoder_decoder"):
        return
    import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

    try:
        ids = torch.zeros((1, 4), dtype=torch.long, device="meta")
        with torch.no_grad():
            model(input_ids=ids)
    except ValueError as exc:
        first = first_line(exc, 200)
        if "decoder" in first or "input_ids" in first:
            raise ConfigError(
                f"the base model ({(config or {}).get('model_type', 'encoder-decoder')}) is an encoder-decoder model "
                f"whose decoder needs inputs of its own ({first}); {ENCODER_DECODER_INPUTS}") from None
    except Exception:  # noqa: BLE001 - the meta pass is a probe: anything else is the run's to judge
        return


def stored_names(ck: Checkpoint, base: Checkpoint, model: Any) -> Checkpoint:
    """A bare state dict saved from a live model (``torch.save(model.state_dict())``) may use the
    live names where ``transformers`` stores others (it renames some architectures' weights on
    load): view it under the stored names so it lines up with the base folder."""
    if ck.is_hf_folder or set(ck.names()) <= set(base.names()):
        return ck
    mapping = {live: stored for live, stored in checkpoint_names(model).items() if live in ck}
    return ck.renamed(mapping) if mapping else ck


def same_stored_value(base: Any, theirs: Any) -> bool:
    """Whether a fine-tune's stored tensor ``theirs`` holds the ``base`` tensor's values, as far as
    their dtypes can tell: stored in a float dtype with a larger ``eps`` (a bfloat16 or float16 save
    of a float32 base) it must be the base rounded to that dtype; stored in one that holds the base's
    values (a float32 fine-tune of a bfloat16 base) it must be them exactly; between float16 and
    bfloat16, where neither holds the other, each entry must be a value that an original rounding
    to the base's float16 entry could also round to in bfloat16 (double rounding; a real change of
    one unit is still a change). Other dtypes compare by value. Before stop 53 a bf16 save of an
    f32 base counted as changed everywhere, and an fp16 base against bf16 fine-tunes never matched."""
    import torch  # optional heavy dependency: the merge runs on torch

    if base.shape != theirs.shape:
        return False
    if base.dtype == theirs.dtype:
        return bool(torch.equal(base, theirs))
    if base.is_floating_point() and theirs.is_floating_point():
        if {base.dtype, theirs.dtype} == {torch.float16, torch.bfloat16}:
            return _same_across_half_formats(base, theirs)
        if torch.finfo(theirs.dtype).eps > torch.finfo(base.dtype).eps:  # saved coarser: the base rounded
            return bool(torch.equal(base.to(theirs.dtype), theirs))
    # saved finer (held exactly), or not both floating point: by value
    return bool(torch.equal(base.to(torch.float64), theirs.to(torch.float64)))


def _same_across_half_formats(base: Any, theirs: Any) -> bool:
    """:func:`same_stored_value` for a float16 / bfloat16 pair: the values ``x`` that round to the
    float16 entry ``h`` form an interval (``h`` plus or minus half its float16 spacings), which
    rounding to bfloat16 maps onto a range of at most two neighbours; the bfloat16 entry must lie in
    it (the float16 entry, where the base is bfloat16: the same with the roles swapped). Non-finite
    entries must be equal."""
    import torch  # optional heavy dependency: the merge runs on torch

    half, brain = (base, theirs) if base.dtype == torch.float16 else (theirs, base)
    h = half.detach().cpu().numpy()
    b = brain.detach().to(torch.float64).cpu().numpy()
    finite = np.isfinite(h)
    if not np.array_equal(h[~finite].astype(np.float64), b[~finite]):
        return False
    h, b = h[finite], b[finite]
    h64 = h.astype(np.float64)
    up = (np.nextafter(h, np.float16(np.inf)).astype(np.float64) - h64) / 2
    down = (h64 - np.nextafter(h, np.float16(-np.inf)).astype(np.float64)) / 2

    def in_bf16(x: np.ndarray) -> np.ndarray:
        return torch.from_numpy(x).to(torch.bfloat16).to(torch.float64).numpy()

    return bool(np.all((in_bf16(h64 - down) <= b) & (b <= in_bf16(h64 + up))))


#: buffers ``transformers`` computes itself and no longer stores, which older checkpoints hold (beside
#: a model's own non-persistent buffers and ignore patterns, :func:`_ignored_on_load`)
DERIVED_BUFFERS = ("position_ids", "inv_freq", "masked_bias")


def _tied_partners(model: Any, names: Mapping[str, str]) -> dict[str, list[str]]:
    """Stored name -> the stored names of the other parameters sharing its tensor (tied weights,
    :func:`~mergeqp.merge.sites.tied_parameters`; ``names``: live -> stored,
    :func:`~mergeqp.merge.sites.checkpoint_names`)."""
    out: dict[str, list[str]] = {}
    for live, group in tied_parameters(model).items():
        stored = list(dict.fromkeys(names.get(n, n) for n in group))
        if len(stored) > 1:
            me = names.get(live, live)
            out[me] = [m for m in stored if m != me]
    return out


def _ignored_on_load(model: Any, names: Mapping[str, str]) -> Callable[[str], bool]:
    """Whether ``transformers`` ignores a stored tensor of this name when it loads ``model``: one the
    model does not persist that is a non-persistent buffer of it (``position_ids``, ``inv_freq``),
    matches the class's ``_keys_to_ignore_on_load_unexpected`` (GPT-2's causal-mask ``attn.bias``),
    or ends in one of :data:`DERIVED_BUFFERS` (``names``: live -> stored)."""
    import re

    state = set(model.state_dict())
    persisted = set(names.values()) | state
    transient = {n for n, _ in model.named_buffers()} - state
    patterns = [re.compile(p) for p in (getattr(type(model), "_keys_to_ignore_on_load_unexpected", None) or ())]

    def ignored(key: str) -> bool:
        return key not in persisted and (key in transient or key.rsplit(".", 1)[-1] in DERIVED_BUFFERS
                                         or any(p.search(key) for p in patterns))

    return ignored


def _same_tensor(ck: Checkpoint, a: str, b: str) -> bool:
    """Whether two names of one checkpoint hold the same values (a stored tied copy)."""
    import torch  # optional heavy dependency: the merge runs on torch

    return ck.info(a).shape == ck.info(b).shape and bool(torch.equal(ck.get(a), ck.get(b)))


def aligned_checkpoints(base: Checkpoint, finetuned: Sequence[Checkpoint], model: Any
                        ) -> tuple[Checkpoint, list[Checkpoint], list[str]]:
    """The checkpoints as ``transformers`` loads them into ``model``: a stored tensor it ignores on
    load (a buffer it computes itself, :func:`_ignored_on_load`) left out wherever stored; a tied
    weight stored under one name in one checkpoint and under both in another (a
    ``torch.save(model.state_dict())`` of a tied model holds ``lm_head.weight``, a ``save_pretrained``
    folder does not) read through the name it has, where the stored copy equals its tied partner
    (a copy that differs is left for the architecture check to refuse: transformers would load that
    model untied). Before stop 53 such inputs were refused as "another architecture". Returns the
    views and a note per model that needed one."""
    names = checkpoint_names(model)
    partners = _tied_partners(model, names)
    ignored = _ignored_on_load(model, names)

    def copy_of(ck: Checkpoint, key: str) -> str | None:
        """The tied partner of ``key`` that ``ck`` stores with the same values, if any."""
        return next((p for p in partners.get(key, ()) if p in ck and _same_tensor(ck, key, p)), None)

    # the first name of each tied group (the embedding before the head it ties): where the base stores a
    # later name as an equal copy, that copy is left out as save_pretrained leaves it, so the merge writes
    # one tensor and the model loads tied (stop 56 review: a torch.save folder's merged embedding was
    # written beside the base's stored head, and transformers loaded the two untied)
    first = {names.get(n, n): names.get(group[0], group[0]) for group in tied_parameters(model).values() for n in group}
    ignored_drop = [k for k in base.names() if ignored(k)]
    copies = [k for k in base.names() if k not in ignored_drop and first.get(k, k) != k and first[k] in base
              and _same_tensor(base, k, first[k])]
    base_drop = ignored_drop + copies
    new_base = base.aligned(drop=base_drop) if base_drop else base
    # whether the base stores a tied name's partner as a copy, judged before the copies above are left
    # out (a fine-tune holding only the later name, as safetensors' save_model keeps the first name
    # alphabetically, is read through it: the review of this very drop found it refused)
    kept = base.aligned(drop=ignored_drop) if ignored_drop else base
    base_copy = functools.cache(lambda key: copy_of(kept, key) is not None)  # read once, not per fine-tune
    notes = ([f"the base stores {listing(ignored_drop, 3)}, which transformers ignores on load: left out"]
             if ignored_drop else [])
    if copies:
        notes.append(f"the base stores {listing(copies, 3)}, a copy of the tied "
                     f"{listing([first[k] for k in copies], 3)}: left out (the written model stores the tied "
                     f"tensor once, as save_pretrained does, and loads tied)")
    out = []
    for ck in finetuned:
        drop = [k for k in ck.names() if k not in new_base and (ignored(k) or copy_of(ck, k) is not None)]
        aliases = {}
        for k in new_base.names():
            present = [p for p in partners.get(k, ()) if p in ck] if k not in ck else []
            if present and base_copy(k):  # the base's stored tied name is a copy too
                aliases[k] = present[0]
        # a name read as its tied partner that the base no longer stores (its copy left out above)
        drop += [p for p in aliases.values() if p not in new_base and p not in drop]
        if drop or aliases:
            out.append(ck.aligned(drop, aliases))
            what = [f"{listing(drop, 3)} left out (a stored tied copy, or ignored on load)"] if drop else []
            what += [f"{listing(list(aliases), 3)} read as the tied {listing(list(aliases.values()), 3)}"] if aliases else []
            notes.append(f"{ck.path}: " + "; ".join(what))
        else:
            out.append(ck)
    return new_base, out, notes


def changed_keys(base: Checkpoint, finetuned: Sequence[Checkpoint], keys: Sequence[str]) -> list[str]:
    """The ``keys`` at which some fine-tuned checkpoint differs from the base (read one tensor at a
    time; a changed tensor usually stops at the first fine-tune; :func:`same_stored_value`)."""
    out = []
    for key in keys:
        ref = base.get(key)
        if any(not same_stored_value(ref, ft.get(key)) for ft in finetuned):
            out.append(key)
    return out


def output_fields(model: Any) -> tuple[str, list[str]] | None:
    """The output class the model's ``forward`` declares it returns and that class's fields (a
    ``transformers`` ``ModelOutput`` in its return annotation), or ``None`` where it declares none
    (a registered architecture returning a tensor or a dict, an annotation that cannot be read): what
    ``output.field`` may name, known without a forward pass."""
    import dataclasses
    import inspect
    import typing

    try:
        from transformers.utils import ModelOutput  # optional heavy dependency, imported on first use
    except ImportError:
        return None
    forward = getattr(type(model), "forward", None)
    try:
        annotation = inspect.signature(forward).return_annotation
        if isinstance(annotation, str):
            annotation = typing.get_type_hints(forward).get("return")
    except Exception:  # noqa: BLE001 - an annotation we cannot resolve: no check
        return None
    found = [a for a in (typing.get_args(annotation) or (annotation,))
             if isinstance(a, type) and issubclass(a, ModelOutput) and dataclasses.is_dataclass(a)]
    if len(found) != 1:
        return None
    return found[0].__name__, [f.name for f in dataclasses.fields(found[0])]

