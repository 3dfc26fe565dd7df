"""The kernels' build system: one body per kernel in CUDA spelling, respelled for Metal
(METAL_SPELLING) with each backend's shared header (HEADERS); make_kernel turns a body into a
launcher, on CUDA through a CUDA file per variant (cuda_source) compiled once per machine
(nvrtc.cuda_binary), on Metal through mx.fast.metal_kernel (never run here: no Apple hardware).
A kernel kept in CUDA files (cuda/) is composed from their pieces (pieces, fill), its run-time
sizes from one table (pack, declare)."""
import re
import struct
from functools import lru_cache
from pathlib import Path

import mlx.core as mx

from ..forms import gpu_backend
from .nvrtc import cuda_binary


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

HEADERS = {
    "cuda": CUDA_DTYPES + """__device__ inline float fn_warp_sum(float v) {
  for (int k = 16; k > 0; k >>= 1) v += __shfl_xor_sync(0xffffffff, v, k);
  return v;
}
__device__ inline float fn_warp_max(float v) {
  for (int k = 16; k > 0; k >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, k));
  return v;
}
__device__ inline float fn_shfl_xor(float v, int k) { return __shfl_xor_sync(0xffffffff, v, k); }
template <typename U, int N> __device__ inline void fn_unpack(uint4 w, float* out) {
  const U* e = reinterpret_cast<const U*>(&w);  // N values of U, 16 bytes, as loaded
  #pragma unroll
  for (int i = 0; i < N; ++i) out[i] = fn_f(e[i]);
}
template <typename U, int N> __device__ inline void fn_load(const U* p, float* out) {
  fn_unpack<U, N>(*reinterpret_cast<const uint4*>(p), out);  // in one load
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
    "blockIdx.x": "threadgroup_position_in_grid.x",
    "threadIdx.x": "thread_position_in_threadgroup.x",
    "blockDim.x": "threads_per_threadgroup.x", "__shared__": "threadgroup",
    "__syncthreads()": "threadgroup_barrier(mem_flags::mem_threadgroup)",
    "__int_as_float": "as_type<float>", "__float_as_int": "as_type<int>",
    "rsqrtf(": "metal::rsqrt(", "exp2f(": "metal::exp2(", "expf(": "metal::exp(",
    "fmaxf(": "metal::fmax(", "sinf(": "metal::sin(", "cosf(": "metal::cos(",
}


def spell(source, backend):
    """A CUDA kernel body in the backend's spelling."""
    if backend == "metal":
        for cuda, metal in METAL_SPELLING.items():
            source = source.replace(cuda, metal)
    return source


@lru_cache(maxsize=None)
def constant(dtype, *values):
    """A small array of run-time sizes or flags for a kernel, made once per distinct value: no
    new array per call, and inside mx.compile one constant of the graph. Padded to 16 bytes: MLX's
    CUDA backend keeps arrays of 8 bytes or less in one managed-memory page that the host touches
    every decode step, and a kernel reading from it waited on it (bench/RESULTS.md, "GPU time per
    kernel")."""
    a = mx.array(values + (0,) * (4 - len(values)), dtype)
    mx.eval(a)
    return a


def position_array(offset):
    """A kernel's position input: the decode step's view of its offset as it is, an int as a
    constant (16 bytes, made once per position): mx.array(offset) would be a new 4-byte array in
    MLX's managed small-array pool at every call, which the kernel's warps then read slowly."""
    return (offset if isinstance(offset, mx.array)
            else constant(mx.int32, offset)).astype(mx.int32).reshape(-1)


# (kernel name, template arguments) of every launch so far: each distinct pair is one compiled
# variant (tests check that requests add none).
VARIANTS = set()


def make_kernel(name, input_names, output_names, source, header):
    """A kernel of body `source` (CUDA spelling) as a function of mx.fast.cuda_kernel's keyword
    arguments (inputs, template, grid, threadgroup, output_shapes, output_dtypes; shared_memory:
    dynamic shared bytes, CUDA only); header: the backend's own. On Metal mx.fast.metal_kernel
    runs the respelled body. On CUDA the body is compiled here (cuda_binary) and run with
    mx.fast.precompiled_cuda_kernel: MLX compiles a cuda_kernel with NVRTC in every process, slowly
    (bench/RESULTS.md, "Compile once"), while a binary kept on disk loads quickly."""
    backend = gpu_backend()
    if backend == "metal":
        kernel = mx.fast.metal_kernel(name=name, input_names=input_names, output_names=output_names,
                                      source=spell(source, backend), header=header)
    shaped = [i for i, n in enumerate(input_names) if reads_shape(n, source)]
    binaries = {}  # (input dtypes and ranks, output dtypes, template) -> cubin (None on Metal)

    def launch(*, inputs: list, template, grid, threadgroup, output_shapes, output_dtypes,
               shared_memory=0):
        # Python work here is host time of every eager launch (prefill): kept to a dict lookup
        key = (*[(a.dtype, a.ndim) for a in inputs], *output_dtypes, *template)
        binary = binaries.get(key, False)
        if binary is False:  # a variant not launched before
            VARIANTS.add((name, tuple((k, str(v)) for k, v in template)))
            binaries[key] = binary = None if backend == "metal" else cuda_binary(name, cuda_source(
                name, input_names, output_names, source, header,
                [(a.dtype, a.ndim) for a in inputs], output_dtypes, template))
        if backend == "metal":
            return kernel(inputs=inputs, template=template, grid=grid, threadgroup=threadgroup,
                          output_shapes=output_shapes, output_dtypes=output_dtypes)
        return mx.fast.precompiled_cuda_kernel(
            name=name, compiled_source=binary, inputs=inputs, output_shapes=output_shapes,
            output_dtypes=output_dtypes, scalars=[d for i in shaped for d in inputs[i].shape],
            grid=grid, threadgroup=threadgroup, shared_memory=shared_memory,
            ensure_row_contiguous=True)

    return launch


def kernel(name, inputs, outputs, source):
    """make_kernel with the backend's shared header (HEADERS)."""
    return make_kernel(name, inputs, outputs, source, HEADERS[gpu_backend()])



CUDA_TYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16",
              mx.int32: "int", mx.uint32: "unsigned int", mx.uint8: "unsigned char",
              mx.bool_: "bool"}
CUDA_PRELUDE = """#include <cuda_fp16.h>
#include <cuda_bf16.h>
typedef int int32_t;
typedef unsigned int uint32_t;
"""


def reads_shape(name, body):
    """Whether a kernel body reads input `name`'s shape (NAME_shape[i] or NAME_ndim)."""
    return f"{name}_shape" in body or f"{name}_ndim" in body


def cuda_source(name, input_names, output_names, body, header, input_types, output_dtypes,
                template):
    """The whole CUDA file of one kernel variant: an extern "C" __global__ function of the inputs
    (input_types: (dtype, ndim) each), the outputs and then, for each input whose shape the body
    reads, its sizes as int arguments (the launch passes them); template arguments as constants. A
    template constant NW (warps a block) bounds the launch to 32 NW threads (__launch_bounds__), so
    that the compiler fits each thread's registers to that many."""
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
            lines.append(f"  constexpr {'bool' if isinstance(v, bool) else 'int'} {k} = "
                         f"{str(v).lower()};")
    bounds = "".join(f"__launch_bounds__({32 * v}) " for k, v in template if k == "NW")
    return (f"{CUDA_PRELUDE}{header}\nextern \"C\" __global__ void "
            f"{bounds}{name}({', '.join(params)}) {{\n"
            + "\n".join(lines) + f"\n{body}\n}}\n")


# A kernel kept in a CUDA file (cuda/*.cu, *.cuh) is made of named pieces: a line `// @piece NAME`
# starts piece NAME, which runs to the next such line or the file's end; the lines before the first
# describe the file. A piece may hold marker lines, `{{NAME}}` alone on a line, that fill replaces.
PIECE = re.compile(r"^// @piece (\w+)\n", re.M)
MARKER = re.compile(r"\{\{(\w+)\}\}")
MARKER_LINE = re.compile(r"^[ \t]*\{\{(\w+)\}\}[ \t]*\n", re.M)


def pieces(path, *names):
    """The pieces of the CUDA file at path, {name: text}; ValueError unless they are exactly
    `names`, each once, and the lines before the first are comments."""
    parts = PIECE.split(Path(path).read_text())
    head, found = parts[0], parts[1::2]
    if any(line.strip() and not line.lstrip().startswith("//") for line in head.splitlines()):
        raise ValueError(f"{path}: code before its first `// @piece` line")
    if sorted(found) != sorted(names):
        raise ValueError(f"{path}: pieces {found}, expected {list(names)}")
    return dict(zip(found, parts[2::2]))


def fill(source, **pieces):
    """source with each marker line (`{{NAME}}` alone on its line) replaced by pieces[NAME], a text
    ending in a newline. ValueError where a marker is not alone on its line, a name's marker is
    missing or repeated, a marker has no piece, or one is left after filling (inside a piece)."""
    markers = MARKER.findall(source)
    if sorted(markers) != sorted(MARKER_LINE.findall(source)):
        raise ValueError(f"a marker not alone on its line among {markers}")
    if sorted(markers) != sorted(pieces):
        raise ValueError(f"markers {sorted(markers)} where the pieces are {sorted(pieces)}: each "
                         "piece fills exactly one marker")
    if not all(text.endswith("\n") for text in pieces.values()):
        raise ValueError("a piece must end with a newline")
    out = MARKER_LINE.sub(lambda m: pieces[m.group(1)], source)
    if left := MARKER.findall(out):
        raise ValueError(f"markers {left} left after filling")
    return out


# A kernel's run-time sizes and flags travel in one int32 array, described by a table of
# (name, kind) fields in the array's order, kind "int", "bool" or "float" (its bits): pack makes
# the array's values, declare the body's constants, both from the same table.
def pack(fields, values):
    """The array's values for table `fields` from values ({name: value}: one for each field, any
    other unused): a bool as 0 or 1, a float as its bits (float_bits). KeyError for a field without
    a value."""
    convert = {"int": int, "bool": int, "float": float_bits}
    return tuple(convert[kind](values[name]) for name, kind in fields)


def declare(fields, array="dims"):
    """A body's constants for table `fields` read from the int array named `array`, one a line."""
    read = {"int": "{}[{}]", "bool": "{}[{}] != 0", "float": "__int_as_float({}[{}])"}
    return "".join(f"  const {kind} {name} = {read[kind].format(array, i)};\n"
                   for i, (name, kind) in enumerate(fields))


# Each kernel's self-check (kernels.check) is a call on small inputs, written beside it, of
# CHECK_DTYPE where not of a dtype of their own: float16 on a GPU; tests/test_cuda_compile.py
# compiles the checks' CUDA variants in each dtype the kernels take.
CHECK_DTYPE = mx.float16


def rand(shape, seed, dtype=None, scale=1.0):
    dtype = CHECK_DTYPE if dtype is None else dtype
    return (scale * mx.random.normal(shape, key=mx.random.key(seed))).astype(dtype)
