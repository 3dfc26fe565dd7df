"""Small GGUF files written with the gguf package's writer from tiny random checkpoints (llama.cpp's
tensor names and metadata keys), for the loaders' tests."""
import gguf
import numpy as np

from mlx_flashnorm.gguf import _Header
from mlx_flashnorm.loader import default_model_path

HF_TO_GGUF = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
              "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def gguf_name(hf):
    for a, b in HF_TO_GGUF.items():
        hf = hf.replace(a, b)
    return hf.replace("model.layers.", "blk.")


def smollm2_meta():
    """The embedded SmolLM2 GGUF's metadata (its byte-level BPE vocabulary and merges)."""
    return _Header(str(default_model_path())).meta


def add_bpe_tokenizer(writer, meta, pre):
    """The vocabulary and merges of `meta` (a GGUF's metadata) as a gpt2-type tokenizer with
    tokenizer.ggml.pre = pre."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(list(meta["tokenizer.ggml.tokens"]))
    writer.add_token_types([int(t) for t in meta["tokenizer.ggml.token_type"]])
    writer.add_token_merges(list(meta["tokenizer.ggml.merges"]))
    writer.add_bos_token_id(int(meta["tokenizer.ggml.bos_token_id"]))
    writer.add_eos_token_id(int(meta["tokenizer.ggml.eos_token_id"]))


def write_qwen_gguf(path, arch, config, weights, tokenizer_meta=None, pre="qwen2", qtype=None):
    """A qwen2 or qwen3 GGUF of `weights` (HF names, float32) as llama.cpp's converter writes one:
    q/k rows as they are (rotate-half RoPE), 1-D tensors in F32, 2-D ones in qtype (F32 default)."""
    qtype = qtype or gguf.GGMLQuantizationType.F32
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    if "head_dim" in config:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if tokenizer_meta is not None:
        add_bpe_tokenizer(writer, tokenizer_meta, pre)
    for hf, w in weights.items():
        w = np.array(w, dtype=np.float32)
        t = qtype if w.ndim == 2 else gguf.GGMLQuantizationType.F32
        data = w if t == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(w, t)
        writer.add_tensor(gguf_name(hf), data, raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
