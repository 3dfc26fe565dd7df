"""Fused kernels for the decode step, each with a plain-MLX fallback.

On a GPU the functions below run one custom kernel each (make_kernel): on CUDA compiled here with
NVRTC and kept on disk (cuda_binary), run by ``mx.fast.precompiled_cuda_kernel``; on Metal
``mx.fast.metal_kernel`` with the same body respelled (METAL_SPELLING; never run here: no Apple
hardware). On the CPU they run the plain MLX composition, which is also the reference of
the tests and of each kernel's self-check: at load on a GPU (self_check) every kernel is compared
with its fallback on small inputs, and one that fails to compile or to match prints a warning
line and falls back for the rest of the process; a pass is remembered per kernel code, MLX
version and device (CACHE_DIR), so later processes skip it. Inside ``mx.compile`` a custom kernel is one node of the graph like any built-in op, so
each kernel here removes the graph nodes (and GPU launches) of the ops it replaces: that is the
per-token cost that bounds decoding on a fast GPU.

    decode_attention   softmax(q k^T * scale) v over the first n cached positions (n an array),
                       so a compiled decode step attends over a fixed-size cache without a mask
    add_rss            p = x * xs + r, p * g, and 1/RSSe(p) = rsqrt(sum(p^2) + d*eps) per row:
                       the residual add and FlashNorm's deferred scale in one pass
    rope_qkv           FlashNorm Sec. 3/4 after the q, k, v projections: RoPE with the deferred
                       1/RSS (Sec. 3) or, with QK-norm (Sec. 4), each head's own 1/RSSe and the
                       q/k norm weights fused into cos/sin (rotate-half layout); v * s
    qkv_rope, gate_up  Sec. 5, one decode row: a pre-norm's residual add, 1/RSSe and gain computed
                       inside its consumer's first 4/8-bit matmul kernel, with rope_qkv's work
                       (q/k/v) or SwiGLU with the up scale deferred (gate/up) as the epilogue

On the CPU, where decoding is bound by MLX's (single-threaded) 4-bit matrix-vector product,
quantized_matmul splits the weight rows over two CPU streams, which MLX runs on two threads; the
result is bit-identical.

Set MLX_FLASHNORM_KERNELS=0 (or ``kernels.ENABLED = False``) to force the fallbacks, nn.py's
fused add + RMSNorm kernel included: on a GPU that is the portable path (``portable``).
"""
import hashlib
import json
import math
import os
import struct
import sys
import threading
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

ENABLED = os.environ.get("MLX_FLASHNORM_KERNELS", "1") != "0"


DISABLED = set()  # kernels that failed their self-check in this process (they fall back)


def use_gpu(name=None):
    """True when the fused kernels (or the one named) run: enabled, the default device a GPU with
    MLX's CUDA or Metal backend, and the kernel not disabled by its self-check."""
    return ENABLED and mx.default_device() == mx.gpu and gpu_backend() is not None and name not in DISABLED


def portable():
    """True on a GPU where our kernels do not run (MLX_FLASHNORM_KERNELS=0, or add_rss failed its
    self-check): models then run on MLX's own primitives alone, as mlx-lm's do. There a deferred
    1/RMS has no fused kernel to live in and would cost extra element-wise launches beside
    mx.fast.rms_norm, so FlashNorm takes its weightless form (flashnorm.apply) and decoding runs
    eagerly over exactly the filled cache (generate_step), as mlx-lm does: a compiled step over a
    fixed-size cache needs a masked attention, which MLX's CUDA backend does not fuse (measured in
    bench/RESULTS.md, "Second pass on speed"; written as two matmuls and a softmax it still ran at
    0.79-0.88x the eager step, "Ninth pass"). The CPU keeps the deferred form (the tests' reference)."""
    return mx.default_device() == mx.gpu and not use_gpu("add_rss")


# ---------------------------------------------------------------- CPU: row-parallel matmul

CPU_STREAMS = 2  # measured on 2 cores: a 4-bit matvec 1.8x faster, decode 1.4x (bench/RESULTS.md)


_thread = threading.local()


def _cpu_streams():
    """The streams of the row blocks; an MLX stream belongs to the thread that made it, so each
    thread running a model (the server's generation worker, say) gets its own."""
    if not hasattr(_thread, "cpu_streams"):
        _thread.cpu_streams = [mx.new_stream(mx.cpu) for _ in range(CPU_STREAMS)]
    return _thread.cpu_streams


def quantized_matmul(x, w, scales, biases, group_size, bits, mode="affine"):
    """x @ dequantize(w).T, as mx.quantized_matmul(..., transpose=True). On the CPU (with at least
    two cores) the output columns are computed in row blocks of w on separate streams; each block
    is the same computation as before, so the result is bit-identical. On the CPU a half-precision
    product runs in float32 and is rounded once: MLX's CPU kernel accumulates in the half type,
    10-40x slower and 10 units in the last place off where float32 accumulation (as on a GPU)
    is not (bench/RESULTS.md, "Half precision on the CPU")."""
    if mx.default_device() != mx.cpu:  # first, and once: an eager forward pass calls this per linear
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size,
                                   bits=bits, mode=mode)
    if x.dtype in (mx.float16, mx.bfloat16) and mode == "affine":
        f32 = mx.float32
        return quantized_matmul(x.astype(f32), w, scales.astype(f32), biases.astype(f32), group_size,
                                bits, mode).astype(x.dtype)
    n = w.shape[0]
    if not (ENABLED and (os.cpu_count() or 1) > 1 and n >= 2 * CPU_STREAMS):
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size,
                                   bits=bits, mode=mode)
    cuts = [n * i // CPU_STREAMS for i in range(CPU_STREAMS + 1)]
    parts = [mx.quantized_matmul(x, w[a:b], scales[a:b], None if biases is None else biases[a:b],
                                 transpose=True, group_size=group_size, bits=bits, mode=mode, stream=st)
             for a, b, st in zip(cuts, cuts[1:], _cpu_streams())]
    return mx.concatenate(parts, axis=-1)


class QuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear computed through quantized_matmul (the loader swaps it in on the CPU)."""

    def __call__(self, x):
        y = quantized_matmul(x, self["weight"], self["scales"], self.get("biases"), self.group_size,
                             self.bits, self.mode)
        return y + self["bias"] if "bias" in self else y


class QuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose as_linear (a tied LM head) goes through quantized_matmul."""

    def as_linear(self, x):
        return quantized_matmul(x, self["weight"], self["scales"], self.get("biases"), self.group_size,
                                self.bits, self.mode)


def row_parallel(model):
    """Make every nn.QuantizedLinear / nn.QuantizedEmbedding of model use quantized_matmul, in
    place (the same arrays, the same parameter names; only the class changes), where the default
    device is the CPU; on a GPU quantized_matmul is MLX's own, so the classes stay MLX's (one
    call frame less per linear in an eager forward pass)."""
    if mx.default_device() != mx.cpu:
        return model
    for _, m in model.named_modules():
        if type(m) is nn.QuantizedLinear:
            m.__class__ = QuantizedLinear
        elif type(m) is nn.QuantizedEmbedding:
            m.__class__ = QuantizedEmbedding
    return model


def float_bits(value):
    return struct.unpack("<i", struct.pack("<f", float(value)))[0]


# One body per kernel, written in CUDA; the Metal form is the same body respelled by this table
# (identifiers CUDA and Metal name differently) with its own header. Each kernel checks itself
# against its fallback (self_check), on whichever backend it runs.
CUDA_DTYPES = """
__device__ inline float fn_f(float v) { return v; }
__device__ inline float fn_f(__half v) { return __half2float(v); }
__device__ inline float fn_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename U> __device__ inline U fn_cast(float v) { return v; }
template <> __device__ inline __half fn_cast<__half>(float v) { return __float2half(v); }
template <> __device__ inline __nv_bfloat16 fn_cast<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);
}
"""  # float <-> T for T = float, __half, __nv_bfloat16 (also nn.py's kernel)

_HEADERS = {
    "cuda": CUDA_DTYPES + """__device__ inline float fn_warp_sum(float v) {
  for (int k = 16; k > 0; k >>= 1) v += __shfl_xor_sync(0xffffffff, v, k);
  return v;
}
__device__ inline float fn_warp_max(float v) {
  for (int k = 16; k > 0; k >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, k));
  return v;
}
__device__ inline float fn_shfl_xor(float v, int k) { return __shfl_xor_sync(0xffffffff, v, k); }
template <typename U, int N> __device__ inline void fn_load(const U* p, float* out) {
  const uint4 w = *reinterpret_cast<const uint4*>(p);  // N values of U, 16 bytes, in one load
  const U* e = reinterpret_cast<const U*>(&w);
  for (int i = 0; i < N; ++i) out[i] = fn_f(e[i]);
}
""",
    "metal": """
template <typename U> inline float fn_f(U v) { return static_cast<float>(v); }
template <typename U> inline U fn_cast(float v) { return static_cast<U>(v); }
inline float fn_warp_sum(float v) { return simd_sum(v); }  // Apple GPUs: 32-wide SIMD groups
inline float fn_warp_max(float v) { return simd_max(v); }
inline float fn_shfl_xor(float v, int k) { return simd_shuffle_xor(v, ushort(k)); }
template <typename U, int N> inline void fn_load(const device U* p, thread float* out) {
  for (int i = 0; i < N; ++i) out[i] = static_cast<float>(p[i]);
}
""",
}

METAL_SPELLING = {
    "blockIdx.x": "threadgroup_position_in_grid.x", "threadIdx.x": "thread_position_in_threadgroup.x",
    "blockDim.x": "threads_per_threadgroup.x", "__shared__": "threadgroup",
    "__syncthreads()": "threadgroup_barrier(mem_flags::mem_threadgroup)",
    "__int_as_float": "as_type<float>", "__float_as_int": "as_type<int>", "rsqrtf(": "metal::rsqrt(",
    "exp2f(": "metal::exp2(", "expf(": "metal::exp(", "fmaxf(": "metal::fmax(", "sinf(": "metal::sin(", "cosf(": "metal::cos(",
}


def spell(source, backend):
    """A CUDA kernel body in the backend's spelling."""
    if backend == "metal":
        for cuda, metal in METAL_SPELLING.items():
            source = source.replace(cuda, metal)
    return source


@lru_cache(maxsize=None)
def gpu_backend():
    """"cuda" or "metal" where MLX has that GPU backend, else None (asked once per process)."""
    return "metal" if mx.metal.is_available() else ("cuda" if mx.cuda.is_available() else None)


@lru_cache(maxsize=None)
def constant(dtype, *values):
    """A small array of run-time sizes or flags for a kernel, made once per distinct value: no
    new array per call, and inside mx.compile one constant of the graph. Padded to 16 bytes: MLX's
    CUDA backend keeps arrays of 8 bytes or less in one managed-memory page that the host touches
    every decode step, and a kernel reading from it waited up to 20 us (bench/RESULTS.md, "Fifth
    pass")."""
    a = mx.array(values + (0,) * (4 - len(values)), dtype)
    mx.eval(a)
    return a


def position_array(offset):
    """A kernel's position input: the decode step's view of its offset as it is, an int as a
    constant (16 bytes, made once per position): mx.array(offset) would be a new 4-byte array in
    MLX's managed small-array pool at every call, which the kernel's warps then read slowly."""
    return (offset if isinstance(offset, mx.array) else constant(mx.int32, offset)).astype(mx.int32).reshape(-1)


# (kernel name, template arguments) of every launch so far: each distinct pair is one compiled
# variant (tests check that requests add none).
VARIANTS = set()


def make_kernel(name, input_names, output_names, source, header):
    """A kernel of body `source` (CUDA spelling) as a function of mx.fast.cuda_kernel's keyword
    arguments (inputs, template, grid, threadgroup, output_shapes, output_dtypes); header: the
    backend's own. On Metal mx.fast.metal_kernel runs the respelled body. On CUDA the body is
    compiled here (cuda_binary) and run with mx.fast.precompiled_cuda_kernel: MLX compiles a
    cuda_kernel with NVRTC in every process (1.5-2 s each on an H100, bench/RESULTS.md), a binary
    kept on disk loads in milliseconds."""
    backend = gpu_backend()
    if backend == "metal":
        kernel = mx.fast.metal_kernel(name=name, input_names=input_names, output_names=output_names,
                                      source=spell(source, backend), header=header)
    shaped = [i for i, n in enumerate(input_names) if reads_shape(n, source)]
    binaries = {}  # (input dtypes and ranks, output dtypes, template) -> cubin (None on Metal)

    def launch(*, inputs: list, template, grid, threadgroup, output_shapes, output_dtypes):
        # Python work here is host time of every eager launch (prefill): kept to a dict lookup
        key = (*[(a.dtype, a.ndim) for a in inputs], *output_dtypes, *template)
        binary = binaries.get(key, False)
        if binary is False:  # a variant not launched before
            VARIANTS.add((name, tuple((k, str(v)) for k, v in template)))
            binaries[key] = binary = None if backend == "metal" else cuda_binary(name, cuda_source(
                name, input_names, output_names, source, header, [(a.dtype, a.ndim) for a in inputs],
                output_dtypes, template))
        if backend == "metal":
            return kernel(inputs=inputs, template=template, grid=grid, threadgroup=threadgroup,
                          output_shapes=output_shapes, output_dtypes=output_dtypes)
        return mx.fast.precompiled_cuda_kernel(
            name=name, compiled_source=binary, inputs=inputs, output_shapes=output_shapes,
            output_dtypes=output_dtypes, scalars=[d for i in shaped for d in inputs[i].shape],
            grid=grid, threadgroup=threadgroup, ensure_row_contiguous=True)

    return launch


def _kernel(name, inputs, outputs, source):
    return make_kernel(name, inputs, outputs, source, _HEADERS[gpu_backend()])


# ---------------------------------------------------------------- CUDA: compiled once per machine

CUDA_TYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.int32: "int",
              mx.uint32: "unsigned int", mx.uint8: "unsigned char", mx.bool_: "bool"}
CUDA_PRELUDE = """#include <cuda_fp16.h>
#include <cuda_bf16.h>
typedef int int32_t;
typedef unsigned int uint32_t;
"""


def reads_shape(name, body):
    """Whether a kernel body reads input `name`'s shape (NAME_shape[i] or NAME_ndim)."""
    return f"{name}_shape" in body or f"{name}_ndim" in body


def cuda_source(name, input_names, output_names, body, header, input_types, output_dtypes, template):
    """The whole CUDA file of one kernel variant: an extern "C" __global__ function of the inputs
    (input_types: (dtype, ndim) each), the outputs and then, for each input whose shape the body
    reads, its sizes as int arguments (the launch passes them); template arguments as constants."""
    params = [f"const {CUDA_TYPES[d]}* {n}" for n, (d, _) in zip(input_names, input_types)]
    params += [f"{CUDA_TYPES[d]}* {n}" for n, d in zip(output_names, output_dtypes)]
    lines = []
    for n, (_, ndim) in zip(input_names, input_types):
        if reads_shape(n, body):
            sizes = [f"{n}_shape{i}" for i in range(ndim)]
            params += [f"int {s}" for s in sizes]
            lines.append(f"  const int {n}_shape[{max(ndim, 1)}] = {{{', '.join(sizes) or '1'}}};")
            lines.append(f"  constexpr int {n}_ndim = {ndim};")
    for k, v in template:
        if isinstance(v, mx.Dtype):
            lines.append(f"  using {k} = {CUDA_TYPES[v]};")
        else:
            lines.append(f"  constexpr {'bool' if isinstance(v, bool) else 'int'} {k} = {str(v).lower()};")
    return (f"{CUDA_PRELUDE}{header}\nextern \"C\" __global__ void {name}({', '.join(params)}) {{\n"
            + "\n".join(lines) + f"\n{body}\n}}\n")


@lru_cache(maxsize=None)
def _nvrtc():
    """MLX's NVRTC (already loaded into this process by its CUDA backend), through ctypes."""
    import ctypes
    import ctypes.util

    with open("/proc/self/maps") as maps:
        loaded = [line.split()[-1] for line in maps if "/libnvrtc.so" in line]
    lib = ctypes.CDLL(loaded[0] if loaded else ctypes.util.find_library("nvrtc") or "libnvrtc.so")
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return lib, f"{major.value}.{minor.value}"


@lru_cache(maxsize=None)
def _cuda_include():
    """A folder holding cuda_fp16.h (the CUDA headers MLX's own JIT compiles against)."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    roots += sorted(str(p.parent) for p in (Path(mx.__file__).parents[2] / "nvidia").glob("*/include"))
    for root in filter(None, roots):
        for folder in (Path(root) / "include", Path(root)):
            if (folder / "cuda_fp16.h").is_file():
                return str(folder)
    raise RuntimeError("no CUDA headers (cuda_fp16.h) found: set CUDA_HOME")


def _cuda_arch():
    return mx.device_info()["architecture"]  # "sm_90" on an H100


@lru_cache(maxsize=None)
def cuda_binary(name, code):
    """The cubin of CUDA file `code` for this GPU: read from CACHE_DIR, or compiled with NVRTC and
    kept there (a temporary file renamed into place) under a hash of the code, the GPU
    architecture and NVRTC's version."""
    import ctypes

    lib, version = _nvrtc()
    arch = _cuda_arch()
    key = hashlib.sha256(f"{code}\n{arch}\n{version}".encode()).hexdigest()[:24]
    file = CACHE_DIR / "cuda" / f"{name}-{key}.cubin"
    try:
        return file.read_bytes()
    except OSError:
        pass
    prog = ctypes.c_void_p()
    check = lambda rc, what: None if rc == 0 else _nvrtc_error(lib, prog, rc, what)
    check(lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), f"{name}.cu".encode(), 0, None, None), "create")
    try:
        opts = [f"--gpu-architecture={arch}", "--std=c++17", f"--include-path={_cuda_include()}"]
        check(lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])),
              "compile")
        size = ctypes.c_size_t()
        check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        cubin = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetCUBIN(prog, cubin), "cubin")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    binary = cubin.raw
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(binary)
        tmp.replace(file)
    except OSError:  # a read-only cache only costs the next process a compile
        pass
    return binary


def _nvrtc_error(lib, prog, rc, what):
    import ctypes

    log = ""
    if what == "compile":
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value + 1)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace").strip()
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    raise RuntimeError(f"NVRTC {what} failed ({lib.nvrtcGetErrorString(rc).decode()}): {log[:2000]}")


# Each kernel's self-check (CHECKS, self_check) is a call on small float16 inputs, written beside it.
def _random(shape, seed, dtype=mx.float16, scale=1.0):
    return (scale * mx.random.normal(shape, key=mx.random.key(seed))).astype(dtype)


# ---------------------------------------------------------------- attention over a static cache

_ATTENTION = """
  // one block per (batch * kv head, split of the cache): the GQ query heads of a kv head share
  // each K/V row it loads. A row (D values) is loaded by LPR lanes, EPL values (16 bytes) each, so
  // a warp holds G rows at a time and takes U of them per row group (all loads in flight before a
  // sum waits); the block's NW warps take ROWS = NW * G * U consecutive positions per step.
  // A long cache (C > SPLIT_ABOVE) is split in chunks of CHUNK positions over S blocks
  // per kv head (flash-decoding): each writes its partial softmax state (max, sum; weighted values)
  // per query head and fn_decode_combine merges them. A short one is one block per kv head, which
  // writes o itself. GQ, D, SPLIT_ABOVE, CHUNK, SCALE_BITS (the scale's float bits): template
  // constants; the other sizes run-time.
  constexpr int EPL = 16 / sizeof(T), LPR = D / EPL, G = 32 / LPR, U = G >= 8 ? 1 : 2;
  constexpr int NW = 8, ROWS = NW * G * U;
  const int HQ = q_shape[1], HKV = k_shape[1], C = k_shape[2];
  const int S = C > SPLIT_ABOVE ? (C + CHUNK - 1) / CHUNK : 1;
  const int kvh = blockIdx.x / S, split = blockIdx.x % S;  // kvh = b * HKV + kv head
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, grp = lane / LPR, sub = lane % LPR;
  const int len = start[0] + 1;  // positions filled: those before the query, and its own
  const int lo = split * (S > 1 ? CHUNK : C);
  const int end = S > 1 ? lo + CHUNK : C;
  const int hi = end < len ? end : len;
  const float sc = __int_as_float(SCALE_BITS) * 1.4426950408889634f;  // exp2 domain
  const long head0 = long(kvh / HKV) * HQ + (kvh % HKV) * GQ;  // the first of its query heads
  float qv[GQ][EPL], acc[GQ][EPL], m[GQ], l[GQ];
  #pragma unroll
  for (int h = 0; h < GQ; ++h) {
    fn_load<T, EPL>(q + (head0 + h) * D + sub * EPL, qv[h]);
    #pragma unroll
    for (int e = 0; e < EPL; ++e) { qv[h][e] *= sc; acc[h][e] = 0.0f; }
    m[h] = -1e30f;
    l[h] = 0.0f;
  }
  const long base = long(kvh) * C * D + sub * EPL;
  for (int w0 = lo + warp * G * U; w0 < hi; w0 += ROWS) {  // the same trip count for a whole warp
    const int j0 = w0 + grp * U;
    float kf[U][EPL], vf[U][EPL], d[U][GQ];
    long r[U];
    #pragma unroll
    for (int u = 0; u < U; ++u) {  // a position past hi reads row w0 again and gets no weight
      r[u] = base + long(j0 + u < hi ? j0 + u : w0) * D;
      fn_load<T, EPL>(k + r[u], kf[u]);
    }
    #pragma unroll
    for (int u = 0; u < U; ++u) fn_load<T, EPL>(v + r[u], vf[u]);
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      #pragma unroll
      for (int h = 0; h < GQ; ++h) {
        float t = 0.0f;
        #pragma unroll
        for (int e = 0; e < EPL; ++e) t += qv[h][e] * kf[u][e];
        #pragma unroll
        for (int x = LPR / 2; x > 0; x >>= 1) t += fn_shfl_xor(t, x);  // over the row's lanes
        d[u][h] = t;
      }
    }
    #pragma unroll
    for (int h = 0; h < GQ; ++h) {
      float mn = m[h];
      #pragma unroll
      for (int u = 0; u < U; ++u) if (j0 + u < hi) mn = fmaxf(mn, d[u][h]);
      const float corr = exp2f(m[h] - mn);
      l[h] *= corr;
      #pragma unroll
      for (int e = 0; e < EPL; ++e) acc[h][e] *= corr;
      #pragma unroll
      for (int u = 0; u < U; ++u) {
        const float w = j0 + u < hi ? exp2f(d[u][h] - mn) : 0.0f;
        l[h] += w;
        #pragma unroll
        for (int e = 0; e < EPL; ++e) acc[h][e] += w * vf[u][e];
      }
      m[h] = mn;
    }
  }
  // merge the row groups of a warp (lanes LPR apart hold the same dims), then the warps; these
  // loops run once per block and stay rolled: MLX hashes a kernel's whole binary at every launch
  // (about 2 us per 10 KB on the host), and unrolled they made it a third larger
  #pragma unroll 1
  for (int x = LPR; x < 32; x <<= 1) {
    #pragma unroll
    for (int h = 0; h < GQ; ++h) {
      const float m2 = fn_shfl_xor(m[h], x), mn = fmaxf(m[h], m2);
      const float c1 = exp2f(m[h] - mn), c2 = exp2f(m2 - mn);
      l[h] = l[h] * c1 + fn_shfl_xor(l[h], x) * c2;
      #pragma unroll
      for (int e = 0; e < EPL; ++e) acc[h][e] = acc[h][e] * c1 + fn_shfl_xor(acc[h][e], x) * c2;
      m[h] = mn;
    }
  }
  __shared__ float sm[NW][GQ], sl[NW][GQ], sacc[NW][GQ][D];
  if (grp == 0) {
    #pragma unroll
    for (int h = 0; h < GQ; ++h) {
      if (sub == 0) { sm[warp][h] = m[h]; sl[warp][h] = l[h]; }
      #pragma unroll
      for (int e = 0; e < EPL; ++e) sacc[warp][h][sub * EPL + e] = acc[h][e];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < GQ * D; i += blockDim.x) {
    const int h = i / D, dd = i % D;
    float M = -1e30f;
    #pragma unroll 1
    for (int w = 0; w < NW; ++w) M = fmaxf(M, sm[w][h]);
    float L = 0.0f, O = 0.0f;
    #pragma unroll 1
    for (int w = 0; w < NW; ++w) {
      const float c = exp2f(sm[w][h] - M);
      L += sl[w][h] * c;
      O += sacc[w][h][dd] * c;
    }
    const long head = head0 + h;
    if (S == 1) o[head * D + dd] = fn_cast<T>(O / L);
    else {
      const long row = (head * S + split) * (D + 2);  // a split's partial state: O, then M and L
      part[row + dd] = O;
      if (dd == 0) { part[row + D] = M; part[row + D + 1] = L; }
    }
  }
"""

_COMBINE = """
  // one block of NW warps per (batch * query head): merge the S partial states fn_decode_attention
  // wrote (per split D weighted values, the max, the sum). Lanes take splits in turn for the max
  // and the sum, then warps take splits and lanes dims for the values: no load waits on another.
  constexpr int NW = 8, W = D + 2;
  const int S = part_shape[1];
  const long head = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long ps = head * S * W;  // this head's splits
  float M = -1e30f;
  for (int s = lane; s < S; s += 32) M = fmaxf(M, part[ps + s * W + D]);
  M = fn_warp_max(M);
  float L = 0.0f;
  for (int s = lane; s < S; s += 32) L += part[ps + s * W + D + 1] * exp2f(part[ps + s * W + D] - M);
  L = fn_warp_sum(L);
  __shared__ float so[NW][D];
  for (int d = lane; d < D; d += 32) {
    float O = 0.0f;
    #pragma unroll 4
    for (int s = warp; s < S; s += NW) O += part[ps + s * W + d] * exp2f(part[ps + s * W + D] - M);
    so[warp][d] = O;
  }
  __syncthreads();
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float O = 0.0f;
    for (int w = 0; w < NW; ++w) O += so[w][d];
    o[head * D + d] = fn_cast<T>(O / L);
  }
"""

SPLIT_ABOVE, CHUNK = 1024, 64  # caches longer than SPLIT_ABOVE are split in CHUNKs (_ATTENTION)
GROUP_MAX = {"cuda": 1024, "metal": 512}  # query heads per kv head x head dim its shared memory holds


@lru_cache(maxsize=None)
def _attention_kernels():
    return (_kernel("fn_decode_attention", ["q", "k", "v", "start"], ["o", "part"], _ATTENTION),
            _kernel("fn_decode_combine", ["part"], ["o"], _COMBINE))


def decode_attention(q, k, v, start, scale):
    """Attention of queries q (B, Hq, L, D) over the filled positions of k, v (B, Hkv, C, D):
    start, an int32 array of one element, is the first query's position (the positions filled
    before these queries), and query i sees positions up to start + i. The decode step passes a
    view of its 16-byte offset (generate.position): a computed one-element array (such as the
    count after the write) would sit in MLX's managed small-array pool (see constant). The CUDA
    kernel takes L = 1 (a decode step), one block per kv head and its query heads; a cache longer
    than SPLIT_ABOVE positions is split over blocks of CHUNK positions and merged by a second
    kernel (flash-decoding), so that a long context keeps the GPU busy."""
    B, Hq, L, D = q.shape
    Hkv, C = k.shape[1], k.shape[2]
    lanes = D * q.dtype.size // 16  # per row: 16-byte loads, a power of two <= 32 lanes
    if (use_gpu("decode_attention") and L == 1 and D * q.dtype.size % 16 == 0 and lanes & (lanes - 1) == 0
            and lanes <= 32 and Hq % Hkv == 0 and Hq // Hkv * D <= GROUP_MAX[gpu_backend()]
            and q.dtype == k.dtype == v.dtype):
        S = -(-C // CHUNK) if C > SPLIT_ABOVE else 1
        attend, combine = _attention_kernels()
        o, part = attend(
            inputs=[q, k, v, start.astype(mx.int32)],  # no op when int32
            template=[("T", q.dtype), ("D", D), ("GQ", Hq // Hkv), ("SPLIT_ABOVE", SPLIT_ABOVE), ("CHUNK", CHUNK),
                      ("SCALE_BITS", float_bits(scale))],  # one scale per model: a constant, not an array
            grid=(B * Hkv * S * 256, 1, 1), threadgroup=(256, 1, 1),  # NW = 8 warps (_ATTENTION)
            output_shapes=[q.shape, (B * Hq, S, D + 2)], output_dtypes=[q.dtype, mx.float32])
        if S == 1:
            return o
        return combine(inputs=[part], template=[("T", q.dtype), ("D", D)],
                       grid=(B * Hq * 256, 1, 1), threadgroup=(256, 1, 1),  # NW = 8 (_COMBINE)
                       output_shapes=[q.shape], output_dtypes=[q.dtype])[0]
    mask = mx.arange(C)[None] <= (start.reshape(-1)[0] + mx.arange(L))[:, None]
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def _check_decode_attention():  # a short cache (one block per head) and a split long one
    q, k, v = _random((2, 6, 1, 64), 4), _random((2, 2, 40, 64), 5), _random((2, 2, 40, 64), 6)
    long_k, long_v = _random((1, 2, SPLIT_ABOVE + 76, 64), 14), _random((1, 2, SPLIT_ABOVE + 76, 64), 15)
    return (decode_attention(q, k, v, mx.array(28), 0.125),
            decode_attention(q[:1], long_k, long_v, mx.array(SPLIT_ABOVE + 49), 0.125))


# ---------------------------------------------------------------- residual add + deferred scale

_ADD_RSS = """
  // one block per row: p = x * xs + r (in float32, rounded once to T), s = rsqrt(sum(p^2) + d*eps)
  // and pg = p * g * P, s / P. The flags (HAS_XS, HAS_R, HAS_G, PRESCALE) and eps (its bits) are read at
  // run time: one compile per dtype. PRESCALE (half precision): P = 2^floor(log2(s)), an exact
  // power of two that brings pg to the scale of a normalized row (in range), s / P in [1, 2).
  const int row = blockIdx.x;
  const int D = x_shape[x_ndim - 1];
  const bool has_xs = flags[0] != 0, has_r = flags[1] != 0, has_g = flags[2] != 0, prescale = flags[3] != 0;
  const long base = long(row) * D;
  const float xsv = has_xs ? xs[row] : 1.0f;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    float t = fn_f(x[base + i]) * xsv;
    if (has_r) t += fn_f(r[base + i]);
    const T tp = fn_cast<T>(t);
    p[base + i] = tp;
    ss += fn_f(tp) * fn_f(tp);
  }
  __shared__ float buf[32];
  __shared__ float total;
  ss = fn_warp_sum(ss);
  if (threadIdx.x % 32 == 0) buf[threadIdx.x / 32] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.0f;
    for (int w = 0; w < int(blockDim.x / 32); ++w) t += buf[w];
    total = t;
  }
  __syncthreads();
  const float sc = rsqrtf(total + D * __int_as_float(flags[4]));
  const float P = prescale ? __int_as_float(__float_as_int(sc) & 0x7f800000) : 1.0f;
  if (threadIdx.x == 0) s[row] = sc / P;
  for (int i = threadIdx.x; i < D; i += blockDim.x)
    pg[base + i] = fn_cast<T>(fn_f(p[base + i]) * (has_g ? g[i] : 1.0f) * P);
"""


@lru_cache(maxsize=None)
def _add_rss_kernel():
    return _kernel("fn_add_rss", ["x", "xs", "r", "g", "flags"], ["p", "pg", "s"], _ADD_RSS)


def _residual_inputs(x, xs, r, g):
    """The kernel inputs x, xs, r, g of a residual add with an optional scale and gain (add_rss and
    the Sec. 5 kernels), absent ones stood in for, and their flags: has xs, r, g; half precision."""
    none = constant(mx.float32, 0.0)  # stands in for an absent input (its flag is 0)
    return ([x, none if xs is None else xs.astype(mx.float32), x if r is None else r.astype(x.dtype),
             none if g is None else g.astype(mx.float32)],
            (xs is not None, r is not None, g is not None, x.dtype != mx.float32))


def scale_shape(x):
    """The shape of a kernel's float32 scale output for rows x: (.., 1), but 4 values for a single
    row (a decode step), so that the array is 16 bytes and out of MLX's managed small-array pool,
    which the next kernel would read slowly (see constant); the caller keeps [..., :1] of a single
    row's, a view."""
    return x.shape[:-1] + ((4,) if x.size == x.shape[-1] else (1,))


def power_of_two_below(s):
    """2^floor(log2(s)) of a positive float32 array, exactly (the exponent bits of s)."""
    return mx.view(mx.bitwise_and(mx.view(s, mx.int32), 0x7F800000), mx.float32)


def add_rss(x, eps, xs=None, r=None, g=None):
    """(p, pg, s) over the last axis: p = x * xs + r (xs (.., 1) and r optional), the new residual
    stream in x's dtype; s = 1/RSSe(p) = rsqrt(sum(p^2) + d * eps) with shape (.., 1), in float32;
    pg = p * g (g optional; None when there is no g, in float32). Appendix A/B of the paper: with
    sqrt(d) * g as the gain, pg * s is RMSNorm(p) * g.

    Half precision: p * sqrt(d) * g leaves float16's range on trained models (their residual
    stream reaches 1e4), and so would every matmul output after it. There pg carries an exact power
    of two P = 2^floor(log2 s) (pg = p * g * P, also without g) and s is returned as s / P, in
    [1, 2): pg is then on the scale of a normalized row and pg * s is unchanged, since a power-of-two
    factor adds no rounding. x * xs + r is computed in float32 and rounded once."""
    half = x.dtype != mx.float32
    if use_gpu("add_rss") and x.dtype in (mx.float32, mx.float16, mx.bfloat16):
        d, rows = x.shape[-1], x.size // x.shape[-1]
        threads = min(1024, max(32, 32 * math.ceil(d / 4 / 32)))
        arrays, flags = _residual_inputs(x, xs, r, g)
        p, pg, s = _add_rss_kernel()(
            inputs=arrays + [constant(mx.int32, *flags, float_bits(eps))],
            template=[("T", x.dtype)],
            grid=(rows * threads, 1, 1), threadgroup=(threads, 1, 1),
            output_shapes=[x.shape, x.shape, scale_shape(x)],
            output_dtypes=[x.dtype, x.dtype, mx.float32])
        return ((p if (r is not None or xs is not None) else x), (pg if (g is not None or half) else None),
                s if rows > 1 else s[..., :1])
    if not half:
        p = x if xs is None else x * xs
        p = p if r is None else p + r
        s = mx.rsqrt(mx.sum(p * p, axis=-1, keepdims=True) + x.shape[-1] * eps)
        return p, (None if g is None else p * g), s
    if xs is None:
        p = x if r is None else x + r
    else:
        pf = x.astype(mx.float32) * xs
        p = (pf if r is None else pf + r.astype(mx.float32)).astype(x.dtype)
    pf = p.astype(mx.float32)
    s = mx.rsqrt(mx.sum(pf * pf, axis=-1, keepdims=True) + x.shape[-1] * eps)
    P = power_of_two_below(s)
    pg = (pf * P if g is None else pf * (g.astype(mx.float32) * P)).astype(x.dtype)
    return p, pg, s / P


def _check_add_rss():
    x, r = _random((3, 320), 1, scale=300.0), _random((3, 320), 2, scale=300.0)
    g = 1 + 0.3 * _random((320,), 3, mx.float32)
    return add_rss(x, 1e-6, xs=mx.full((3, 1), 0.7), r=r, g=g)


# ---------------------------------------------------------------- QK-norm + RoPE (Sec. 4)

_ROPE_QKV = """
  // one warp per (token, head); heads: HQ queries, HKV keys, HKV values, read from q, k, v at
  // row strides QS, KS, VS and column offsets QO, KO, VO (one fused qkv array may be all three).
  // rotate-half RoPE: lane holds elements lane + 32 t, whose partners i +- D/2 are in the same lane.
  // Every size and flag is read at run time (dims; EPS and FACTOR as float bits): one compile per
  // dtype and head dim.
  constexpr int VPT = D / 32, HALF = VPT / 2;
  const int HQ = dims[0], HKV = dims[1], QS = dims[2], KS = dims[3], VS = dims[4];
  const int QO = dims[5], KO = dims[6], VO = dims[7];
  const bool QK_NORM = dims[8] != 0;
  const float EPS = __int_as_float(dims[9]), FACTOR = __int_as_float(dims[10]);
  const int H = HQ + 2 * HKV;
  const int L = q_shape[1], ROWS = q_shape[0] * L;
  const int gw = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (gw >= ROWS * H) return;
  const int row = gw / H, head = gw % H;      // row = b * L + l
  const int b = row / L, l = row % L;
  const bool is_q = head < HQ, is_k = !is_q && head < HQ + HKV;
  const long in = is_q ? long(row) * QS + QO + long(head) * D
      : is_k ? long(row) * KS + KO + long(head - HQ) * D
             : long(row) * VS + VO + long(head - HQ - HKV) * D;
  float x[VPT];
  #pragma unroll
  for (int t = 0; t < VPT; ++t) x[t] = fn_f((is_q ? q : (is_k ? k : v))[in + lane + 32 * t]);
  if (!is_q && !is_k) {
    const float sv = fn_f(s[row]);
    const long out = (long(b * HKV + head - HQ - HKV) * L + l) * D;
    #pragma unroll
    for (int t = 0; t < VPT; ++t) vo[out + lane + 32 * t] = fn_cast<T>(x[t] * sv);
    return;
  }
  // QK_NORM (Sec. 4): 1/RSSe of the head, gains g and permute(g) (sqrt(D), D^-1/4 folded in) on
  // cos and sin. Else (Sec. 3): the token's deferred s times D^-1/4 (FACTOR) on cos and sin.
  float ss = 0.0f;
  #pragma unroll
  for (int t = 0; t < VPT; ++t) ss += x[t] * x[t];
  ss = fn_warp_sum(ss);
  const float inv = QK_NORM ? rsqrtf(ss + D * EPS) : FACTOR * fn_f(s[row]);
  const float pos = float(off[0] + l);
  float y[VPT];
  #pragma unroll
  for (int t = 0; t < HALF; ++t) {
    const int i = lane + 32 * t, j = i + D / 2;   // a rotation pair
    float sn, cs;
    sn = sinf(pos * theta[i]);
    cs = cosf(pos * theta[i]);
    const float gi = QK_NORM ? (is_q ? qg : kg)[i] : 1.0f, gj = QK_NORM ? (is_q ? qg : kg)[j] : 1.0f;
    const float pi = QK_NORM ? (is_q ? qg : kg)[D + i] : 1.0f, pj = QK_NORM ? (is_q ? qg : kg)[D + j] : 1.0f;
    y[t] = inv * (x[t] * gi * cs - x[t + HALF] * pi * sn);
    y[t + HALF] = inv * (x[t + HALF] * gj * cs + x[t] * pj * sn);
  }
  const long out = is_q ? (long(b * HQ + head) * L + l) * D : (long(b * HKV + head - HQ) * L + l) * D;
  #pragma unroll
  for (int t = 0; t < VPT; ++t) (is_q ? qo : ko)[out + lane + 32 * t] = fn_cast<T>(y[t]);
"""


@lru_cache(maxsize=None)
def _rope_qkv_kernel():
    return _kernel("fn_rope_qkv", ["q", "k", "v", "s", "off", "theta", "qg", "kg", "dims"],
                   ["qo", "ko", "vo"], _ROPE_QKV)


def rope_qkv_supported(head_dim, traditional):
    return use_gpu("rope_qkv") and not traditional and head_dim % 64 == 0 and head_dim <= 256


def rope_qkv(q, k, v, s, offset, theta, n_heads, n_kv_heads, gains=None, eps=0.0, factor=1.0):
    """CUDA kernel preparing q, k, v for attention after a FlashNorm'd pre-norm (rotate-half layout
    only; see rope_qkv_supported). q, k, v (B, L, H * D) token-major projection outputs, or one
    fused (B, L, (Hq + 2 Hkv) * D) array passed as all three; s (B, L, 1) the deferred 1/RSSe of
    the block input; theta (D/2,) angles per position. v is returned times s. q and k get RoPE and:
    with gains ((2, D) tables for q and k, Sec. 4) their own per-head 1/RSSe and the gain tables on
    cos/sin; without (Sec. 3) s * factor. Returns q, k, v as (B, H, L, D). The kernel reads one
    position: per-row offsets (a batch, mlx_flashnorm.batch) take the MLX composition."""
    if not use_gpu("rope_qkv") or getattr(offset, "size", 1) > 1:
        return _rope_qkv_mlx(q, k, v, s, offset, theta, n_heads, n_kv_heads, gains, eps, factor)
    B, L, _ = q.shape
    D = theta.shape[0] * 2
    fused = q is k
    width = (n_heads + 2 * n_kv_heads) * D
    strides = (width,) * 3 if fused else (n_heads * D, n_kv_heads * D, n_kv_heads * D)
    offsets = (0, n_heads * D, (n_heads + n_kv_heads) * D) if fused else (0, 0, 0)
    rows, threads = B * L, 256
    warps = rows * (n_heads + 2 * n_kv_heads)
    off = position_array(offset)
    qg, kg = gains if gains is not None else (theta, theta)  # unused without QK-norm
    dims = constant(mx.int32, n_heads, n_kv_heads, *strides, *offsets, gains is not None, float_bits(eps),
                    float_bits(factor))
    return _rope_qkv_kernel()(
        inputs=[q, k, v, s.astype(mx.float32), off, theta, qg, kg, dims],
        template=[("T", q.dtype), ("D", D)],
        grid=(math.ceil(warps * 32 / threads) * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(B, n_heads, L, D), (B, n_kv_heads, L, D), (B, n_kv_heads, L, D)],
        output_dtypes=[q.dtype] * 3)


def _rope_qkv_mlx(q, k, v, s, offset, theta, n_heads, n_kv_heads, gains, eps, factor):
    """rope_qkv in plain MLX ops (its self-check reference), through flashnorm's RoPE pieces."""
    from .flashnorm import apply_rope, rope_tables  # flashnorm imports this module

    B, L, _ = q.shape
    D = theta.shape[0] * 2
    heads = lambda a, start, n: a[..., start:start + n * D].reshape(B, L, n, D).transpose(0, 2, 1, 3)
    if q is k:
        q, k, v = heads(q, 0, n_heads), heads(q, n_heads * D, n_kv_heads), heads(q, (n_heads + n_kv_heads) * D, n_kv_heads)
    else:
        q, k, v = heads(q, 0, n_heads), heads(k, 0, n_kv_heads), heads(v, 0, n_kv_heads)
    sf = s.astype(mx.float32)[:, None]
    cos, sin = rope_tables((1.0, theta.astype(mx.float32)), offset, L, traditional=False)

    def rope(x, gain):
        if gain is None:
            return apply_rope(x, cos, sin, False, factor * sf)
        xf = x.astype(mx.float32)
        inv = mx.rsqrt(mx.sum(xf * xf, axis=-1, keepdims=True) + D * eps)
        return apply_rope(x, cos * gain[0].astype(mx.float32), sin * gain[1].astype(mx.float32), False, inv)

    qg, kg = gains if gains is not None else (None, None)
    return rope(q, qg), rope(k, kg), (v.astype(mx.float32) * sf).astype(v.dtype)


def _check_rope_qkv():
    qkv = _random((2, 3, 8 * 64), 7, scale=3.0)
    s = mx.abs(_random((2, 3, 1), 8, mx.float32))
    theta = mx.exp(-mx.arange(32, dtype=mx.float32) * (2 * math.log(10000.0) / 64))
    gains = (1 + 0.3 * _random((2, 64), 9, mx.float32), 1 + 0.3 * _random((2, 64), 10, mx.float32))
    return rope_qkv(qkv, qkv, qkv, s, 5, theta, 4, 2, gains, 1e-6, 0.35)


# ---------------------------------------------------------------- Sec. 5: norm beside the matmul

# The decode step's two projections that read a pre-norm's output, each one kernel with its
# norm: the residual add, 1/RSSe and the norm gain computed beside a 4- or 8-bit matrix-vector
# product (the paper's Sec. 5: FlashNorm needs the norm's reduction only at the matmul's output, so
# it runs inside the matmul kernel) and the consumer's first step in the epilogue: RoPE (Sec. 3/4)
# for qkv, the SwiGLU for gate/up. Where rms runs norm, matmul, split, RoPE (or activation) as
# separate launches, flash runs one. One row (a decode step), MLX's affine quantization.
_PROLOGUE = """
  // The block's input row, as add_rss computes it: p = x * xs + r in float32, rounded once to T
  // (block 0 writes it: the new residual stream), s = 1/RSSe(p), and p * g in float32 in shared
  // memory, word-major (element 8 w + j of the packed words at j * KW + w: lanes reading
  // consecutive words hit consecutive banks). P: add_rss's power of two (PRESCALE, half
  // precision), carried by outputs whose scale stays deferred. Sizes, flags and eps (dims[0-6], eps
  // as float bits) are read at run time: one compile per dtype and bit width.
  constexpr int PER = 32 / BITS, MASK = (1 << BITS) - 1;  // values per word
  const int NW = blockDim.x / 32, K = dims[0], GS = dims[1], KW = K / PER, G = K / GS;  // NW: warps
  const bool has_xs = dims[2] != 0, has_r = dims[3] != 0, has_g = dims[4] != 0, prescale = dims[5] != 0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __shared__ float hs[KMAX];
  __shared__ float red[32];
  float ss = 0.0f;
  for (int i = threadIdx.x; i < K; i += blockDim.x) {
    float t = fn_f(x[i]);
    if (has_xs) t *= xs[0];
    if (has_r) t += fn_f(r[i]);
    const T tp = fn_cast<T>(t);
    if (blockIdx.x == 0) h[i] = tp;
    const float pv = fn_f(tp);
    ss += pv * pv;
    hs[(i % PER) * KW + i / PER] = has_g ? pv * g[i] : pv;
  }
  ss = fn_warp_sum(ss);
  if (lane == 0) red[warp] = ss;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < NW; ++w) total += red[w];
  const float s = rsqrtf(total + K * __int_as_float(dims[6]));
  const float P = prescale ? __int_as_float(__float_as_int(s) & 0x7f800000) : 1.0f;
"""

_DOT = """
    // rows n0 and n1 of the packed weight times p * g (a warp; lanes take the words in turn):
    // w = scale * q + bias per group of GS values, so a group adds scale * (q . x) + bias * sum(x)
    float a0 = 0.0f, a1 = 0.0f;
    for (int wd = lane; wd < KW; wd += 32) {
      const int grp = wd * PER / GS;
      const uint32_t q0 = wq[long(n0) * KW + wd], q1 = wq[long(n1) * KW + wd];
      float sx = 0.0f, d0 = 0.0f, d1 = 0.0f;
      #pragma unroll
      for (int j = 0; j < PER; ++j) {
        const float xv = hs[j * KW + wd];
        sx += xv;
        d0 += float((q0 >> (BITS * j)) & MASK) * xv;
        d1 += float((q1 >> (BITS * j)) & MASK) * xv;
      }
      a0 += fn_f(scales[long(n0) * G + grp]) * d0 + fn_f(biases[long(n0) * G + grp]) * sx;
      a1 += fn_f(scales[long(n1) * G + grp]) * d1 + fn_f(biases[long(n1) * G + grp]) * sx;
    }
    a0 = fn_warp_sum(a0);
    a1 = fn_warp_sum(a1);
"""

_QKV_ROPE = _PROLOGUE + """
  // One block per head of the qkv rows (HQ query, HKV key, HKV value heads, D rows each); a warp
  // computes rows i and i + D/2, a rotation pair. Then as rope_qkv: v * s; q and k rotated with
  // factor * s (Sec. 3) or their own 1/RSSe and the gain tables on cos/sin (QK_NORM, Sec. 4; the
  // values carry P as in the composition, so epsilon weighs the same). Output: the heads in the
  // same order, one array (q, k and v are views of it: fewer arrays, less host work per launch).
  const int HQ = dims[7], HKV = dims[8], D = dims[9];
  const bool qk_norm = dims[10] != 0;
  const float factor = __int_as_float(dims[11]), qk_eps = __int_as_float(dims[12]);
  const int head = blockIdx.x;
  __shared__ float res[256];
  for (int i = warp; i < D / 2; i += NW) {
    const int n0 = head * D + i, n1 = n0 + D / 2;
""" + _DOT + """
    if (lane == 0) { res[i] = a0; res[i + D / 2] = a1; }
  }
  __syncthreads();
  const bool is_q = head < HQ, is_k = !is_q && head < HQ + HKV;
  const long out = long(head) * D;
  if (!is_q && !is_k) {
    for (int d = threadIdx.x; d < D; d += blockDim.x) qkv[out + d] = fn_cast<T>(res[d] * s);
    return;
  }
  float inv = factor * s;
  if (qk_norm) {
    float hss = 0.0f;
    for (int d = lane; d < D; d += 32) hss += (res[d] * P) * (res[d] * P);
    hss = fn_warp_sum(hss);
    inv = rsqrtf(hss + D * qk_eps) * P;
  }
  const float pos = float(off[0]);
  for (int i = threadIdx.x; i < D / 2; i += blockDim.x) {
    const int j = i + D / 2;
    const float sn = sinf(pos * theta[i]), cs = cosf(pos * theta[i]);
    const float gi = qk_norm ? (is_q ? qg : kg)[i] : 1.0f, gj = qk_norm ? (is_q ? qg : kg)[j] : 1.0f;
    const float pi = qk_norm ? (is_q ? qg : kg)[D + i] : 1.0f, pj = qk_norm ? (is_q ? qg : kg)[D + j] : 1.0f;
    const float yi = inv * (res[i] * gi * cs - res[j] * pi * sn), yj = inv * (res[j] * gj * cs + res[i] * pj * sn);
    qkv[out + i] = fn_cast<T>(yi);
    qkv[out + j] = fn_cast<T>(yj);
  }
"""

_GATE_UP = _PROLOGUE + """
  // A warp per (gate row i, up row I + i), blocks taking them in turn (BLOCKS of them):
  // a_i = silu(gate_i * s) * up_i * P, the up branch's scale deferred: so = s / P (Sec. 2.2).
  const int I = dims[7], BLOCKS = dims[8];
  if (blockIdx.x == 0 && threadIdx.x == 0) so[0] = s / P;
  for (int i = blockIdx.x * NW + warp; i < I; i += BLOCKS * NW) {
    const int n0 = i, n1 = I + i;
""" + _DOT + """
    if (lane == 0) {
      const float gt = a0 * s;
      a[i] = fn_cast<T>(gt / (1.0f + expf(-gt)) * a1 * P);
    }
  }
"""

KMAX = {"cuda": 8192, "metal": 4096}  # longest input row the shared memory holds (32 / 16 KiB)
FUSED_BLOCKS = 256  # the most blocks of _GATE_UP (each recomputes the input row)
# warps a block of _QKV_ROPE runs, at most: its grid is one block per head (15 for SmolLM2), so
# each warp computes one rotation pair where it can, not four in turn
QKV_WARPS = {"cuda": 32, "metal": 8}


@lru_cache(maxsize=None)
def _fused_kernels():
    inputs = ["x", "xs", "r", "g", "wq", "scales", "biases"]
    return (_kernel("fn_qkv_rope", inputs + ["theta", "qg", "kg", "off", "dims"], ["h", "qkv"], _QKV_ROPE),
            _kernel("fn_gate_up", inputs + ["dims"], ["h", "a", "so"], _GATE_UP))


def fused_supported(name, x, linear):
    """Whether the fused kernel `name` ("qkv_rope" or "gate_up") runs for one row x through
    linear: a bias-free, affine 4- or 8-bit QuantizedLinear whose input fits the shared memory."""
    return (use_gpu(name) and x.size == x.shape[-1] and x.dtype in (mx.float32, mx.float16, mx.bfloat16)
            and isinstance(linear, nn.QuantizedLinear) and linear.bits in (4, 8) and linear.mode == "affine"
            and "bias" not in linear and "biases" in linear and linear["scales"].dtype == x.dtype
            and x.shape[-1] <= KMAX[gpu_backend()]
            and x.shape[-1] % linear.group_size == 0)


def _fused_inputs(x, eps, xs, r, g, linear):
    arrays, flags = _residual_inputs(x, xs, r, g)
    return (arrays + [linear["weight"], linear["scales"], linear["biases"]],
            (x.shape[-1], linear.group_size, *flags, float_bits(eps)),  # _PROLOGUE's dims[0-6]
            [("T", x.dtype), ("BITS", linear.bits), ("KMAX", KMAX[gpu_backend()])])


@lru_cache(maxsize=None)
def gated(activation):
    """h = activation(gate * s) * up, rounded once to up's dtype (s is float32 in half precision,
    so all of it runs in float32), as one compiled element-wise kernel: run eagerly (prefill) it
    was four launches over float32 intermediates. shapeless: one trace serves every length. The
    gate_up kernel's fallback, and FlashNorm's FFNs where that kernel does not run."""
    return mx.compile(lambda gate, s, up: (activation(gate * s) * up).astype(up.dtype), shapeless=True)


def qkv_rope(x, eps, xs, r, g, linear, offset, theta, n_heads, n_kv_heads, gains=None, qk_eps=0.0, factor=1.0):
    """(p, q, k, v) of one decode row: p, pg, s = add_rss(x, eps, xs, r, g), then linear (the
    concatenated q/k/v projection) on pg, and rope_qkv's RoPE (Sec. 3 with factor, or Sec. 4 with
    gains and qk_eps) on its output; q, k, v as (B, H, 1, D). One kernel where fused_supported,
    else that composition."""
    if not fused_supported("qkv_rope", x, linear):
        p, pg, s = add_rss(x, eps, xs=xs, r=r, g=g)
        y = linear(p if pg is None else pg)
        return (p, *rope_qkv(y, y, y, s, offset, theta, n_heads, n_kv_heads, gains, qk_eps, factor))
    inputs, flags, template = _fused_inputs(x, eps, xs, r, g, linear)
    D = theta.shape[0] * 2
    off = position_array(offset)
    qg, kg = gains if gains is not None else (theta, theta)  # unused without QK-norm
    threads = 32 * min(D // 2, QKV_WARPS[gpu_backend()])
    heads = n_heads + 2 * n_kv_heads
    p, qkv = _fused_kernels()[0](
        inputs=inputs + [theta, qg, kg, off, constant(mx.int32, *flags, n_heads, n_kv_heads, D, gains is not None,
                                                      float_bits(factor), float_bits(qk_eps))],
        template=template, grid=(heads * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[x.shape, (1, heads, 1, D)], output_dtypes=[x.dtype] * 2)
    return p, qkv[:, :n_heads], qkv[:, n_heads:n_heads + n_kv_heads], qkv[:, n_heads + n_kv_heads:]


def gate_up(x, eps, xs, r, g, linear):
    """(p, a, s) of one decode row: p, pg, s = add_rss(x, eps, xs, r, g), then linear (gate rows
    over up rows) on pg and a = silu(gate * s) * up, its scale s still to apply (Sec. 2.2). One
    kernel where fused_supported, else that composition."""
    if not fused_supported("gate_up", x, linear):
        p, pg, s = add_rss(x, eps, xs=xs, r=r, g=g)
        gate, up = mx.split(linear(p if pg is None else pg), 2, axis=-1)
        return p, gated(nn.silu)(gate, s, up), s
    inputs, flags, template = _fused_inputs(x, eps, xs, r, g, linear)
    I = linear["weight"].shape[0] // 2
    blocks = min(FUSED_BLOCKS, -(-I // 8))
    p, a, so = _fused_kernels()[1](
        inputs=inputs + [constant(mx.int32, *flags, I, blocks)],
        template=template, grid=(blocks * 256, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[x.shape, x.shape[:-1] + (I,), scale_shape(x)],
        output_dtypes=[x.dtype, x.dtype, mx.float32])
    return p, a, so[..., :1]


def _quantized(out_dims, in_dims, seed):
    linear = nn.Linear(in_dims, out_dims, bias=False)
    linear.weight = _random((out_dims, in_dims), seed, scale=0.05)
    return nn.QuantizedLinear.from_linear(linear, 64, 4)


def _check_qkv_rope():  # Sec. 4 (a residual add, gain and QK-norm) and Sec. 3 (a deferred input)
    linear, theta = _quantized(8 * 64, 320, 16), mx.exp(-mx.arange(32, dtype=mx.float32) * 0.3)
    x, r = _random((1, 1, 320), 17, scale=300.0), _random((1, 1, 320), 18, scale=300.0)
    g = 1 + 0.3 * _random((320,), 19, mx.float32)
    gains = (1 + 0.3 * _random((2, 64), 20, mx.float32), 1 + 0.3 * _random((2, 64), 21, mx.float32))
    return (*qkv_rope(x, 1e-6, None, r, g, linear, 5, theta, 4, 2, gains, 1e-6, 0.35),
            *qkv_rope(x, 1e-6, mx.full((1, 1, 1), 0.01), r, None, linear, 9, theta, 4, 2, factor=0.35))


def _check_gate_up():
    linear = _quantized(2 * 200, 320, 22)
    x, r = _random((1, 1, 320), 23, scale=300.0), _random((1, 1, 320), 24, scale=300.0)
    return gate_up(x, 1e-6, mx.full((1, 1, 1), 0.01), r, 1 + 0.3 * _random((320,), 25, mx.float32), linear)


# ---------------------------------------------------------------- self-check at first use

def _check_normalize():
    from .nn import normalize  # nn.py's fused add + RMSNorm kernel (nn.py imports this module)

    x, r, w = _random((3, 320), 11), _random((3, 320), 12), 1 + 0.3 * _random((320,), 13)
    backend = (gpu_backend() if use_gpu("normalize") else None) or "fallback"
    return normalize(x, r, w, eps=1e-6, backend=backend, vjp=False)


# name: (a call on small float16 inputs, the largest max |kernel - fallback| / max |fallback|)
CHECKS = {"add_rss": (_check_add_rss, 1e-2), "decode_attention": (_check_decode_attention, 1e-2),
          "rope_qkv": (_check_rope_qkv, 1e-2), "normalize": (_check_normalize, 1e-2),
          "qkv_rope": (_check_qkv_rope, 1e-2), "gate_up": (_check_gate_up, 1e-2)}


# Where the checks that passed are kept, one file per (kernel code, MLX version, device): a check
# costs 1.5-4 s per kernel on an H100 even with MLX's kernel cache warm (bench/RESULTS.md), in every
# process. A changed kernel file, MLX or GPU is checked again; a failed check is never kept.
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx_flashnorm"


def _passed_file():
    from . import nn  # its add + RMSNorm kernel is checked here too (nn.py imports this module)

    key = hashlib.sha256(Path(__file__).read_bytes() + Path(nn.__file__).read_bytes())
    key.update(f"{mx.__version__} {gpu_backend()} {mx.default_device()} "
               f"{mx.device_info().get('device_name', '')}".encode())
    return CACHE_DIR / f"self-check-{key.hexdigest()[:20]}.json"


def _read_passed(file):
    try:
        return set(json.loads(file.read_text()))
    except (OSError, ValueError):
        return set()


def _write_passed(file, passed):
    try:  # a temporary file renamed into place; a read-only cache only costs the next process time
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(sorted(passed)))
        tmp.replace(file)
    except OSError:
        pass


def self_check(names=None):
    """Run each kernel (or those named) once on small inputs against its plain-MLX fallback on the
    device in use; a kernel that fails to compile or to match prints one warning line and falls
    back for the rest of the process. Runs once per process (the loader calls it on a GPU); a
    kernel that passed with the same code, MLX and device before (CACHE_DIR) is not run again."""
    file = _passed_file()
    passed = _read_passed(file)
    known = set(passed)
    for name in names or CHECKS:
        if name in _CHECKED:
            continue
        _CHECKED.add(name)
        if name in passed:
            continue
        call, tol = CHECKS[name]
        outputs = lambda: [a for a in (lambda o: o if isinstance(o, (tuple, list)) else [o])(call())
                           if a is not None]
        try:
            got = outputs()
            DISABLED.add(name)  # the same call through the fallback
            want = outputs()
            DISABLED.discard(name)
            err = max((mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max()
                       / mx.abs(b.astype(mx.float32)).max()).item() for a, b in zip(got, want))
            why = None if err <= tol else f"differs from its fallback by {err:.2e} (> {tol:g})"
        except Exception as e:  # a compile or launch error
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else 'no detail'}"
        if why:
            DISABLED.add(name)
            print(f"warning: kernel {name} failed its self-check on {mx.default_device()} ({why}); "
                  "using the plain MLX fallback", file=sys.stderr)
        else:
            passed.add(name)
    if passed != known:
        _write_passed(file, passed)
    return not DISABLED


_CHECKED = set()
