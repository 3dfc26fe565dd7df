"""How exact FlashNorm is, in float32 on random inputs and real weights (bench/RESULTS.md,
"FlashNorm exactness"). rel = max |ref - flash| / max |ref|.

1. Sec. 4.1 with epsilon: one OpenELM-270M-shaped attention layer (dim 1280, 12 query / 3 kv
   heads of 64, QK-norm, eps 1e-6, weights as in bench.decode's random checkpoint), inputs of
   RMS 1e-3 .. 1e3, prefill of 16 tokens: flash against reference, and with eps set to 0.
2. Whole models: SmolLM2-135M (real weights, dequantized) and OpenELM-270M shape (random): logits,
   and greedy agreement over 64 tokens for SmolLM2.

    python -m mlx_flashnorm.bench.flash_exactness
"""
import argparse
import functools
import sys

import mlx.core as mx

from .. import flashnorm
from ..errors import HelpFormatter, run_cli
from ..decoding import generate_step
from ..loader import dequantize, load, model_args
from .decode import OPENELM_270M
from .flash_head import random_openelm


def rel(ref, got):
    return (mx.abs(ref - got).max() / mx.abs(ref).max()).item()


@functools.lru_cache(maxsize=1)
def first_block():
    return random_openelm().layers[0]


def qk_deviation(scale, eps):
    _, args = model_args(OPENELM_270M)
    block = first_block()
    norm, attn = block.attn_norm, block.attn
    for m in (norm, attn.q_norm, attn.k_norm):
        m.eps = eps
    flash = flashnorm.FlashQKNormAttention(norm, attn)
    mx.random.seed(1)
    x = scale * mx.random.normal((1, 16, args.model_dim))
    return rel(attn(norm(x), mask="causal"), flash(x, mask="causal"))


def main(argv=None):
    argparse.ArgumentParser(prog="python -m mlx_flashnorm.bench.flash_exactness", description=__doc__,
                            formatter_class=HelpFormatter).parse_args(argv)
    print("| input RMS | rel, eps 1e-6 | rel, eps 0 |")
    print("| ---: | ---: | ---: |")
    for scale in (1e-3, 1e-2, 1e-1, 1.0, 1e1, 1e3):
        print(f"| {scale:g} | {qk_deviation(scale, 1e-6):.2e} | {qk_deviation(scale, 0.0):.2e} |")
    ref, tok = load(norm="rms", progress=False)
    flash, _ = load(norm="rms", progress=False)
    for m in (ref, flash):
        dequantize(m)
    flashnorm.apply(flash)
    prompt = mx.array(tok.encode("The history of the printing press begins"))
    a = [int(t) for t, _ in generate_step(prompt, ref, max_tokens=64)]
    b = [int(t) for t, _ in generate_step(prompt, flash, max_tokens=64)]
    print(f"SmolLM2-135M logits rel {rel(ref(prompt[None]), flash(prompt[None])):.2e}, "
          f"greedy 64 tokens identical: {a == b}")
    del ref, flash
    ref, flash = random_openelm(), random_openelm()
    flashnorm.apply(flash)
    tokens = mx.random.randint(0, 32000, (1, 64))
    print(f"OpenELM-270M shape (random) logits rel {rel(ref(tokens), flash(tokens)):.2e}")


if __name__ == "__main__":
    sys.exit(run_cli(main))
