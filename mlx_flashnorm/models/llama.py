"""Llama family (Llama 2/3, SmolLM2, TinyLlama, Mistral-style): GQA, RoPE (incl. llama3
scaling), SwiGLU MLP, RMSNorm pre-norms, optional biases and tied embeddings."""
from dataclasses import dataclass
from typing import Dict, Optional, Union

import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.rope_utils import initialize_rope

from .. import flashnorm as fn
from ..cache import scaled_dot_product_attention
from ..concat import heads, project
from ..errors import UserError
from ..nn import RMSNorm

MODEL_TYPES = ("llama", "mistral")  # config.json model_type values this file serves

# FlashNorm on this architecture: both pre-norms of a block feed linears and go (folded into
# q/k/v and gate/up, or kept as their input gain; 1/RMS deferred, Sec. 3 and 2.2); the final norm
# goes into the LM head. No norm is left.
FLASHNORM = fn.Mapping(
    pairs=(fn.Pair("input_layernorm", "self_attn", fn.FlashAttention,
                   ("q_proj", "k_proj", "v_proj")),
           fn.Pair("post_attention_layernorm", "mlp", fn.FlashSwiGLU, ("gate_proj", "up_proj"))),
    trunk="model", tie_key="tie_word_embeddings")


@dataclass
class BaseArgs:
    """The config.json keys every Llama-like file here reads (llama, qwen2, qwen3 and gemma3 each
    add their own, with num_key_value_heads and max_position_embeddings), the context length and
    the check of the KV heads (a subclass's __post_init__ calls this one)."""
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int

    @property
    def context_length(self):
        return self.max_position_embeddings

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("config.json: num_attention_heads must be a multiple of "
                             "num_key_value_heads")


@dataclass
class ModelArgs(BaseArgs):
    rms_norm_eps: float = 1e-6
    head_dim: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_theta: float = 10000
    rope_traditional: bool = False
    rope_scaling: Optional[Dict[str, Union[float, str]]] = None
    tie_word_embeddings: bool = True

    def __post_init__(self):
        super().__post_init__()
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, qkv_bias=None, o_bias=None):
        """The biases (of q/k/v_proj, of o_proj) are args.attention_bias where not given (Qwen 2's
        config.json does not state them)."""
        super().__init__()
        dim, h = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = (args.num_attention_heads,
                                                        args.num_key_value_heads, h)
        self.scale = h**-0.5
        bias = args.attention_bias if qkv_bias is None else qkv_bias
        self.q_proj = nn.Linear(dim, self.n_heads * h, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * h, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * h, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * h, dim, bias=bias if o_bias is None else o_bias)
        self.rope = initialize_rope(h, args.rope_theta, args.rope_traditional, args.rope_scaling,
                                    args.max_position_embeddings)

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        q, k, v = heads(self, x)  # (B, heads, L, head_dim) each
        if "q_norm" in self:  # QK-norm (Qwen 3's attention): per head, before RoPE
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
        dim, hidden, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def __call__(self, x):
        gate, up = project(self, x, ("gate_proj", "up_proj"))
        return self.down_proj(swiglu(gate, up))  # silu(gate) * up


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, attention=Attention):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.self_attn = attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.mlp = MLP(args)

    def __call__(self, x, residual, mask=None, cache=None):
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, mask, cache), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, attention=Attention):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args, attention) for _ in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, tokens, cache=None):
        h = self.embed_tokens(tokens)
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
    """The Llama model; Llama-like architectures (Qwen 2/3, Gemma 3) subclass it with their own
    attention or trunk."""

    FLASHNORM = FLASHNORM
    attention = Attention

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = self.trunk(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, tokens, cache=None):
        h = self.model(tokens, cache)
        if "lm_head" in self:
            return self.lm_head(h)
        return self.model.embed_tokens.as_linear(h)

    def trunk(self, args):
        return LlamaModel(args, self.attention)

    @property
    def layers(self):
        return self.model.layers

    @property
    def embed_tokens(self):
        return self.model.embed_tokens

    def sanitize(self, weights):
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        return weights


def gguf_rope_scaling(scalar, arch, llama3_table=False):
    """config.json's rope_scaling from a GGUF's `ARCH.rope.scaling.*` metadata (scalar(key, default)
    reads a value): None or linear. Any other type (yarn, longrope), or llama3's frequency table
    (llama3_table: the file holds rope_freqs.weight), is a UserError rather than a model that
    would silently compute with unscaled positions."""
    scaling = scalar(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        return {"rope_type": "linear", "factor": float(scalar(f"{arch}.rope.scaling.factor"))}
    if scaling == "none" and not llama3_table:
        return None
    raise UserError("GGUF RoPE scaling "
                    f"'{'llama3 (rope_freqs)' if scaling == 'none' else scaling}' is not "
                    f"supported for {arch}; use the model's Hugging Face checkpoint")


# llama.cpp's tensor names -> Hugging Face's, for Llama-like files (Qwen 2/3 share them; q_norm and
# k_norm are Qwen 3's); gemma3.py passes its own layer table.
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                  "output": "lm_head"}


def gguf_name(name, layer_names=GGUF_LAYER_NAMES):
    """A GGUF tensor's Hugging Face name
    (blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight; the quantized parts
    .scales/.biases follow their weight)."""
    parts = name.split(".")
    if parts[0] == "blk":
        return ".".join([f"model.layers.{parts[1]}.{layer_names.get(parts[2], parts[2])}"]
                        + parts[3:])
    return ".".join([GGUF_TOP_NAMES.get(parts[0], parts[0])] + parts[1:])
