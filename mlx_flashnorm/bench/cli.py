"""`python -m mlx_flashnorm.bench`: the throughput bench's command line. One model (--model, --tiny,
--config or --shape) in bench.md/json/png, with llama.cpp's llama-bench on the same GGUF file beside
it (--llama-bench, llama_bench.py), or --matrix over shapes x prompt lengths (matrix.py), or --merge
of earlier matrix runs."""
import argparse
import json
import sys
import tempfile
from pathlib import Path

from ..cli import add_model_args
from ..errors import HelpFormatter, UserError, run_cli
from ..loader import default_model_path, read_config, resolve, resolve_dtype
from . import llama_bench
from .decode import (SHAPES, bench, check_context, gguf_checkpoint, log, parse_modes, plot,
                     positive, random_checkpoint, random_shape, table, write_atomic)
from .matrix import merge, run_matrix


def arg_parser():
    p = argparse.ArgumentParser(
        prog="python -m mlx_flashnorm.bench",
        description="Prompt (pp) and decode (tg) tokens/s of each norm mode and of mlx-lm on the "
                    "same weights, interleaved in one process: the paper's OpenELM-270M table.",
        epilog="Without --model, --shape, --config or --tiny: the embedded SmolLM2-135M-Instruct "
               "(Q4_1 GGUF); --model also takes a .gguf file. --shape: random weights (labelled as "
               "such). Modes: rms, flash, none, mlx-lm, rms-primitives (rms on the layer loop, "
               "without the whole-step kernel); add -eager to a norm mode (e.g. rms-eager) "
               "for our runner without the compiled decode step; flash-loop-prefill: flash with "
               "the prompt through the model's blocks, not kernels.prefill_rows. --matrix runs "
               "every shape "
               "(--shape, --config) at every prompt length (--pp) and writes matrix.md, "
               "matrix.json and matrix.png; time to first token over a series of requests: python "
               "-m mlx_flashnorm.bench.latency.",
        formatter_class=HelpFormatter)
    add_model_args(p, "--model", model=dict(help="HF model folder, repo id or .gguf file (default: "
                                                 "the embedded SmolLM2-135M-Instruct)"))
    p.add_argument("--modes", default="rms,flash,none,mlx-lm", help="comma-separated")
    add_model_args(p, "--bits", "--group-size", "--dtype",
                   bits=dict(help="weight bits, 0 for full precision (default: 4; a quantized "
                                  "checkpoint as it is)"),
                   group_size=dict(help="weights per scale/bias"))
    p.add_argument("--pp", help="prompt tokens (default 512); with --matrix a comma-separated "
                                "list, where 'long' is 4096, or 1792 when the model's context is "
                                "too short (default 128,long)")
    p.add_argument("--tg", type=int, default=128, help="generated tokens")
    p.add_argument("--reps", type=int, default=5, help="measured repetitions after one warm-up")
    p.add_argument("--out", default="out/bench", help="folder for bench.md, bench.json, bench.png")
    p.add_argument("--shape", help=f"architecture of random weights: {', '.join(SHAPES)} (with "
                                   "--matrix a comma-separated list, default all)")
    p.add_argument("--config", action="append", metavar="FILE",
                   help="random weights of the architecture of a Hugging Face config.json (repeat "
                        "it with --matrix)")
    p.add_argument("--tiny", action="store_true",
                   help="a 2-layer OpenELM-shaped random model: a smoke test in seconds")
    p.add_argument("--matrix", action="store_true",
                   help="every shape at every prompt length, one table and one chart")
    p.add_argument("--merge", nargs="+", metavar="FILE",
                   help="one table and chart (in --out) from the matrix.json files of earlier "
                        "--matrix runs")
    p.add_argument("--llama-bench", metavar="PATH",
                   help="llama.cpp's llama-bench binary: run it on the same GGUF file (--model "
                        "FILE.gguf, or the embedded one) after our modes, its prefill at depth 0 "
                        "and decode after --pp tokens, and add its rows and our ratio to it to the "
                        "table and chart")
    p.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    return p


def main(argv=None):
    args = arg_parser().parse_args(argv)
    modes = parse_modes(args.modes)
    if args.tg < 2 or args.reps < 1:
        raise UserError("need --tg >= 2 and --reps >= 1")
    chosen = [o for o, v in (("--model", args.model), ("--tiny", args.tiny),
                             ("--config", args.config), ("--shape", args.shape)) if v]
    if args.llama_bench and (args.merge or args.matrix):
        raise UserError("--llama-bench compares one model's run: drop --merge or --matrix")
    # the embedded one by default
    gguf_file = args.model or (None if chosen else str(default_model_path()))
    peer = llama_bench.check_args(args.llama_bench, gguf_file) if args.llama_bench else None
    if args.merge:
        if args.matrix or chosen:
            raise UserError("--merge reads earlier runs' matrix.json files: it runs no model")
        return merge(args.merge, Path(args.out))
    if args.matrix:
        if args.model or args.tiny:
            raise UserError("--matrix runs random weights of --shape and --config models: "
                            f"drop {chosen[0]}")
        return run_matrix(args, modes)
    if len(chosen) > 1:
        raise UserError(f"{chosen[0]} and {chosen[1]} both choose the model: keep one")
    if "," in (args.shape or "") + (args.pp or ""):
        raise UserError("lists of shapes or prompt lengths need --matrix")
    pp = positive(args.pp or "512", "--pp")
    bits = 4 if args.bits is None else args.bits or None
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model or not chosen:
            folder = resolve(args.model) if args.model else None
            if folder is None or folder.is_file():  # a GGUF, or the embedded one
                if folder is not None and folder.suffix != ".gguf":
                    raise UserError(f"{folder}: not a model; pass a model folder, a .gguf file or "
                                    "a repo id")
                log(f"reading {folder.name if folder else 'the embedded SmolLM2-135M-Instruct'}...")
                folder = Path(tmp) / "model"
                label, config = gguf_checkpoint(args.model, folder, args.bits, args.group_size)
            else:
                config = read_config(folder)
                label = config.get("_name_or_path") or folder.name
            if "quantization" in config:
                if args.bits:
                    print(f"note: {label} is already quantized; --bits is ignored", file=sys.stderr)
                bits = None
            check_context(label, config, pp, args.tg)
        else:
            name, config = random_shape(args)
            label = f"{name} (random weights)"
            check_context(name, config, pp, args.tg)
            log(f"building {label}...")
            folder = random_checkpoint(Path(tmp) / "model", config)
        report = bench(modes, folder, label, bits, resolve_dtype(args.dtype, config), pp, args.tg,
                       args.reps, args.group_size, log=log)
    if peer:
        llama_bench.compare(report, peer, gguf_file, log)
    out.mkdir(parents=True, exist_ok=True)
    md = table(report)
    write_atomic(out / "bench.md", f"Command: `{report['command']}`\n\n{md}")
    write_atomic(out / "bench.json", json.dumps(report, indent=1))
    print(md)
    plot([report], out / "bench.png")
    print(f"wrote {out}/bench.md, bench.json, bench.png")


if __name__ == "__main__":
    run_cli(main)
