"""Quantization: checkpoints written by `quantize` read back by our load() and by stock mlx-lm,
load-time quantization, norm modes on a quantized checkpoint, and bad input."""
import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from conftest import TINY_LLAMA, cli
from mlx_flashnorm.errors import UserError
from mlx_flashnorm.loader import load, prepare
from mlx_flashnorm.quantize import quantize_checkpoint

TOKENS = mx.array([[1, 450, 2304, 17, 88, 9000, 31, 4, 1200, 77, 5, 6]])


def logits(model):
    return model(TOKENS).astype(mx.float32)


@pytest.fixture(scope="module")
def exported(tiny_llama_dir, tmp_path_factory):
    """tiny-llama quantized to 4 bits (group 32), head/tied embedding kept at 8 bits."""
    out = tmp_path_factory.mktemp("q") / "tiny-q4"
    return quantize_checkpoint(tiny_llama_dir, out, bits=4, group_size=32, head_bits=8, progress=False)


def test_config_records_quantization_like_mlx_lm(exported):
    q = json.loads((exported / "config.json").read_text())["quantization"]
    assert q == {"group_size": 32, "bits": 4, "mode": "affine",
                 "model.embed_tokens": {"group_size": 32, "bits": 8}}
    assert {"tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= {p.name for p in exported.iterdir()}


def test_export_loads_in_ours_and_stock_mlx_lm_with_identical_logits(exported):
    from mlx_lm.utils import load_model

    ours, tok = load(exported, norm="rms", progress=False, concat=False)  # the checkpoint's layout
    stock, _ = load_model(exported)
    saved = mx.load(str(exported / "model.safetensors"))
    for name, v in tree_flatten(ours.parameters()):  # read as stored, not quantized again
        assert mx.array_equal(v, saved[name]).item(), name
    assert ours.model.layers[0].mlp.up_proj.bits == 4 and ours.model.embed_tokens.bits == 8
    assert mx.array_equal(logits(ours), logits(stock)).item()
    assert tok.encode("hello there") == load(exported, norm="rms", progress=False)[1].encode("hello there")


def test_load_time_quantization_equals_the_export(tiny_llama_dir, exported):
    at_load, _ = load(tiny_llama_dir, bits=4, group_size=32, norm="rms", progress=False)
    from_disk, _ = load(exported, norm="rms", progress=False)
    # load-time quantization keeps the head at 4 bits too; compare a 4-bit layer's output
    x = mx.random.normal((3, TINY_LLAMA["hidden_size"]), key=mx.random.key(0))
    a, b = at_load.model.layers[1].self_attn.qkv_proj, from_disk.model.layers[1].self_attn.qkv_proj
    assert mx.array_equal(a(x), b(x)).item()
    assert at_load.config["quantization"]["bits"] == 4


def test_quantization_error_shrinks_with_bits(tiny_llama_dir):
    full, _ = load(tiny_llama_dir, norm="rms", progress=False)
    ref = logits(full)
    errors = []
    for bits in (2, 3, 4, 5, 6, 8):
        quant, _ = load(tiny_llama_dir, bits=bits, norm="rms", progress=False)
        assert quant.model.layers[0].mlp.gate_up_proj.bits == bits  # (down_proj: 160 wide, kept float)
        errors.append((mx.abs(logits(quant) - ref).max() / mx.abs(ref).max()).item())
    assert all(a > b > 0 for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.01, errors  # 8 bits: within 1% of the float32 logits


@pytest.mark.parametrize("norm", ["flash", "none"])
def test_norm_modes_keep_a_quantized_checkpoint_as_it_is(exported, norm):
    """norm flash (gain kept on the activations) and none touch no linear weight: a quantized
    checkpoint keeps its layout and its very arrays, nothing dequantized or requantized."""
    ref, _ = load(exported, norm="rms", progress=False, concat=False)
    model, _ = load(exported, norm=norm, progress=False, concat=False)
    assert model.config["quantization"] == ref.config["quantization"]
    assert model.model.embed_tokens.bits == 8 and model.model.layers[1].mlp.up_proj.bits == 4
    ref_w, got = dict(tree_flatten(ref.parameters())), dict(tree_flatten(model.parameters()))
    quantized = [k for k in ref_w if k.rsplit(".", 1)[0] + ".scales" in ref_w]
    assert len(quantized) == 3 * (2 * 7 + 1)
    assert all(mx.array_equal(got[k], ref_w[k]).item() for k in quantized)


def test_bits_0_dequantizes_the_gguf():
    model, _ = load(norm="rms", progress=False)
    quantized = logits(model)
    prepare(model, bits=0)
    assert "quantization" not in model.config and "quantization_config" not in model.config
    assert not any(k.endswith(".scales") for k, _ in tree_flatten(model.parameters()))
    assert model.model.embed_tokens.weight.dtype == mx.float32
    assert mx.allclose(logits(model), quantized, rtol=1e-3, atol=1e-3).item()


def test_prepare_refuses_to_quantize_twice(exported):
    model, _ = load(exported, norm="rms", progress=False)
    with pytest.raises(UserError, match="already quantized"):
        prepare(model, bits=4)
    with pytest.raises(UserError, match="bits must be one of"):
        prepare(model, bits=7)


def one_line_error(r, *words):
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr


def test_cli_bad_input(tiny_llama_dir, exported, tmp_path):
    args = ["mlx_flashnorm.quantize", "--model", str(tiny_llama_dir)]
    one_line_error(cli(*args, "--bits", "7", "--out", str(tmp_path / "a")), "bits", "2, 3, 4, 5, 6, 8")
    one_line_error(cli(*args, "--group-size", "48", "--out", str(tmp_path / "a")), "group size", "32, 64, 128")
    stamp = {p.name: p.stat().st_mtime_ns for p in exported.iterdir()}
    one_line_error(cli(*args, "--out", str(exported)), "already exists")
    assert {p.name: p.stat().st_mtime_ns for p in exported.iterdir()} == stamp  # untouched
    one_line_error(cli("mlx_flashnorm.quantize", "--model", str(exported), "--out", str(tmp_path / "b")),
                   "already quantized", "--dequantize")
    assert list(tmp_path.iterdir()) == []  # no output, no temporary folder left behind


def test_cli_writes_a_loadable_checkpoint(exported, tmp_path):
    out = tmp_path / "q8"
    r = cli("mlx_flashnorm.quantize", "--model", str(exported), "--dequantize", "--bits", "8",
            "--out", str(out))
    assert r.returncode == 0, r.stderr
    model, _ = load(out, norm="rms", progress=False)
    assert model.config["quantization"] == {"group_size": 64, "bits": 8, "mode": "affine"}
    assert [p.name for p in tmp_path.iterdir()] == ["q8"]
    ref, _ = load(exported, norm="rms", progress=False)
    assert mx.allclose(logits(model), logits(ref), rtol=0.05, atol=0.05).item()


def test_flash_export_is_a_plain_checkpoint_for_stock_mlx_lm(tiny_llama_dir, tmp_path):
    """--norm flash folds (weightless form) before quantizing, and says once that this costs
    quality below 8 bits; stock mlx-lm runs the result."""
    from mlx_lm.utils import load_model

    full = quantize_checkpoint(tiny_llama_dir, tmp_path / "f32", bits=0, norm="flash", progress=False)
    q4 = tmp_path / "q4"
    r = cli("mlx_flashnorm.quantize", "--model", str(tiny_llama_dir), "--norm", "flash", "--out", str(q4))
    assert r.returncode == 0, r.stderr
    note = [line for line in r.stderr.splitlines() if line.startswith("note:")]
    assert len(note) == 1 and "bench/RESULTS.md" in note[0], r.stderr
    ref, _ = load(tiny_llama_dir, norm="rms", progress=False)
    folded, _ = load(full, norm="rms", progress=False)
    assert folded.config["tie_word_embeddings"] is False  # final norm folded into a head copy
    norms = [v for k, v in tree_flatten(folded.parameters()) if "norm" in k]
    assert norms and all(mx.array_equal(v, mx.ones_like(v)).item() for v in norms)
    # float32 folding is exact up to rounding: same function as the reference
    assert mx.allclose(logits(folded), logits(ref), rtol=1e-4, atol=1e-5).item()
    ours, _ = load(q4, norm="rms", progress=False)
    stock, _ = load_model(q4)
    assert ours.config["quantization"]["bits"] == 4
    assert mx.array_equal(logits(ours), logits(stock)).item()
