"""Fused add+RMSNorm kernel against the fallback composition (issue 6).

    python bench/normalize_kernel.py [--samples N] [--calls N]

1. Checks that the kernel equals the fallback (float32 and float16, stated tolerances).
2. Times both, interleaved after a warm-up: each sample issues ``--calls`` chained calls
   (o, p of one call are x, residual of the next), evaluates them and divides; the
   table gives the median time per call and the spread (25th-75th percentile) over
   the samples, and the bandwidth that the median implies.

On a machine without a GPU backend the "kernel" is the fallback itself (CPU), so the
script compares the fallback with itself.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx.core as mx  # noqa: E402

from mlx_flashnorm import nn as fnn  # noqa: E402
from mlx_flashnorm import forms  # noqa: E402
from mlx_flashnorm.errors import HelpFormatter  # noqa: E402

SHAPES = [(1, 1280), (1, 2048), (1, 4096), (512, 1280), (512, 4096)]
TOLERANCE = {mx.float32: 2e-6, mx.float16: 2e-3}  # relative, Frobenius norm


def rel_err(a, b):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.linalg.norm((a - b).reshape(-1)) / mx.linalg.norm(b.reshape(-1))).item()


def inputs(shape, dtype, seed=0):
    k = mx.random.split(mx.random.key(seed), 3)
    x = mx.random.normal(shape, key=k[0]).astype(dtype)
    res = mx.random.normal(shape, key=k[1]).astype(dtype)
    w = (1 + 0.2 * mx.random.normal(shape[-1:], key=k[2])).astype(dtype)
    mx.eval(x, res, w)
    return x, res, w


def check(kernel):
    worst = 0.0
    for shape in SHAPES + [(3, 7, 1000), (2, 10000)]:
        for dtype in (mx.float32, mx.float16):
            x, res, w = inputs(shape, dtype)
            for center in (False, True):
                for r in (None, res):
                    o_k, p_k = fnn.normalize(x, r, w, center=center, eps=1e-5, backend=kernel)
                    o_f, p_f = fnn.normalize(x, r, w, center=center, eps=1e-5,
                                             backend="fallback")
                    err = rel_err(o_k, o_f)
                    worst = max(worst, err / TOLERANCE[dtype])
                    assert err < TOLERANCE[dtype], (shape, dtype, center, r is None, err)
                    assert mx.array_equal(p_k, p_f), (shape, dtype, center)
    print(f"check: kernel == fallback, worst error {worst:.2f} of tolerance "
          f"(float32 {TOLERANCE[mx.float32]:g}, float16 {TOLERANCE[mx.float16]:g})")


def sample(backend, x, res, w, calls, fused):
    mx.synchronize()
    t0 = time.perf_counter()
    if fused:
        for _ in range(calls):
            x, res = fnn.normalize(x, res, w, eps=1e-5, backend=backend)
    else:
        for _ in range(calls):
            x, _ = fnn.normalize(x, None, w, eps=1e-5, backend=backend)
    mx.eval(x, res)
    mx.synchronize()
    return (time.perf_counter() - t0) / calls


def quartiles(values):
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


def bench(kernel, samples, calls, dtype, warmup=5):
    print(f"\n{dtype}, {calls} chained calls a sample, {samples} samples after {warmup} "
          "warm-up rounds, microseconds per call: median [25th-75th percentile]")
    print("| op | shape | kernel | fallback | fallback / kernel | kernel GB/s |")
    print("|---|---|---|---|---|---|")
    for fused in (True, False):
        for shape in SHAPES:
            x, res, w = inputs(shape, dtype)
            times = {"kernel": [], "fallback": []}  # on CPU both slots run the fallback
            slots = [("kernel", kernel), ("fallback", "fallback")]
            for i in range(warmup + samples):
                for slot, backend in slots if i % 2 else slots[::-1]:  # interleaved
                    t = sample(backend, x, res, w, calls, fused)
                    if i >= warmup:
                        times[slot].append(t)
            lo_k, med_k, hi_k = (1e6 * t for t in quartiles(times["kernel"]))
            lo_f, med_f, hi_f = (1e6 * t for t in quartiles(times["fallback"]))
            size = x.size * x.itemsize
            moved = size * (4 if fused else 2) + w.size * w.itemsize  # reads + writes
            print(f"| {'add+rms_norm' if fused else 'rms_norm'} | {shape} "
                  f"| {med_k:.1f} [{lo_k:.1f}-{hi_k:.1f}] | {med_f:.1f} [{lo_f:.1f}-{hi_f:.1f}] "
                  f"| {med_f / med_k:.2f} | {moved / (med_k * 1e-6) / 1e9:.1f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    parser.add_argument("--samples", type=int, help="default 30 on a GPU, 5 on the CPU")
    parser.add_argument("--calls", type=int, help="default 50 on a GPU, 5 on the CPU")
    args = parser.parse_args()
    kernel = forms.gpu_backend() or "fallback"
    samples = args.samples or (30 if kernel != "fallback" else 5)
    calls = args.calls or (50 if kernel != "fallback" else 5)
    if kernel != "fallback":
        mx.set_default_device(mx.gpu)
    print(f"mlx {mx.__version__}, device {mx.default_device()}, {mx.device_info()}, "
          f"kernel path: {kernel}")
    check(kernel)
    for dtype in (mx.float16, mx.float32) if kernel != "fallback" else (mx.float32,):
        bench(kernel, samples, calls, dtype)


if __name__ == "__main__":
    main()
