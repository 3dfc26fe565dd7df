"""Weightless checkpoints (python -m mlx_flashnorm.convert) loaded by stock mlx-lm, and the
verify command."""
import json
import os

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model

from conftest import OPENELM_270M, cli, random_weights
from mlx_flashnorm import flashnorm, loader
from mlx_flashnorm.convert import export

MODEL_TOL = 1e-4  # max |ours - mlx-lm| / max |ours| of the logits, float32


def rel(ref, got):
    return (mx.abs(ref - got).max() / mx.abs(ref).max()).item()


def test_smollm2_weightless_checkpoint_in_stock_mlx_lm(tmp_path):
    out = tmp_path / "smollm2-flash"
    r = cli("mlx_flashnorm.convert", "--flashnorm", "--out", str(out), "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("(float32)")
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and "quantization" not in config
    assert {"tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    weights = mx.load(str(out / "model.safetensors"))
    assert "lm_head.weight" in weights
    norms = [v for k, v in weights.items() if "norm" in k]
    assert len(norms) == 2 * 30 + 1 and all(mx.array_equal(v, mx.ones_like(v)) for v in norms)

    ref, tok = loader.load(norm="rms", progress=False)
    loader.dequantize(ref)
    stock, _ = load_model(out)
    tokens = mx.array([tok.encode("Weightless normalization folds the weights")])
    assert rel(ref(tokens), stock(tokens)) < MODEL_TOL
    again = loader.load(out, norm="rms", progress=False)[0]  # and ours reads it too
    assert rel(ref(tokens), again(tokens)) < MODEL_TOL


def test_openelm_weightless_checkpoint_in_stock_mlx_lm(tmp_path):
    """Random OpenELM-270M shape (its first 4 layers: every layer converts alike): pre-norms folded,
    tied head untied, QK-norm weights kept."""
    config = dict(OPENELM_270M, num_transformer_layers=4,
                  **{k: OPENELM_270M[k][:4] for k in ("num_query_heads", "num_kv_heads", "ffn_multipliers")})
    arch, args = loader.model_args(config)
    model = arch.Model(args)
    model.load_weights(list(random_weights(model, seed=5, uniform=True).items()))
    model.config = config
    tokens = mx.random.randint(0, 32000, (1, 16))
    ref = model(tokens)
    mx.eval(ref)
    q_norm = model.layers[0].attn.q_norm.weight
    flashnorm.make_weightless(model)
    out = export(model, None, tmp_path / "openelm-flash")
    config = json.loads((out / "config.json").read_text())
    assert config["share_input_output_layers"] is False
    weights = mx.load(str(out / "model.safetensors"))
    assert mx.array_equal(weights["transformer.layers.0.attn.q_norm.weight"], q_norm)
    assert mx.array_equal(weights["transformer.layers.0.attn_norm.weight"], mx.ones(1280))
    del model, weights
    stock, _ = load_model(out)
    assert rel(ref, stock(tokens)) < MODEL_TOL


def test_convert_refuses_existing_output_and_missing_flag(tmp_path):
    r = cli("mlx_flashnorm.convert", "--flashnorm", "--out", str(tmp_path))
    assert r.returncode == 2 and "already exists" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = cli("mlx_flashnorm.convert", "--out", str(tmp_path / "new"))
    assert r.returncode == 2 and "--flashnorm" in r.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary folder left


def test_export_is_atomic(tmp_path):
    """A failed write leaves neither the output nor its temporary folder behind."""
    class Broken:
        config = {"model_type": "llama"}

        def parameters(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        export(Broken(), None, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_verify_command(tiny_llama_dir):
    r = cli("mlx_flashnorm.verify", "--model", str(tiny_llama_dir), "--steps", "8")
    assert r.returncode == 0, r.stderr
    removed, *lines = r.stdout.splitlines()
    assert removed.startswith("FlashNorm removes input_layernorm, post_attention_layernorm") and "keeps none" in removed
    rows = {line.split()[0] + (" " + line.split()[1] if line.startswith("layer") else ""): line.split()[-2:]
            for line in lines[1:-1]}
    assert set(rows) == {"layer 0", "layer 1", "logits"}
    assert all(float(rel_diff) < 1e-4 for _, rel_diff in rows.values())
    assert lines[-1] == "greedy tokens agree over 8 steps"


@pytest.mark.parametrize("command", ["mlx_flashnorm.verify", "mlx_flashnorm.convert"])
def test_help_and_bad_input(command, tmp_path):
    assert cli(command, "--help").returncode == 0
    r = cli(command, "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "o"), "--flashnorm") \
        if command.endswith("convert") else cli(command, "--model", str(tmp_path / "missing"))
    assert r.returncode == 2 and "no such file or folder" in r.stderr and "Traceback" not in r.stderr


def test_convert_keeps_the_source_dtype_and_quantizes_with_q(tmp_path, spm_model):
    from conftest import TINY_LLAMA, make_checkpoint
    from mlx_flashnorm.convert import main

    config = {**TINY_LLAMA, "vocab_size": 60, "torch_dtype": "bfloat16"}
    folder, _ = make_checkpoint(tmp_path / "bf16", config)
    ref = loader.load(str(folder), tokenizer=str(spm_model), norm="rms", progress=False)[0]
    tokens = mx.array([[1, 5, 9, 13, 17]])
    for args, dtype, bits in (([], mx.bfloat16, None), (["--dtype", "float32"], mx.float32, None),
                              (["-q", "--q-bits", "8"], mx.bfloat16, 8)):
        out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
        main(["--model", str(folder), "--tokenizer", str(spm_model), "--flashnorm", "--out", str(out), *args])
        saved = json.loads((out / "config.json").read_text())
        weights = mx.load(str(out / "model.safetensors"))
        assert weights["model.layers.0.mlp.up_proj.scales" if bits else "lm_head.weight"].dtype == dtype
        assert saved["torch_dtype"] == str(dtype).split(".")[-1]
        assert saved.get("quantization", {}).get("bits") == bits
        model = loader.load(str(out), norm="rms", progress=False, tokenizer=str(spm_model))[0]
        assert rel(ref(tokens), model(tokens)) < 0.02  # bfloat16 weights


def test_convert_errors_are_one_error_line(tmp_path, tiny_llama_dir):
    """convert reports bad input as the other commands do: one line starting 'error: ', exit code 2,
    no traceback, before loading a model where the arguments alone show the problem."""
    folder = tmp_path / "a-file"
    folder.write_text("not a folder")
    for argv, words in [(["--out", str(tmp_path / "missing" / "out")], "no such folder"),
                        (["--out", str(folder / "out")], "no such folder"),
                        (["--out", str(tmp_path / "o"), "-q", "--q-bits", "7"], "bits must be one of"),
                        (["--out", str(tmp_path / "o"), "--model", str(folder)], "not a model")]:
        r = cli("mlx_flashnorm.convert", "--flashnorm", *argv)
        assert r.returncode == 2 and r.stderr.startswith("error: ") and words in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    from mlx_flashnorm.errors import UserError

    model, tok = loader.load(str(tiny_llama_dir), norm="rms", progress=False, concat=False)
    (tmp_path / f".out.partial-{os.getpid()}").write_text("in the way")  # the OS refuses the write
    with pytest.raises(UserError, match="cannot write .*out"):
        export(model, tok, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_convert_refuses_to_quantize_a_quantized_checkpoint(tmp_path):
    """-q of an already quantized source (the embedded 4-bit GGUF) used to write, silently, a model
    that answers nonsense; as generate --bits does, convert refuses it: one line, nothing written."""
    from conftest import in_process
    from mlx_flashnorm.convert import main

    r = in_process(main, "--flashnorm", "-q", "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "already quantized" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and list(tmp_path.iterdir()) == []


FOLDED_TOL = 1e-5  # max |folded - original| / max |original| of the logits, float32


def _logits(folder, norm, tokens):
    model = loader.load(folder, norm=norm, dtype="float32", progress=False)[0]
    return model(tokens)


def _rewrite(src, dst, edit):
    """A copy of checkpoint folder src at dst with its weights passed through edit(name, array)
    (None drops the tensor)."""
    import shutil

    shutil.copytree(src, dst)
    weights = mx.load(str(dst / "model.safetensors"))
    kept = {k: w for k, w in ((k, edit(k, v)) for k, v in weights.items()) if w is not None}
    mx.save_safetensors(str(dst / "model.safetensors"), kept, metadata={"format": "pt"})
    return dst


def test_flash_norm_checkpoint_round_trip(tmp_path, tiny_llama_dir):
    """convert --flashnorm marks its output "flash_norm": true (norm tensors kept as ones); it
    loads without a second fold, in norm rms and flash, with the original's logits; so does the
    same checkpoint without norm tensors (the Hub's weightless-rmsnorm form); one whose config
    says flash_norm but whose norms are not ones is a one-line error."""
    from mlx_flashnorm.convert import main
    from mlx_flashnorm.errors import UserError

    out = tmp_path / "tiny-flash"
    main(["--model", str(tiny_llama_dir), "--flashnorm", "--out", str(out), "--dtype", "float32"])
    assert json.loads((out / "config.json").read_text())["flash_norm"] is True
    norms = {k: v for k, v in mx.load(str(out / "model.safetensors")).items() if "norm" in k}
    assert len(norms) == 2 * 2 + 1
    assert all(mx.array_equal(v, mx.ones_like(v)) for v in norms.values())
    tokens = mx.array([[1, 5, 300, 7, 42, 9000, 12]])
    for norm in ("rms", "flash"):  # each form against the original in the same form
        ref = _logits(tiny_llama_dir, norm, tokens)
        assert rel(ref, _logits(out, norm, tokens)) < FOLDED_TOL, norm
    bare = _rewrite(out, tmp_path / "tiny-bare", lambda k, v: None if "norm" in k else v)
    assert not any("norm" in k for k in mx.load(str(bare / "model.safetensors")))
    for norm in ("rms", "flash"):
        assert mx.array_equal(_logits(bare, norm, tokens), _logits(out, norm, tokens)), norm
    bad = _rewrite(out, tmp_path / "tiny-bad",
                   lambda k, v: v * 1.5 if k.endswith("model.norm.weight") else v)
    with pytest.raises(UserError) as e:
        loader.load(bad, norm="rms", progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "flash_norm" in msg and "model.norm.weight" in msg
    assert str(bad / "config.json") in msg


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "openelm"])
def test_flash_norm_checkpoint_other_architectures(tmp_path, name):
    """Qwen 3 and OpenELM (QK-norms kept) and Gemma 3 (offset norms: gain 1 is a weight of 0, the
    post-norms kept): make_weightless + export, then the same with the folded norms left out of
    the file, give the original's logits (each norm form against the original in that form)."""
    from conftest import GEMMA3, QWEN3, TINY_OPENELM

    config = {"qwen3": QWEN3, "gemma3": GEMMA3, "openelm": TINY_OPENELM}[name]
    arch, args = loader.model_args(config)
    model = arch.Model(args)
    model.load_weights(list(random_weights(model, seed=3).items()))
    model.config = config
    tokens = mx.array([[1, 5, 300, 7, 42, 100, 12]])
    original = export(model, None, tmp_path / name)
    folded = {name for name, _ in flashnorm.folded_norms(model)}
    flashnorm.make_weightless(model)
    out = export(model, None, tmp_path / f"{name}-flash")
    assert json.loads((out / "config.json").read_text())["flash_norm"] is True
    bare = _rewrite(out, tmp_path / f"{name}-bare", lambda k, v: None if k in folded else v)

    def build(folder, norm):
        m = loader.build_model(loader.read_config(folder), loader.read_safetensors(folder),
                               progress=False)
        return loader.prepare(m, norm=norm)(tokens)

    for norm in ("rms", "flash"):  # each form against the original in the same form
        assert rel(build(original, norm), build(out, norm)) < FOLDED_TOL, norm
        assert mx.array_equal(build(bare, norm), build(out, norm)), norm
