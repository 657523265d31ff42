"""Models larger than memory: blocks whose weights stay on disk until they run.

A merge linearises the model along a *path*: the blocks from the lowest one holding a merge
site up to the output. The blocks below it only turn the batch into that block's input, the same
every time (:mod:`mergeqp.stats.prefix` caches it per batch), and a fine-tuned model only gives
its outputs (teacher-forced targets) and, for RegMean, its layers' inputs. So with ``lazy: true``
in a ``mergeqp merge`` config:

- :func:`load_lazy_model` builds the architecture with its parameters on the ``meta`` device
  (buffers such as rotary frequencies are computed as usual), loads every parameter that is not
  in a lazy block from the checkpoint (safetensors, sharded or not: read through
  :meth:`~mergeqp.io.checkpoint.Checkpoint.read_many`, without a memory map) and ties the tied ones;
- every lazy block (a :class:`LazyBlock`) holds ``meta`` placeholders; its ``forward`` reads its
  tensors from the checkpoint, runs, and puts the placeholders back, so at most one lazy block's
  weights are in memory at a time (plus what autograd keeps for a backward pass through it).

The merge's base model keeps its path resident (the blocks from the first site's up, the
embeddings, the final norm and the head) and the blocks below lazy; each fine-tuned model is lazy
in every block. With the frozen prefix a lower block runs once per calibration batch (twice for
the first batch, whose cached output is verified), so its tensors are read that often. What is
exact: the tensors a lazy block computes with are the checkpoint's, cast to the run's dtype
exactly as ``from_pretrained`` casts them; a test compares lazy and resident merges to 1e-12.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ValidationError

#: the attribute of a block module that holds its :class:`LazyBlock`
LAZY_ATTR = "_mergeqp_lazy"


def _owner(module: Any, path: str) -> tuple[Any, str]:
    """The submodule that holds parameter ``path`` (dotted, relative to ``module``) and its leaf name."""
    *parents, leaf = path.split(".")
    for p in parents:
        module = getattr(module, p)
    return module, leaf


@dataclass(eq=False)
class LazyBlock:
    """One block whose parameters are read from ``checkpoint`` while it runs (module docstring).

    ``keys``: parameter path inside the block -> checkpoint name; ``placeholders``: the ``meta``
    parameters it holds otherwise; ``loads``: how many times its tensors were read."""

    module: Any
    keys: dict[str, str]
    checkpoint: Any
    dtype: Any
    device: str
    placeholders: dict[str, Any] = field(default_factory=dict)
    loads: int = 0
    #: tensors that replace the checkpoint's (a start merge loaded into the model), in memory
    overrides: dict[str, Any] = field(default_factory=dict)
    #: changes each time an override is set (the frozen prefix compares it)
    generation: int = 0
    _depth: int = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> LazyBlock:
        import copy

        return LazyBlock(copy.deepcopy(self.module, memo), dict(self.keys), self.checkpoint, self.dtype, self.device,
                         {k: copy.deepcopy(v, memo) for k, v in self.placeholders.items()}, 0,
                         {k: v.clone() for k, v in self.overrides.items()}, self.generation)

    def override(self, path: str, tensor: Any) -> None:
        """Use ``tensor`` for parameter ``path`` from now on instead of the checkpoint's."""
        if path not in self.keys:
            raise ValidationError(f"lazy block: no parameter {path!r}")
        self.overrides[path] = tensor.detach().to(device=self.device, dtype=self.placeholders[path].dtype).clone()
        self.generation += 1

    @property
    def nbytes(self) -> int:
        """Bytes of its parameters in the run's dtype (what a load holds)."""
        return sum(int(p.numel()) * p.element_size() for p in self.placeholders.values())

    @contextlib.contextmanager
    def materialised(self) -> Iterator[None]:
        """Within the block the module holds its real tensors (re-entrant)."""
        import torch  # deferred: torch is heavy

        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        read = [key for path, key in self.keys.items() if path not in self.overrides]
        tensors = self.checkpoint.read_many(read, dtype=self.dtype, device=self.device)
        for path, key in self.keys.items():
            owner, leaf = _owner(self.module, path)
            value = self.overrides[path] if path in self.overrides else tensors[key]
            owner._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
        self.loads += 1
        self._depth = 1
        try:
            yield
        finally:
            self._depth = 0
            for path in self.keys:
                owner, leaf = _owner(self.module, path)
                owner._parameters[leaf] = self.placeholders[path]


def make_lazy(module: Any, keys: dict[str, str], checkpoint: Any, dtype: Any, device: str) -> LazyBlock:
    """Turn ``module`` (a block whose parameters are ``meta`` placeholders) into a lazy block: its
    ``forward`` materialises it around its class's ``forward``. A deep copy of the model copies
    the block's state and shares the checkpoint."""
    if "forward" in vars(module):
        raise ValidationError(f"lazy block {type(module).__name__}: it already has a forward of its own")
    placeholders = {}
    for path in keys:
        owner, leaf = _owner(module, path)
        placeholders[path] = owner._parameters[leaf]
    lazy = LazyBlock(module, dict(keys), checkpoint, dtype, device, placeholders)
    module.forward = types.MethodType(_lazy_forward, module)
    setattr(module, LAZY_ATTR, lazy)
    return lazy


def _lazy_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    with getattr(self, LAZY_ATTR).materialised():
        return type(self).forward(self, *args, **kwargs)


def run_block(module: Any, *args: Any, **kwargs: Any) -> Any:
    """``module``'s own computation, bypassing any instance ``forward`` patch: its class's
    ``forward``, with its tensors read for the call when it is a lazy block."""
    if lazy_of(module) is not None:
        return _lazy_forward(module, *args, **kwargs)
    return type(module).forward(module, *args, **kwargs)


def lazy_of(module: Any) -> LazyBlock | None:
    """The :class:`LazyBlock` of ``module``, or ``None`` for a resident one."""
    return getattr(module, LAZY_ATTR, None)


def lazy_parameters(model: Any) -> dict[str, tuple[LazyBlock, str]]:
    """Live parameter name -> (its lazy block, its path inside the block), for every lazy block
    of ``model`` (empty for a resident model)."""
    out: dict[str, tuple[LazyBlock, str]] = {}
    for name, module in model.named_modules():
        lazy = lazy_of(module)
        if lazy is not None:
            out.update({f"{name}.{path}" if name else path: (lazy, path) for path in lazy.keys})
    return out


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built within the block get their parameters on the ``meta`` device (buffers are
    created as usual): a parameter is allocated by its layer's constructor and moved at once, so
    at most one layer's parameter is ever in memory."""
    import torch  # deferred: torch is heavy

    original = torch.nn.Module.register_parameter

    def register(self: Any, name: str, param: Any) -> None:
        original(self, name, param)
        p = self._parameters.get(name)
        if p is not None and p.device.type != "meta":
            self._parameters[name] = torch.nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    torch.nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


def _initialise_missing(model: Any, missing: Sequence[str], dtype: Any, device: str, path: Any) -> None:
    """Give the architecture's tensors that the checkpoint lacks (outside the lazy blocks) the
    values ``from_pretrained`` gives them, the model's own ``_init_weights`` (e.g. the pooler of a
    ``BertModel`` saved without it), with a warning, as a resident load does; a model without
    ``_init_weights`` cannot be completed: an error naming the tensors."""
    import warnings

    import torch  # deferred: torch is heavy

    init = getattr(model, "_init_weights", None)
    if init is None:
        raise ValidationError(f"{path} lacks tensors {list(missing)[:5]} of the architecture")
    owners: dict[int, tuple[Any, set[str]]] = {}
    for name in missing:
        owner, leaf = _owner(model, name)
        shape = owner._parameters[leaf].shape
        owner._parameters[leaf] = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device),
                                                     requires_grad=False)
        owners.setdefault(id(owner), (owner, set()))[1].add(leaf)
    with torch.no_grad():
        for owner, leaves in owners.values():
            kept = {k: v.detach().clone() for k, v in owner._parameters.items() if v is not None and k not in leaves}
            init(owner)  # initialises the whole module: the tensors that were loaded go back
            for k, v in kept.items():
                owner._parameters[k].copy_(v)
    warnings.warn(f"{path} lacks tensors {list(missing)[:5]} of the architecture: initialised as "
                  f"transformers' from_pretrained initialises them", stacklevel=3)


@dataclass(frozen=True)
class LazyModel:
    """What :func:`load_lazy_model` made: the model, its lazy blocks and the resident bytes."""

    model: Any
    blocks: tuple[LazyBlock, ...]
    resident_bytes: int

    @property
    def lazy_bytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    @property
    def loads(self) -> int:
        return sum(b.loads for b in self.blocks)


def load_lazy_model(build: Any, checkpoint: Any, stored_names: Any, dtype: Any, device: str,
                    lazy_blocks: Any) -> LazyModel:
    """A model whose blocks ``lazy_blocks(model)`` stay on disk (module docstring).

    ``build()``: constructs the architecture in the run's dtype (called with parameters on ``meta``;
    buffers are created as ``from_pretrained`` creates them);
    ``checkpoint``: the weights; ``stored_names(model) -> {live name: checkpoint name}``;
    ``lazy_blocks(model)``: the block modules to keep on disk (each holds its own weights)."""
    import torch  # deferred: torch is heavy

    with _parameters_on_meta():
        model = build()
    stack = list(lazy_blocks(model))
    names = stored_names(model)
    prefixes = [_module_path(model, block) + "." for block in stack]

    def block_of(live: str) -> int | None:
        return next((i for i, pre in enumerate(prefixes) if live.startswith(pre)), None)

    by_block: list[dict[str, str]] = [{} for _ in stack]
    resident: dict[str, str] = {}
    for live, _ in model.named_parameters(remove_duplicate=False):
        block = block_of(live)
        stored = names.get(live, live)
        if block is not None:
            if stored not in checkpoint:
                fused = live not in names  # stored in pieces that transformers fuses on load (MoE experts)
                raise ValidationError(
                    f"{checkpoint.path}: lazy block tensor {stored!r} is not stored"
                    + (" as it is: transformers builds it on load from tensors stored under other names (a "
                       "mixture of experts' experts, fused into one parameter), which lazy: true cannot read; "
                       "leave lazy off" if fused else " (a block must hold its own weights)"))
            by_block[block][live[len(prefixes[block]):]] = stored
        elif stored in checkpoint:
            resident[live] = stored
    tensors = checkpoint.read_many(list(dict.fromkeys(resident.values())), dtype=dtype, device=device)
    for live, stored in resident.items():
        owner, leaf = _owner(model, live)
        owner._parameters[leaf] = torch.nn.Parameter(tensors[stored], requires_grad=False)
    del tensors
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    missing = [n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta and block_of(n) is None]
    if missing:
        _initialise_missing(model, missing, dtype, device, checkpoint.path)
    for name, buf in list(model.named_buffers()):
        if buf is None:
            continue
        stored = names.get(name, name)
        owner, leaf = _owner(model, name)
        if stored in checkpoint:  # a persistent buffer the checkpoint holds
            owner._buffers[leaf] = checkpoint.get(stored, dtype=buf.dtype, device=device)
        else:
            owner._buffers[leaf] = buf.to(device)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    blocks = tuple(make_lazy(block, keys, checkpoint, dtype, device) for block, keys in zip(stack, by_block))
    # model.parameters() yields a tied parameter once
    resident_bytes = sum(int(p.numel()) * p.element_size() for p in model.parameters() if not p.is_meta)
    return LazyModel(model, blocks, resident_bytes)


def _module_path(model: Any, module: Any) -> str:
    for name, m in model.named_modules():
        if m is module:
            return name
    raise ValidationError("lazy block: the block is not a submodule of the model")


def lazy_summary(models: Sequence[LazyModel]) -> dict[str, Any]:
    """For the report: blocks kept on disk, their bytes, the resident bytes, tensor reads."""
    return {"lazy_blocks": sum(len(m.blocks) for m in models),
            "lazy_bytes": max((m.lazy_bytes for m in models), default=0),
            "resident_bytes": max((m.resident_bytes for m in models), default=0),
            "block_loads": sum(m.loads for m in models)}


__all__ = ["LAZY_ATTR", "LazyBlock", "LazyModel", "lazy_of", "lazy_parameters", "lazy_summary", "load_lazy_model", "make_lazy",
           "run_block"]
