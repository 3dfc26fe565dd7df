"""python -m mlx_flashnorm.verify: check that FlashNorm computes the same function as RMSNorm.

Loads the model twice in float32 (a quantized checkpoint is dequantized first, so both copies hold
the same weights), applies FlashNorm to one, and prints the max absolute and relative difference
of every layer's hidden state and of the logits, then whether greedy decoding agrees.
Exit code 1 when the greedy tokens differ. With --dtype float16/bfloat16 it also loads rms and
flash in that dtype (a quantized checkpoint stays quantized) and prints, side by side, their max
relative logit error against the float32 rms reference and how long their greedy tokens agree:
rms with float32's, flash with rms's in the same dtype."""
import argparse
import sys

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask

from . import flashnorm
from .cli import TOKENIZER_HELP, add_model_args
from .errors import HelpFormatter, UserError, run_cli
from .decoding import generate_step
from .loader import dequantize, load


def load_float32(model, tokenizer=None):
    m, tok = load(model, norm="rms", dtype="float32", tokenizer=tokenizer)
    if "quantization" in m.config:
        dequantize(m)
    return m, tok


def hidden_states(model, tokens):
    """The residual stream after each block (the same tensors in a reference and a flash model)."""
    from .flashnorm import Deferred

    trunk = getattr(model, flashnorm.mapping(model).trunk)
    # Gemma scales
    h = trunk.embed(tokens) if hasattr(trunk, "embed") else model.embed_tokens(tokens)
    full = sliding = create_attention_mask(h, None)
    if hasattr(trunk, "masks"):  # Gemma 3: sliding-window layers
        full, sliding = trunk.masks(h, [None] * len(model.layers))
    residual, states = None, []
    for layer in model.layers:
        mask = sliding if getattr(layer, "is_sliding", False) else full
        h, residual = layer(h, residual, mask)  # the block's output still to be added
        states.append((h.xg * h.s if isinstance(h, Deferred) else h) + residual)
    return states


def norms_line(model):
    """Which norms FlashNorm removes on this architecture and which it keeps (its model file's
    FLASHNORM)."""
    spec = flashnorm.mapping(model)
    removed = [p.norm for p in spec.pairs]
    qk = any("q_norm" in getattr(model.layers[0], p.consumer) for p in spec.pairs)
    line = f"FlashNorm removes {', '.join(removed)} (each block) and the final norm"
    line += "; fuses q_norm/k_norm into RoPE (their per-head 1/RMS stays)" if qk else ""
    kept = "; ".join(f"{name} ({why})" for name, why in spec.kept)
    return line + (f"; keeps {kept}" if kept else "; keeps none")


def difference(ref, other):
    """(max |ref - other|, max |ref - other| / max |ref|) as floats."""
    diff = mx.abs(ref - other).max()
    return diff.item(), (diff / mx.maximum(mx.abs(ref).max(), 1e-30)).item()


def greedy(model, prompt, steps):
    return [int(t) for t, _ in generate_step(prompt, model, max_tokens=steps)][:steps]


def compare(ref, flash, tokens, steps):
    """Rows (name, max abs, max rel) per layer and for the logits, and the two greedy sequences."""
    rows = [(f"layer {i}", *difference(a, b))
            for i, (a, b) in enumerate(zip(hidden_states(ref, tokens[None]),
                                           hidden_states(flash, tokens[None])))]
    rows.append(("logits", *difference(ref(tokens[None]), flash(tokens[None]))))
    return rows, greedy(ref, tokens, steps), greedy(flash, tokens, steps)


def arg_parser():
    p = argparse.ArgumentParser(prog="python -m mlx_flashnorm.verify",
                                description=__doc__.split("\n\n")[1],
                                formatter_class=HelpFormatter)
    add_model_args(p, "--model", "--tokenizer", tokenizer=dict(help=TOKENIZER_HELP))
    p.add_argument("--prompt",
                   default="The quick brown fox jumps over the lazy dog. Once upon a time",
                   help="text fed to both models")
    p.add_argument("--steps", type=int, default=32, help="greedy tokens to compare")
    p.add_argument("--dtype", action="append", choices=("float16", "bfloat16"), default=[],
                   help="also compare rms and flash in this half precision (repeatable)")
    p.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    return p


def agree(a, b):
    """How many leading tokens two greedy sequences share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def half_rows(args, ref, tokens, ref_tokens):
    """Per dtype: (dtype, rms rel error, flash rel error, rms-vs-float32 agreement,
    flash-vs-rms)."""
    want = ref(tokens[None]).astype(mx.float32)
    top = mx.abs(want).max()
    rows = []
    for dtype in args.dtype:
        out = {}
        for norm in ("rms", "flash"):
            m, _ = load(args.model, norm=norm, dtype=dtype, tokenizer=args.tokenizer,
                        progress=False)
            err = (mx.abs(m(tokens[None]).astype(mx.float32) - want).max() / top).item()
            out[norm] = err, greedy(m, tokens, args.steps)
        rows.append((dtype, out["rms"][0], out["flash"][0], agree(out["rms"][1], ref_tokens),
                     agree(out["flash"][1], out["rms"][1])))
    return rows


def main(argv=None):
    args = arg_parser().parse_args(argv)
    if args.steps < 1:
        raise UserError("--steps must be at least 1")
    ref, tok = load_float32(args.model, args.tokenizer)
    flash, _ = load_float32(args.model, args.tokenizer)
    print(norms_line(ref))
    flashnorm.apply(flash)
    tokens = mx.array(tok.encode(args.prompt))
    if tokens.size == 0:
        raise UserError("the prompt encodes to no tokens; pass some text with --prompt")
    rows, a, b = compare(ref, flash, tokens, args.steps)
    print(f"{'':10} {'max abs diff':>14} {'max rel diff':>14}")
    for name, d_abs, d_rel in rows:
        print(f"{name:10} {d_abs:14.3e} {d_rel:14.3e}")
    same = agree(a, b)
    if same == args.steps:
        print(f"greedy tokens agree over {args.steps} steps")
    else:
        print(f"greedy tokens differ from step {same} of {args.steps}: rms {a[same]}, "
              f"flash {b[same]}")
    if args.dtype:
        print(f"{'dtype':10} {'rms rel err':>12} {'flash rel err':>14} {'rms = f32 tokens':>17} "
              f"{'flash = rms tokens':>19}  (logits vs float32 rms; greedy steps agreeing)")
        for dtype, e_rms, e_flash, n_rms, n_flash in half_rows(args, ref, tokens, a):
            print(f"{dtype:10} {e_rms:12.3e} {e_flash:14.3e} {n_rms:17d} {n_flash:19d}")
    return 0 if same == args.steps else 1


if __name__ == "__main__":
    sys.exit(run_cli(main))
