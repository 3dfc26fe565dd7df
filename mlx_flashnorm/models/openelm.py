"""OpenELM (Mehta et al., 2024) as in Apple's HF checkpoints: layer-wise scaling of heads and
FFN widths, fused qkv projection, QK-RMSNorm shared by all heads, rotate-half RoPE, SwiGLU."""
from dataclasses import dataclass
from typing import List

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import create_attention_mask

from .. import flashnorm as fn
from ..cache import scaled_dot_product_attention
from ..nn import RMSNorm

MODEL_TYPES = ("openelm",)

# FlashNorm on this architecture: both pre-norms go (attn_norm folded into qkv_proj with Sec. 4
# for the QK-norm, ffn_norm into proj_1 with Sec. 2.2); q_norm/k_norm are fused into RoPE's cos/sin
# (their per-head 1/RMS stays; in an export their weights stay); the final norm goes into the head.
FLASHNORM = fn.Mapping(
    pairs=(fn.Pair("attn_norm", "attn", fn.FlashQKNormAttention, ("qkv_proj",)),
           fn.Pair("ffn_norm", "ffn", fn.FlashFusedSwiGLU, ("proj_1",))),
    trunk="transformer", tie_key="share_input_output_layers")


@dataclass
class ModelArgs:
    model_type: str
    model_dim: int
    num_transformer_layers: int
    head_dim: int
    num_query_heads: List[int]
    num_kv_heads: List[int]
    ffn_multipliers: List[float]
    vocab_size: int
    ffn_dim_divisor: int = 256
    ffn_with_glu: bool = True
    normalize_qk_projections: bool = True
    share_input_output_layers: bool = True
    rms_norm_eps: float = 1e-6
    rope_freq_constant: float = 10000
    max_context_length: int = 2048

    @property
    def context_length(self):
        return self.max_context_length

    def __post_init__(self):
        n = self.num_transformer_layers
        for key in ("num_query_heads", "num_kv_heads", "ffn_multipliers"):
            if len(getattr(self, key)) != n:
                raise ValueError(f"config.json: {key} has {len(getattr(self, key))} entries, "
                                 f"num_transformer_layers is {n}")
        if not self.ffn_with_glu:
            raise ValueError("config.json: ffn_with_glu=false OpenELM variants are not supported")


def make_divisible(v, divisor):
    """Round v to the nearest multiple of divisor, never going more than 10% below v."""
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.head_dim = h = args.head_dim
        self.n_heads = args.num_query_heads[layer]
        self.n_kv_heads = args.num_kv_heads[layer]
        self.scale = h**-0.5
        self.qkv_proj = nn.Linear(args.model_dim, (self.n_heads + 2 * self.n_kv_heads) * h,
                                  bias=False)
        self.out_proj = nn.Linear(self.n_heads * h, args.model_dim, bias=False)
        if args.normalize_qk_projections:
            self.q_norm = RMSNorm(h, eps=args.rms_norm_eps)
            self.k_norm = RMSNorm(h, eps=args.rms_norm_eps)
        self.rope = nn.RoPE(h, traditional=False, base=args.rope_freq_constant)

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        qkv = self.qkv_proj(x).reshape(B, L, -1, self.head_dim).transpose(0, 2, 1, 3)
        q, k, v = mx.split(qkv, [self.n_heads, self.n_heads + self.n_kv_heads], axis=1)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        o = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.out_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        dim = args.model_dim
        hidden = int(make_divisible(args.ffn_multipliers[layer] * dim, args.ffn_dim_divisor))
        self.proj_1 = nn.Linear(dim, 2 * hidden, bias=False)  # [gate; up]
        self.proj_2 = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x):
        gate, up = mx.split(self.proj_1(x), 2, axis=-1)
        return self.proj_2(swiglu(gate, up))  # silu(gate) * up


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(args.model_dim, eps=args.rms_norm_eps)
        self.attn = Attention(args, layer)
        self.ffn_norm = RMSNorm(args.model_dim, eps=args.rms_norm_eps)
        self.ffn = FeedForward(args, layer)

    def __call__(self, x, residual, mask=None, cache=None):
        h, residual = self.attn_norm(x, residual)
        h, residual = self.ffn_norm(self.attn(h, mask, cache), residual)
        return self.ffn(h), residual


class OpenELMModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.token_embeddings = nn.Embedding(args.vocab_size, args.model_dim)
        self.layers = [TransformerBlock(args, i) for i in range(args.num_transformer_layers)]
        self.norm = RMSNorm(args.model_dim, eps=args.rms_norm_eps)

    def __call__(self, tokens, cache=None):
        h = self.token_embeddings(tokens)
        cache = cache or [None] * len(self.layers)
        # one kernel for every block
        if (fused := fn.decode_stack(self.layers, h, cache)) is not None:
            return self.norm(*fused)[0]
        mask = create_attention_mask(h, cache[0])
        residual = None
        for layer, c in zip(self.layers, cache):
            h, residual = layer(h, residual, mask, c)
        return self.norm(h, residual)[0]


class Model(nn.Module):
    FLASHNORM = FLASHNORM

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.transformer = OpenELMModel(args)
        if not args.share_input_output_layers:
            self.lm_head = nn.Linear(args.model_dim, args.vocab_size, bias=False)

    def __call__(self, tokens, cache=None):
        h = self.transformer(tokens, cache)
        if "lm_head" in self:
            return self.lm_head(h)
        return self.transformer.token_embeddings.as_linear(h)

    @property
    def layers(self):
        return self.transformer.layers

    @property
    def embed_tokens(self):
        return self.transformer.token_embeddings

    def sanitize(self, weights):
        # HF checkpoints keep nothing we do not use; a tied model may still carry an lm_head copy.
        if self.args.share_input_output_layers:
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        return weights
