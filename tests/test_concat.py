"""Concatenated projections (mlx_flashnorm/concat.py): q/k/v_proj as one qkv_proj and gate/up_proj
as one gate_up_proj compute the same logits as the separate linears, in every architecture, norm
mode and precision, with fewer matmuls per decode step; exports keep the checkpoint's layout.
float32; error measure max|a - b| / max|b| over the logits."""
import collections
import json

import mlx.core as mx
import pytest

from conftest import TINY_LLAMA, f32_tol, random_weights, rel
from mlx_flashnorm import concat, flashnorm, kernels, loader
from mlx_flashnorm.kernels import cpu
from mlx_flashnorm.bench.step_graph import step_ops
from mlx_flashnorm.decoding import generate_step

TOL = f32_tol(1e-5)  # float32; widened on a GPU (TF32 matmuls)
SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256}
CONFIGS = {
    "llama": dict(TINY_LLAMA, **SMALL),
    "llama-biases": dict(TINY_LLAMA, **SMALL, attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
    "qwen2": dict(SMALL, model_type="qwen2"),  # q/k/v biases
    "qwen3": dict(SMALL, model_type="qwen3", head_dim=32),
    "gemma3": dict(SMALL, model_type="gemma3_text", head_dim=32, num_key_value_heads=1,
                   query_pre_attn_scalar=32, sliding_window=8, sliding_window_pattern=2),
}
TOKENS = mx.array([[5, 9, 2, 7, 11, 3, 40, 8]])
MATMULS = ("Matmul", "AddMM", "QuantizedMatmul")


def checkpoint(name):
    """(config, random weights) of CONFIGS[name]."""
    config = CONFIGS[name]
    model_arch, args = loader.model_args(config)
    return config, random_weights(model_arch.Model(args), seed=2, scale=0.1)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def arch(request):
    return checkpoint(request.param)


def build(arch, norm, bits, concat):
    config, weights = arch
    model = loader.build_model(config, dict(weights), progress=False)
    return loader.prepare(model, norm=norm, bits=bits, concat=concat)


def matmuls(model):
    return sum(n for op, n in collections.Counter(step_ops(model)).items() if op in MATMULS)


@pytest.mark.parametrize("bits", [None, 4])
@pytest.mark.parametrize("norm", ["rms", "flash", "none"])
def test_concatenated_equals_separate(arch, norm, bits):
    separate, joined = build(arch, norm, bits, False), build(arch, norm, bits, True)
    for layer in joined.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert "qkv_proj" in attn and "gate_up_proj" in mlp and "q_proj" not in attn and "up_proj" not in mlp
        assert ("scales" in attn.qkv_proj) == (bits is not None)
    assert rel(joined(TOKENS), separate(TOKENS)) < TOL
    # one decode step: 3 matmuls fewer per layer (q, k, v -> 1; gate, up -> 1), quantized ones
    # counted as the CPU runs them (row blocks on cpu.CPU_STREAMS streams)
    per_linear = cpu.CPU_STREAMS if bits else 1
    assert matmuls(separate) - matmuls(joined) == 3 * per_linear * len(joined.layers)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_flash_kernel_branch_takes_the_concatenated_output_whole(name, monkeypatch):
    """The branch that runs kernels.rope_after_qkv (here its MLX form, forced on the CPU) gets
    qkv_proj's one output as q, k and v, as OpenELM's."""
    whole, rope_after_qkv = [], kernels.rope_after_qkv

    def spy(q, k, v, *args, **kwargs):
        whole.append(q is k is v)
        return rope_after_qkv(q, k, v, *args, **kwargs)

    monkeypatch.setattr(kernels, "rope_after_qkv_supported", lambda head_dim, traditional: True)
    monkeypatch.setattr(kernels, "rope_after_qkv", spy)
    ref, flash = build(checkpoint(name), "rms", None, False), build(checkpoint(name), "flash", None, True)
    assert rel(flash(TOKENS), ref(TOKENS)) < f32_tol(1e-4)  # Sec. 4 (qwen3) is exact up to epsilon
    assert whole and all(whole)


def test_heads_split_the_projections_into_heads():
    """heads(): q, k, v as (B, heads, L, head_dim), bit for bit the projections reshaped and
    transposed one by one, from the separate linears and from the concatenated one."""
    config, weights = checkpoint("llama")
    attn = loader.build_model(config, dict(weights), progress=False).layers[0].self_attn
    x = mx.random.normal((2, 3, config["hidden_size"]), key=mx.random.key(1))
    ref = [t.reshape(2, 3, -1, attn.head_dim).transpose(0, 2, 1, 3) for t in concat.project(attn, x, concat.QKV)]
    assert [t.shape for t in ref] == [(2, 4, 3, 16), (2, 2, 3, 16), (2, 2, 3, 16)]
    for module in (attn, concat.concatenate(attn)):
        assert all(mx.array_equal(a, b) for a, b in zip(concat.heads(module, x), ref, strict=True))


def test_a_group_that_differs_stays_separate():
    """Per-module quantization: layer 0's k_proj at 8 bits keeps its q/k/v apart; the rest merge."""
    config, weights = checkpoint("llama")
    ref = loader.build_model(config, dict(weights), progress=False)
    model = loader.build_model(config, dict(weights), progress=False)
    k0 = {"model.layers.0.self_attn.k_proj": {"group_size": 64, "bits": 8}}
    for m in (ref, model):
        loader.quantize(m, bits=4, group_size=64, overrides=k0)
    concat.concatenate(model)
    first, second = model.layers
    assert {"q_proj", "k_proj", "v_proj"} <= set(first.self_attn) and "qkv_proj" not in first.self_attn
    assert "qkv_proj" in second.self_attn and "gate_up_proj" in first.mlp
    assert rel(model(TOKENS), ref(TOKENS)) < TOL


def test_flashnorm_applies_to_a_concatenated_model():
    """load() concatenates; FlashNorm applied afterwards (verify) takes the
    concatenated linears as they are."""
    ref = build(checkpoint("qwen2"), "rms", None, False)
    model = flashnorm.apply(build(checkpoint("qwen2"), "rms", None, True))
    assert isinstance(model.layers[0].self_attn.qkv_proj, flashnorm.DeferredLinear)
    assert rel(model(TOKENS), ref(TOKENS)) < 1e-4


def test_exports_keep_the_checkpoint_layout(tiny_llama_dir, tmp_path):
    """load() concatenates (last step of prepare); convert and quantize load with concat=False, so
    what they write has the checkpoint's q/k/v_proj and gate/up_proj."""
    from mlx_flashnorm.convert import main as convert
    from mlx_flashnorm.quantize import quantize_checkpoint

    loaded, _ = loader.load(tiny_llama_dir, norm="rms", progress=False)
    assert "qkv_proj" in loaded.layers[0].self_attn and "gate_up_proj" in loaded.layers[0].mlp
    convert(["--model", str(tiny_llama_dir), "--flashnorm", "--out", str(tmp_path / "flash")])
    quantize_checkpoint(tiny_llama_dir, tmp_path / "q4", bits=4, group_size=32, progress=False)
    for out in ("flash", "q4"):
        names = set(mx.load(str(tmp_path / out / "model.safetensors")))
        layer = "model.layers.1."
        for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert layer + p + ".weight" in names, (out, p)
        assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)
    assert "quantization" in json.loads((tmp_path / "q4" / "config.json").read_text())


def test_smollm2_gguf_greedy_tokens_unchanged(smollm2):
    """The embedded Q4_1 GGUF as load() gives it (concatenated) and in the checkpoint's layout:
    the same greedy tokens."""
    joined, tok = smollm2
    separate, _ = loader.load(None, norm="rms", progress=False, concat=False)
    assert "qkv_proj" in joined.layers[0].self_attn and "q_proj" in separate.layers[0].self_attn
    prompt = mx.array(tok.encode("The capital of France is"))
    a = [int(t) for t, _ in generate_step(prompt, separate, max_tokens=12)]
    b = [int(t) for t, _ in generate_step(prompt, joined, max_tokens=12)]
    assert len(a) == 12 and a == b
