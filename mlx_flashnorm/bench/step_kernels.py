"""GPU time of each kernel in a decode step, by kernel name, measured by Nsight Compute (ncu).

On the CUDA machine, one mode per process:

    ncu --profile-from-start off --cache-control none --clock-control none \\
        --metrics gpu__time_duration.sum --csv \\
        python -m mlx_flashnorm.bench.step_kernels run --mode flash --shape smollm2-135m \
--pp 1792 > flash.csv
    python -m mlx_flashnorm.bench.step_kernels summary flash.csv

`run` builds the random-weight model (4-bit, --dtype), prefills --pp tokens, warms the decode loop
up (bench.anatomy's: our compiled step, or mlx-lm's eager one), then decodes --steps tokens
between cuProfilerStart and cuProfilerStop, so that ncu profiles those steps alone. ncu runs the
kernels one at a time: each duration is the kernel's own, and the sum is the GPU time of a step
without the gaps between kernels. `summary` adds the durations up by kernel name and prints the
largest per step.
"""
import argparse
import collections
import csv
import ctypes
import tempfile
from pathlib import Path

import mlx.core as mx

from ..errors import HelpFormatter, UserError, run_cli
from .anatomy import decode_loop, load_mode
from .decode import PEER, random_checkpoint, random_shape

STEPS_LINE = "step_kernels: steps "


def profiler(on):
    """cuProfilerStart / cuProfilerStop of the CUDA driver (ncu --profile-from-start off waits for
    the first); nothing where there is no CUDA driver."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return
    (cuda.cuProfilerStart if on else cuda.cuProfilerStop)()


def run(args):
    _, config = random_shape(args)
    with tempfile.TemporaryDirectory() as tmp:
        folder = random_checkpoint(Path(tmp) / "m", config)
        model = load_mode(folder, args.mode, args.dtype)
        prompt = mx.random.randint(0, config.get("vocab_size", 32000), (args.pp,))
        step, y = decode_loop(model, args.mode, prompt)
        for _ in range(3):
            y = step(y)
            mx.eval(y)
        mx.synchronize()
        profiler(True)
        for _ in range(args.steps):
            y = step(y)
            mx.eval(y)
        mx.synchronize()
        profiler(False)
    print(f"{STEPS_LINE}{args.steps} mode {args.mode} pp {args.pp}", flush=True)


def summary(file, top=14):
    """(steps, [(kernel name, calls per step, microseconds per step)] largest first) of an ncu CSV
    written around `run`'s output."""
    lines = Path(file).read_text(errors="replace").splitlines()
    steps = [int(line.split()[2]) for line in lines if line.startswith(STEPS_LINE)]
    rows = [r for r in csv.reader(line for line in lines if line.startswith('"'))
            if len(r) > 12 and r[0] != "ID"]
    if not steps or not rows:
        raise UserError(f"{file}: no kernels of a `step_kernels run` in it: run it under ncu as "
                        "this module's help shows")
    time = collections.defaultdict(float)
    calls = collections.Counter()
    for r in rows:
        scale = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(r[-2], 1e-3)
        name = r[4].split("(")[0].removeprefix("void ")
        time[name] += float(r[-1].replace(",", "")) * scale
        calls[name] += 1
    n = steps[0]
    table = sorted(((k, calls[k] / n, t / n) for k, t in time.items()), key=lambda row: -row[2])
    return n, table[:top], sum(time.values()) / n, len(rows) / n


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mlx_flashnorm.bench.step_kernels",
                                description=__doc__, formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="decode steps for ncu to profile")
    r.add_argument("--mode", default="flash", choices=["rms", "flash", "none", PEER])
    r.add_argument("--shape", default="smollm2-135m", help="random weights of this architecture")
    r.add_argument("--config", action="append", metavar="FILE", help="or of this HF config.json")
    r.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    r.add_argument("--pp", type=int, default=1792, help="prompt tokens")
    r.add_argument("--steps", type=int, default=1,
                   help="decode steps profiled (ncu takes about 80 s a step)")
    r.add_argument("--dtype", default="float16", help="activation dtype")
    s = sub.add_parser("summary", help="GPU microseconds per step by kernel, from ncu's CSV")
    s.add_argument("file")
    p.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    args = p.parse_args(argv)
    if args.command == "run":
        return run(args)
    steps, table, total, kernels = summary(args.file)
    print(f"{args.file}: {kernels:.1f} kernels a step, {total:.1f} us of GPU time a step "
          f"(over {steps} steps)")
    print("| kernel | calls a step | us a step | us a call |\n| --- | ---: | ---: | ---: |")
    for name, calls, t in table:
        print(f"| `{name[:70]}` | {calls:g} | {t:.1f} | {t / calls:.1f} |")


if __name__ == "__main__":
    run_cli(main)
