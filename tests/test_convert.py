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
