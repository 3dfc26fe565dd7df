"""FlashNorm (Graef, Wasielewski, Clapp: arXiv 2407.09577) as load-time transformations.

The model files stay plain reference code. Each transformation here takes a (norm, consumer) pair
of a loaded model and replaces it: the norm becomes a DeferredNorm (the residual add and 1/RSS,
handed on as a Deferred value, not applied) and the consumer a flash module that computes the same function with the 1/RMS scale deferred past the matmul and the norm gain
sqrt(n) g either folded into its linear weights (fold=True: weightless, for full precision) or
multiplied onto its input, the weights untouched (fold=False: for quantized weights, which then
equal those of the reference exactly). One class or function per paper section:

    fold_weight, weightless            Sec. 1, Fig. 1(b): weightless normalization
    DeferredLinear, rss_scale          Sec. 1, Fig. 1(c) + Appendix A/B: deferred 1/RMSe
    DeferredNorm, Deferred             what is left of a pre-norm in a model, and its output
    FlashReLUFFN, FlashGLU             Sec. 2.1 / 2.2 (ReGLU, bilinear GLU): toy FFNs
    FlashSwiGLU, FlashFusedSwiGLU      Sec. 2.2: SwiGLU (Llama mlp, OpenELM ffn)
    FlashGeGLU                         Sec. 2.2 with tanh GELU (Gemma mlp)
    FlashAttention                     Sec. 3: 1/RMS and 1/sqrt(h) fused into RoPE's cos/sin
    FlashQKNormAttention               Sec. 4: QK-norm (OpenELM, Qwen 3, Gemma 3), norm weights
                                       fused into cos/sin
    FlashHead, TiedFlashHead           final norm + LM head (untied: folded or input gain; tied:
                                       kept scale vector)
    FlashLayerNormLinear, DyTLinear    Sec. 1.1: LayerNorm / DyT bias moved into the next linear
    merge_mean_centering               Sec. 1.2: mean centering merged into a preceding linear

apply(model, fold=...) rewrites a whole model following the Mapping its model file states
(models/*.py: FLASHNORM, a Pair per pre-norm); remove_norms(model) drops every norm
(a speed ceiling, not the same function). Weights are folded in float32 and cast back to the model
dtype. Why not always fold: quantizing W*g loses far more than quantizing W where g varies inside a
quantization group (SmolLM2 4-bit perplexity +46%, bench/RESULTS.md), so a quantized model keeps g
on the activations. Every linear keeps its path (model.layers.0.self_attn.q_proj stays that), so
per-module quantization settings carry over, and DeferredLinear quantizes to QuantizedDeferredLinear
(a QuantizedLinear becomes one as it is, with apply(fold=False)).
"""
import math
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from . import kernels
from .cache import scaled_dot_product_attention
from .concat import GATE_UP, QKV, heads, held, project
from .errors import UserError
from .nn import RMSNorm

HEADS = ("scale", "untie")
DEFAULT_HEAD = "scale"


# ---------------------------------------------------------------- Sec. 1, Appendix A/B: basics

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


class Pending:
    """A DeferredNorm's work left to its consumer (Sec. 5, decode): the inputs of the residual add
    and 1/RSSe. The consumer's first projection computes them beside its matmul in one kernel
    (kernels.qkv_rope, kernels.gate_up), which also returns p and records it here; any other
    reader settles it through kernels.add_rss, the same operations as without it. A DeferredNorm
    hands it out twice, for its consumer and as the residual stream (residual())."""

    def __init__(self, norm, x, xs, r):
        self.norm, self.x, self.xs, self.r = norm, x, xs, r
        self.p = None  # the residual stream x * xs + r, once computed
        self._settled = None

    @property
    def args(self):
        """kernels.qkv_rope / gate_up's first arguments: x, eps, xs, r, g."""
        return self.x, self.norm.eps, self.xs, self.r, self.norm.get("gain")

    def settle(self):
        if self._settled is None:
            p, pg, s = kernels.add_rss(self.x, self.norm.eps, xs=self.xs, r=self.r, g=self.norm.get("gain"))
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
    if isinstance(x, Pending) and name in module and kernels.fused_supported(kernel, x.x, module[name]):
        return x
    return None


def fused_gate_up(module, x, gate_up, down):
    """Sec. 5 for a SwiGLU FFN: its output (deferred_output) from kernels.gate_up on the Pending x
    and the down projection, or None where the fused kernel does not take x (or down has a bias,
    which must come after the deferred scale)."""
    pending = fused(x, "gate_up", module, gate_up)
    if pending is None or "bias" in module[down]:
        return None
    pending.p, h, s = kernels.gate_up(*pending.args, module[gate_up])
    return deferred_output(module, module[down](h), s)


def fused_qkv(module, x, offset, gains=None, qk_eps=0.0, factor=1.0):
    """Sec. 5 for an attention: (q, k, v) from kernels.qkv_rope on the Pending x (arguments as
    kernels.rope_qkv takes them), or None where the fused kernel does not take x."""
    pending = fused(x, "qkv_rope", module, "qkv_proj")
    if pending is None or not kernels.rope_qkv_supported(module.head_dim, module.traditional):
        return None
    pending.p, q, k, v = kernels.qkv_rope(*pending.args, module.qkv_proj, offset, module._theta,
                                          module.n_heads, module.n_kv_heads, gains, qk_eps, factor)
    return q, k, v


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
    1 (a weight of 0 for a norm with offset 1). The model keeps its structure (an RMSNorm without effective weights), so the result is an
    ordinary checkpoint that any loader runs unchanged. Biases are unaffected: y = (a*g) W^T + c."""
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
            raise ValueError("cannot fold a norm gain into quantized weights: keep it on the input (fold=False)")
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


# ---------------------------------------------------------------- Sec. 2: FFNs

class FlashSwiGLU(nn.Module):
    """Sec. 2.2, SwiGLU after RMSNorm (Llama's mlp: gate_proj, up_proj, down_proj; or one
    concatenated gate_up_proj, concat.py: bias-free, the same computation as FlashFusedSwiGLU's).

    The norm weights are folded into gate and up (or, fold=False, multiplied onto x once for
    both); the gate branch is scaled by s = 1/RMS before SiLU (SiLU is not scale invariant); the up
    branch's scale is deferred past down_proj (all of it is linear). With gate or up biases both
    take s before their bias (down_proj is not scaled)."""

    activation = staticmethod(nn.silu)

    def __init__(self, norm, mlp, fold=True):
        super().__init__()
        folded, self.gain = split_gain(norm, fold)
        self.eps = norm.eps
        for p in held(mlp, GATE_UP):
            setattr(self, p, deferred(mlp[p], folded))
        self.down_proj = deferred(mlp.down_proj)
        self.late = not any("bias" in mlp[p] for p in held(mlp, GATE_UP))  # else s before the biases

    def __call__(self, x):
        if self.activation is nn.silu and (y := fused_gate_up(self, x, "gate_up_proj", "down_proj")) is not None:
            return y
        a, s = deferred_input(self, x)
        late = self.late
        gate, up = project(self, a, GATE_UP, None if late else s)
        h = kernels.gated(self.activation)(gate, s, up) if late else (self.activation(gate) * up).astype(up.dtype)
        if late and "bias" not in self.down_proj:
            return deferred_output(self, self.down_proj(h), s)
        return self.down_proj(h, s if late else None)


class FlashGeGLU(FlashSwiGLU):
    """Sec. 2.2 with GELU (Gemma's mlp: GeGLU, tanh-approximated GELU): as FlashSwiGLU, the gate
    branch scaled by 1/RMS before the (not scale-invariant) GELU, the up branch's scale deferred."""

    activation = staticmethod(nn.gelu_approx)


class FlashFusedSwiGLU(nn.Module):
    """Sec. 2.2 for OpenELM's ffn: proj_1 = [gate; up] (one fused, bias-free matmul), proj_2.
    The gate half is scaled by 1/RMS before SiLU, the up half's scale is deferred to the output."""

    def __init__(self, norm, ffn, fold=True):
        super().__init__()
        if "bias" in ffn.proj_1 or "bias" in ffn.proj_2:
            raise ValueError("FlashFusedSwiGLU needs bias-free proj_1 and proj_2")
        folded, self.gain = split_gain(norm, fold)
        self.eps = norm.eps
        self.proj_1 = deferred(ffn.proj_1, folded)
        self.proj_2 = deferred(ffn.proj_2)

    def __call__(self, x):
        if (y := fused_gate_up(self, x, "proj_1", "proj_2")) is not None:
            return y
        a, s = deferred_input(self, x)
        gate, up = mx.split(self.proj_1(a), 2, axis=-1)
        h = kernels.gated(nn.silu)(gate, s, up)
        return deferred_output(self, self.proj_2(h), s)


class FlashReLUFFN(nn.Module):
    """Sec. 2.1: RMSNorm -> up -> ReLU -> down. ReLU(s*a) = s*ReLU(a) for s >= 0, so the whole
    1/RMS scale moves to the FFN output (before down's bias). up must be bias-free."""

    def __init__(self, norm, up, down, fold=True):
        super().__init__()
        if "bias" in up:
            raise ValueError("Sec. 2.1 needs a bias-free up projection (ReLU(s*a + c) != s*ReLU(a + c))")
        folded, self.gain = split_gain(norm, fold)
        self.eps = norm.eps
        self.up = deferred(up, folded)
        self.down = deferred(down)

    def __call__(self, x):
        return self.down(nn.relu(self.up(gained(self, x))), rss_scale(x, self.eps))


class FlashGLU(nn.Module):
    """Sec. 2.2, ReGLU and bilinear GLU: RMSNorm -> down(act(gate) * up) with act ReLU or the
    identity (both positively homogeneous). Both branches carry s, so one 1/MS = s^2 scale is
    applied at the output. gate and up must be bias-free."""

    ACTIVATIONS = {"relu": nn.relu, "bilinear": lambda a: a}

    def __init__(self, norm, gate, up, down, activation, fold=True):
        super().__init__()
        if activation not in self.ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(self.ACTIVATIONS)} (s*act(a) = act(s*a))")
        if "bias" in gate or "bias" in up:
            raise ValueError("Sec. 2.2 (ReGLU/bilinear) needs bias-free gate and up projections")
        folded, self.gain = split_gain(norm, fold)
        self.eps, self.activation = norm.eps, activation
        self.gate, self.up, self.down = deferred(gate, folded), deferred(up, folded), deferred(down)

    def __call__(self, x):
        s = rss_scale(x, self.eps)
        a = gained(self, x)
        return self.down(self.ACTIVATIONS[self.activation](self.gate(a)) * self.up(a), s * s)


# ---------------------------------------------------------------- Sec. 3/4: attention and RoPE

def rope_frequencies(rope):
    """(position scale, per-pair frequencies theta_i in float32) of a reference RoPE module, with
    angle_i = (scale * pos) * theta_i computed as mx.fast.rope does. nn.RoPE: its scale and
    theta_i = exp(-2i ln(base) / dims); mlx-lm's Llama3RoPE: 1 and 1 / _freqs (mx.fast.rope's
    freqs are inverse frequencies). Other RoPE variants are refused."""
    if type(rope) is nn.RoPE:
        i = mx.arange(rope.dims // 2, dtype=mx.float32)
        return rope.scale, mx.exp(-i * (2 * math.log(rope.base) / rope.dims))
    if type(rope).__name__ == "Llama3RoPE":
        return 1.0, 1.0 / rope._freqs.astype(mx.float32)
    raise UserError(f"FlashNorm supports plain, linear-scaled and llama3 RoPE, not {type(rope).__name__}; "
                    "use norm='rms' for this model")


def rope_tables(frequencies, offset, length, traditional):
    """cos and sin of shape (length, h) for positions offset .. offset+length-1 (offset an int or
    a scalar array; or one offset per row of a batch, (B,): tables (B, 1, length, h)), laid out
    for the rotation used: interleaved (x0,x1),(x2,x3).. (traditional) or rotate-half (i, i+h/2).
    frequencies: rope_frequencies(reference rope)."""
    scale, theta = frequencies
    if getattr(offset, "ndim", 0):
        offset = offset[:, None, None]
    pos = (offset + mx.arange(length)).astype(mx.float32)
    if scale != 1.0:  # x * 1 is x
        pos = pos * scale
    theta = mx.repeat(theta, 2) if traditional else mx.concatenate([theta, theta])  # per column
    angles = pos[..., None] * theta
    return mx.cos(angles), mx.sin(angles)


def rotate(x, traditional):
    """The signed pair swap of RoPE: y = x*cos + rotate(x)*sin. Interleaved: (-x1, x0, -x3, x2, ..);
    rotate-half: (-x[h/2:], x[:h/2])."""
    if traditional:
        pairs = x.reshape(*x.shape[:-1], -1, 2)
        return mx.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    a, b = mx.split(x, 2, axis=-1)
    return mx.concatenate([-b, a], axis=-1)


def permute_gain(g, traditional):
    """Sec. 4.2: the permutation with rotate(x * g) = rotate(x) * permute(g). Interleaved (as in
    the paper): swap each pair (g1, g0, g3, g2, ..). Rotate-half (OpenELM, Llama in MLX): rotate
    pairs element i with i+h/2, so permute swaps the two halves: (g[h/2:], g[:h/2])."""
    if traditional:
        return g.reshape(-1, 2)[:, ::-1].reshape(g.shape)
    a, b = mx.split(g, 2, axis=-1)
    return mx.concatenate([b, a], axis=-1)


def apply_rope(x, cos, sin, traditional, scale=None):
    """x * cos + rotate(x) * sin (times a per-row scale), computed in the tables' float32 and
    rounded once to x's dtype, as mx.fast.rope does."""
    y = x * cos + rotate(x, traditional) * sin
    return (y if scale is None else y * scale).astype(x.dtype)


def attend(q, k, v, mask, cache, out_proj):
    """Cache update, attention with the softmax scale already in q and k, and the output
    projection: the end of both flash attention modules."""
    B, _, L, _ = q.shape
    if cache is not None:
        k, v = cache.update_and_fetch(k, v)
    o = scaled_dot_product_attention(q, k, v, cache=cache, scale=1.0, mask=mask)
    return out_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


def rope_qkv_inputs(module, x):
    """The q, k, v projections of x as kernels.rope_qkv takes them: the output of one qkv_proj
    (OpenELM's, or concat.py's) passed as all three, or three outputs."""
    return (module.qkv_proj(x),) * 3 if "qkv_proj" in module else project(module, x, QKV)


class FlashAttention(nn.Module):
    """Sec. 3, attention with RoPE after RMSNorm (Llama's self_attn).

    The norm weights are folded into q/k/v_proj (or, fold=False, multiplied onto x once for all
    three). s = 1/RMS(x) is one scalar per token; RoPE is
    linear, so s is multiplied into the cos/sin tables (shared by all heads) together with
    h^-1/4 for each of q and k, which makes the softmax scale 1/sqrt(h) fused too (sdpa runs with
    scale 1). V keeps its deferred scale. With biases (Qwen 2) q, k and v all get s before them
    instead, and RoPE runs without s. q/k/v_proj may be one concatenated qkv_proj (concat.py).
    Same call signature, KV cache and mask as the reference; the cache holds the scaled k."""

    def __init__(self, norm, attn, fold=True):
        super().__init__()
        folded, self.gain = split_gain(norm, fold)
        self.eps = norm.eps
        self.n_heads, self.n_kv_heads, self.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        if attn.scale != self.head_dim**-0.5:
            raise ValueError("FlashAttention fuses a 1/sqrt(head_dim) softmax scale only")
        for p in held(attn, QKV):
            setattr(self, p, deferred(attn[p], folded))
        self.o_proj = attn.o_proj
        self.traditional = attn.rope.traditional
        self._rope = rope_frequencies(attn.rope)
        self._theta = self._rope[0] * self._rope[1]  # angle per position (kernels.rope_qkv)
        self.factor = self.head_dim**-0.25  # sqrt of the softmax scale, into q and k each
        self.qkv_bias = any("bias" in attn[p] for p in held(attn, QKV))

    def __call__(self, x, mask=None, cache=None):
        offset = cache.offset if cache is not None else 0
        if (qkv := fused_qkv(self, x, offset, factor=self.factor)) is not None:
            return attend(*qkv, mask, cache, self.o_proj)
        a, s = deferred_input(self, x)
        if not self.qkv_bias and kernels.rope_qkv_supported(self.head_dim, self.traditional):
            q, k, v = kernels.rope_qkv(*rope_qkv_inputs(self, a), s, offset, self._theta, self.n_heads,
                                       self.n_kv_heads, factor=self.factor)
            return attend(q, k, v, mask, cache, self.o_proj)
        q, k, v = heads(self, a, s if self.qkv_bias else None)  # with biases all three get s before them
        c = self.factor
        if not self.qkv_bias:  # s into cos/sin: (B, 1, L, 1), one factor per token, all heads
            v, c = times(v, s[:, None]), (c * s)[:, None].astype(mx.float32)
        cos, sin = rope_tables(self._rope, offset, a.shape[1], self.traditional)
        cos, sin = cos * c, sin * c  # the same tables for q and k
        q, k = apply_rope(q, cos, sin, self.traditional), apply_rope(k, cos, sin, self.traditional)
        return attend(q, k, v, mask, cache, self.o_proj)


class FlashQKNormAttention(nn.Module):
    """Sec. 4, QK-normalization with RoPE: q_norm, k_norm shared by all heads, after either one
    fused qkv_proj (OpenELM's attn, out_proj) or separate q/k/v_proj (Qwen 3, Gemma 3: o_proj;
    or their concatenated qkv_proj, concat.py, which runs as OpenELM's).

    The norm weights are folded into the q/k/v projections (or, fold=False, multiplied onto x).
    4.1: q and k are RMS-normalized again per head, and RMS(s*a) = s*RMS(a), so the input's 1/RMS
    cancels for them: only V gets the deferred s. With epsilon this is not exact: the reference
    normalizes q(x/RMSe(x)) with eps, here the unscaled q(x) (weights times sqrt(n) g), so eps
    weighs differently: the result changes where eps is not negligible against mean(q^2)
    (measured in tests and bench/RESULTS.md, "FlashNorm exactness").
    4.2: the q_norm/k_norm weights g (times sqrt(h), Appendix B, and the square root of the
    softmax scale: h^-1/4, or Gemma's query_pre_attn_scalar^-1/4) are fused into cos/sin:
    RoPE(q*g) = q*(g*cos) + rotate(q)*(permute(g)*sin). The paper writes the interleaved layout; for OpenELM's rotate-half layout permute swaps the halves of g
    (permute_gain). Only the per-head 1/RSSe(q) is computed, and applied after RoPE.
    Without QK-norm (normalize_qk_projections false), s goes into cos/sin as in Sec. 3."""

    def __init__(self, norm, attn, fold=True):
        super().__init__()
        self.eps = norm.eps
        self.n_heads, self.n_kv_heads, self.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        projections = held(attn, QKV)  # one qkv_proj or q/k/v_proj
        if any("bias" in attn[p] for p in projections):
            raise ValueError("FlashQKNormAttention needs bias-free q/k/v projections")
        folded, self.gain = split_gain(norm, fold)
        for p in projections:
            setattr(self, p, deferred(attn[p], folded))
        self.out_name = "out_proj" if "out_proj" in attn else "o_proj"  # OpenELM's, or o_proj
        setattr(self, self.out_name, attn[self.out_name])
        self.traditional = attn.rope.traditional
        self._rope = rope_frequencies(attn.rope)
        self._theta = self._rope[0] * self._rope[1]  # angle per position (kernels.rope_qkv)
        self.factor = c = attn.scale**0.5  # sqrt of the softmax scale, into q and k each
        if "q_norm" in attn:
            self.qk_eps = attn.q_norm.eps
            for name, qk_norm in (("q_gain", attn.q_norm), ("k_gain", attn.k_norm)):
                g = c * norm_gain(qk_norm)
                setattr(self, name, mx.stack([g, permute_gain(g, self.traditional)]))

    def _rope_qk(self, x, cos, sin, gain):
        """RoPE(x / RMSe(x) * g) * sqrt(scale) with g fused into the tables (Sec. 4.2)."""
        xf = x.astype(mx.float32)
        inv = mx.rsqrt(mx.sum(xf * xf, axis=-1, keepdims=True) + x.shape[-1] * self.qk_eps)
        return apply_rope(x, cos * gain[0], sin * gain[1], self.traditional, inv)

    def __call__(self, x, mask=None, cache=None):
        offset = cache.offset if cache is not None else 0
        out_proj = self[self.out_name]
        qk_norm = "q_gain" in self  # Sec. 4; else Sec. 3 with s in cos/sin
        gains, qk_eps = ((self.q_gain, self.k_gain), self.qk_eps) if qk_norm else (None, 0.0)
        if (qkv := fused_qkv(self, x, offset, gains, qk_eps, self.factor)) is not None:
            return attend(*qkv, mask, cache, out_proj)
        a, s = deferred_input(self, x)
        if kernels.rope_qkv_supported(self.head_dim, self.traditional):
            q, k, v = kernels.rope_qkv(*rope_qkv_inputs(self, a), s, offset, self._theta, self.n_heads,
                                       self.n_kv_heads, gains, qk_eps, factor=self.factor)
            return attend(q, k, v, mask, cache, out_proj)
        q, k, v = heads(self, a)
        v = times(v, s[:, None])
        cos, sin = rope_tables(self._rope, offset, a.shape[1], self.traditional)
        if qk_norm:
            q = self._rope_qk(q, cos, sin, self.q_gain)
            k = self._rope_qk(k, cos, sin, self.k_gain)
        else:
            cs = (self.factor * s)[:, None]
            cos, sin = cos * cs, sin * cs  # the same tables for q and k
            q, k = apply_rope(q, cos, sin, self.traditional), apply_rope(k, cos, sin, self.traditional)
        return attend(q, k, v, mask, cache, out_proj)


# ---------------------------------------------------------------- final norm + LM head

def FlashHead(norm, linear, fold=True):
    """Final RMSNorm + an untied LM head (an nn.Linear, or nn.QuantizedLinear with fold=False) as
    one deferred linear (Fig. 1(c)): sqrt(n)*g folded into the head weight (fold) or kept as its
    input gain, logits scaled by the deferred 1/RSSe. For a tied embedding, apply(head="untie")
    passes a copy of the embedding: vocab x dim extra parameters."""
    folded, kept = split_gain(norm, fold)
    head = deferred(linear, folded, norm.eps)
    head.gain = kept  # None: no gain (folded)
    return head


class TiedFlashHead(nn.Module):
    """Final RMSNorm + tied LM head, keeping the embedding shared (the 'scale' variant): the norm
    weights stay as one scale vector, logits = E (x * sqrt(n) g) * 1/RSSe(x); no reduction sits
    between x and the matmul. The embedding is looked up on the model at call time, so it may be
    quantized (or replaced) later; it is not a parameter of this module."""

    def __init__(self, norm, model):
        super().__init__()
        self.eps = norm.eps
        self.scale = norm_gain(norm)
        self._model = lambda: model  # a plain attribute: keeps the embedding out of this subtree

    def __call__(self, x):
        if isinstance(x, Pending):
            x = x.settle()
        if isinstance(x, Deferred):
            xg, s = x.xg, x.s
        else:
            _, xg, s = kernels.add_rss(x, self.eps, g=self.scale)
        return times(self._model().embed_tokens.as_linear(xg), s)


# ---------------------------------------------------------------- Sec. 1.1/1.2: LayerNorm, DyT

def _move_bias(norm, linear, gain):
    """Sec. 1.1: a linear after y = n(x)*g + beta becomes W* = W*gain, c* = c + W beta."""
    out_dims, in_dims = linear.weight.shape
    new_bias = linear.bias.astype(mx.float32) if "bias" in linear else mx.zeros((out_dims,))
    if "bias" in norm:
        new_bias = new_bias + linear.weight.astype(mx.float32) @ norm.bias.astype(mx.float32)
    return fold_weight(linear.weight, gain), new_bias.astype(linear.weight.dtype)


class FlashLayerNormLinear(nn.Module):
    """Sec. 1.1: LayerNorm (weight g, bias beta) followed by a linear (W, c). beta moves to the
    linear's bias (c* = c + W beta), sqrt(n)*g is folded into W, and the 1/RSSe of the centered
    input is deferred to the output (before c*). center=False when Sec. 1.2 already merged the
    mean centering into the preceding linear (merge_mean_centering)."""

    def __init__(self, norm, linear, center=True):
        super().__init__()
        n = linear.weight.shape[1]
        gain = math.sqrt(n) * (norm.weight.astype(mx.float32) if "weight" in norm else mx.ones((n,)))
        out_dims, in_dims = linear.weight.shape
        self.linear = DeferredLinear(in_dims, out_dims, bias=True)
        self.linear.weight, self.linear.bias = _move_bias(norm, linear, gain)
        self.linear.eps = norm.eps
        self.center = center

    def __call__(self, x):
        if self.center:
            x = x - mx.mean(x, axis=-1, keepdims=True)
        return self.linear(x)


def DyTLinear(dyt, linear):
    """Sec. 1.1 for DyT: y = g*tanh(alpha x) + beta then linear(W, c) becomes
    linear(W*g, c + W beta) applied to tanh(alpha x): returns (alpha, the new nn.Linear)."""
    out_dims, in_dims = linear.weight.shape
    new = nn.Linear(in_dims, out_dims, bias=True)
    new.weight, new.bias = _move_bias(dyt, linear, dyt.weight.astype(mx.float32))
    return FlashDyT(dyt.alpha, new)


class FlashDyT(nn.Module):
    """tanh(alpha x) followed by a linear carrying DyT's weight and bias (see DyTLinear)."""

    def __init__(self, alpha, linear):
        super().__init__()
        self.alpha, self.linear = alpha, linear

    def __call__(self, x):
        return self.linear(mx.tanh(self.alpha * x))


def merge_mean_centering(linear):
    """Sec. 1.2: a linear y = x V^T + c followed by mean centering over y's n features equals
    y* = x V*^T + c* with V* = V - s/n, s_i the sum of column i over the outputs (the paper's row
    sums of V in its (in, out) layout), i.e. V* = V - mean(V, axis=0), and c* = c - mean(c).
    The LayerNorm after it then needs no centering: FlashLayerNormLinear(..., center=False)."""
    out_dims, in_dims = linear.weight.shape
    w = linear.weight.astype(mx.float32)
    new = nn.Linear(in_dims, out_dims, bias="bias" in linear)
    new.weight = (w - mx.mean(w, axis=0, keepdims=True)).astype(linear.weight.dtype)
    if "bias" in linear:
        c = linear.bias.astype(mx.float32)
        new.bias = (c - mx.mean(c)).astype(linear.bias.dtype)
    return new


# ---------------------------------------------------------------- whole models

class NoNorm(nn.Module):
    """In place of a norm whose work moved elsewhere (or was removed): m(x) returns x, and
    m(x, residual) the fused residual add alone, (p, p) with p = x + residual."""

    def __call__(self, x, *residual):
        if not residual:
            return x
        p = x if residual[0] is None else x + residual[0]
        return p, p


class Pair(NamedTuple):
    """A pre-norm of a block and what it feeds, as a model file states it: the norm's attribute on
    the block, its consumer's, the flash module replacing the consumer, the consumer's linears
    that take the norm weights in a weightless export (make_weightless), and whether the flash
    module may hand its last deferred scale on to the next DeferredNorm (its output goes straight
    to a residual add) or must apply it (its output feeds a norm first: Gemma's post-norms)."""
    norm: str
    consumer: str
    flash: type
    linears: tuple
    defer_output: bool = True


class Mapping(NamedTuple):
    """How FlashNorm maps onto one architecture; each model file states its own as FLASHNORM
    (models/*.py). pairs: the block's (pre-norm, consumer) Pairs; trunk: the attribute of the
    Model holding the final `norm` (which goes into the LM head); tie_key: the config key saying
    the embedding is tied (set false when an export unties it); kept: the block's norms FlashNorm
    leaves as they are, with why (verify and the README name them)."""
    pairs: tuple
    trunk: str
    tie_key: str
    kept: tuple = ()


def mapping(model):
    """The Mapping the model's architecture file states (its class attribute FLASHNORM)."""
    spec = getattr(type(model), "FLASHNORM", None)
    if spec is None:
        raise UserError(f"FlashNorm has no mapping for model type '{model.args.model_type}' "
                        "(its model file states no FLASHNORM)")
    return spec


def _check_full_precision(model):
    if any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules()):
        raise UserError("folding norm weights needs full-precision weights: dequantize the model "
                        "first (loader.dequantize), or keep the norm gain on the activations "
                        "(flashnorm.apply(model, fold=False))")


def apply(model, head=DEFAULT_HEAD, fold=True, deferred=None):
    """Rewrite a loaded model (in place), as its model file's FLASHNORM Mapping says, to compute the same function with FlashNorm;
    returns it. Every pre-norm becomes a DeferredNorm (residual add, 1/RSSe and any kept gain in one
    pass) and its consumer a flash module reading that Deferred value; the final norm's weights go
    into the LM head (or stay as its DeferredNorm's gain).

    fold=True (full precision only): each norm's sqrt(n) g is folded into the weights of the
    linears it feeds. fold=False: no linear weight is touched (a QuantizedLinear becomes a
    QuantizedDeferredLinear holding the same arrays, nothing is dequantized) and the gain
    multiplies each flash module's input once; quantizing afterwards gives exactly the quantized
    weights of the reference model. Use it for quantized models (bench/RESULTS.md, "Perplexity").

    head: how a tied embedding takes the final norm. "scale" (default) keeps the embedding shared
    and the norm weights as one scale vector (TiedFlashHead): no extra memory. "untie" folds them
    into an untied vocab x dim copy (FlashHead): +156 MiB in float32 for OpenELM-270M (+15%), and
    no faster: CPU decode 3.26 vs 3.33 tokens/s for "scale" (bench/flash_head.py, interleaved, in
    bench/RESULTS.md), since decode is bound by reading weights. An untied model always folds
    into its own lm_head. "untie" exists to fold, so it needs fold=True.

    deferred: False gives Sec. 1's weightless form alone (Fig. 1(b)): with fold, every norm's
    weights folded into the linears it feeds (the final norm's into an untied lm_head), the norms
    kept without effective weights; without fold the model is left as it is. None (default): False
    where our fused kernels do not run on a GPU (kernels.portable: a deferred scale would only add
    element-wise launches beside mx.fast.rms_norm there), else True."""
    if head not in HEADS:
        raise UserError(f"head must be one of {', '.join(HEADS)}, not '{head}'")
    if head == "untie" and not fold:
        raise UserError("head 'untie' folds the final norm into a head copy: it needs fold=True")
    spec = mapping(model)
    if fold:
        _check_full_precision(model)
    if deferred is None:
        deferred = not kernels.portable()
    if not deferred:
        if fold:
            _fold_blocks(model, spec)
            if "lm_head" in model:
                weightless(getattr(model, spec.trunk).norm, [model.lm_head])
        mx.eval(model.parameters())
        return model
    for layer in model.layers:
        for pair in spec.pairs:
            module = pair.flash(getattr(layer, pair.norm), getattr(layer, pair.consumer), fold)
            module.defer_output = pair.defer_output  # an FFN's last scale into the next residual add
            setattr(layer, pair.consumer, module)
            norm = DeferredNorm(module.eps, module.pop("gain", None))
            norm.fuse = not spec.kept  # a kept norm (Gemma's post-norms) reads the residual itself
            setattr(layer, pair.norm, norm)
    trunk = getattr(model, spec.trunk)
    norm = trunk.norm
    if "lm_head" in model:
        model.lm_head = FlashHead(norm, model.lm_head, fold)
    elif head == "untie":
        w = model.embed_tokens.weight
        untied = nn.Linear(w.shape[1], w.shape[0], bias=False)
        untied.weight = w
        model.lm_head = FlashHead(norm, untied)
    else:
        model.lm_head = TiedFlashHead(norm, model)
    gain = model.lm_head.pop("scale", None) if isinstance(model.lm_head, TiedFlashHead) \
        else model.lm_head.pop("gain", None)
    trunk.norm = DeferredNorm(norm.eps, gain)
    mx.eval(model.parameters())
    return model


def remove_norms(model):
    """Replace every RMSNorm (pre-norms, final norm, QK-norms) by an identity, in place. Not the
    same function: the speed ceiling of any norm optimization, as in the paper's table. No linear
    weight is touched, so a quantized model stays as it is."""
    mapping(model)
    norms = [(path, NoNorm()) for path, m in model.named_modules() if isinstance(m, (RMSNorm, nn.RMSNorm))]
    from mlx.utils import tree_unflatten

    model.update_modules(tree_unflatten(norms))
    return model


def _fold_blocks(model, spec):
    """weightless() on every Pair of every block: the pre-norms' weights into their linears."""
    for layer in model.layers:
        for pair in spec.pairs:
            consumer = getattr(layer, pair.consumer)
            weightless(getattr(layer, pair.norm), [consumer[name] for name in held(consumer, pair.linears)])


def make_weightless(model):
    """Sec. 1, Fig. 1(b) on a whole model, in place, keeping its reference structure (for export):
    every pre-norm's weights folded into the linears it feeds and set to 1; the final norm folded
    into the LM head, untying a tied embedding (a head copy is written). QK-norm weights are not
    foldable into a linear (a per-head RMS sits between) and are kept. Returns the model; its
    config says the head is untied. Quantizing this form afterwards quantizes W*g, which costs
    quality at low bits (bench/RESULTS.md, "Perplexity"); a stock loader has no place for the gain
    on the activations, so an export has no other choice."""
    spec = mapping(model)
    _check_full_precision(model)
    _fold_blocks(model, spec)
    trunk = getattr(model, spec.trunk)
    if "lm_head" not in model:
        w = model.embed_tokens.weight
        model.lm_head = nn.Linear(w.shape[1], w.shape[0], bias=False)
        model.lm_head.weight = w
        setattr(model.args, spec.tie_key, False)
        model.config = dict(model.config, **{spec.tie_key: False})
    weightless(trunk.norm, [model.lm_head])
    mx.eval(model.parameters())
    return model
