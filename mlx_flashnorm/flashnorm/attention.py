"""Sec. 3 and 4: attention after a FlashNorm'd pre-norm. The deferred 1/RMS (Sec. 3) or QK-norm's
own per-head 1/RMS and its weights (Sec. 4) go into RoPE's cos/sin tables; V keeps the deferred
scale. One fused kernel per decode row where it runs (Sec. 5: kernels.norm_qkv_rope)."""
import mlx.core as mx
import mlx.nn as nn

from .. import kernels
from ..cache import scaled_dot_product_attention
from ..concat import QKV, heads, held, project
from ..rope import apply_rope, permute_gain, rope_frequencies, rope_tables
from .norm import deferred, deferred_input, fused, norm_gain, split_gain, times


def fused_qkv(module, x, offset, gains=None, qk_eps=0.0, factor=1.0):
    """Sec. 5 for an attention: (q, k, v) from kernels.norm_qkv_rope on the Pending x (arguments as
    kernels.rope_after_qkv takes them), or None where the fused kernel does not take x."""
    pending = fused(x, "qkv_rope", module, "qkv_proj")  # norm_qkv_rope's switch name
    if pending is None or not kernels.rope_after_qkv_supported(module.head_dim, module.traditional):
        return None
    pending.p, q, k, v = kernels.norm_qkv_rope(*pending.args, module.qkv_proj, offset,
                                               module._theta, module.n_heads, module.n_kv_heads,
                                               gains, qk_eps, factor)
    return q, k, v


def attend(q, k, v, mask, cache, out_proj):
    """Cache update, attention with the softmax scale already in q and k, and the output
    projection: the end of both flash attention modules."""
    B, _, L, _ = q.shape
    if cache is not None:
        k, v = cache.update_and_fetch(k, v)
    o = scaled_dot_product_attention(q, k, v, cache=cache, scale=1.0, mask=mask)
    return out_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


def rope_after_qkv_inputs(module, x):
    """The q, k, v projections of x as kernels.rope_after_qkv takes them: the output of one
    qkv_proj (OpenELM's, or concat.py's) passed as all three, or three outputs."""
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
        self._theta = self._rope[0] * self._rope[1]  # angle per position (kernels.rope_after_qkv)
        self.factor = self.head_dim**-0.25  # sqrt of the softmax scale, into q and k each
        self.qkv_bias = any("bias" in attn[p] for p in held(attn, QKV))

    def __call__(self, x, mask=None, cache=None):
        offset = cache.offset if cache is not None else 0
        if (qkv := fused_qkv(self, x, offset, factor=self.factor)) is not None:
            return attend(*qkv, mask, cache, self.o_proj)
        a, s = deferred_input(self, x)
        if not self.qkv_bias and kernels.rope_after_qkv_supported(self.head_dim, self.traditional):
            q, k, v = kernels.rope_after_qkv(*rope_after_qkv_inputs(self, a), s, offset,
                                             self._theta, self.n_heads, self.n_kv_heads,
                                             factor=self.factor)
            return attend(q, k, v, mask, cache, self.o_proj)
        # with biases all three get s before them
        q, k, v = heads(self, a, s if self.qkv_bias else None)
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
    RoPE(q*g) = q*(g*cos) + rotate(q)*(permute(g)*sin). The paper writes the interleaved layout;
    for OpenELM's rotate-half layout permute swaps the halves of g (permute_gain). Only the
    per-head 1/RSSe(q) is computed, and applied after RoPE.
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
        self._theta = self._rope[0] * self._rope[1]  # angle per position (kernels.rope_after_qkv)
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
        if kernels.rope_after_qkv_supported(self.head_dim, self.traditional):
            q, k, v = kernels.rope_after_qkv(*rope_after_qkv_inputs(self, a), s, offset,
                                             self._theta, self.n_heads, self.n_kv_heads, gains,
                                             qk_eps, factor=self.factor)
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
            q, k = (apply_rope(q, cos, sin, self.traditional),
                    apply_rope(k, cos, sin, self.traditional))
        return attend(q, k, v, mask, cache, out_proj)
