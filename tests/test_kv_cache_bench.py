"""`python -m mlx_flashnorm.bench.kv_cache`: perplexity and greedy agreement of the quantized KV
caches against the float one, on a tiny random Llama whose head size (64) the group sizes divide."""
import math

import pytest
from conftest import TINY_LLAMA, f32_tol, in_process, make_checkpoint
from test_cli_errors import assert_user_error

from mlx_flashnorm import load
from mlx_flashnorm.bench import kv_cache
from mlx_flashnorm.perplexity import perplexity

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
        "must be in want of a wife. However little known the feelings or views of such a man may be "
        "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
        "surrounding families, that he is considered the rightful property of some one or other of "
        "their daughters.")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2):
    config = dict(TINY_LLAMA, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=256)
    folder, _ = make_checkpoint(tmp_path_factory.mktemp("kv") / "tiny-llama", config, tokenizer=smollm2[1])
    return folder


def test_table_rows_and_numbers(model_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    out = tmp_path / "kv.md"
    argv = ["--model", str(model_dir), "--dtype", "float32", "--text", str(text), "--max-tokens", "48",
            "--window", "20", "--chunk", "6", "--gen-tokens", "6", "--kv-bits", "8,2", "--out", str(out)]
    rows = kv_cache.main(argv)
    assert [r["cache"] for r in rows] == ["float32", "8-bit", "2-bit"]
    assert all(math.isfinite(r["perplexity"]) and r["perplexity"] > 1 for r in rows)
    # the float cache fed in chunks scores as one forward pass without a cache does
    model, tok = load(str(model_dir), dtype="float32", progress=False)
    tokens = tok.encode(TEXT)[:49]
    ref = rows[0]["perplexity"]
    assert ref == pytest.approx(perplexity(model, tokens, 20), rel=f32_tol(1e-5))
    # the quantized rows read a quantized cache: 2 bits moves the perplexity (+1.8% on this model),
    # 8 bits far less (+0.002%)
    assert rows[1]["perplexity"] == pytest.approx(ref, rel=0.02)
    assert abs(rows[2]["perplexity"] / ref - 1) > max(0.002, 10 * abs(rows[1]["perplexity"] / ref - 1))
    float_row = rows[0]
    assert float_row["kept"] == float_row["of"] and all(0 < n <= 6 for n in float_row["of"])
    assert all(0 <= k <= n for r in rows for k, n in zip(r["kept"], r["of"]))
    assert len(float_row["kept"]) == len(kv_cache.PROMPTS)
    written = out.read_text()
    assert written.startswith("Command: `python -m mlx_flashnorm.bench.kv_cache --model ")
    lines = [line for line in written.splitlines() if line.startswith("| ")]
    assert len(lines) == 2 + len(rows)  # header, rule, one row per cache
    assert lines[3].startswith("| 8-bit | ") and "%" in lines[3]
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("flags, words", [
    (["--kv-bits", "7"], ["--kv-bits takes", "not '7'"]),
    (["--kv-bits", "8,x"], ["--kv-bits takes"]),
    (["--kv-bits", "8,8"], ["twice"]),
    (["--kv-group-size", "48"], ["--kv-group-size must be one of"]),
    (["--chunk", "0"], ["--chunk must be at least 1"]),
])
def test_bad_flags_are_one_line_errors(flags, words):
    assert_user_error(in_process(kv_cache.main, *flags), *words)
