"""The quantized KV cache (`--kv-bits N`, mlx-lm's QuantizedKVCache) against the float one.

    python -m mlx_flashnorm.bench.kv_cache [--model X] [--norm flash] [--dtype auto] [--kv-bits 8,4]
        [--kv-group-size 64] [--text FILE] [--max-tokens 1024] [--window 512] [--chunk 64]
        [--gen-tokens 32] [--out FILE.md]

For the float cache (mlx-lm's KVCache, in the activation dtype) and each of --kv-bits it reports:

- perplexity: the first --max-tokens scored tokens of --text, tokenized and cut into windows as
  `python -m mlx_flashnorm.perplexity --window W --max-tokens N` does (perplexity.token_nll), but
  each window is fed through a fresh cache of that kind in chunks of --chunk tokens, as a long
  prompt is prefilled: every chunk's queries attend to the keys and values the cache hands back,
  so for a quantized cache to the quantized keys and values of the earlier chunks. mlx-lm's
  QuantizedKVCache quantizes a chunk's own positions too before they are read, each position on
  its own (groups along the head dimension), so the chunk size changes no number: on SmolLM2
  (CPU, float32), chunks of 64 and one chunk per window gave the same perplexity, float, 8-bit
  and 4-bit; the chunks mirror a prefill. With the float cache the numbers are those of
  `perplexity` (one forward pass per window, no cache).
- greedy agreement: the greedy answers (--gen-tokens tokens; fewer if the answer ends at EOS) to
  three fixed prompts, through the chat template, as `generate --kv-bits N` makes them
  (stream_generate with kv_bits, decoding eagerly; the float row decodes eagerly too, over
  KVCache, so that only the cache differs). A cell "k/n" counts the leading tokens equal to the
  float cache's answer of n tokens, up to the first position where they differ (nothing after
  it counts, even where the answers meet again).

It prints a Markdown table (and writes it, with the command, to --out: a temporary file renamed
into place)."""
import argparse
import math
import shlex
import sys
import time
from pathlib import Path

import mlx.core as mx

from ..cli import add_model_args
from ..errors import HelpFormatter, UserError, run_cli
from ..decoding import KV_BITS, eager_cache, stream_generate
from ..loader import load
from ..perplexity import token_nll
from .decode import write_atomic

DEFAULT_TEXT = (Path(__file__).resolve().parents[2] / "tests" / "data"
                / "pride_and_prejudice_ch1-3.txt")
PROMPTS = ("What is the capital of France?",
           "Write a short poem about the sea.",
           "Explain in two sentences why the sky is blue.")
GROUP_SIZES = (32, 64, 128)


def parse_bits(text):
    """--kv-bits: a comma-separated list of distinct KV_BITS values."""
    parts = [p.strip() for p in text.split(",")]
    try:
        bits = [int(p) for p in parts]
    except ValueError:
        bits = None
    if not bits or any(b not in KV_BITS for b in bits):
        raise UserError("--kv-bits takes a comma-separated list of "
                        f"{', '.join(map(str, KV_BITS))}, not '{text}'")
    if len(set(bits)) != len(bits):
        raise UserError(f"--kv-bits lists a bit width twice: '{text}'")
    return bits


class ThroughCache:
    """The model as perplexity.window_nll calls it (token ids of shape 1 x N -> logits), but fed
    through a fresh cache from new_cache() in chunks of `chunk` tokens: each chunk attends to
    what the cache hands back for the positions so far."""

    def __init__(self, model, new_cache, chunk):
        self.model, self.new_cache, self.chunk = model, new_cache, chunk

    def __call__(self, inputs):
        cache = self.new_cache()
        parts = []
        for s in range(0, inputs.shape[1], self.chunk):
            logits = self.model(inputs[:, s : s + self.chunk], cache=cache)
            mx.eval(logits, [c.state for c in cache])
            parts.append(logits)
        return mx.concatenate(parts, axis=1)


def kinds(model, bits, group_size):
    """(label, new_cache) per cache: the float one first (labelled with the dtype its keys get, read
    off a 1-token probe), then one per bit width. eager_cache checks the group size against the
    model's head size here, before anything is measured."""
    probe = eager_cache(model)
    model(mx.array([[0]]), cache=probe)
    for b in bits:
        eager_cache(model, kv_bits=b, kv_group_size=group_size)
    out = [(str(probe[0].keys.dtype).removeprefix("mlx.core."), lambda: eager_cache(model))]
    out += [(f"{b}-bit", lambda b=b: eager_cache(model, kv_bits=b, kv_group_size=group_size))
            for b in bits]
    return out


def answer(model, tokenizer, prompt, n, kv_bits, group_size):
    """Greedy token ids as `generate` makes them: with kv_bits over the QuantizedKVCache, else
    eagerly over mlx-lm's KVCache."""
    cache = None if kv_bits else eager_cache(model)
    return [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=n, cache=cache,
                                             kv_bits=kv_bits, kv_group_size=group_size)]


def kept(tokens, ref):
    """How many leading tokens equal ref's, up to the first that differs."""
    n = 0
    for a, b in zip(tokens, ref):
        if a != b:
            break
        n += 1
    return n


def measure(model, tokenizer, tokens, bits, group_size=64, window=512, chunk=64, gen_tokens=32,
            prompts=PROMPTS, log=None):
    """One row per cache kind: label, bits (None: float), perplexity, kept and answer lengths."""
    rows, refs = [], None
    for (label, new_cache), b in zip(kinds(model, bits, group_size), [None] + list(bits)):
        tic = time.perf_counter()
        nll = token_nll(ThroughCache(model, new_cache, chunk), tokens, window)
        ppl = math.exp(nll.mean().item())
        answers = [answer(model, tokenizer, p, gen_tokens, b, group_size) for p in prompts]
        refs = refs or answers
        rows.append({"cache": label, "kv_bits": b, "perplexity": ppl,
                     "kept": [kept(a, r) for a, r in zip(answers, refs)],
                     "of": [len(r) for r in refs]})
        if log:
            log(f"{label}: perplexity {ppl:.3f}, kept {rows[-1]['kept']} "
                f"({time.perf_counter() - tic:.1f} s)")
    return rows


def table(rows, gen_tokens):
    ref = rows[0]["perplexity"]
    lines = [f"| KV cache | perplexity | greedy tokens kept (of the float cache's {gen_tokens}), "
             f"{len(rows[0]['kept'])} prompts |", "| --- | ---: | --- |"]
    for r in rows:
        ppl = f"{r['perplexity']:.3f}"
        if r["kv_bits"] is not None:
            ppl += f" ({100 * (r['perplexity'] / ref - 1):+.2f}%)"
        kept = ", ".join(f"{k}/{n}" for k, n in zip(r["kept"], r["of"]))
        lines.append(f"| {r['cache']} | {ppl} | {kept} |")
    return "\n".join(lines) + "\n"


def positive(name, value):
    if value < 1:
        raise UserError(f"--{name} must be at least 1, not {value}")
    return value


def arg_parser():
    p = argparse.ArgumentParser(prog="python -m mlx_flashnorm.bench.kv_cache", description=__doc__,
                                formatter_class=HelpFormatter)
    add_model_args(p, "--model", "--norm", "--dtype",
                   model=dict(help="HF model folder, repo id or .gguf file (default: the embedded "
                                   "SmolLM2-135M-Instruct)"),
                   norm=dict(help=None),
                   dtype=dict(help="activation dtype (the float cache's too); auto: float32 on the "
                                   "CPU, the checkpoint's half precision on a GPU"))
    p.add_argument("--kv-bits", default="8,4",
                   help="the quantized caches, comma-separated bit widths")
    p.add_argument("--kv-group-size", type=int, default=64,
                   help="values per scale/bias of the quantized caches")
    p.add_argument("--text", default=str(DEFAULT_TEXT), help="UTF-8 text file for the perplexity")
    p.add_argument("--max-tokens", type=int, default=1024, help="tokens of the text scored")
    p.add_argument("--window", type=int, default=512, help="tokens predicted per window")
    p.add_argument("--chunk", type=int, default=64, help="tokens fed through the cache at a time")
    p.add_argument("--gen-tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--out", metavar="FILE.md", help="also write the table, with the command, here")
    p.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    return p


def main(argv=None):
    args = arg_parser().parse_args(argv)
    bits = parse_bits(args.kv_bits)
    if args.kv_group_size not in GROUP_SIZES:
        raise UserError(f"--kv-group-size must be one of {', '.join(map(str, GROUP_SIZES))}, "
                        f"not {args.kv_group_size}")
    for name in ("max_tokens", "window", "chunk", "gen_tokens"):
        positive(name.replace("_", "-"), getattr(args, name))
    path = Path(args.text)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read the text ({type(e).__name__}: {e}); pass a UTF-8 "
                        "text file")
    model, tokenizer = load(args.model, norm=args.norm, dtype=args.dtype, progress=False)
    tokens = tokenizer.encode(text)[: args.max_tokens + 1]
    ctx = model.args.context_length
    if min(args.window, len(tokens) - 1) > ctx:
        raise UserError(f"--window {args.window} is longer than the model's context ({ctx})")

    def log(line):
        print(line, file=sys.stderr, flush=True)

    log(f"{len(tokens)} tokens, {len(tokens) - 1} scored in windows of {args.window}, "
        f"chunks of {args.chunk}")
    rows = measure(model, tokenizer, tokens, bits, args.kv_group_size, args.window, args.chunk,
                   args.gen_tokens, log=log)
    md = table(rows, args.gen_tokens)
    print(md, end="")
    if args.out:
        given = shlex.join(sys.argv[1:] if argv is None else argv)
        command = f"python -m mlx_flashnorm.bench.kv_cache {given}"
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, f"Command: `{command.strip()}`\n\n{md}")
    return rows


if __name__ == "__main__":
    run_cli(main)
