"""What the load-time check for non-finite weights costs (bench/RESULTS.md, "Loading checks").

    python -m mlx_flashnorm.bench.load_cost [--model X ...] [--reps 3]

For each model: the median time of a whole `load()` (reading, checking and preparing the model,
the finite check included) and of the finite check alone (`validate.finite`) on the loaded model,
over --reps loads."""
import argparse
import statistics
import time

from .. import validate
from ..errors import HelpFormatter, run_cli
from ..loader import default_model_path, load


def timed(f):
    tic = time.perf_counter()
    out = f()
    return out, time.perf_counter() - tic


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mlx_flashnorm.bench.load_cost", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--model", action="append", help="model to load, repeatable (default: the embedded SmolLM2)")
    p.add_argument("--reps", type=int, default=3, help="loads per model")
    args = p.parse_args(argv)
    print("| model | load (s) | finite check (ms) | share of the load |")
    print("| --- | ---: | ---: | ---: |")
    for path in args.model or [str(default_model_path())]:
        loads, checks = [], []
        for _ in range(max(1, args.reps)):
            (model, _), seconds = timed(lambda: load(path, progress=False))
            loads.append(seconds)
            checks.append(timed(lambda: validate.finite(model, path))[1])
        load_s, check_s = statistics.median(loads), statistics.median(checks)
        print(f"| {path} | {load_s:.2f} | {check_s * 1e3:.0f} | {check_s / load_s:.1%} |", flush=True)


if __name__ == "__main__":
    run_cli(main)
