"""Gemma 3 (text; Gemma Team, 2025) as in google/gemma-3-*-it config.json (model_type gemma3_text):
RMSNorm scaling by (1 + weight) computed in float32, embeddings times sqrt(hidden_size), four norms
per block (input, post-attention on the attention output before the residual add,
pre-feedforward, post-feedforward), per-head q_norm/k_norm before RoPE, GeGLU MLP (tanh GELU),
softmax scale query_pre_attn_scalar^-1/2, sliding-window (local) layers with their own RoPE base
and a global layer every sliding_window_pattern-th layer, tied embeddings."""
import math
from dataclasses import dataclass
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.rope_utils import initialize_rope

from .. import flashnorm as fn
from . import llama
from .. import nn as fnn
from ..cache import scaled_dot_product_attention
from ..concat import heads, project

MODEL_TYPES = ("gemma3_text",)
GGUF_ARCHITECTURE = "gemma3"  # llama.cpp's name (from_gguf below)

# FlashNorm on this architecture: the two pre-norms go: input_layernorm folded (gain 1 + w) into
# q/k/v_proj with Sec. 4 for the QK-norm (q_norm/k_norm fused into RoPE's cos/sin, their per-head
# 1/RMS stays), pre_feedforward_layernorm into gate/up_proj with Sec. 2.2 (GELU: the gate branch
# scaled before it, the up branch's scale deferred past down_proj); the final norm goes into the
# tied head. The post-norms stay: they normalize a linear's output (o_proj, down_proj) that feeds
# the residual add, not a linear, so there is nothing to fold them into; and the MLP applies its
# deferred scale itself (defer_output False), since post_feedforward_layernorm reads its output.
FLASHNORM = fn.Mapping(
    pairs=(fn.Pair("input_layernorm", "self_attn", fn.FlashQKNormAttention,
                   ("q_proj", "k_proj", "v_proj")),
           fn.Pair("pre_feedforward_layernorm", "mlp", fn.FlashGeGLU, ("gate_proj", "up_proj"),
                   defer_output=False)),
    trunk="model", tie_key="tie_word_embeddings",
    kept=(("post_attention_layernorm", "normalizes o_proj's output before the residual add"),
          ("post_feedforward_layernorm", "normalizes down_proj's output before the residual add")))


@dataclass
class ModelArgs(llama.BaseArgs):
    head_dim: int = 256
    num_key_value_heads: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    rope_scaling: Optional[Dict] = None
    query_pre_attn_scalar: float = 256
    sliding_window: int = 512
    sliding_window_pattern: int = 6
    layer_types: Optional[List[str]] = None  # newer configs: "sliding_attention" / "full_attention"
    max_position_embeddings: int = 32768
    hidden_activation: str = "gelu_pytorch_tanh"
    final_logit_softcapping: Optional[float] = None
    attn_logit_softcapping: Optional[float] = None
    tie_word_embeddings: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.layer_types is None:
            self.layer_types = ["full_attention" if (i + 1) % self.sliding_window_pattern == 0
                                else "sliding_attention" for i in range(self.num_hidden_layers)]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"config.json: layer_types has {len(self.layer_types)} entries, "
                             f"num_hidden_layers is {self.num_hidden_layers}")
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"config.json: hidden_activation '{self.hidden_activation}' is not "
                             "supported (Gemma 3 uses gelu_pytorch_tanh)")
        if self.final_logit_softcapping or self.attn_logit_softcapping:
            raise ValueError("config.json: logit soft-capping (Gemma 2) is not supported")

    def is_sliding(self, layer):
        return self.layer_types[layer] == "sliding_attention"


class RMSNorm(fnn.RMSNorm):
    """x / sqrt(mean(x^2) + eps) * (1 + weight), in float32 whatever the input dtype (weight is
    stored as an offset from 1: zeros at initialization). m(x, residual) -> (o, p),
    p = x + residual, as every norm of the models here (mlx_flashnorm.nn)."""

    offset = 1.0  # the gain is offset + weight (flashnorm.norm_weight reads this)

    def __init__(self, dims, eps=1e-6):
        super().__init__(dims, eps=eps)
        self.weight = mx.zeros((dims,))

    def __call__(self, x, *residual):
        r = residual[0] if residual else None
        o, p = fnn.normalize(x.astype(mx.float32), None if r is None else r.astype(mx.float32),
                             self.weight.astype(mx.float32) + self.offset, eps=self.eps,
                             vjp=self.training)
        return (o.astype(x.dtype), p.astype(x.dtype)) if residual else o.astype(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        dim, h = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = (args.num_attention_heads,
                                                        args.num_key_value_heads, h)
        self.scale = args.query_pre_attn_scalar**-0.5
        self.q_proj = nn.Linear(dim, self.n_heads * h, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * h, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * h, bias=False)
        self.o_proj = nn.Linear(self.n_heads * h, dim, bias=False)
        self.q_norm = RMSNorm(h, eps=args.rms_norm_eps)
        self.k_norm = RMSNorm(h, eps=args.rms_norm_eps)
        if args.is_sliding(layer):  # local layers: their own base, no scaling
            self.rope = initialize_rope(h, args.rope_local_base_freq, False)
        else:
            self.rope = initialize_rope(h, args.rope_theta, False, args.rope_scaling,
                                        args.max_position_embeddings)

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        q, k, v = heads(self, x)  # (B, heads, L, head_dim) each
        q, k = self.q_norm(q), self.k_norm(k)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        o = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, hidden = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x):
        gate, up = project(self, x, ("gate_proj", "up_proj"))
        return self.down_proj(nn.gelu_approx(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.is_sliding = args.is_sliding(layer)
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.self_attn = Attention(args, layer)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.mlp = MLP(args)
        self.post_feedforward_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x, residual, mask=None, cache=None):
        """(x, residual) -> (block output still to be added, new residual), as the Llama blocks:
        h = residual + x; h + post_attn(attn(in(h))) = h'; the output is
        post_ff(mlp(pre_ff(h')))."""
        h, residual = self.input_layernorm(x, residual)
        r = self.post_attention_layernorm(self.self_attn(h, mask, cache))
        h, residual = self.pre_feedforward_layernorm(r, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def embed(self, tokens):
        """Embeddings times sqrt(hidden_size), the factor rounded to bfloat16 as in the reference
        implementation (trained in bfloat16) and in mlx-lm."""
        h = self.embed_tokens(tokens)
        return h * mx.array(math.sqrt(self.args.hidden_size), mx.bfloat16).astype(h.dtype)

    def masks(self, h, cache):
        """(global mask, sliding-window mask) for the blocks."""
        first = {s: next((c for c, layer in zip(cache, self.layers) if layer.is_sliding == s), None)
                 for s in (False, True)}
        return (create_attention_mask(h, first[False]),
                create_attention_mask(h, first[True], window_size=self.args.sliding_window))

    def __call__(self, tokens, cache=None):
        h = self.embed(tokens)
        cache = cache or [None] * len(self.layers)
        # one kernel for every block, the sliding layers' windows as the masks have them
        windows = [self.args.sliding_window if layer.is_sliding else None for layer in self.layers]
        if (fused := fn.decode_stack(self.layers, h, cache, windows)) is not None:
            return self.norm(*fused)[0]
        full, sliding = self.masks(h, cache)
        residual = None
        for layer, c in zip(self.layers, cache):
            h, residual = layer(h, residual, sliding if layer.is_sliding else full, c)
        return self.norm(h, residual)[0]


class Model(llama.Model):
    """Llama's head and properties (models/llama.py) over the Gemma 3 trunk."""

    FLASHNORM = FLASHNORM

    def trunk(self, args):
        return Gemma3Model(args)

    def sanitize(self, weights):
        weights = {k: v for k, v in weights.items() if "rotary_emb" not in k}
        if self.args.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        return weights


# GGUF (llama.cpp) tensor names -> HF names.
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "post_ffw_norm": "post_feedforward_layernorm",
}


def from_gguf(tensors, scalar):
    """(config.json dict, HF-named weights) from a gemma3 GGUF's tensors (GGUF names, as
    gguf.read_tensors gives them) and metadata (scalar(key, default) reads a value). llama.cpp
    stores every norm weight as 1 + w (the gain): 1 is subtracted again. What the metadata lacks,
    llama.cpp fixes for Gemma 3 too: local RoPE base 10000, a global layer every 6th, softmax scale
    1/sqrt(head_dim) (27B, 62 layers: 1/sqrt(hidden_size / heads))."""
    p = "gemma3."
    hidden, heads = int(scalar(p + "embedding_length")), int(scalar(p + "attention.head_count"))
    layers, head_dim = int(scalar(p + "block_count")), int(scalar(p + "attention.key_length", 256))
    config = {
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": int(scalar(p + "feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(scalar(p + "attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(scalar(p + "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(scalar(p + "rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        "sliding_window": int(scalar(p + "attention.sliding_window", 512)),
        "sliding_window_pattern": 6,
        "max_position_embeddings": int(scalar(p + "context_length", 32768)),
        "vocab_size": int(tensors["token_embd.weight"].shape[0]),
        "tie_word_embeddings": not any(k.startswith("output.") for k in tensors),
        "bos_token_id": scalar("tokenizer.ggml.bos_token_id", -1),
        "eos_token_id": scalar("tokenizer.ggml.eos_token_id", -1),
    }
    if scaling := llama.gguf_rope_scaling(scalar, "gemma3"):
        config["rope_scaling"] = scaling
    weights = {}
    for name, w in tensors.items():
        hf = llama.gguf_name(name, _GGUF_LAYER_NAMES)
        if hf.endswith("norm.weight"):
            w = (w.astype(mx.float32) - 1.0).astype(w.dtype)
        weights[hf] = w
    return config, weights
