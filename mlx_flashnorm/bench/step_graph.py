"""Operations in one 1-token decode step, per norm mode: the graph that mx.compile replays.

On a fast GPU decoding is bound by per-operation host work, so this count is the cost model of
the levers in bench/RESULTS.md, "Launches per step". Counts the step's (uncompiled) graph by
operation name:

    python -m mlx_flashnorm.bench.step_graph [--shape smollm2-135m | --config FILE] [--bits 4]
        [--dtype float16]

Modes: rms, flash, none and flash-sublayer (flash without the whole-step kernel,
kernels.decode_layers: the count before it), each on random weights of --shape or of a Hugging
Face config.json's architecture (--config: Gemma 3's and Qwen 3's in bench/configs).
"""
import argparse
import collections
import io
import re
import tempfile
from pathlib import Path

import mlx.core as mx

from .. import forms
from ..cache import StaticKVCache
from ..errors import HelpFormatter, run_cli
from ..decoding import decode_offset, position
from .decode import NORM_MODES, SHAPES, SUBLAYER, config_file, load_ours, random_checkpoint

# no kernel: they share the input's buffer (when contiguous)
VIEWS = {"Reshape", "Transpose", "Slice", "Split", "ExpandDims", "Squeeze", "Broadcast",
         "AsStrided", "Flatten", "Unflatten"}


def step_ops(model, prompt=8):
    """Operation names in the graph of one 1-token step after a prefill of `prompt` tokens: the
    compiled step's (offset an array), or on the portable path the eager one's (generate_step)."""
    cache = [StaticKVCache(prompt + 8) for _ in model.layers]
    model(mx.arange(prompt)[None], cache=cache)
    mx.eval([c.state for c in cache])
    for c in cache:
        # as generate's
        c.offset = c.offset if forms.portable() else position(decode_offset(prompt))
    return graph_ops(model(mx.array([[3]]), cache=cache), *[a for c in cache for a in c.state])


def graph_ops(*arrays):
    """Operation names in the (unevaluated) graph of arrays; non-arrays among them (mlx-lm's cache
    states carry an int) are left out."""
    f = io.StringIO()
    mx.export_to_dot(f, *[a for a in arrays if isinstance(a, mx.array)])
    return re.findall(r'label ="?([A-Za-z]+)', f.getvalue())


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mlx_flashnorm.bench.step_graph",
                                description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--bits", type=int, default=4, help="weight bits, 0 for full precision")
    p.add_argument("--dtype", default="float16", help="activation dtype")
    p.add_argument("--layers", type=int, default=16, help="decoder layers")
    p.add_argument("--shape", choices=list(SHAPES), default="openelm-270m",
                   help="architecture of the random weights")
    p.add_argument("--config", metavar="FILE",
                   help="random weights of the architecture of a Hugging Face config.json instead")
    p.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    args = p.parse_args(argv)
    name, config = config_file(args.config) if args.config else SHAPES[args.shape]
    if "num_transformer_layers" in config:  # OpenELM: per-layer lists
        config = dict(config, num_transformer_layers=args.layers,
                      **{k: config[k][:args.layers]
                         for k in ("num_query_heads", "num_kv_heads", "ffn_multipliers")})
    else:
        config = dict(config, num_hidden_layers=args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        folder = random_checkpoint(Path(tmp) / "m", config)
        print(f"device {mx.default_device()}, {name} shape, {args.layers} layers, "
              f"bits {args.bits}, {args.dtype}")
        for mode in NORM_MODES + ("flash" + SUBLAYER,):
            model = load_ours(folder, mode.removesuffix(SUBLAYER), args.bits or None, args.dtype,
                              64)
            with forms.without(*(("decode_layers",) if mode.endswith(SUBLAYER) else ())):
                ops = step_ops(model)
            counts = collections.Counter(ops)
            kernels = sum(n for op, n in counts.items() if op not in VIEWS)
            print(f"{mode:14} ops {len(ops):4}  non-view {kernels:4}  {dict(counts.most_common())}")


if __name__ == "__main__":
    run_cli(main)
