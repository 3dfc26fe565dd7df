"""Perplexity: the windowed computation against token-by-token decoding, and the command line."""
import math
import re
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from conftest import TINY_LLAMA, cli, random_weights
from mlx_flashnorm.errors import UserError
from mlx_flashnorm.loader import build_model, load, model_args
from mlx_flashnorm.perplexity import perplexity, token_nll

TEXT = Path(__file__).parent / "data" / "pride_and_prejudice_ch1-3.txt"


@pytest.fixture(scope="module")
def tiny():
    arch, args = model_args(TINY_LLAMA)
    return build_model(TINY_LLAMA, random_weights(arch.Model(args), seed=3, scale=0.2), progress=False)


def decoded_nll(model, tokens, window):
    """Independent reference: feed one token at a time through a KV cache that starts empty at
    each window, and take -log softmax of the next token with numpy-free scalar arithmetic."""
    nll = []
    for s in range(0, len(tokens) - 1, window):
        cache = [KVCache() for _ in model.layers]
        chunk = tokens[s : s + window + 1]
        for i in range(len(chunk) - 1):
            logits = model(mx.array([[chunk[i]]]), cache=cache)[0, -1].astype(mx.float32)
            log_z = math.log(mx.exp(logits - logits.max()).sum().item()) + logits.max().item()
            nll.append(log_z - logits[chunk[i + 1]].item())
    return nll


def test_windowed_nll_matches_token_by_token_decoding(tiny):
    tokens = mx.random.randint(0, TINY_LLAMA["vocab_size"], (45,), key=mx.random.key(1)).tolist()
    nll = token_nll(tiny, tokens, window=16)
    ref = decoded_nll(tiny, tokens, window=16)
    assert nll.size == len(tokens) - 1 == len(ref)  # every token but the first, once
    # float32 batch vs incremental attention: differences are rounding only
    assert mx.allclose(nll, mx.array(ref), rtol=1e-4, atol=1e-4).item()
    ppl = perplexity(tiny, tokens, window=16)
    assert math.isfinite(ppl) and ppl > 1
    assert ppl == pytest.approx(math.exp(sum(ref) / len(ref)), rel=1e-5)


def test_windows_do_not_share_context(tiny):
    tokens = mx.random.randint(0, TINY_LLAMA["vocab_size"], (33,), key=mx.random.key(2)).tolist()
    whole = token_nll(tiny, tokens, window=32)
    split = token_nll(tiny, tokens, window=16)
    assert mx.allclose(whole[:16], split[:16], atol=1e-5).item()  # first window: same context
    assert not mx.allclose(whole[16:], split[16:], atol=1e-3).item()  # second: context cut at 16


def test_too_short_or_bad_window(tiny):
    with pytest.raises(UserError, match="at least 2"):
        token_nll(tiny, [5], window=8)
    with pytest.raises(UserError, match="window"):
        token_nll(tiny, [5, 6, 7], window=0)


def test_cli_prints_final_line_matching_the_library(tiny_llama_dir):
    r = cli("mlx_flashnorm.perplexity", "--model", str(tiny_llama_dir), "--text", str(TEXT),
            "--window", "32", "--max-tokens", "64")
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"perplexity: \d+\.\d+", last), last
    model, tok = load(tiny_llama_dir, norm="rms", progress=False)
    expected = perplexity(model, tok.encode(TEXT.read_text())[:65], window=32)
    assert float(last.split()[1]) == pytest.approx(expected, rel=1e-4)


def test_cli_missing_text_is_a_one_line_error(tmp_path):
    r = cli("mlx_flashnorm.perplexity", "--text", str(tmp_path / "nope.txt"))
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "nope.txt" in r.stderr and "Traceback" not in r.stderr
