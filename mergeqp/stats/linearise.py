"""The linearisation core: derivatives of a model's compared output with respect to the
outputs of hooked layers, shared by every producer of statistics (:mod:`mergeqp.stats.collect`,
:mod:`mergeqp.merge.firstorder`, :mod:`mergeqp.merge.outputbasis`).

``u`` is a hooked layer's output for one batch (``(B, *positions, r)``, ``T = prod(positions)``)
and ``h`` the compared model output (flattened to ``(B, c)``). A forward hook
(:class:`~mergeqp.stats.hooks.PerturbationHook`) adds a perturbation ``p`` to the layer output,
so ``f(p) = h`` of the perturbed model, and ``torch.func`` differentiates ``f`` at ``p = 0``.
The pieces, in the order a producer uses them:

- :func:`~mergeqp.stats.hooks.hooked_layers`: eval mode, frozen parameters, one hook per layer;
- :func:`run_recorded`: one forward pass without gradients that records every hooked layer's
  input and output and checks that each ran exactly once;
- :func:`perturbed_output`: ``f`` for one hooked layer;
- :class:`OutputDerivatives`: for one batch and layer, directional derivatives ``(d f)[v]``
  along tangents ``v`` (``(n, B, *positions, r)``) and the full per-sample Jacobian
  ``L_j = d h_j / d u_j`` (``(B, c, T, r)``). Two ways, chosen by counting (:func:`choose_mode`):

  - ``forward``: one Jacobian-vector product per tangent, vectorised with ``vmap``
    (``n`` JVPs; for the full Jacobian the ``T r`` unit tangents);
  - ``reverse``: one forward pass and ``c`` vector-Jacobian products (cotangent ``e_o`` for
    every sample at once, vectorised over ``o``), then the tangents are contracted with the
    Jacobian (``c`` VJPs whatever ``n``);
  - ``auto``: reverse when ``c <= n``, else forward.

  If an operation has no forward-mode AD (e.g. CPU flash attention) forward falls back to
  reverse; if it has no ``vmap`` batching rule, a plain autograd loop over the ``c`` outputs.
- :func:`linearise_batch`: the per-sample Jacobian of one batch with the checks the
  per-sample statistics need (the batch is the layer's first dimension, samples independent);
- :class:`~mergeqp.stats.gauss_newton.GaussNewtonSums`: the float64 sums ``H_t``, ``g_t``.

Products over the whole batch give per-sample Jacobians because samples do not interact
(``d h_j / d u_i = 0`` for ``i != j``; models are put in eval mode): reverse mode and the full
Jacobian rely on it. Forward-mode directional derivatives along tangents that perturb every
sample need no such assumption. The Jacobian is exact for a
linear downstream and first-order correct through nonlinearities, and for sequences it
includes how perturbing one position changes the outputs at others (attention).
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
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
    import torch  # deferred: torch is heavy

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
    import torch  # deferred: torch is heavy

    if not isinstance(y, torch.Tensor):
        raise ValidationError(f"{where}: the compared output is a {type(y).__name__}, not a tensor")
    if y.ndim == 0 or y.shape[0] != batch:
        raise ValidationError(
            f"{where}: the compared output has shape {tuple(y.shape)}; its first dimension "
            f"must be the batch ({batch})"
        )
    return y.reshape(batch, -1)




def check_mode(mode: str) -> None:
    """Raise :class:`ValidationError` unless ``mode`` is one of :data:`JACOBIAN_MODES`."""
    if mode not in JACOBIAN_MODES:
        raise ValidationError(f"jacobian_mode must be one of {JACOBIAN_MODES}, got {mode!r}")


def choose_mode(mode: str, n_outputs: int, n_tangents: int) -> str:
    """``"forward"`` or ``"reverse"`` for ``mode`` (one of :data:`JACOBIAN_MODES`), by counting:
    derivatives along ``n_tangents`` tangents of ``n_outputs`` compared outputs cost
    ``n_tangents`` JVPs forward or ``n_outputs`` VJPs in reverse; ``auto`` takes the fewer
    (reverse on a tie, as it needs one forward pass less)."""
    check_mode(mode)
    if mode == "auto":
        return "reverse" if n_outputs <= n_tangents else "forward"
    return mode


def leads_with_samples(layer_output: Any, samples: int) -> bool:
    """Whether a hooked layer's output ``(B, *positions, r)`` leads with the batch's ``samples``
    (per-sample Jacobians need it). Some models flatten the batch and positions before a layer
    (OPT's ``fc1`` / ``fc2`` see ``(B T, r)``): forward mode still gives exact derivatives there,
    reverse mode's per-sample Jacobian does not exist in that layout."""
    return int(layer_output.shape[0]) == int(samples)


class NotBatchMajor(ValidationError):
    """A flattened layer output whose rows are not each sample's own (no per-sample Jacobian)."""


def _flattened(layer_output: Any, samples: int) -> bool:
    """Whether a layer output ``(samples * T, ...)`` flattens a batch of ``samples`` (``T > 1``)."""
    rows = int(layer_output.shape[0]) if layer_output.dim() else 0
    return samples > 0 and layer_output.dim() >= 2 and rows != samples and rows % samples == 0


def _per_sample(zero: Any, samples: int) -> None:
    if not leads_with_samples(zero, samples):
        raise ValidationError(
            f"the merged layer's output has shape {tuple(zero.shape)} for a batch of {samples} samples: the model "
            "flattens the batch before this layer, so per-sample (reverse-mode) Jacobians do not apply; use "
            "forward mode (statistics jacobian_mode: forward)")


def run_recorded(call: Callable[[], Any], hooks: Sequence[Any], labels: Sequence[str],
                 where: str) -> Any:
    """Run the model once (``call()``, without gradients) with every hook of ``hooks``
    recording its layer's input and output; return the model output.

    Raises :class:`ValidationError` (prefixed by ``where``, naming the layer by ``labels[i]``)
    unless every hooked layer ran exactly once.
    """
    import torch  # deferred: torch is heavy

    for hook in hooks:
        hook.record, hook.calls = True, 0
    try:
        with torch.no_grad():
            out = call()
    finally:
        for hook in hooks:
            hook.record = False
    for hook, label in zip(hooks, labels):
        if hook.calls == 0:
            raise ValidationError(
                f"{where}: {label} did not run in the forward pass (is it used by this "
                f"model's forward at all? some fused fast paths, such as nn.MultiheadAttention's "
                f"out_proj in eval mode, bypass the module's hooks)"
            )
        if hook.calls != 1:
            raise ValidationError(
                f"{where}: {label} ran {hook.calls} times in one forward pass; it must run "
                f"exactly once (a layer shared or reused inside the model cannot be merged alone)"
            )
    return out


def perturbed_output(hook: Any, call: Callable[[], Any], compare: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``f(p)``: the compared output ``compare(call())`` (``(B, c)``) of the model whose layer
    carrying ``hook`` has ``p`` (the layer output's shape) added to its output."""

    def f(p: Any) -> Any:
        hook.perturbation = p
        try:
            return compare(call())
        finally:
            hook.perturbation = None

    return f


class OutputDerivatives:
    """Derivatives at ``p = 0`` of ``f`` (:func:`perturbed_output`, values ``(B, c)``) for one
    batch and one hooked layer whose output has the shape of ``zero`` (``(B, *positions, r)``,
    zeros in the model's dtype). Results are in the model's dtype.

    ``chunk_size``: tangents (or output coordinates) per ``vmap`` call (``None``: all at once);
    ``vectorize=False`` skips ``vmap`` and loops over the outputs.
    ``rows``: ``(B, s, c)`` (a sketch): the derivatives are those of ``rows_j f_j`` (``s`` outputs
    per sample, ``n_outputs = s``); reverse mode pulls the rows back through ``f`` as its ``s``
    cotangents (under ``vmap``, differentiating through the product instead broadcast ``rows`` to
    ``s`` copies: most of the statistics' time on a language model).
    """

    def __init__(self, f: Callable[[Any], Any], zero: Any, n_outputs: int, *,
                 chunk_size: int | None = None, vectorize: bool = True, rows: Any = None,
                 samples: int | None = None) -> None:
        #: ``samples``: a layer output of ``(samples * T, r)`` (the model flattened batch and positions
        #: before the layer: OPT's fc1 / fc2, a mixture of experts' shared expert) is viewed as
        #: ``(samples, T, r)``: exact for forward mode; per-sample (reverse-mode) Jacobians then check
        #: once that the rows are batch-major (:meth:`_check_batch_major`)
        self._flat_shape: tuple[int, ...] | None = None
        self._batch_major_checked = False
        if samples is not None and _flattened(zero, samples):
            flat = tuple(int(x) for x in zero.shape)
            self._flat_shape = flat
            zero = zero.reshape(samples, flat[0] // samples, *flat[1:])
            flat_f = f

            def f(p: Any) -> Any:
                return flat_f(p.reshape(flat))
        self.raw = f
        self.rows = rows
        if rows is not None and int(rows.shape[1]) != int(n_outputs):
            raise ValueError(f"rows have {int(rows.shape[1])} outputs per sample, n_outputs is {n_outputs}")
        self.f = f if rows is None else (lambda p: _row_product(rows, f(p)))
        self.zero = zero
        self.c = int(n_outputs)
        self.chunk_size = chunk_size
        self.vectorize = vectorize
        self._reverse_jacobian: Any = None
        #: the forward-mode overflow warning was given (:meth:`_finite_or_reverse`)
        self._warned_overflow = False

    @property
    def positions(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.zero.shape[1:-1])

    @property
    def T(self) -> int:
        return int(math.prod(self.positions))

    @property
    def r(self) -> int:
        return int(self.zero.shape[-1])

    def push(self, v: Any) -> Any:
        """``(d f)[v]`` (``(B, c)``) along one tangent ``v`` (``zero``'s shape): one JVP."""
        from torch.func import jvp  # deferred: torch is heavy

        v = v.reshape(self.zero.shape)
        try:
            out = jvp(self.f, (self.zero,), (v,))[1]
        except (RuntimeError, NotImplementedError):
            # some kernels (e.g. CPU flash attention) have no forward-mode AD: reverse mode
            return self.along(v.unsqueeze(0), "reverse")[0]
        return self._finite_or_reverse(out, lambda: self.along(v.unsqueeze(0), "reverse")[0])

    def _finite_or_reverse(self, forward: Any, reverse: Callable[[], Any]) -> Any:
        """``forward`` (a forward-mode result) where it is finite; else ``reverse()`` where that is:
        forward-mode derivatives can overflow where reverse mode does not (PyTorch's JVP of a float16
        ``LayerNorm`` whose input's standard deviation is below ~0.05: a review's find, stop 74, that
        was reported as NaN in the user's data), and a warning says so once."""
        import torch  # deferred: torch is heavy

        if bool(torch.isfinite(forward).all()):
            return forward
        backward = reverse()
        if not bool(torch.isfinite(backward).all()):
            return forward  # (non-finite either way: the caller names the data)
        if not self._warned_overflow:
            self._warned_overflow = True
            warnings.warn(f"forward-mode derivatives were not finite ({forward.dtype}; e.g. the JVP of a half-"
                          f"precision LayerNorm overflows) where reverse mode's are: reverse mode used",
                          RuntimeWarning, stacklevel=4)
        return backward

    def along(self, tangents: Any, mode: str = "forward") -> Any:
        """``(d f)[v_i]`` for tangents ``v`` (``(n, *zero.shape)``): ``(n, B, c)``.

        ``mode``: ``forward`` (``n`` JVPs), ``reverse`` (``c`` VJPs, then a contraction with
        the per-sample Jacobian, kept for the next call; exact only when samples do not
        interact, see the module docstring) or ``auto`` (:func:`choose_mode`)."""
        import torch  # deferred: torch is heavy
        from torch.func import jvp, vmap  # deferred: torch is heavy

        n = int(tangents.shape[0])
        if choose_mode(mode, self.c, n) == "forward" and self.vectorize:
            def push(v: Any) -> Any:
                return jvp(self.f, (self.zero,), (v.reshape(self.zero.shape),))[1]

            try:
                with warnings.catch_warnings():
                    _quiet_transforms()
                    out = vmap(push, chunk_size=self.chunk_size)(tangents)
                return self._finite_or_reverse(out, lambda: self.along(tangents, "reverse"))
            except (RuntimeError, NotImplementedError):
                pass  # no forward-mode AD for some op (e.g. CPU flash attention): reverse mode
        jac = self._reverse_jacobian
        if jac is None:
            jac = self._reverse_jacobian = self.jacobian("reverse")
        return torch.einsum("bctr,nbtr->nbc", jac, tangents.reshape(n, -1, self.T, self.r))

    def jacobian(self, mode: str = "auto") -> Any:
        """The per-sample Jacobian ``L_j = d h_j / d u_j``: ``(B, c, T, r)``; ``auto`` counts
        ``c`` VJPs against ``T r`` JVPs. Needs samples that do not interact (module docstring)."""
        chosen = choose_mode(mode, self.c, self.T * self.r)
        self._check_batch_major()
        if self.vectorize:
            try:
                try:
                    out = self._vectorised(chosen)
                    if chosen == "forward":
                        return self._finite_or_reverse(out, lambda: self._vectorised("reverse"))
                    return out
                except (RuntimeError, NotImplementedError):
                    if chosen != "forward":
                        raise
                    # some kernels (e.g. CPU flash attention) have no forward-mode AD: reverse mode
                    return self._vectorised("reverse")
            except (RuntimeError, NotImplementedError) as exc:
                warnings.warn(
                    f"vmap over the model failed ({str(exc).splitlines()[0][:200]}); falling back "
                    f"to a loop of {self.c} backward passes per batch",
                    RuntimeWarning, stacklevel=4,
                )
        return self._looped()

    def _check_batch_major(self) -> None:
        """For a flattened layer output: that every sample's outputs depend on its own block of rows
        only (the model flattened ``(B, T, r)`` batch-major, as ``reshape`` / ``view`` do), by one
        backward pass per sample (randomly weighted outputs, so that no dependence cancels);
        otherwise the per-sample Jacobians of that view would be wrong (a position-major or
        head-major layout whose first sample reads only early rows passed a check of the first
        sample alone: an adversarial review's find), and a :class:`ValidationError` says so."""
        if self._flat_shape is None or self._batch_major_checked:
            return
        import torch  # deferred: torch is heavy

        B = int(self.zero.shape[0])
        p = self.zero.clone().requires_grad_(True)
        gen = torch.Generator(device="cpu").manual_seed(0)
        with torch.enable_grad():
            y = self.raw(p)
            weights = torch.rand(y.shape, generator=gen, dtype=torch.float64).to(device=y.device, dtype=y.dtype) + 0.5
            for b in range(B):
                (grad,) = torch.autograd.grad((y[b] * weights[b]).sum(), p, retain_graph=b < B - 1,
                                              allow_unused=True)
                if grad is None:
                    continue
                outside = torch.cat([grad[:b].reshape(-1), grad[b + 1:].reshape(-1)])
                if bool(torch.any(outside != 0)):
                    raise NotBatchMajor(
                        f"the merged layer's output has shape {self._flat_shape} for a batch of {B} samples, and "
                        f"sample {b}'s outputs depend on rows outside its block: the model mixes samples or lays "
                        "them out position-major (or head-major), so per-sample (reverse-mode) Jacobians do not "
                        "apply; use forward mode (statistics jacobian_mode: forward), or the output-space merge's "
                        "matrix-free solve (jacobian_max_bytes: 0)")
        self._batch_major_checked = True

    def _vectorised(self, mode: str) -> Any:
        import torch  # deferred: torch is heavy
        from torch.func import jvp, vjp, vmap  # deferred: torch is heavy

        p0, B, c, T, r, positions = self.zero, int(self.zero.shape[0]), self.c, self.T, self.r, self.positions
        with torch.no_grad(), warnings.catch_warnings():
            # (torch.func transforms still differentiate; parameters are constants.)
            _quiet_transforms()
            if mode == "reverse":
                if self.rows is None:
                    out, vjp_fn = vjp(self.f, p0)
                    eye = torch.eye(c, dtype=out.dtype, device=out.device)
                    cotangents = eye[:, None, :].expand(c, B, c)
                else:  # each sample's rows are the cotangents of the unsketched outputs
                    out, vjp_fn = vjp(self.raw, p0)
                    cotangents = self.rows.transpose(0, 1).to(out.dtype)  # (s, B, c_raw)
                _per_sample(p0, int(out.shape[0]))
                rows = vmap(vjp_fn, chunk_size=self.chunk_size)(cotangents)[0]  # (c, B, *pos, r)
                return rows.reshape(c, B, T, r).permute(1, 0, 2, 3).contiguous()
            eye = torch.eye(T * r, dtype=p0.dtype, device=p0.device)
            tangents = eye.reshape(T * r, 1, *positions, r).expand(T * r, B, *positions, r)

            def push(v: Any) -> Any:
                return jvp(self.f, (p0,), (v,))[1]

            cols = vmap(push, chunk_size=self.chunk_size)(tangents)  # (T*r, B, c)
        _per_sample(p0, int(cols.shape[1]))
        return cols.permute(1, 2, 0).reshape(B, c, T, r).contiguous()

    def _looped(self) -> Any:
        import torch  # deferred: torch is heavy

        p0, c = self.zero, self.c
        p = p0.clone().requires_grad_(True)
        with torch.enable_grad():
            y = self.f(p) if self.rows is None else self.raw(p)
            _per_sample(p0, int(y.shape[0]))
            rows = []
            for o in range(c):
                picked = y[:, o] if self.rows is None else (y * self.rows[:, o].to(y.dtype)).sum(-1)
                (grad,) = torch.autograd.grad(picked.sum(), p, retain_graph=o < c - 1,
                                              allow_unused=True)
                rows.append(torch.zeros_like(p0) if grad is None else grad.detach())
        return torch.stack(rows, 1).reshape(int(p0.shape[0]), c, self.T, self.r)


def _row_product(rows: Any, values: Any) -> Any:
    """``rows_j values_j`` per sample: ``(B, s, c) x (B, c) -> (B, s)``."""
    import torch  # deferred: torch is heavy

    return torch.einsum("bsc,bc->bs", rows, values)


def _quiet_transforms() -> None:
    """Inside ``warnings.catch_warnings()``: silence what torch.func says that is no problem."""
    # vmap's notice that an op has no batching rule only says it runs a slower loop: still exact
    warnings.filterwarnings("ignore", message=r"There is a performance drop", category=UserWarning)
    # torch's own forward-AD set-up (first use only)
    warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.*", category=DeprecationWarning)


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
    :class:`~mergeqp.stats.hooks.PerturbationHook`) for one batch of ``inputs``: the
    per-sample Jacobian ``(B, c, T, r)`` (:meth:`OutputDerivatives.jacobian`).

    ``output_fn`` is already normalised (:func:`resolve_output_fn`). Raises
    :class:`ValidationError` if the layer is not called exactly once per forward pass or
    the Jacobian would exceed ``max_jacobian_bytes``, or when the layer's first dimension is
    not the batch. ``check_independence``: also check, with two extra forward passes, that
    perturbing the first or the last sample's layer output changes no other sample's compared
    output (what the per-sample Jacobians assume; it fails for sequence-first layouts inside the
    model).
    """
    import torch  # deferred: torch is heavy

    out = run_recorded(lambda: checked_call(model, inputs, where, "the base model"), [hook],
                       ["the merge layer"], where)
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
    f = perturbed_output(hook, lambda: call_model(model, inputs),
                         lambda y: flatten_output(output_fn(y, task), B, where))
    if check_independence and B > 1:
        _check_samples_independent(f, u, h, where)
    derivatives = OutputDerivatives(f, torch.zeros_like(u), c, chunk_size=chunk_size,
                                    vectorize=vectorize)
    jac = derivatives.jacobian(mode)
    return LinearisedBatch(
        layer_input=z.reshape(B, T, z.shape[-1]),
        output=h.detach(),
        jacobian=jac.detach(),
        positions=positions,
    )


def _check_samples_independent(f: Callable[[Any], Any], u: Any, h: Any, where: str) -> None:
    """Perturb the first sample's layer output, then the last's; raise if another sample's output
    moves. Two probes: a sample read only by samples before it (an anti-causal or look-ahead mix
    along a sequence-first layout) moves nothing when the first sample is perturbed."""
    import torch  # deferred: torch is heavy

    B = int(u.shape[0])
    gen = torch.Generator(device="cpu").manual_seed(0)
    noise = torch.randn(tuple(u.shape[1:]), generator=gen, dtype=torch.float64)
    # large enough to stand out of half-precision rounding (sqrt(eps): 0.03 in float16)
    rel = max(1e-3, math.sqrt(float(torch.finfo(u.dtype).eps)))
    # independent samples give other outputs that do not move at all (the same computation);
    # allow a few units of rounding of the largest output (nondeterministic kernels)
    eps = float(torch.finfo(h.dtype).eps) if h.is_floating_point() else 0.0
    for b in (0, B - 1):
        p = torch.zeros_like(u)
        p[b] = (rel * (float(u[b].abs().max()) + 1.0) * noise).to(dtype=u.dtype, device=u.device)
        with torch.no_grad():
            moved = (f(p) - h).abs()
        own = float(moved[b].max())
        others = float(torch.cat([moved[:b], moved[b + 1:]]).max())
        tol = max(1e-3 * own, 16.0 * eps * float(h.detach().abs().max()))
        if others > tol:
            raise ValidationError(
                f"{where}: perturbing the merge layer's output for sample {b} changed the compared "
                f"output of other samples (by {others:.3g}, against {own:.3g} for sample {b}): the "
                f"layer's first dimension must be the batch and samples must not interact (a "
                f"sequence-first layout inside the model, or batch statistics, break this)"
            )
