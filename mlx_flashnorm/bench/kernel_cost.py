"""What each custom kernel costs on the GPU, against the MLX primitive it stands beside.

    python -m mlx_flashnorm.bench.kernel_cost            # microseconds per call
    python -m mlx_flashnorm.bench.kernel_cost --check    # seconds each self-check takes in this process
    python -m mlx_flashnorm.bench.kernel_cost --launch   # what a launch costs by binary size and arrays

Per call: a chain of 60 calls (each feeding the next) inside mx.compile, as a decode step runs
them, median of 7; SmolLM2-135M's attention heads (9 queries, 3 keys/values, head dim 64) over
caches of 1024, 2048 and 4096 positions, and a 576-wide row for the norms. --check times
kernels.self_check per kernel with its verdict cache off (run it twice: the second process shows
what a warm MLX kernel cache leaves). --launch: the per-call cost of one element-wise kernel over 576
values as written, with a never-taken branch that makes its binary about 30 KB, and with 12 inputs
and 4 outputs: where a decode step is bound by host work, these are what each of our launches adds.
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from .. import forms, kernels
from ..kernels import build, nvrtc
from ..kernels import check as checks
from .. import nn as fnn
from ..errors import HelpFormatter
from ..decoding import decode_offset, position


def per_call(f, x, n=60, compiled=True):
    """Median microseconds per call of f in a chain of n calls."""
    def chain(x):
        for _ in range(n):
            x = f(x)
        return x

    g = mx.compile(chain) if compiled else chain
    mx.eval(g(x))
    times = []
    for _ in range(7):
        t = time.perf_counter()
        mx.eval(g(x))
        times.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(times)


def check_times():
    with tempfile.TemporaryDirectory() as tmp:
        nvrtc.CACHE_DIR = Path(tmp)
        t = time.perf_counter()
        mx.eval(mx.ones(4) + 1)
        print(f"first MLX op: {time.perf_counter() - t:.3f} s")
        for name in checks.CHECKS:
            t = time.perf_counter()
            kernels.self_check([name])
            mx.synchronize()
            print(f"self-check {name}: {time.perf_counter() - t:.3f} s")


def call_costs(dtype=mx.float16):
    print("| kernel | cache | compiled us/call | eager us/call | MLX primitive | compiled us/call | eager us/call |")
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: |")
    B, Hq, Hkv, D = 1, 9, 3, 64
    q = mx.random.normal((B, Hq, 1, D)).astype(dtype)
    for C, n in ((1024, 100), (2048, 1900), (4096, 4000)):
        k, v = (mx.random.normal((B, Hkv, C, D)).astype(dtype) for _ in range(2))
        start = position(decode_offset(n - 1))  # as the decode step passes it (a 16-byte buffer)
        ks, vs = k[:, :, :n], v[:, :, :n]
        mx.eval(k, v, ks, vs)
        ours = [per_call(lambda x: kernels.decode_attention(x, k, v, start, 0.125), q, compiled=c) for c in (True, False)]
        theirs = [per_call(lambda x: mx.fast.scaled_dot_product_attention(x, ks, vs, scale=0.125), q, compiled=c)
                  for c in (True, False)]
        print(f"| decode_attention, {n} filled | {C} | {ours[0]:.1f} | {ours[1]:.1f} | "
              f"sdpa over the {n} filled, no mask | {theirs[0]:.1f} | {theirs[1]:.1f} |")
    x, r = (mx.random.normal((1, 1, 576)).astype(dtype) for _ in range(2))
    w, g = mx.ones((576,), dtype), mx.ones((576,), mx.float32)
    rows = [("add_rss (residual, gain)", lambda x: kernels.add_rss(x, 1e-5, r=r, g=g)[1],
             "add + rms_norm", lambda x: mx.fast.rms_norm(x + r, w, 1e-5)),
            ("nn.py add + RMSNorm", lambda x: fnn.normalize(x, r, w, eps=1e-5, backend=forms.gpu_backend(), vjp=False)[0],
             "rms_norm alone", lambda x: mx.fast.rms_norm(x, w, 1e-5))]
    for name, ours, peer, theirs in rows:
        a, b = (per_call(ours, x, compiled=c) for c in (True, False))
        c_, d = (per_call(theirs, x, compiled=c) for c in (True, False))
        print(f"| {name} | - | {a:.1f} | {b:.1f} | {peer} | {c_:.1f} | {d:.1f} |")


_ADD_ONE = """
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < x_shape[0]) o[i] = x[i] + 1.0f;
"""
_LARGE = _ADD_ONE + """
  if (x_shape[0] == 12345) {  // never taken: code that only makes the binary larger
    float t = x[i];
    #pragma unroll
    for (int j = 0; j < 20; ++j) t = sinf(t * 1.0001f + j);
    o[i] = t;
  }
"""


def launch_costs():
    def kernel(name, body, n_in, n_out):
        launch = build.make_kernel(name, ["x"] + [f"x{j}" for j in range(1, n_in)],
                                     ["o"] + [f"o{j}" for j in range(1, n_out)], body, build.HEADERS[forms.gpu_backend()])
        return lambda x: launch(inputs=[x] * n_in, template=[("T", x.dtype)], grid=(x.size, 1, 1),
                                threadgroup=(192, 1, 1), output_shapes=[x.shape] * n_out,
                                output_dtypes=[x.dtype] * n_out)[0]
    x, w = mx.random.normal((576,)), mx.ones((576,))
    rows = [("rms_norm (MLX)", lambda x: mx.fast.rms_norm(x, w, 1e-5)),
            ("x + 1, 1 input, 1 output", kernel("cost_small", _ADD_ONE, 1, 1)),
            ("x + 1, binary about 30 KB", kernel("cost_large", _LARGE, 1, 1)),
            ("x + 1, 12 inputs, 4 outputs", kernel("cost_arrays", _ADD_ONE, 12, 4))]
    print("| launch | compiled us/call | eager us/call |")
    print("| --- | ---: | ---: |")
    for name, f in rows:
        per_call(f, x)  # warm-up: compiles the kernel
        print(f"| {name} | {per_call(f, x):.1f} | {per_call(f, x, compiled=False):.1f} |")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mlx_flashnorm.bench.kernel_cost", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--check", action="store_true", help="time each kernel's self-check instead")
    p.add_argument("--launch", action="store_true", help="time launches by binary size and array count instead")
    args = p.parse_args(argv)
    if not forms.use_gpu():
        sys.exit("error: the kernels run on a GPU (Metal or CUDA) only; here they fall back to MLX ops")
    print(f"device: {mx.device_info().get('device_name', mx.default_device())} | MLX {mx.__version__}")
    check_times() if args.check else launch_costs() if args.launch else call_costs()


if __name__ == "__main__":
    main()
