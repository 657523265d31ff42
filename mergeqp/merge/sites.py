"""Merge sites: the linear layers of a model that the QP can merge, found by name or glob.

A site is an ``nn.Linear`` (weight ``(r, m)``: out x in) or a Hugging Face ``Conv1D`` (GPT-2's
projections; weight stored transposed, ``(m, r)``). Either way a site exposes its weight in the
``nn.Linear`` convention and, when it has one, its bias, so the rest of the code sees one kind
of layer. With a bias the weight is *augmented* to ``(r, m + 1)`` (last column = bias), as in
:mod:`mergeqp.stats.parametrisation`.

Patterns (``fnmatch`` globs, ``*`` also crossing dots) are matched against module names and
against the names the checkpoint stores them under (which ``transformers`` 5 may rename on
load); a trailing ``.weight`` is ignored so that parameter names work too.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, ValidationError, listing

LINEAR_KINDS = ("linear", "conv1d")


@dataclass(frozen=True)
class LayerSite:
    """A mergeable linear layer. ``name``: module name in the live model; ``kind``: ``linear`` |
    ``conv1d``; ``r``, ``m``: output / input features; ``has_bias``; ``stored``: the layer's name
    in the checkpoint (differs from ``name`` when ``transformers`` renames weights on load, e.g.
    ViT's ``encoder.layer.0.attention.attention.query`` -> ``layers.0.attention.q_proj``);
    ``weight_key`` / ``bias_key``: the checkpoint tensors (``bias_key`` ``None`` without a bias)."""

    name: str
    kind: str
    r: int
    m: int
    has_bias: bool
    stored: str = ""

    def __post_init__(self) -> None:
        if not self.stored:
            object.__setattr__(self, "stored", self.name)

    @property
    def weight_key(self) -> str:
        return f"{self.stored}.weight"

    @property
    def bias_key(self) -> str | None:
        return f"{self.stored}.bias" if self.has_bias else None

    @property
    def m1(self) -> int:
        """Augmented input width (``m + 1`` with a bias)."""
        return self.m + (1 if self.has_bias else 0)

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.weight_key,) + ((self.bias_key,) if self.bias_key else ())

    @property
    def label(self) -> str:
        return self.name if self.stored == self.name else f"{self.name} (stored as {self.stored})"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "stored": self.stored, "kind": self.kind, "out_features": self.r,
                "in_features": self.m, "bias": self.has_bias}


def _kind(module: Any) -> str | None:
    from torch import nn  # optional heavy dependency, imported on first use (importing mergeqp stays light)

    if isinstance(module, nn.Linear):
        return "linear"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None:
        return "conv1d"
    return None


def checkpoint_names(model: Any) -> dict[str, str]:
    """Live state-dict name -> checkpoint name, for tensors that ``transformers`` stores under
    another name (its weight-conversion mapping, reverted as ``save_pretrained`` does). Tensors
    whose stored form is not a plain rename (fused / split by a converter) are left out."""
    state = model.state_dict()
    try:
        from transformers.core_model_loading import revert_weight_conversion  # optional heavy dependency, imported on first use (importing mergeqp stays light)
    except ImportError:  # transformers 4: names are stored as they are
        return {k: k for k in state}
    try:
        reverted = revert_weight_conversion(model, dict(state))
    except Exception:  # noqa: BLE001 - no usable mapping: assume names are stored as they are
        return {k: k for k in state}
    by_id = {id(v): k for k, v in reverted.items()}
    return {k: by_id[id(v)] for k, v in state.items() if id(v) in by_id}


def tied_parameters(model: Any) -> dict[str, tuple[str, ...]]:
    """Each parameter name of ``model`` whose tensor another name shares (tied weights, e.g. a
    language model's ``lm_head.weight`` and its input embeddings) -> every name of that tensor, in
    registration order (itself included)."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return {name: tuple(g) for g in groups.values() if len(g) > 1 for name in g}


def model_sites(model: Any, checkpoint_keys: Iterable[str] | None = None) -> list[LayerSite]:
    """Every linear site of ``model`` in module order (works on a ``meta``-device skeleton).

    With ``checkpoint_keys``, only sites whose weight (and bias) is stored in the checkpoint
    under a plain (possibly renamed) key; tied weights, such as GPT-2's ``lm_head``, are not
    stored and not offered, and a parameter shared by several modules is never a site."""
    keys = None if checkpoint_keys is None else set(checkpoint_keys)
    names = checkpoint_names(model) if keys is not None else {}
    tied = tied_parameters(model)
    out = []
    for name, module in model.named_modules():
        kind = _kind(module) if name else None
        if kind is None or f"{name}.weight" in tied:
            continue
        has_bias = getattr(module, "bias", None) is not None
        stored = name
        if keys is not None:
            wkey = names.get(f"{name}.weight")
            if wkey is None or wkey not in keys or not wkey.endswith(".weight"):
                continue
            stored = wkey[: -len(".weight")]
            if has_bias and names.get(f"{name}.bias") != f"{stored}.bias":
                continue
        w = module.weight
        r, m = (int(w.shape[0]), int(w.shape[1])) if kind == "linear" else (int(w.shape[1]), int(w.shape[0]))
        out.append(LayerSite(name, kind, r, m, has_bias, stored))
    return out


def _norm(pattern: str) -> str:
    p = pattern.strip()
    return p.removesuffix(".weight")


def module_hint(sites: Sequence[LayerSite], pattern: str) -> str:
    """`` (P is a module holding N of them: P.* selects them all, e.g. ...)`` when ``pattern`` names a
    module whose linear layers are among ``sites``, else ``""``."""
    p = _norm(pattern)
    inside = [s.name for s in sites if site_matches(s, f"{p}.*")]
    return (f" ({p!r} is a module holding {len(inside)} of them: {p}.* selects them all, e.g. {inside[0]})"
            if inside else "")


def shared_linear_layers(model: Any) -> dict[str, str]:
    """Linear modules of ``model`` whose weight is shared with another parameter (tied, like a
    language model's ``lm_head`` and its input embeddings): name -> the other parameter's name.
    They are never sites (:func:`model_sites`)."""
    tied = tied_parameters(model)
    out = {}
    for name, module in model.named_modules():
        group = tied.get(f"{name}.weight", ()) if name and _kind(module) is not None else ()
        if group and group[0] != f"{name}.weight":
            out[name] = group[0]
    return out


def tied_match(pattern: str, shared: Mapping[str, str] | None) -> str | None:
    """What a layer ``pattern`` that matches only a tied linear layer (``shared``:
    :func:`shared_linear_layers`) matches, as the start of an error; ``None`` when it matches none."""
    p = _norm(pattern)
    tied = [n for n in (shared or {}) if n == p or fnmatch.fnmatchcase(n, p)]
    if not tied:
        return None
    assert shared is not None
    return (f"layer pattern {pattern!r} matches {tied[0]!r}, a linear layer whose weight is tied to "
            f"{shared[tied[0]]!r} (one tensor, stored once)")


def match_sites(sites: Sequence[LayerSite], patterns: Sequence[str],
                shared: Mapping[str, str] | None = None) -> list[LayerSite]:
    """Sites matching any pattern (exact names or globs), in model order. A pattern that matches
    nothing is a :class:`ConfigError` listing the available sites (and, from ``shared``
    (:func:`shared_linear_layers`), naming a tied layer it matches)."""
    chosen: set[str] = set()
    for pattern in patterns:
        p = _norm(pattern)
        hits = [s.name for s in sites if site_matches(s, p)]
        if not hits:
            tied = tied_match(pattern, shared)
            if tied:
                raise ConfigError(
                    f"{tied}: it is not merged as a layer of its own; "
                    f"the model's linear layers are: {listing([s.label for s in sites])}")
            hint = module_hint(sites, p) or _prefix_hint(sites, p)
            raise ConfigError(
                f"layer pattern {pattern!r} matches no linear layer{hint}; the model's linear layers "
                f"are: {listing([s.label for s in sites])}"
            )
        chosen.update(hits)
    return [s for s in sites if s.name in chosen]


def _prefix_hint(sites: Sequence[LayerSite], pattern: str) -> str:
    """`` (it matches N layers as the end of their names, e.g. NAME: write the full name, or '*.P')``
    when ``pattern`` lacks only a leading part of the names (``layers.3.mlp.down_proj`` for
    ``model.layers.3.mlp.down_proj``), else ``""``."""
    tails = [s.name for s in sites if site_matches(s, f"*.{pattern}")]
    return (f" (it matches {len(tails)} layer(s) as the end of their names, e.g. {tails[0]}: write the full "
            f"name, or '*.{pattern}')" if tails else "")


def site_matches(site: LayerSite, pattern: str) -> bool:
    """Whether a (normalised) pattern matches the site's module name or its checkpoint name."""
    return any(n == pattern or fnmatch.fnmatchcase(n, pattern) for n in {site.name, site.stored})



# ---------------------------------------------------------------------- weights in Linear convention
def site_module(model: Any, site: LayerSite) -> Any:
    try:
        return model.get_submodule(site.name)
    except AttributeError:
        raise ValidationError(f"model has no module {site.name!r}") from None


def weight_from_tensors(site: LayerSite, weight: Any, bias: Any = None) -> Any:
    """Augmented ``(r, m1)`` float64 weight (a new tensor) from stored tensors (Conv1D weights
    transposed)."""
    import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

    W = weight.detach().to("cpu", torch.float64, copy=True)  # never a view of a live parameter
    if site.kind == "conv1d":
        W = W.t()
    if tuple(W.shape) != (site.r, site.m):
        raise ValidationError(f"tensor {site.weight_key!r} has shape {tuple(weight.shape)}, "
                              f"expected ({site.r}, {site.m}) in the out x in convention")
    if site.has_bias:
        if bias is None:
            raise ValidationError(f"site {site.name!r} has a bias but none was given")
        W = torch.cat([W, bias.detach().to("cpu", torch.float64).reshape(-1, 1)], dim=1)
    return W.contiguous()


def append_ones(z: Any, has_bias: bool) -> Any:
    """The layer input ``z`` (``(..., n_in)``) with a column of ones appended when the layer
    has a bias (``(..., n_in + 1)``), matching :func:`read_augmented`'s ``[W | b]``."""
    import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

    if not has_bias:
        return z
    return torch.cat([z, torch.ones(*z.shape[:-1], 1, dtype=z.dtype, device=z.device)], dim=-1)


def read_augmented(model: Any, site: LayerSite) -> Any:
    """The site's current augmented weight ``(r, m1)`` (float64, CPU) from a live model."""
    module = site_module(model, site)
    return weight_from_tensors(site, module.weight, module.bias if site.has_bias else None)


def write_augmented(model: Any, site: LayerSite, W: Any) -> None:
    """Set the site's weight (and bias) in a live model from an augmented ``(r, m1)`` matrix."""
    import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

    module = site_module(model, site)
    W = torch.as_tensor(W)
    if tuple(W.shape) != (site.r, site.m1):
        raise ValidationError(f"new weight for {site.name!r} has shape {tuple(W.shape)}, expected ({site.r}, {site.m1})")
    weight = W[:, : site.m]
    with torch.no_grad():
        target = weight.t() if site.kind == "conv1d" else weight
        module.weight.copy_(target.to(module.weight.dtype))
        if site.has_bias:
            module.bias.copy_(W[:, site.m].to(module.bias.dtype))


def stored_tensors(site: LayerSite, W: Any, like: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Checkpoint tensors (``{weight_key: ..., bias_key: ...}``) of an augmented weight, in the
    stored layout (Conv1D transposed) and the dtype of ``like``'s tensors when given."""
    import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

    W = torch.as_tensor(W)
    weight = W[:, : site.m]
    out = {site.weight_key: (weight.t() if site.kind == "conv1d" else weight).contiguous()}
    if site.has_bias:
        out[site.bias_key] = W[:, site.m].contiguous()  # type: ignore[index]
    if like is not None:
        out = {k: v.to(like[k].dtype) if k in like else v for k, v in out.items()}
    return out
