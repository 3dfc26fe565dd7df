"""Tensor parallelism (shard.py): memory per rank and decode speed, with 1 process or N.

    python -m mlx_flashnorm.bench.tensor_parallel [--model X] [--norm flash] [--tg 64]
    mlx.launch -n N --backend ring python -m mlx_flashnorm.bench.tensor_parallel [...]

Each rank prints one JSON line: its weights (the bytes of its model's parameters), MLX's peak
memory after loading and after decoding, its peak resident set (RSS, the process's whole
footprint: Python, MLX and the libraries included), and the greedy decode speed (tokens/s over
`--tg` tokens after the first, the compiled step; a warm-up generation first), and under
mlx.launch the time of one all-sum of a hidden state (a token costs two a layer)."""
import argparse
import json
import resource
import time

import mlx.core as mx
from mlx.utils import tree_flatten

from ..cli import add_model_args
from ..errors import HelpFormatter, run_cli
from ..decoding import generate_step
from ..loader import load
from ..shard import world

MB = 2**20


def decode_tps(model, tokens):
    """Greedy tokens/s over `tokens` decode steps after the first token of a 16-token prompt."""
    prompt = mx.arange(16) % model.args.vocab_size + 1
    steps = generate_step(prompt, model, max_tokens=tokens + 1)
    next(steps)
    tic = time.perf_counter()
    for _ in steps:
        pass
    return tokens / (time.perf_counter() - tic)


def all_sum_us(group, size, reps=100):
    """Microseconds of one all-sum of a float32 vector of `size` (a token's hidden state), after
    a warm-up; None for one process."""
    if group is None:
        return None
    x = mx.ones((1, 1, size))
    for _ in range(10):
        mx.eval(mx.distributed.all_sum(x, group=group))
    tic = time.perf_counter()
    for _ in range(reps):
        mx.eval(mx.distributed.all_sum(x, group=group))
    return round((time.perf_counter() - tic) / reps * 1e6)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mlx_flashnorm.bench.tensor_parallel",
                                description=__doc__, formatter_class=HelpFormatter)
    add_model_args(p, "--model", "--norm",
                   model=dict(help="model (default: the embedded SmolLM2-135M-Instruct)"),
                   norm=dict(help=None))
    p.add_argument("--tg", type=int, default=64, help="decode tokens timed")
    args = p.parse_args(argv)
    group = world()
    model, _ = load(args.model, norm=args.norm, progress=False)
    loaded = mx.get_peak_memory()
    decode_tps(model, 4)  # warm-up: the step's trace, the kernels
    tps = decode_tps(model, args.tg)
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    hidden = getattr(model.args, "hidden_size", None) or model.args.model_dim
    print(json.dumps({
        "rank": 0 if group is None else group.rank(),
        "processes": 1 if group is None else group.size(),
        "norm": args.norm, "weights_mb": round(weights / MB, 1),
        "peak_after_load_mb": round(loaded / MB, 1), "peak_mb": round(mx.get_peak_memory() / MB, 1),
        "rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "decode_tps": round(tps, 2), "all_sum_us": all_sum_us(group, hidden)}), flush=True)


if __name__ == "__main__":
    run_cli(main)
