"""The downstream Jacobian ``L_j = d h_j / d u_j`` of the compared output at the base model.

``u_j`` is the merge layer's output for sample ``j`` (``(r,)``, or ``(T, r)`` with ``T``
positions: any shape ``(*positions, r)``, flattened to ``T = prod(positions)``) and ``h_j`` the
compared model output (``output_fn`` of the model output, flattened to ``(c,)``). A forward hook
adds a perturbation ``p`` to the layer output and ``torch.func`` differentiates the model
output with respect to ``p`` at ``p = 0``:

- ``reverse`` mode: one forward pass and ``c`` vector-Jacobian products, vectorised with
  ``vmap`` over the output coordinates (cotangent ``e_o`` for every sample at once);
- ``forward`` mode: ``T * r`` Jacobian-vector products, vectorised over the tangents;
- ``auto``: reverse when ``c <= T * r``, else forward.

Products over the whole batch give per-sample Jacobians because samples do not interact
(``d h_j / d u_i = 0`` for ``i != j``; models are put in eval mode). The Jacobian is exact
for a linear downstream and first-order correct through nonlinearities, and for sequences it
includes how perturbing one position changes the outputs at others (attention). If an
operation has no ``vmap`` batching rule, a plain autograd loop over output coordinates is used.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ValidationError
from .data import batch_len, call_model, checked_call

JACOBIAN_MODES = ("auto", "reverse", "forward")


@dataclass(frozen=True)
class LinearisedBatch:
    """One batch linearised at the merge layer (torch tensors in the model's dtype).

    ``layer_input``: ``(B, T, m)``; ``output``: ``(B, c)`` compared output at the base point;
    ``jacobian``: ``(B, c, T, r)``; ``positions``: the layer output's middle dimensions.
    """

    layer_input: Any
    output: Any
    jacobian: Any
    positions: tuple[int, ...]

    @property
    def T(self) -> int:
        return int(math.prod(self.positions))


def default_output(out: Any) -> Any:
    """The tensor compared by default: the output itself, ``.logits``, or the first element."""
    import torch

    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, Mapping) and "logits" in out:
        return out["logits"]
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise ValidationError(
        f"cannot find the output tensor in a model output of type {type(out).__name__}; "
        f"pass output_fn=... to select it"
    )


def resolve_output_fn(output_fn: Callable[..., Any] | None) -> Callable[[Any, int], Any]:
    """Normalise ``output_fn`` to ``f(model_output, task_index) -> tensor``.

    ``output_fn`` may take ``(output)`` or ``(output, task_index)`` (e.g. to apply a
    task-specific head); ``None`` selects :func:`default_output`.
    """
    if output_fn is None:
        return lambda out, task: default_output(out)
    if not callable(output_fn):
        raise ValidationError(f"output_fn must be callable, got {type(output_fn).__name__}")
    try:
        params = [
            p for p in inspect.signature(output_fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
        ]
    except (TypeError, ValueError):
        params = []
    takes_task = len(params) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)
    if takes_task:
        return lambda out, task: output_fn(out, task)
    return lambda out, task: output_fn(out)


def flatten_output(y: Any, batch: int, where: str) -> Any:
    """``(B, ...)`` -> ``(B, c)``; error naming ``where`` if it is not a batched tensor."""
    import torch

    if not isinstance(y, torch.Tensor):
        raise ValidationError(f"{where}: the compared output is a {type(y).__name__}, not a tensor")
    if y.ndim == 0 or y.shape[0] != batch:
        raise ValidationError(
            f"{where}: the compared output has shape {tuple(y.shape)}; its first dimension "
            f"must be the batch ({batch})"
        )
    return y.reshape(batch, -1)


def _choose_mode(mode: str, c: int, Tr: int) -> str:
    if mode not in JACOBIAN_MODES:
        raise ValidationError(f"jacobian_mode must be one of {JACOBIAN_MODES}, got {mode!r}")
    if mode == "auto":
        return "reverse" if c <= Tr else "forward"
    return mode


def linearise_batch(
    model: Any,
    hook: Any,
    inputs: Any,
    output_fn: Callable[[Any, int], Any],
    task: int = 0,
    *,
    mode: str = "auto",
    chunk_size: int | None = 32,
    vectorize: bool = True,
    where: str = "batch",
    max_jacobian_bytes: float = float("inf"),
    check_independence: bool = False,
) -> LinearisedBatch:
    """Linearise ``model`` at the layer carrying ``hook`` (a registered
    :class:`~mergeqp.stats.hooks.PerturbationHook`) for one batch of ``inputs``.

    ``output_fn`` is already normalised (:func:`resolve_output_fn`). Raises
    :class:`ValidationError` if the layer is not called exactly once per forward pass or
    the Jacobian would exceed ``max_jacobian_bytes``, or when the layer's first dimension is
    not the batch. ``check_independence``: also check, with one extra forward pass, that
    perturbing one sample's layer output changes no other sample's compared output (what the
    per-sample Jacobians assume; it fails for sequence-first layouts inside the model).
    """
    import torch

    calls = hook.calls
    hook.record = True
    try:
        with torch.no_grad():
            out = checked_call(model, inputs, where, "the base model")
    finally:
        hook.record = False
    ncalls = hook.calls - calls
    if ncalls == 0:
        raise ValidationError(
            f"{where}: the merge layer did not run in the forward pass (is it used by this "
            f"model's forward at all? some fused fast paths, such as nn.MultiheadAttention's "
            f"out_proj in eval mode, bypass the module's hooks)"
        )
    if ncalls != 1:
        raise ValidationError(
            f"{where}: the merge layer ran {ncalls} times in one forward pass; it must run "
            f"exactly once (a layer shared or reused inside the model cannot be merged alone)"
        )
    u = hook.layer_output
    z = hook.layer_input
    B = int(u.shape[0])
    B_in = batch_len(inputs, where)
    if B != B_in:
        raise ValidationError(
            f"{where}: the merge layer's output has shape {tuple(u.shape)}, whose first dimension "
            f"({B}) is not the batch size of the inputs ({B_in}); the layer must see samples "
            f"along its first dimension (sequence-first layouts or (B*T, r) reshapes inside the "
            f"model are not supported)"
        )
    positions = tuple(int(s) for s in u.shape[1:-1])
    T = int(math.prod(positions))
    r = int(u.shape[-1])
    h = flatten_output(output_fn(out, task), B, where)
    c = int(h.shape[1])
    nbytes = 8.0 * B * c * T * r
    if nbytes > max_jacobian_bytes:
        raise ValidationError(
            f"{where}: the Jacobian of this batch would take {nbytes / 2**20:.0f} MiB "
            f"(B={B}, c={c}, T={T}, r={r}); use smaller batches or an output_fn that compares "
            f"fewer outputs (e.g. selected logits or a projection)"
        )

    def f(p: Any) -> Any:
        hook.perturbation = p
        try:
            return flatten_output(output_fn(call_model(model, inputs), task), B, where)
        finally:
            hook.perturbation = None

    if check_independence and B > 1:
        _check_samples_independent(f, u, h, where)
    p0 = torch.zeros_like(u)
    chosen = _choose_mode(mode, c, T * r)
    jac = None
    if vectorize:
        try:
            try:
                jac = _vectorised(f, p0, chosen, B, c, T, r, positions, chunk_size)
            except (RuntimeError, NotImplementedError):
                if chosen != "forward":
                    raise
                # some kernels (e.g. CPU flash attention) have no forward-mode AD: reverse mode
                hook.perturbation = None
                jac = _vectorised(f, p0, "reverse", B, c, T, r, positions, chunk_size)
        except (RuntimeError, NotImplementedError) as exc:
            warnings.warn(
                f"vmap over the model failed ({str(exc).splitlines()[0][:200]}); falling back "
                f"to a loop of {c} backward passes per batch",
                RuntimeWarning, stacklevel=3,
            )
            hook.perturbation = None
    if jac is None:
        jac = _looped(f, p0, B, c, T, r)
    return LinearisedBatch(
        layer_input=z.reshape(B, T, z.shape[-1]),
        output=h.detach(),
        jacobian=jac.detach(),
        positions=positions,
    )


def _check_samples_independent(f: Callable[[Any], Any], u: Any, h: Any, where: str) -> None:
    """Perturb sample 0's layer output only; raise if another sample's output moves."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(0)
    noise = torch.randn(tuple(u.shape[1:]), generator=gen, dtype=torch.float64)
    # large enough to stand out of half-precision rounding (sqrt(eps): 0.03 in float16)
    rel = max(1e-3, math.sqrt(float(torch.finfo(u.dtype).eps)))
    scale = rel * (float(u[0].abs().max()) + 1.0)
    p = torch.zeros_like(u)
    p[0] = (scale * noise).to(dtype=u.dtype, device=u.device)
    with torch.no_grad():
        moved = (f(p) - h).abs()
    own = float(moved[0].max())
    others = float(moved[1:].max())
    # independent samples give other outputs that do not move at all (the same computation);
    # allow a few units of rounding of the largest output (nondeterministic kernels)
    eps = float(torch.finfo(h.dtype).eps) if h.is_floating_point() else 0.0
    tol = max(1e-3 * own, 16.0 * eps * float(h.abs().max()))
    if others > tol:
        raise ValidationError(
            f"{where}: perturbing the merge layer's output for sample 0 changed the compared "
            f"output of other samples (by {others:.3g}, against {own:.3g} for sample 0): the "
            f"layer's first dimension must be the batch and samples must not interact (a "
            f"sequence-first layout inside the model, or batch statistics, break this)"
        )


def _vectorised(f: Callable[[Any], Any], p0: Any, mode: str, B: int, c: int, T: int, r: int,
                positions: tuple[int, ...], chunk_size: int | None) -> Any:
    import torch
    from torch.func import jvp, vjp, vmap

    with torch.no_grad(), warnings.catch_warnings():
        # (torch.func transforms still differentiate; parameters are constants.) vmap's notice
        # that an op has no batching rule only says it runs a slower loop: still exact
        warnings.filterwarnings("ignore", message=r"There is a performance drop", category=UserWarning)
        if mode == "reverse":
            _, vjp_fn = vjp(f, p0)
            eye = torch.eye(c, dtype=p0.dtype, device=p0.device)
            cotangents = eye[:, None, :].expand(c, B, c)
            rows = vmap(vjp_fn, chunk_size=chunk_size)(cotangents)[0]  # (c, B, *pos, r)
            return rows.reshape(c, B, T, r).permute(1, 0, 2, 3).contiguous()
        eye = torch.eye(T * r, dtype=p0.dtype, device=p0.device)
        tangents = eye.reshape(T * r, 1, *positions, r).expand(T * r, B, *positions, r)

        def push(v: Any) -> Any:
            return jvp(f, (p0,), (v,))[1]

        with warnings.catch_warnings():  # torch's own forward-AD set-up (first use only)
            warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.*",
                                    category=DeprecationWarning)
            cols = vmap(push, chunk_size=chunk_size)(tangents)  # (T*r, B, c)
        return cols.permute(1, 2, 0).reshape(B, c, T, r).contiguous()


def _looped(f: Callable[[Any], Any], p0: Any, B: int, c: int, T: int, r: int) -> Any:
    import torch

    p = p0.clone().requires_grad_(True)
    with torch.enable_grad():
        y = f(p)
        rows = []
        for o in range(c):
            (grad,) = torch.autograd.grad(y[:, o].sum(), p, retain_graph=o < c - 1,
                                          allow_unused=True)
            rows.append(torch.zeros_like(p0) if grad is None else grad.detach())
    return torch.stack(rows, 1).reshape(B, c, T, r)
