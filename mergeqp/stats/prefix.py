"""The frozen prefix of a model being merged: blocks below every merge site, computed once per batch.

A merge changes only its sites' weights, so the blocks of a transformer stack below the first
block holding a site compute the same hidden states on a batch every time: in every derivative
pass of the statistics, every evaluation of the calibration objective and every trust-region
step. :func:`frozen_prefix` patches those lower blocks' ``forward`` for the duration of a merge so
that a batch seen before skips them: the first lower block recognises its input (compared
exactly, not by a hash) and the cached output of the last lower block is handed on, the blocks in
between passing their input through. On a real language model whose top blocks are merged this
removes most of the cost of each pass.

What keeps it exact:

- the cached output is used only for an input equal to the one it was computed from, with equal
  other arguments (the attention mask, position ids: since stop 56), and only while no lower
  block's parameter has changed (their versions and storage are compared);
- the first time a cached output is used it is also recomputed and compared (to the rounding of
  the model's dtype); on a mismatch the cache switches itself off for the rest of the merge;
- the lower blocks are constants of every pass of a merge (the sites, where the statistics'
  perturbations enter, all lie above them), so inside ``torch.func`` transforms the value under
  the transform's wrapper is what is compared and the cached output enters as a constant; an
  input carrying a ``vmap`` dimension, or one that autograd tracks, runs the blocks unchanged, as
  does a block stack it does not recognise.

The stack is the model's ``nn.ModuleList`` with the most children of one class (``model.layers``
of Llama, ``transformer.h`` of GPT-2, ``encoder.layer`` of BERT / ViT); its blocks must take the
hidden states as their first argument (or ``hidden_states=``) and the same other arguments, and
return the hidden states (or a tuple that starts with them), as Hugging Face's do.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..io.lazy_model import lazy_of, run_block

#: entries kept at once (batches of calibration and held-out prompts); the oldest is dropped
MAX_ENTRIES = 512


def block_stack(model: Any) -> Any:
    """The model's stack of blocks: the ``nn.ModuleList`` with the most children of one class (at
    least two), or ``None``."""
    import torch  # deferred: torch is heavy

    best, size = None, 1
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > size:
            kinds = {type(m) for m in module}
            if len(kinds) == 1:
                best, size = module, len(module)
    return best


def first_site_block(stack: Any, sites: Sequence[Any]) -> int | None:
    """The index of the lowest block of ``stack`` that holds one of the ``sites`` (modules), or
    ``None`` when a site lies outside every block (nothing below it is known to be frozen)."""
    owner = {}
    for i, block in enumerate(stack):
        for m in block.modules():
            owner[id(m)] = i
    found = [owner.get(id(s)) for s in sites]
    if not found or any(i is None for i in found):
        return None
    return min(found)  # type: ignore[type-var]


@dataclass
class _Entry:
    key: Any
    output: Any
    versions: tuple[Any, ...]
    #: the block's other arguments (:func:`_context`): the attention mask, position ids ...
    context: tuple[Any, ...] = ()


@dataclass
class PrefixCache:
    """The state shared by the patched lower blocks (see the module docstring)."""

    blocks: list[Any]
    enabled: bool = True
    verified: bool = False
    entries: list[_Entry] = field(default_factory=list)
    hits: int = 0
    misses: int = 0
    note: str | None = None
    _active: Any = None
    _pending: tuple[Any, tuple[Any, ...]] | None = None

    #: per block, the ``forward`` it had before the cache patched it (a lazy block's, or ``None``),
    #: given back on exit
    previous: list[Any] = field(default_factory=list)

    def versions(self) -> tuple[Any, ...]:
        # a lazy block (weights on disk, :mod:`mergeqp.io.lazy_model`) reads the same checkpoint each time
        return tuple(("lazy", id(lazy), lazy.generation) if (lazy := lazy_of(b)) is not None
                     else tuple((p.data_ptr(), p._version) for p in b.parameters()) for b in self.blocks)

    def call(self, index: int, *args: Any, **kwargs: Any) -> Any:
        """Block ``index``'s own computation (what it did before the cache patched it)."""
        return run_block(self.blocks[index], *args, **kwargs)

    def lookup(self, key: Any, context: tuple[Any, ...] = ()) -> _Entry | None:
        now = None
        for entry in self.entries:
            if _same(entry.key, key) and len(entry.context) == len(context) \
                    and all(_same(a, b) for a, b in zip(entry.context, context)):
                now = now or self.versions()
                if entry.versions == now:
                    return entry
        return None

    def store(self, output: Any) -> None:
        if self._pending is None:
            return
        key, versions, context = self._pending
        self._pending = None
        if len(self.entries) >= MAX_ENTRIES:
            self.entries.pop(0)
        self.entries.append(_Entry(key, _detached(output), versions, context))


def _same(a: Any, b: Any) -> bool:
    """Two keys' parts are equal: tensors of one shape, dtype and device with equal entries, or equal
    plain values."""
    import torch  # deferred: torch is heavy

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b)))
    return type(a) is type(b) and a == b


def _context(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """The block's arguments besides the hidden states, as part of the cache's key: every tensor (the
    attention mask, position ids, rotary embeddings; copied) by position and name; other values
    (flags such as ``use_cache`` or ``output_router_logits``, which one call path passes and another
    not, and a key-value cache object) are left out. ``None`` when a tensor cannot be compared (one
    carrying a ``vmap`` dimension or tracked by autograd): no cache then. Before stop 56 only the
    hidden states were compared, and two batches with the same token ids and different masks (a
    prompt holding the pad token's text) shared one cached output."""
    import torch  # deferred: torch is heavy

    out: list[Any] = []

    def add(where: Any, value: Any) -> bool:
        if isinstance(value, (tuple, list)):
            return all(add((where, i), v) for i, v in enumerate(value))
        if isinstance(value, torch.Tensor):
            plain = _unwrapped(value)
            if plain is None:
                return False
            out.extend((where, plain.detach().clone()))
        return True

    for i, a in enumerate(args[1:]):
        if not add(i, a):
            return None
    for name in sorted(kwargs):
        if name != "hidden_states" and not add(name, kwargs[name]):
            return None
    return tuple(out)


def _detached(output: Any) -> Any:
    if isinstance(output, tuple):
        return tuple(_detached(x) for x in output)
    return output.detach() if hasattr(output, "detach") else output


def _hidden_of(output: Any) -> Any:
    return output[0] if isinstance(output, tuple) else output


def _with_hidden(output_like: Any, hidden: Any) -> Any:
    return (hidden, *output_like[1:]) if isinstance(output_like, tuple) else hidden


def _unwrapped(x: Any) -> Any:
    """The ordinary tensor under ``x``: ``x`` itself, or the value that ``torch.func`` transforms wrap
    (a derivative pass wraps every tensor it computes, constants too); ``None`` when ``x`` is not a
    tensor, carries a ``vmap`` dimension or is tracked by autograd."""
    import torch  # deferred: torch is heavy

    if not isinstance(x, torch.Tensor):
        return None
    try:
        from torch._C._functorch import get_unwrapped, is_batchedtensor, is_functorch_wrapped_tensor
    except ImportError:  # pragma: no cover - a torch without functorch: only plain tensors
        return None if x.requires_grad else x
    while is_functorch_wrapped_tensor(x):
        if is_batchedtensor(x):
            return None
        x = get_unwrapped(x)
    return None if x.requires_grad else x


def _hidden_arg(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if args else kwargs.get("hidden_states")


def _agree(a: Any, b: Any) -> bool:
    import torch  # deferred: torch is heavy

    if a.shape != b.shape:
        return False
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    eps = float(torch.finfo(a.dtype).eps) if a.is_floating_point() else 0.0
    return float((a64 - b64).norm()) <= 1e3 * eps * float(b64.norm()) + 1e-300


def _patched(cache: PrefixCache, index: int, last: int) -> Any:
    """The ``forward`` of lower block ``index`` (``last``: the index of the last lower block)."""

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self is not cache.blocks[index]:  # a copy of the model (deepcopy)
            return run_block(self, *args, **kwargs)
        if not cache.enabled:
            return cache.call(index, *args, **kwargs)
        hidden = _hidden_arg(args, kwargs)
        if index == 0:
            cache._active, cache._pending = None, None
            plain = _unwrapped(hidden)
            context = _context(args, kwargs) if plain is not None else None
            if plain is not None and context is not None:
                entry = cache.lookup(plain, context)
                if entry is not None and not cache.verified:
                    _verify(cache, entry, plain, args, kwargs)
                if entry is not None and cache.enabled:
                    cache.hits += 1
                    cache._active = entry
                else:
                    cache.misses += 1
                    cache._pending = (plain.detach().clone(), cache.versions(), context)
        entry = cache._active
        if entry is not None:
            if index == last:
                cache._active = None
                return entry.output
            return hidden if not isinstance(entry.output, tuple) else _with_hidden(entry.output, hidden)
        out = cache.call(index, *args, **kwargs)
        if index == last:
            cache.store(out)
        return out

    return forward


def _verify(cache: PrefixCache, entry: _Entry, hidden: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Recompute the lower blocks once from ``hidden`` and compare with the cached output; switch the
    cache off when they differ."""
    import torch  # deferred: torch is heavy

    rest_args = args[1:] if args else ()
    h = hidden
    with torch.no_grad():
        for i in range(len(cache.blocks)):
            call_kwargs = dict(kwargs)
            if args:
                out = cache.call(i, h, *rest_args, **call_kwargs)
            else:
                call_kwargs["hidden_states"] = h
                out = cache.call(i, **call_kwargs)
            h = _hidden_of(out)
    if _agree(h, _hidden_of(entry.output)):
        cache.verified = True
    else:
        cache.enabled = False
        cache.note = ("the frozen-prefix cache was switched off: the lower blocks' recomputed output differs from "
                      "the cached one (a block that depends on more than its input?)")


@contextlib.contextmanager
def frozen_prefix(model: Any, sites: Sequence[Any]) -> Iterator[PrefixCache | None]:
    """Within the block, ``model``'s blocks below every module of ``sites`` are computed once per
    batch (module docstring); yields the :class:`PrefixCache` (``None`` when nothing is frozen:
    no block stack, a site outside it, or a site in the first block). The blocks are restored on
    exit."""
    stack = block_stack(model)
    first = first_site_block(stack, sites) if stack is not None else None
    if not first:
        yield None
        return
    blocks = list(stack)[:first]
    cache = PrefixCache(blocks)
    patched = []
    try:
        for i, block in enumerate(blocks):
            own = vars(block).get("forward")
            if own is not None and lazy_of(block) is None:  # already patched, or a forward of its own
                raise _Skip
            cache.previous.append(own)
            block.forward = types.MethodType(_patched(cache, i, first - 1), block)
            patched.append(block)
    except _Skip:
        _restore(patched, cache.previous)
        yield None
        return
    try:
        yield cache
    finally:
        _restore(patched, cache.previous)


def _restore(blocks: Sequence[Any], previous: Sequence[Any]) -> None:
    """Give each block back the ``forward`` it had (a lazy block's own, or its class's)."""
    for block, own in zip(blocks, previous):
        if own is not None:
            block.forward = own
        else:
            vars(block).pop("forward", None)


class _Skip(Exception):
    pass


__all__ = ["MAX_ENTRIES", "PrefixCache", "block_stack", "first_site_block", "frozen_prefix"]
