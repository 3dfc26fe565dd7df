"""Final norm + tied LM head under FlashNorm: 'scale' (shared embedding + one scale vector) vs
'untie' (norm weights folded into an untied head copy), with the reference 'rms' alongside.

All variants hold the same weights in this one process; after a warm-up round they take turns
(rms scale untie rms scale untie ...); median and min - max over the rounds. Memory is the bytes
of the model's parameters (the untied copy is vocab x dim more).

    python -m mlx_flashnorm.bench.flash_head [--model X] [--reps 5] [--tg 64]
"""
import argparse
import sys

import mlx.core as mx
from mlx.utils import tree_flatten

from .. import flashnorm
from ..errors import HelpFormatter, UserError, run_cli
from ..decoding import generate_step
from ..loader import dequantize, load, model_args
from .decode import OPENELM_270M, device_name, measure, summary

VARIANTS = ("rms", "scale", "untie")


def random_openelm(seed=0):
    arch, args = model_args(OPENELM_270M)
    model = arch.Model(args)
    mx.random.seed(seed)
    model.load_weights([(k, (1.0 + 0.2 * mx.random.normal(v.shape)) if "norm" in k else 0.02 * mx.random.normal(v.shape))
                        for k, v in tree_flatten(model.parameters())])
    model.config = dict(OPENELM_270M)
    mx.eval(model.parameters())
    return model


def build(model_path, variant):
    if model_path is None:
        model = random_openelm()
    else:
        model = load(model_path, norm="rms", dtype="float32", progress=False)[0]
        if "quantization" in model.config:
            dequantize(model)
    if variant != "rms":
        flashnorm.apply(model, head=variant)
    return model


def param_bytes(model):
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mlx_flashnorm.bench.flash_head",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model", help="model to load (default: OpenELM-270M shape, random weights)")
    p.add_argument("--reps", type=int, default=5, help="measured repetitions")
    p.add_argument("--pp", type=int, default=16, help="prompt tokens")
    p.add_argument("--tg", type=int, default=64, help="generated tokens per round")
    p.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    args = p.parse_args(argv)
    if args.reps < 1 or args.tg < 2 or args.pp < 1:
        raise UserError("--reps and --pp must be at least 1, --tg at least 2")
    models = {v: build(args.model, v) for v in VARIANTS}
    mx.random.seed(0)
    prompt = mx.random.randint(0, 32000 if args.model is None else models["rms"].args.vocab_size, (args.pp,))
    tg = {v: [] for v in VARIANTS}
    for rep in range(args.reps + 1):  # round 0 is the warm-up
        for v in VARIANTS:
            speed = measure(lambda pr, n: generate_step(pr, models[v], max_tokens=n), prompt, args.tg)[1]
            if rep:
                tg[v].append(speed)
    label = args.model or "OpenELM-270M shape, random weights"
    print(f"device: {device_name()} | MLX {mx.__version__} | float32 | {label} | {args.reps} reps, interleaved, after warm-up")
    print("| head | decode t/s (median) | spread (min - max) | vs rms | parameter memory |")
    print("| --- | ---: | ---: | ---: | ---: |")
    base = summary(tg["rms"])["median"]
    for v in VARIANTS:
        s = summary(tg[v])
        print(f"| {v} | {s['median']:.2f} | {s['min']:.2f} - {s['max']:.2f} | {s['median'] / base:.3f} "
              f"| {param_bytes(models[v]) / 2**20:.1f} MiB |")


if __name__ == "__main__":
    sys.exit(run_cli(main))
