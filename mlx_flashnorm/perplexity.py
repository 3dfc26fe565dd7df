"""Perplexity of a model on a text: `python -m mlx_flashnorm.perplexity --text FILE`.

The text is tokenized once (as the tokenizer does by default, e.g. with its BOS token) and cut into
fixed, non-overlapping windows of `window` predicted tokens: a window feeds tokens[s : s+window]
and scores tokens[s+1 : s+window+1]; the next window starts at s+window. So the first token of a
window is context only (it was scored as the last target of the previous window, without the
earlier context), every token but the text's first is scored exactly once, and no window sees
tokens of another. Perplexity = exp(mean negative log-likelihood over the scored tokens).
"""
import argparse
import math
import sys
import time
from pathlib import Path

import mlx.core as mx

from . import progress
from .cli import TOKENIZER_HELP, add_model_args
from .errors import HelpFormatter, UserError, run_cli
from .loader import load


def window_nll(model, tokens):
    """Negative log-likelihoods (float32) of tokens[1:] given their prefix within tokens."""
    tokens = mx.array(tokens)
    logits = model(tokens[None, :-1])[0].astype(mx.float32)
    target = tokens[1:]
    return (mx.logsumexp(logits, axis=-1)
            - mx.take_along_axis(logits, target[:, None], axis=-1)[:, 0])


def token_nll(model, tokens, window=512):
    """One NLL per scored token (len(tokens) - 1 of them), window by window."""
    if window < 1:
        raise UserError(f"--window must be at least 1, not {window}")
    if len(tokens) < 2:
        raise UserError(f"the text has {len(tokens)} token(s); perplexity needs at least 2")
    parts = []
    for s in progress.bar(range(0, len(tokens) - 1, window), desc="perplexity", unit="window"):
        nll = window_nll(model, tokens[s : s + window + 1])
        mx.eval(nll)
        parts.append(nll)
    return mx.concatenate(parts)


def perplexity(model, tokens, window=512):
    return math.exp(token_nll(model, tokens, window).mean().item())


def arg_parser():
    p = argparse.ArgumentParser(
        prog="python -m mlx_flashnorm.perplexity",
        description="Perplexity of a model on a text file, in fixed non-overlapping windows.",
        epilog="The last line printed is exactly 'perplexity: <number>'. --bits 0 dequantizes a "
               "quantized checkpoint (e.g. the embedded Q4_1 GGUF) to full precision.",
        formatter_class=HelpFormatter)
    add_model_args(p, "--model")
    p.add_argument("--text", required=True, help="UTF-8 text file")
    add_model_args(p, "--tokenizer", "--norm", "--bits", "--group-size", "--dtype",
                   tokenizer=dict(help=TOKENIZER_HELP),
                   norm=dict(help="flash: FlashNorm (as the other commands run by default); rms: "
                                  "the reference; none: no norms"),
                   bits=dict(help="quantize at load time (2-8), or 0 for full precision "
                                  "(dequantizes)"),
                   group_size=dict(help="weights per scale/bias with --bits"))
    p.add_argument("--window", type=int, default=512, help="tokens predicted per window")
    p.add_argument("--max-tokens", type=int, default=0,
                   help="score only the first N tokens of the text (0: all of it)")
    p.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    return p


def main(argv=None):
    args = arg_parser().parse_args(argv)
    path = Path(args.text)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read the text ({type(e).__name__}: {e}); pass a UTF-8 "
                        "text file")
    if args.window < 1:
        raise UserError(f"--window must be at least 1, not {args.window}")
    if args.max_tokens < 0:
        raise UserError(f"--max-tokens must be 0 (all) or more, not {args.max_tokens}")
    tic = time.perf_counter()
    model, tokenizer = load(args.model, norm=args.norm, bits=args.bits, dtype=args.dtype,
                            tokenizer=args.tokenizer, group_size=args.group_size)
    load_s = time.perf_counter() - tic
    tokens = tokenizer.encode(text)
    if args.max_tokens > 0:
        tokens = tokens[: args.max_tokens + 1]
    tic = time.perf_counter()
    nll = token_nll(model, tokens, args.window)
    print(f"{len(tokens)} tokens, {nll.size} scored in windows of {args.window}; "
          f"load {load_s:.1f} s, eval {time.perf_counter() - tic:.1f} s", file=sys.stderr)
    print(f"perplexity: {math.exp(nll.mean().item()):.5f}")


if __name__ == "__main__":
    run_cli(main)
