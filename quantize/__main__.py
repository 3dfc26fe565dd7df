"""python -m mlx_flashnorm.quantize --model X --bits 4 --out DIR"""
import argparse
import sys

from ..errors import HelpFormatter, UserError, run_cli
from ..loader import NORMS, QUANT_BITS, QUANT_GROUP_SIZES
from . import quantize_checkpoint


def arg_parser():
    p = argparse.ArgumentParser(
        prog="python -m mlx_flashnorm.quantize",
        description="Write a quantized checkpoint (mlx-lm layout: loads in our load() and in "
                    "mlx-lm). With --norm flash, FlashNorm is folded in full precision first.",
        epilog="--bits 0 writes full precision (float32), e.g. a dequantized copy of a GGUF.",
        formatter_class=HelpFormatter)
    p.add_argument("--model", help="HF model folder, HF repo id, or llama .gguf file "
                                   "(default: embedded SmolLM2-135M-Instruct, Q4_1)")
    p.add_argument("--out", required=True, help="new folder to write (must not exist)")
    p.add_argument("--bits", type=int, default=4,
                   help=f"bits per weight: {', '.join(map(str, QUANT_BITS))}, or 0 for full precision")
    p.add_argument("--group-size", type=int, default=64,
                   help=f"weights per scale/bias: {', '.join(map(str, QUANT_GROUP_SIZES))}")
    p.add_argument("--head-bits", type=int, default=None,
                   help="bits for the logits layer (and a tied input embedding), e.g. 8")
    p.add_argument("--norm", choices=NORMS, default="rms",
                   help="rms: as it is; flash: fold FlashNorm before quantizing")
    p.add_argument("--dequantize", action="store_true",
                   help="accept an already quantized input: dequantize it first (its error stays)")
    p.add_argument("--tokenizer", help="tokenizer folder, repo id or sentencepiece .model file")
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
        print(f"note: --norm flash quantizes the norm-folded weights, which costs quality at {args.bits} "
              "bits (SmolLM2 at 4 bits: perplexity +46%, bench/RESULTS.md); FlashNorm at load time "
              f"(--norm flash --bits {args.bits} on an rms checkpoint) does not fold and has no such cost",
              file=sys.stderr)
    what = "full precision" if args.bits == 0 else f"{args.bits}-bit, group size {args.group_size}"
    print(f"wrote {out} ({what}, norm {args.norm})")


if __name__ == "__main__":
    run_cli(main)
