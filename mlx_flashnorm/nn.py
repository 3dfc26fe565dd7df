"""Normalization layers and the general normalize operator with a fused residual add.

The operator (over the last axis, d = its size):

    p     = x + residual            (or x)
    q     = p   or   p - mean(p)    (center)
    sigma = sqrt(q.q / d + eps)
    r     = q / sigma
    o     = c / sqrt(d) * r * w + b

and ``normalize`` returns ``(o, p)``: ``p`` is the new residual stream, so a stack of
pre-norm layers needs one fused add+norm per layer (see ``normalize``'s docstring).
With ``c = sqrt(d)`` (the default, ``c=None``) this is RMSNorm (center off) or
LayerNorm (center on): ``normalize(x, weight=w, eps=e)[0] == mx.fast.rms_norm(x, w, e)``.

Forward runs the fused add+norm kernel (``kernels.normalize``: Metal or CUDA) when the
default device is a GPU, and otherwise the plain MLX composition on ``mx.fast.rms_norm`` /
``mx.fast.layer_norm``; the modules at inference take the kernel for one row (a decode step)
and the composition for a prompt's rows, where host time decides.  Backward is the closed form
through ``mx.custom_function``'s vjp, whatever ran forward.
"""
import math
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn

from . import forms
from .forms import select_backend
from .kernels.normalize import compose, fused, kernel_ok

__all__ = ["normalize", "RMSNorm", "LayerNorm", "DyT", "plain_norms"]


# ----------------------------------------------------------------------------------
# The differentiable operator: forward by kernel or composition, closed-form backward.

def _forward(path, x, residual, weight, bias, scale, center, eps):
    """(o, p) by the kernel of ``path`` where it takes the inputs, else by the composition."""
    if path != "fallback" and kernel_ok(x, residual, weight, bias):
        return fused(path, x, residual, weight, bias, scale, center, eps)
    return compose(x, residual, weight, bias, scale, center, eps)


def _path(backend, residual):
    """select_backend(backend), but "fallback" for a lone norm under "auto": with nothing to fuse,
    mx.fast.rms_norm / layer_norm is one kernel already."""
    if residual is None and (forms.BACKEND if backend is None else backend) == "auto":
        return "fallback"
    return select_backend(backend)


def _eps(eps, dtype):
    return float(mx.finfo(dtype).eps) if eps is None else float(eps)


@lru_cache(maxsize=None)
def _operator(has_res, has_w, has_b, scale, center, eps, backend):
    def unpack(arrays):
        it = iter(arrays)
        x = next(it)
        return x, *(next(it) if on else None for on in (has_res, has_w, has_b))

    def forward(*arrays):
        x, res, w, b = unpack(arrays)
        o, p = _forward(backend, x, res, w, b, scale, center, eps)
        return (o, p) if has_res else (o,)

    op = mx.custom_function(forward)

    @op.vjp
    def op_vjp(arrays, cotangents, outputs):
        # with one primal or one output, MLX hands over a bare array, not a tuple
        if isinstance(arrays, mx.array):
            arrays = (arrays,)
        if isinstance(cotangents, mx.array):
            cotangents = (cotangents,)
        x, res, w, b = unpack(arrays)
        ct = mx.float64 if x.dtype == mx.float64 else mx.float32
        d = x.shape[-1]
        p = (x if res is None else x + res).astype(ct)
        q = p - p.mean(-1, keepdims=True) if center else p
        sigma = mx.sqrt((q * q).mean(-1, keepdims=True) + eps)
        r = q / sigma
        do = cotangents[0].astype(ct)
        dr = do * scale if w is None else do * (scale * w.astype(ct))
        dq = (dr - (r * dr).mean(-1, keepdims=True) * r) / sigma
        dp = dq - dq.mean(-1, keepdims=True) if center else dq
        grads = [dp.astype(x.dtype)]
        if has_res:
            dp = dp + cotangents[1].astype(ct)  # p is also an output: the residual stream
            grads = [dp.astype(x.dtype), dp.astype(res.dtype)]
        if has_w:
            grads.append((do * r * scale).reshape(-1, d).sum(0).astype(w.dtype))
        if has_b:
            grads.append(do.reshape(-1, d).sum(0).astype(b.dtype))
        return tuple(grads)

    return op


def normalize(x, residual=None, weight=None, bias=None, c=None, center=False, eps=None,
              backend=None, vjp=True):
    """Fused (residual add +) RMSNorm/LayerNorm over the last axis; returns ``(o, p)``.

    p = x + residual (x itself when residual is None); o = c/sqrt(d) * r * w + b with
    r = q / sqrt(q.q/d + eps), q = p - mean(p) if ``center`` else p.

    - ``c=None`` means c = sqrt(d), so ``normalize(x, weight=w, eps=e)[0]`` equals
      ``mx.fast.rms_norm(x, w, e)`` and with ``center=True`` ``mx.fast.layer_norm``.
    - ``eps=None`` means ``mx.finfo(x.dtype).eps`` (torch.nn.RMSNorm's default).
    - ``vjp=False`` skips the custom-VJP wrapper (two graph nodes per call, and a
      StopGradient per input): for inference. The composition path stays differentiable by
      MLX's own rules; the GPU kernel then has no gradient. Modules pass ``self.training``.
    - ``backend``: None uses ``forms.BACKEND``; "auto", "fallback", "metal"
      or "cuda" (the kernel runs only for float32/float16/bfloat16 inputs of one dtype).

    Fused residual over a stack of pre-norm layers f_1..f_n (equal to the naive
    ``x = x + f(norm(x))``)::

        p, r = x, None
        for f in layers:
            q, r = normalize(p, r, w)   # r_k = p_(k-1) + r_(k-1), q_k = norm(r_k)
            p = f(q)
        out = p + r
    """
    scale = 1.0 if c is None else float(c) / math.sqrt(x.shape[-1])
    eps, path = _eps(eps, x.dtype), _path(backend, residual)
    if not vjp:
        return _forward(path, x, residual, weight, bias, scale, bool(center), eps)
    op = _operator(residual is not None, weight is not None, bias is not None, scale, bool(center),
                   eps, path)
    out = op(*(a for a in (x, residual, weight, bias) if a is not None))
    return (out[0], out[1]) if residual is not None else (out[0], x)


# ----------------------------------------------------------------------------------
# Modules (torch.nn semantics).

_ALONE = object()  # m(x) called without a residual argument


def _as_shape(normalized_shape):
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    return tuple(int(n) for n in normalized_shape)


class _Norm(nn.Module):
    """Shared by RMSNorm and LayerNorm: normalizes over the trailing ``normalized_shape``.

    ``m(x)`` returns the normalized x; ``m(x, residual)`` returns ``(o, p)``, the fused
    add+norm of ``normalize`` (p = x + residual, the new residual stream; residual None
    means p = x): the form the models call for every pre-norm.
    """

    center = False

    def __init__(self, normalized_shape, eps, elementwise_affine, bias):
        super().__init__()
        self.normalized_shape = _as_shape(normalized_shape)
        self._last = self.normalized_shape[0] if len(self.normalized_shape) == 1 else None
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = mx.ones(self.normalized_shape)
            if bias:
                self.bias = mx.zeros(self.normalized_shape)

    def __call__(self, x, residual=_ALONE):
        if not self.training and x.shape[-1] == self._last:
            # inference over the last axis (every model here), with as little Python as can be:
            # an eager forward pass (prefill; every decode step on the portable path) calls this
            # 65 times per OpenELM-270M token (bench/RESULTS.md, "Prefill"). The fused kernel
            # runs for one row with a residual (a decode step); a lone norm or the rows of a
            # prompt run mx.fast.rms_norm (on x + r): a custom launch's host cost outweighs the
            # pass it saves there, and an eager prefill is bound by host time
            r = None if residual is _ALONE else residual
            eps = _eps(self.eps, x.dtype)
            w = self.get("weight")
            path = _path(None, r) if x.size == self._last else "fallback"
            if self.center or "bias" in self:
                o, p = _forward(path, x, r, w, self.get("bias"), 1.0, self.center, eps)
            elif path != "fallback" and kernel_ok(x, r, w, None):
                o, p = fused(path, x, r, w, None, 1.0, False, eps)
            else:  # compose's RMSNorm case, without its frames
                p = x if r is None else x + r
                o = mx.fast.rms_norm(p, w, eps)
            return o if residual is _ALONE else (o, p)
        shape = self.normalized_shape
        if tuple(x.shape[x.ndim - len(shape):]) != shape:
            raise ValueError(f"input shape {x.shape} does not end with {shape}")
        flat = x.shape[:x.ndim - len(shape)] + (math.prod(shape),)
        weight, bias = (getattr(self, n, None) for n in ("weight", "bias"))
        alone = residual is _ALONE
        residual = None if alone else residual
        o, p = normalize(
            x.reshape(flat), None if residual is None else residual.reshape(flat),
            None if weight is None else weight.reshape(-1),
            None if bias is None else bias.reshape(-1), center=self.center, eps=self.eps,
            vjp=self.training)
        if alone:
            return o.reshape(x.shape)
        return o.reshape(x.shape), p.reshape(x.shape)

    def _extra_repr(self):
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")


class RMSNorm(_Norm):
    """torch.nn.RMSNorm: x / sqrt(mean(x^2) + eps) * weight over the trailing
    ``normalized_shape``; ``eps=None`` is the machine epsilon of the input's dtype."""

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True):
        super().__init__(normalized_shape, eps, elementwise_affine, bias=False)


class PlainRMSNorm(RMSNorm):
    """An RMSNorm where no norm kernel can run: the inference call is mx.fast.rms_norm on x + r
    and nothing else, as mlx-lm's RMSNorm is (no per-call path decision: less graph building on
    each of the 65 calls per OpenELM-270M token; bench/LOG.md, "Host work of the eager
    forward"). plain_norms swaps it in at load."""

    def __call__(self, x, residual=_ALONE):  # mx.fast.rms_norm has its own vjp: training too
        eps = _eps(self.eps, x.dtype)
        if residual is _ALONE:
            return mx.fast.rms_norm(x, self.get("weight"), eps)
        p = x if residual is None else x + residual
        return mx.fast.rms_norm(p, self.get("weight"), eps), p


def plain_norms(model):
    """Where no norm kernel can run (the CPU; the portable path, forms.portable()), make every
    RMSNorm of model over one axis a PlainRMSNorm, in place (the same weights and names; only the
    class changes). Decided at load, as FlashNorm's form is; a model keeps its classes after."""
    if select_backend() != "fallback":
        return model
    for _, m in model.named_modules():
        if type(m) is RMSNorm and m._last is not None:
            m.__class__ = PlainRMSNorm
    return model


class LayerNorm(_Norm):
    """torch.nn.LayerNorm: (x - mean) / sqrt(var + eps) * weight + bias over the
    trailing ``normalized_shape``."""

    center = True

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True):
        super().__init__(normalized_shape, eps, elementwise_affine, bias)


class DyT(nn.Module):
    """Dynamic Tanh: weight * tanh(alpha * x) + bias, alpha a learnable scalar."""

    def __init__(self, dim, alpha_init=0.5):
        super().__init__()
        self.alpha = mx.full((1,), alpha_init)
        self.weight = mx.ones((dim,))
        self.bias = mx.zeros((dim,))

    def __call__(self, x):
        return self.weight * mx.tanh(self.alpha * x) + self.bias
