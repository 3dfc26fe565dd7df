"""Qwen 3 (dense): Llama-like blocks (GQA, rotate-half RoPE, SwiGLU MLP, RMSNorm pre-norms) with
per-head QK-RMSNorm (q_norm/k_norm over head_dim, shared by all heads) before RoPE, an explicit
head_dim, optional attention biases and tied embeddings."""
from dataclasses import dataclass
from typing import Dict, Optional, Union

from .. import flashnorm as fn
from . import llama, qwen2
from ..nn import RMSNorm

MODEL_TYPES = ("qwen3",)
GGUF_ARCHITECTURE = "qwen3"  # llama.cpp's name (from_gguf below)

# FlashNorm on this architecture: both pre-norms go (input_layernorm folded into q/k/v_proj with
# Sec. 4 for the QK-norm: q and k need no input 1/RMS, v gets it deferred; post_attention_layernorm
# into gate/up_proj with Sec. 2.2); q_norm/k_norm are fused into RoPE's cos/sin (their per-head
# 1/RMS stays; in an export their weights stay); the final norm goes into the LM head.
FLASHNORM = fn.Mapping(
    pairs=(fn.Pair("input_layernorm", "self_attn", fn.FlashQKNormAttention,
                   ("q_proj", "k_proj", "v_proj")),
           fn.Pair("post_attention_layernorm", "mlp", fn.FlashSwiGLU, ("gate_proj", "up_proj"))),
    trunk="model", tie_key="tie_word_embeddings")


@dataclass
class ModelArgs(llama.BaseArgs):
    num_key_value_heads: Optional[int] = None
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    rope_theta: Optional[float] = None
    rope_scaling: Optional[Dict[str, Union[float, str]]] = None
    tie_word_embeddings: bool = True
    mlp_bias: bool = False  # llama.MLP's; Qwen's MLP has no biases
    # llama.Attention's; not a field (no annotation): not read from config.json
    rope_traditional = False

    def __post_init__(self):
        super().__post_init__()
        self.rope_theta = self.rope_theta or 10000.0


class Attention(llama.Attention):
    """Llama's, with per-head QK-RMSNorm (q_norm/k_norm over head_dim, before RoPE)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.q_norm = RMSNorm(args.head_dim, eps=args.rms_norm_eps)
        self.k_norm = RMSNorm(args.head_dim, eps=args.rms_norm_eps)


class Model(llama.Model):
    """Llama's blocks, trunk and head (models/llama.py) with this file's attention."""

    FLASHNORM = FLASHNORM
    attention = Attention


def from_gguf(tensors, scalar):
    """(config.json dict, HF-named weights) from a qwen3 GGUF (qwen2.gguf_config's keys, plus the
    head size, which Qwen 3 states apart from hidden_size / heads; no attention biases unless the
    file has them)."""
    config = qwen2.gguf_config(tensors, scalar, GGUF_ARCHITECTURE)
    config["head_dim"] = int(scalar(GGUF_ARCHITECTURE + ".attention.key_length",
                                    config["hidden_size"] // config["num_attention_heads"]))
    config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    return config, qwen2.gguf_weights(tensors)
