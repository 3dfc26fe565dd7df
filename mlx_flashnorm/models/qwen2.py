"""Qwen 2 / 2.5 (dense): Llama-like blocks (GQA, RoPE, SwiGLU MLP, RMSNorm pre-norms) with biases
on the q, k and v projections (none on o_proj or the MLP), and tied or untied embeddings."""
from dataclasses import dataclass
from typing import Dict, Optional, Union

from . import llama

MODEL_TYPES = ("qwen2",)
GGUF_ARCHITECTURE = "qwen2"  # llama.cpp's name (from_gguf below)

# FlashNorm on this architecture: Llama's (both pre-norms go: input_layernorm folded into
# q/k/v_proj with Sec. 3; their biases take the deferred 1/RMS before the bias, q/k outside RoPE's
# cos/sin; post_attention_layernorm into gate/up_proj with Sec. 2.2); the final norm goes into the
# LM head. No norm is left.
FLASHNORM = llama.FLASHNORM


@dataclass
class ModelArgs(llama.BaseArgs):
    num_key_value_heads: Optional[int] = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    rope_theta: Optional[float] = None
    rope_traditional: bool = False
    use_sliding_window: bool = False
    rope_scaling: Optional[Dict[str, Union[float, str]]] = None
    tie_word_embeddings: bool = True
    mlp_bias: bool = False  # llama.MLP's; Qwen's MLP has no biases

    def __post_init__(self):
        if self.use_sliding_window:
            raise ValueError("config.json: use_sliding_window=true Qwen 2 variants are not "
                             "supported")
        super().__post_init__()
        self.rope_theta = self.rope_theta or 1000000.0

    @property
    def head_dim(self):  # not a field: config.json does not state it
        return self.hidden_size // self.num_attention_heads


class Attention(llama.Attention):
    """Llama's, with biases on q/k/v_proj only (config.json does not state them)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, qkv_bias=True, o_bias=False)


class Model(llama.Model):
    """Llama's blocks, trunk and head (models/llama.py) with this file's attention."""

    FLASHNORM = FLASHNORM
    attention = Attention


def gguf_config(tensors, scalar, arch):
    """The config.json keys Qwen 2 and Qwen 3 share, from a GGUF's metadata under `arch.`. llama.cpp
    keeps Qwen's q/k rows as Hugging Face has them (rotate-half RoPE: nothing to unpermute)."""
    p = f"{arch}."
    heads = int(scalar(p + "attention.head_count"))
    config = {
        "model_type": arch,
        "hidden_size": int(scalar(p + "embedding_length")),
        "num_hidden_layers": int(scalar(p + "block_count")),
        "intermediate_size": int(scalar(p + "feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(scalar(p + "attention.head_count_kv", heads)),
        "rms_norm_eps": float(scalar(p + "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(scalar(p + "rope.freq_base", 1_000_000.0)),
        "max_position_embeddings": int(scalar(p + "context_length", 32768)),
        "vocab_size": int(tensors["token_embd.weight"].shape[0]),
        "tie_word_embeddings": not any(k.startswith("output.") for k in tensors),
        "bos_token_id": scalar("tokenizer.ggml.bos_token_id", -1),
        "eos_token_id": scalar("tokenizer.ggml.eos_token_id", -1),
    }
    if scaling := llama.gguf_rope_scaling(scalar, arch):
        config["rope_scaling"] = scaling
    return config


def gguf_weights(tensors):
    """GGUF tensor names -> HF names (llama.gguf_name)."""
    return {llama.gguf_name(name): w for name, w in tensors.items()}


def from_gguf(tensors, scalar):
    """(config.json dict, HF-named weights) from a qwen2 GGUF's tensors and metadata (scalar(key,
    default) reads a value), as models/gemma3.py's from_gguf."""
    return gguf_config(tensors, scalar, GGUF_ARCHITECTURE), gguf_weights(tensors)
