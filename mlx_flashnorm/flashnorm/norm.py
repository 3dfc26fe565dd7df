"""FlashNorm's basics (Sec. 1, Appendix A/B): the deferred 1/RMS and what carries it.

    rss_scale, norm_gain, fold_weight  1/RSSe, the gain sqrt(n) g, Fig. 1(b)'s folded weight
    Deferred                           a value whose scale is deferred: (x, x * gain, 1/RSSe)
    Pending                            a DeferredNorm's work left to its consumer's fused kernel
    DeferredNorm                       what is left of a pre-norm in a model: residual add + 1/RSSe
    DeferredLinear                     Fig. 1(c): a linear whose output takes the deferred scale
    NoNorm                             a norm removed (remove_norms): the residual add alone
    weightless                         Fig. 1(b) in place: norm weights folded into the linears
"""
import math
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from .. import kernels



def rss_scale(x, eps):
    """Appendix A/B: 1/RSSe(x) = rsqrt(sum(x^2) + n*eps), computed in float32.

    With the norm weights multiplied by sqrt(n) (norm_gain), x * sqrt(n) * g / RSSe(x) is exactly
    RMSNorm(x) = x * g / sqrt(mean(x^2) + eps): the epsilon is kept and no 1/n is computed."""
    xf = x.astype(mx.float32)
    return mx.rsqrt(mx.sum(xf * xf, axis=-1, keepdims=True) + x.shape[-1] * eps).astype(x.dtype)


def norm_gain(norm, n=None):
    """Appendix B: sqrt(n) * g (float32) for an RMSNorm; g = 1 for a weightless norm."""
    n = n or norm.weight.shape[-1]
    g = norm_weight(norm) if "weight" in norm else mx.ones((n,))
    return math.sqrt(n) * g


def norm_weight(norm):
    """The gain g an RMSNorm multiplies by, in float32: its weight, plus the norm's `offset` where
    it has one (Gemma scales by 1 + weight)."""
    return norm.weight.astype(mx.float32) + getattr(norm, "offset", 0.0)


def fold_weight(weight, gain):
    """Sec. 1, Fig. 1(b): W*[:, i] = gain_i * W[:, i] in MLX's (out, in) layout; folded in float32
    and cast back to the weight's dtype."""
    return (weight.astype(mx.float32) * gain).astype(weight.dtype)


def split_gain(norm, fold):
    """(folded, kept): norm_gain(norm), in float32, to fold into the weights of the linears the
    norm feeds (fold), or to keep for their input (not fold; kernels.add_rss multiplies it in
    float32 and rounds once); the other is None."""
    gain = norm_gain(norm)
    return (gain, None) if fold else (None, gain)


def times(y, s):
    """y * s in y's dtype: the deferred scale s (float32 in half precision, kernels.add_rss)
    applied with one rounding."""
    return y * s if s.dtype == y.dtype else (y * s).astype(y.dtype)


def gained(module, x):
    """x * module.gain where the module keeps the norm gain on the activation side, else x."""
    return times(x, module.gain) if "gain" in module else x


class Deferred(NamedTuple):
    """A value left unnormalized, its scale deferred (Fig. 1(c)): the value is xg * s, per row.
    From a DeferredNorm: x its input p, xg = p * gain (the norm gain kept on the activations; p
    where it was folded into the weights), s = 1/RSSe(p). From a flash FFN: its output before the
    deferred s (x = xg), which the next DeferredNorm multiplies in during its residual add."""
    x: mx.array
    xg: mx.array
    s: mx.array


class NoNorm(nn.Module):
    """In place of a norm whose work moved elsewhere (or was removed): m(x) returns x, and
    m(x, residual) the fused residual add alone, (p, p) with p = x + residual."""

    def __call__(self, x, *residual):
        if not residual:
            return x
        p = x if residual[0] is None else x + residual[0]
        return p, p


class Pending:
    """A DeferredNorm's work left to its consumer (Sec. 5, decode): the inputs of the residual add
    and 1/RSSe. The consumer's first projection computes them beside its matmul in one kernel
    (kernels.norm_qkv_rope, kernels.gate_up), which also returns p and records it here; any other
    reader settles it through kernels.add_rss, the same operations as without it. A DeferredNorm
    hands it out twice, for its consumer and as the residual stream (residual())."""

    def __init__(self, norm, x, xs, r):
        self.norm, self.x, self.xs, self.r = norm, x, xs, r
        self.p = None  # the residual stream x * xs + r, once computed
        self._settled = None

    @property
    def args(self):
        """kernels.norm_qkv_rope / gate_up's first arguments: x, eps, xs, r, g."""
        return self.x, self.norm.eps, self.xs, self.r, self.norm.get("gain")

    def settle(self):
        if self._settled is None:
            p, pg, s = kernels.add_rss(self.x, self.norm.eps, xs=self.xs, r=self.r,
                                       g=self.norm.get("gain"))
            self._settled, self.p = Deferred(p, p if pg is None else pg, s), p
        return self._settled

    def residual(self):
        return self.p if self.p is not None else self.settle().x


class DeferredNorm(nn.Module):
    """What FlashNorm leaves of a pre-norm inside a model: the fused residual add, 1/RSSe and, when
    not folded, the gain, in one pass (kernels.add_rss: one kernel on CUDA). m(x) -> Deferred;
    m(x, residual) -> (Deferred, p) with p = x + residual (the models' fused-residual form). The
    flash module after it reads the Deferred instead of a normalized array. With `fuse` set
    (apply(): a block's pre-norm whose residual only DeferredNorms read) a one-row input gives a
    Pending for both, its work left to the consumer's fused kernel."""

    fuse = False

    def __init__(self, eps, gain=None):
        super().__init__()
        self.eps = eps
        if gain is not None:
            self.gain = gain

    def __call__(self, x, *residual):
        xs = None
        if isinstance(x, Deferred):
            x, xs = x.xg, x.s
        r = residual[0] if residual else None
        if isinstance(r, Pending):
            r = r.residual()
        if self.fuse and residual and x.size == x.shape[-1]:
            pending = Pending(self, x, xs, r)
            return pending, pending
        p, pg, s = kernels.add_rss(x, self.eps, xs=xs, r=r, g=self.get("gain"))
        d = Deferred(p, p if pg is None else pg, s)
        return (d, p) if residual else d


def fused(x, kernel, module, name):
    """The Pending x when the consumer can hand it to the fused kernel `kernel` with its linear
    `name`, else None."""
    if (isinstance(x, Pending) and name in module
            and kernels.fused_supported(kernel, x.x, module[name])):
        return x
    return None


def deferred_input(module, x):
    """(x * gain, 1/RSSe(x)) for a flash module: read from a Deferred (its DeferredNorm did the
    work, or settles it now), or computed here in one pass (standalone use: the module holds eps
    and gain)."""
    if isinstance(x, Pending):
        x = x.settle()
    if isinstance(x, Deferred):
        return x.xg, x.s
    _, xg, s = kernels.add_rss(x, module.eps, g=module.get("gain"))
    return (x if xg is None else xg), s


def deferred_output(module, y, s):
    """y * s, or Deferred(y, y, s) where apply() let the next DeferredNorm apply s."""
    return Deferred(y, y, s) if getattr(module, "defer_output", False) else times(y, s)


def weightless(norm, linears):
    """Sec. 1, Fig. 1(b) in place: fold the norm weights g into each following linear and set g to
    1 (a weight of 0 for a norm with offset 1). The model keeps its structure (an RMSNorm without
    effective weights), so the result is an ordinary checkpoint that any loader runs unchanged.
    Biases are unaffected: y = (a*g) W^T + c."""
    g = norm_weight(norm)
    for linear in linears:
        linear.weight = fold_weight(linear.weight, g)
    norm.weight = mx.full(norm.weight.shape, 1.0 - getattr(norm, "offset", 0.0), norm.weight.dtype)


class _Deferred:
    """Sec. 1, Fig. 1(c): y = ((x * gain) W^T) * s + c, the scale s applied to the matmul output,
    before the bias. gain (optional parameter): the norm gain kept on the input (not folded into
    W). s=None: no scale (bias still added); s None and eps set: s = 1/RSSe(x) of the input
    itself, so the module alone replaces an RMSNorm + Linear pair."""

    eps = None

    def __call__(self, x, s=None):
        if isinstance(x, (Deferred, Pending)) or (s is None and self.eps is not None):
            x, s = deferred_input(self, x)
        else:
            x = gained(self, x)
        y = self._product(x)
        if s is not None:
            y = times(y, s)
        return y + self["bias"] if "bias" in self else y


class DeferredLinear(_Deferred, nn.Linear):
    def _product(self, x):
        return x @ self["weight"].T

    def to_quantized(self, group_size=None, bits=None, mode="affine", quantize_input=False):
        if quantize_input:
            raise ValueError("DeferredLinear: quantized input is not supported")
        q = QuantizedDeferredLinear.from_linear(self, group_size, bits, mode)
        q.eps = self.eps
        if "gain" in self:
            q.gain = self.gain
        return q


class QuantizedDeferredLinear(_Deferred, nn.QuantizedLinear):
    def _product(self, x):
        return kernels.quantized_matmul(x, self["weight"], self["scales"], self.get("biases"),
                                        self.group_size, self.bits, self.mode)


def deferred(linear, gain=None, eps=None):
    """The deferred form of a reference nn.Linear (a DeferredLinear) or nn.QuantizedLinear (a
    QuantizedDeferredLinear), holding its arrays as they are, with gain (e.g. norm_gain) folded
    into the weight (full precision only)."""
    if isinstance(linear, nn.QuantizedLinear):
        if gain is not None:
            raise ValueError("cannot fold a norm gain into quantized weights: "
                             "keep it on the input (fold=False)")
        out_dims, packed = linear.weight.shape
        new = QuantizedDeferredLinear(packed * 32 // linear.bits, out_dims, "bias" in linear,
                                      linear.group_size, linear.bits, linear.mode)
    else:
        new = DeferredLinear(linear.weight.shape[1], linear.weight.shape[0], "bias" in linear)
    new.update(linear.parameters())
    if gain is not None:
        new.weight = fold_weight(linear.weight, gain)
    new.eps = eps
    return new
