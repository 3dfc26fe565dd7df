"""Our reference models, loaded through load(), against mlx-lm's on the same weights (float32)."""
import mlx.core as mx
import numpy as np
import pytest
from conftest import OPENELM_270M, TINY_LLAMA, make_checkpoint

from mlx_flashnorm import load
from mlx_flashnorm.gguf import read_gguf
from mlx_flashnorm.loader import default_model_path, quantize_like

RTOL = 1e-4  # max |ours - mlx-lm| / max |mlx-lm| over all logits


def max_rel_diff(a, b):
    a, b = np.array(a, dtype=np.float64), np.array(b, dtype=np.float64)
    return np.abs(a - b).max() / np.abs(b).max()


def mlx_lm_model(folder):
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    return model


def check_against_mlx_lm(folder, tokens, tokenizer):
    ours, _ = load(str(folder), norm="rms", dtype="float32", tokenizer=str(tokenizer), progress=False)
    theirs = mlx_lm_model(folder)
    a, b = ours(tokens), theirs(tokens)
    assert a.shape == b.shape == (*tokens.shape, ours.args.vocab_size)
    return max_rel_diff(a, b)


@pytest.fixture(scope="module")
def tokens():
    return mx.array([[1, 306, 4658, 278, 6593, 310, 2834, 338, 29871, 29946, 29906],
                     [1, 450, 4996, 17354, 1701, 29916, 432, 17204, 975, 278, 17366]])


def test_openelm_270m_matches_mlx_lm(tmp_path, tokens, spm_model):
    """OpenELM-270M's first 4 layers (their head counts and FFN widths differ layer by layer) at
    its width, random weights (test_flashnorm's end-to-end test runs all 16)."""
    config = dict(OPENELM_270M, num_transformer_layers=4,
                  **{k: OPENELM_270M[k][:4] for k in ("num_query_heads", "num_kv_heads", "ffn_multipliers")})
    folder, _ = make_checkpoint(tmp_path / "openelm", config, uniform=True)
    assert check_against_mlx_lm(folder, tokens, spm_model) < RTOL


@pytest.mark.parametrize("variant", [
    dict(tie_word_embeddings=True, rope_scaling={"rope_type": "llama3", "factor": 8.0,
         "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True, num_key_value_heads=1),
])
def test_llama_matches_mlx_lm(tmp_path, tokens, variant, spm_model):
    folder, _ = make_checkpoint(tmp_path / "llama", {**TINY_LLAMA, "vocab_size": 32000, **variant})
    assert check_against_mlx_lm(folder, tokens, spm_model) < RTOL


def test_smollm2_gguf_matches_mlx_lm(smollm2):
    """Real weights: our Llama fed the GGUF's Q4_1 tensors equals mlx-lm's llama fed the same."""
    from mlx_lm.models import llama

    model, tokenizer = smollm2
    config, weights, _, _ = read_gguf(default_model_path())
    theirs = llama.Model(llama.ModelArgs.from_dict(config))
    quantize_like(theirs, config["quantization"], weights)  # Q4_1 blocks, Q8_0 embedding
    theirs.load_weights(list(theirs.sanitize(weights).items()), strict=True)
    theirs.set_dtype(mx.float32)  # as load(dtype="float32") does: float16 scales -> float32, exactly
    tokens = mx.array([tokenizer.encode("The quick brown fox jumps over the lazy dog.")])
    assert max_rel_diff(model(tokens), theirs(tokens)) < RTOL


def test_smollm2_answers_sensibly(smollm2):
    from mlx_flashnorm import generate

    model, tokenizer = smollm2
    text = generate(model, tokenizer, "What is the capital of France?", max_tokens=24)
    assert "Paris" in text


def test_gguf_qk_rows_back_in_hf_order():
    """llama.cpp permutes q/k rows as w.reshape(H, 2, h/2, -1).swapaxes(1, 2); we undo exactly that."""
    from mlx_flashnorm.gguf import _unpermute_rows

    heads, h, cols = 3, 8, 5
    hf = mx.arange(heads * h * cols).reshape(heads * h, cols)
    gguf = hf.reshape(heads, 2, h // 2, cols).swapaxes(1, 2).reshape(hf.shape)
    assert not mx.array_equal(gguf, hf)
    assert mx.array_equal(_unpermute_rows(gguf, heads), hf)
