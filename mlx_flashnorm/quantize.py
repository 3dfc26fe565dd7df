"""python -m mlx_flashnorm.quantize --model X --bits 4 --out DIR: write a quantized (or
full-precision) checkpoint in the mlx-lm layout, through convert's writer (export).

With --norm flash the checkpoint is FlashNorm's weightless form, so the order is fixed: fold in
full precision, then quantize W*g. That is the only form a stock loader runs, and it costs quality
at low bits (bench/RESULTS.md, "Perplexity"); load(..., norm="flash", bits=...) does not fold and
has no such cost. The checkpoint records its quantization in config.json as mlx-lm does, so our
load() and stock mlx-lm (mlx_lm.utils.load_model) read it back as it is, without quantizing again.
"""
import argparse
import sys
from pathlib import Path

from . import flashnorm
from .cli import TOKENIZER_HELP, add_model_args
from .convert import export
from .errors import HelpFormatter, UserError, run_cli
from .loader import QUANT_BITS, QUANT_GROUP_SIZES, check_quantization, dequantize, load, prepare


def quantize_checkpoint(model_path, out, bits=4, group_size=64, norm="rms", head_bits=None,
                        tokenizer=None, dequantize_first=False, progress=True):
    """Load model_path, fold the norm mode, quantize (bits 0: keep full precision) and save to out.

    norm "flash" saves FlashNorm's weightless form (Fig. 1(b)): norm weights folded into the
    linears they feed and set to 1, the final norm folded into an (untied) LM head; a plain
    checkpoint that any loader of the architecture runs, stock mlx-lm included. Quantized, it
    loses more than norm "rms" does (the folded weights quantize worse).

    An already quantized input is refused unless dequantize_first (its rounding error stays in).
    Returns the path written."""
    out = Path(out)
    if out.exists():  # fail before the (slow) load
        raise UserError(f"{out} already exists: pass a new --out folder (nothing was overwritten)")
    if bits:
        check_quantization(bits, group_size)
    # as saved
    model, tok = load(model_path, norm="rms", tokenizer=tokenizer, progress=progress, concat=False)
    if "quantization" in model.config:
        if not dequantize_first and bits != 0:
            q = model.config["quantization"]
            raise UserError(f"{model_path or 'the default model'} is already quantized "
                            f"({q['bits']}-bit, group size {q['group_size']}): pass --dequantize "
                            "to dequantize it first (its rounding error stays), or quantize a "
                            "full-precision checkpoint")
        dequantize(model)
    if norm == "flash":  # folded in full precision, kept in the reference structure
        flashnorm.make_weightless(model)
    elif norm != "rms":
        raise UserError(f"norm must be rms or flash for a saved checkpoint, not '{norm}'")
    prepare(model, bits=bits, group_size=group_size, head_bits=head_bits, concat=False)
    return export(model, tok, out)


def arg_parser():
    p = argparse.ArgumentParser(
        prog="python -m mlx_flashnorm.quantize",
        description="Write a quantized checkpoint (mlx-lm layout: loads in our load() and in "
                    "mlx-lm). With --norm flash, FlashNorm is folded in full precision first.",
        epilog="--bits 0 writes full precision (float32), e.g. a dequantized copy of a GGUF.",
        formatter_class=HelpFormatter)
    add_model_args(p, "--model", model=dict(help="HF model folder, HF repo id, or llama .gguf file "
                                                 "(default: embedded SmolLM2-135M-Instruct, Q4_1)"))
    p.add_argument("--out", required=True, help="new folder to write (must not exist)")
    add_model_args(p, "--bits", "--group-size",
                   bits=dict(default=4, help=f"bits per weight: {', '.join(map(str, QUANT_BITS))}, "
                                             "or 0 for full precision"),
                   group_size=dict(help="weights per scale/bias: "
                                        f"{', '.join(map(str, QUANT_GROUP_SIZES))}"))
    p.add_argument("--head-bits", type=int, default=None,
                   help="bits for the logits layer (and a tied input embedding), e.g. 8")
    add_model_args(p, "--norm", norm=dict(
        default="rms", help="rms: the weights as they are (default: FlashNorm then runs at load "
                            "time, which every command does by default, at no quality cost); "
                            "flash: fold FlashNorm into the weights before quantizing (a "
                            "checkpoint stock mlx-lm runs weightless, at a quality cost)"))
    p.add_argument("--dequantize", action="store_true",
                   help="accept an already quantized input: dequantize it first (its error stays)")
    add_model_args(p, "--tokenizer", tokenizer=dict(help=TOKENIZER_HELP))
    p.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    return p


def main(argv=None):
    args = arg_parser().parse_args(argv)
    if args.norm == "none":
        raise UserError("--norm none removes every norm (a speed ceiling, meaningless text): "
                        "not worth saving; use --norm rms or flash")
    out = quantize_checkpoint(args.model, args.out, bits=args.bits, group_size=args.group_size,
                              norm=args.norm, head_bits=args.head_bits, tokenizer=args.tokenizer,
                              dequantize_first=args.dequantize)
    if args.norm == "flash" and 0 < args.bits < 8:
        print(f"note: --norm flash quantizes the norm-folded weights, which costs quality at "
              f"{args.bits} bits (SmolLM2 at 4 bits: perplexity +46%, "
              'bench/RESULTS.md, "Perplexity"); FlashNorm at load time (--norm flash --bits '
              f"{args.bits} on an rms checkpoint) does not fold and has no such cost",
              file=sys.stderr)
    what = "full precision" if args.bits == 0 else f"{args.bits}-bit, group size {args.group_size}"
    print(f"wrote {out} ({what}, norm {args.norm})")


if __name__ == "__main__":
    run_cli(main)
