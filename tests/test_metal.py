"""The Metal compile check: the Metal form of every kernel body, compiled by clang's C++ front end.

Our kernels are written once, in CUDA spelling; on Apple hardware build.make_kernel respells each body
(build.spell, METAL_SPELLING) and hands it with its Metal header to mx.fast.metal_kernel, which never
runs on this Linux machine. Here every launcher of the kernels package runs with the backend set to
Metal and mx.fast.metal_kernel replaced by a recorder (MetalRecorder), so the check sees exactly what
make_kernel would hand MLX, for every variant the launchers ask for (dtypes, template arguments, input
sizes). Each body is then wrapped as mx.fast.metal_kernel wraps it (metal_source, after MLX's
write_signature in mlx/fast.cpp: the header, then a `[[kernel]] void` function template over the
template arguments whose parameters are the inputs in order, each followed by its _shape/_strides/
_ndim buffers when the body names them, then the outputs, then one `[[attribute]]` parameter for each
thread-position name the body uses; an input of fewer than 8 values is in the constant address space,
others in device memory, a 0-d one passed by reference; one explicit instantiation per template
argument list) and parsed once per body with C++17 semantics against tests/metal_stub.h, a small
header declaring what MSL and MLX's prelude give our kernels (address spaces as clang address-space
qualifiers, the metal:: math, SIMD-group and barrier functions, as_type, half/bfloat and the vector
types). Any error fails the test.

What it catches: a CUDA name left in a respelled body or header (__syncthreads, __shfl_xor_sync,
rsqrtf, __int_as_float, ...), C++ syntax and type errors, a template that does not instantiate for a
dtype or size the launchers use, an undeclared input or shape name, a pointer passed to a helper in
the wrong address space (device, constant, threadgroup, thread), a 0-d input indexed as an array, an
as_type between types of different sizes, a double.

What it cannot catch: anything of MSL's own semantics beyond these declarations (this is clang's C++,
not Apple's Metal compiler: MSL rules the stub does not model pass, such as a threadgroup variable
with an initializer, unsupported C++ features inside a kernel, or an overload MSL lacks that C++'s
conversions find); address-space errors the stub cannot express (the `thread` space is C++'s default
one, references and the constant space's read-only rule are not checked); Metal compiler limits
(threadgroup memory over 32 KiB, register pressure, the threadgroup size a kernel may run with); the
[[host_name]] of MLX's instantiation (C++ allows no attribute there, so it is left out); and anything
at run time: wrong results, races, SIMD-group width assumptions, out-of-bounds reads. Those the
kernels' first-use self-check (kernels.check) covers on Apple hardware."""
import math
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from clang import cindex

from mlx_flashnorm import forms
from mlx_flashnorm.kernels import attention, build, check, matvec, normalize, rope, scale
from mlx_flashnorm.kernels.build import rand

STUB = Path(__file__).with_name("metal_stub.h")
KERNEL_DIR = Path(build.__file__).parent

# MLX's names of our dtypes in Metal source (its get_type_string)
METAL_TYPES = {mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t", mx.int32: "int32_t",
               mx.uint32: "uint32_t", mx.uint8: "uint8_t", mx.bool_: "bool"}
# the thread-position names metal_kernel declares as parameters when a body uses them, and their types
ATTRIBUTES = {"thread_position_in_grid": "uint3", "thread_position_in_threadgroup": "uint3",
              "threadgroup_position_in_grid": "uint3", "threads_per_threadgroup": "uint3",
              "threadgroups_per_grid": "uint3", "threads_per_grid": "uint3", "grid_size": "uint3",
              "thread_index_in_threadgroup": "uint", "thread_index_in_simdgroup": "uint",
              "simdgroup_index_in_threadgroup": "uint", "threads_per_simdgroup": "uint",
              "simdgroups_per_threadgroup": "uint", "thread_execution_width": "uint"}
CONSTANT_BELOW = 8  # inputs with fewer values go in the constant address space (MLX)


class MetalRecorder:
    """Stands in for mx.fast.metal_kernel: keeps what make_kernel hands it (name, input and output
    names, the respelled body, the header) and, per launch, what the kernel would be compiled for
    (each input's dtype, ndim and size; the template arguments; the output dtypes). A launch
    returns zeros of the output shapes, so that the launcher goes on as on a GPU."""

    def __init__(self):
        self.kernels = {}  # (name, input names, output names, body, header) -> [launch, ...]

    def __call__(self, *, name, input_names, output_names, source, header="", **_):
        launches = self.kernels.setdefault((name, tuple(input_names), tuple(output_names), source, header), [])

        def launch(*, inputs, template=(), output_shapes, output_dtypes, **_):
            launches.append((tuple((a.dtype, a.ndim, a.size) for a in inputs), tuple(template), tuple(output_dtypes)))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

        return launch


def _clear_kernel_caches():
    for made in (scale.add_rss_kernel, attention._attention_kernels, rope.rope_after_qkv_kernel,
                 matvec.fused_kernels, normalize.kernel):
        made.cache_clear()


def record(launch):
    """A MetalRecorder of everything `launch()` asks make_kernel for, with the backend set to Metal
    (and the kernels on) in this process for its duration only."""
    recorder = MetalRecorder()
    with pytest.MonkeyPatch.context() as mp:
        for module in (forms, build, matvec, attention):
            mp.setattr(module, "gpu_backend", lambda: "metal")
        mp.setattr(forms, "use_gpu", lambda name=None: True)
        mp.setattr(mx.fast, "metal_kernel", recorder)
        mp.setattr(build, "VARIANTS", set())
        _clear_kernel_caches()  # launchers made for this machine's backend
        try:
            launch()
        finally:
            _clear_kernel_caches()  # none made for Metal outlives the test
    return recorder


def _template_value(v):
    if isinstance(v, mx.Dtype):
        return METAL_TYPES[v]
    return str(int(v))  # bools as MLX writes them: 1 or 0


def _signature(input_names, output_names, body, inputs, output_dtypes):
    params = []
    for n, (dtype, ndim, size) in zip(input_names, inputs):
        space = "constant" if size < CONSTANT_BELOW else "device"
        params.append(f"const {space} {METAL_TYPES[dtype]}{'&' if ndim == 0 else '*'} {n}")
        if ndim > 0:
            params += [f"const constant int* {n}_shape"] * (f"{n}_shape" in body)
            params += [f"const constant int64_t* {n}_strides"] * (f"{n}_strides" in body)
            params += [f"const constant int& {n}_ndim"] * (f"{n}_ndim" in body)
    params += [f"device {METAL_TYPES[d]}* {n}" for n, d in zip(output_names, output_dtypes)]
    params = [f"{p} [[buffer({i})]]" for i, p in enumerate(params)]
    params += [f"{t} {a} [[{a}]]" for a, t in sorted(ATTRIBUTES.items()) if a in body]  # in MLX's order
    return ",\n    ".join(params)


def metal_source(name, input_names, output_names, body, header, launches):
    """One C++ file of a kernel body and all its launches, each distinct signature (input dtypes,
    address spaces, ranks; output dtypes) as its own [[kernel]] function template, instantiated
    for each distinct template argument list, as metal_kernel writes each variant (MLX compiles
    each variant apart, with the header; here the header comes once and the variants follow it)."""
    variants = {}  # (template parameters, signature) -> template argument lists
    for inputs, template, output_dtypes in launches:
        kinds = ", ".join(("typename " if isinstance(v, mx.Dtype) else "bool " if isinstance(v, bool) else "int ") + k
                          for k, v in template)
        variants.setdefault((kinds, _signature(input_names, output_names, body, inputs, output_dtypes)), set()).add(
            ", ".join(_template_value(v) for _, v in template))
    parts = [f'#include "{STUB.name}"', header, "#undef threadgroup", "#define threadgroup METAL_KERNEL_THREADGROUP"]
    for i, ((kinds, signature), arguments) in enumerate(variants.items()):
        fn = f"custom_kernel_{name}_{i}"
        parts.append(f"{f'template <{kinds}>' if kinds else ''}\n[[kernel]] void {fn}(\n    {signature}) {{\n{body}\n}}")
        parts += [f"template decltype({fn}<{a}>) {fn}<{a}>;" for a in sorted(arguments) if kinds]
    return "\n".join(parts) + "\n"


def clang_errors(source):
    """clang's errors (with their notes) on a C++17 file of Metal source, against metal_stub.h."""
    tu = cindex.Index.create().parse("kernel.cpp", args=["-x", "c++", "-std=c++17", "-fsyntax-only",
                                                         f"-I{STUB.parent}", "-ferror-limit=0"],
                                     unsaved_files=[("kernel.cpp", source)])
    lines = source.splitlines()
    errors = {}  # each distinct error once (a body's error repeats in each instantiation), with its first notes
    for d in tu.diagnostics:
        if d.severity >= cindex.Diagnostic.Error:
            where = lines[d.location.line - 1].strip() if d.location.file and d.location.file.name == "kernel.cpp" else ""
            errors.setdefault(f"line {d.location.line}: {d.spelling}  [{where}]",
                              "".join(f"\n    note: {n.spelling}" for n in d.children))
    return [e + notes for e, notes in errors.items()]


def check_recorded(recorder):
    """{kernel name: clang's errors} over every body the recorder holds (one parse per body)."""
    return {key[0]: clang_errors(metal_source(*key, launches)) for key, launches in recorder.kernels.items()}


# ---------------------------------------------------------------------------------------------
# Every launcher, as the models call it.

def _linear(out_dims, in_dims, bits, dtype, seed):
    linear = nn.Linear(in_dims, out_dims, bias=False)
    linear.weight = rand((out_dims, in_dims), seed, dtype, scale=0.05)
    return nn.QuantizedLinear.from_linear(linear, 64, bits)


def _theta(d):
    return mx.exp(-mx.arange(d // 2, dtype=mx.float32) * (2 * math.log(10000.0) / d))


def launch_every_kernel():
    """Each kernel's self-check call (the first thing a kernel runs on Apple hardware), then every
    launcher over each dtype the kernels take, each head dim our architectures have (64: SmolLM2,
    OpenELM; 128: Qwen and Llama; 256: Gemma 3), 4- and 8-bit weights, with and without their
    optional inputs, for one decode row and for a batch of rows: an input of fewer than 8 values
    (a decode row's scale, a position, a flag array) goes in the constant address space, a larger
    one in device memory, and a decode step's position is a 0-d view (generate.position)."""
    for call, _ in check.CHECKS.values():
        call()
    position = mx.array([28, 0, 0, 0], mx.int32)[:1].reshape(())  # as generate.position passes it
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        r = lambda shape, seed, s=1.0: rand(shape, seed, dtype, scale=s)
        g = 1 + 0.3 * rand((320,), 3, mx.float32)
        for rows in ((1, 1), (2, 8)):
            x = r((*rows, 320), 1, 30.0)
            scale.add_rss(x, 1e-6)
            scale.add_rss(x, 1e-6, xs=mx.full((*rows, 1), 0.5), r=r((*rows, 320), 2, 30.0), g=g)
            for has_res, has_w, has_b, center in ((a, b, c, d) for a in (0, 1) for b in (0, 1) for c in (0, 1)
                                                   for d in (0, 1)):
                normalize.fused("metal", x, r((*rows, 320), 4) if has_res else None, g.astype(dtype) if has_w else None,
                                r((320,), 5) if has_b else None, 0.5, bool(center), 1e-6)
        for d in (64, 128, 256):
            for gq in (1, 2, 3, 4, 8):
                q = r((1, 2 * gq, 1, d), 6)
                for c in (40, attention.SPLIT_ABOVE + 76):
                    kv = r((1, 2, c, d), 7)
                    attention.decode_attention(q, kv, kv, position, d**-0.5)
            theta, gains = _theta(d), (1 + 0.3 * rand((2, d), 8, mx.float32),) * 2
            for rows, offset in (((1, 1), position), ((2, 5), 3)):
                qkv = r((*rows, 8 * d), 9)
                s = mx.abs(rand((*rows, 1), 10, mx.float32))
                rope.rope_after_qkv(qkv, qkv, qkv, s, offset, theta, 4, 2, gains, 1e-6, 0.5)
                rope.rope_after_qkv(qkv, qkv, qkv, s, offset, theta, 4, 2, None, 0.0, 0.5)
        for bits in (4, 8):
            x, res = r((1, 1, 320), 11, 30.0), r((1, 1, 320), 12, 30.0)
            xs = mx.full((1, 1, 1), 0.5)
            qkv_linear, theta = _linear(8 * 64, 320, bits, dtype, 13), _theta(64)
            gains = (1 + 0.3 * rand((2, 64), 14, mx.float32),) * 2
            matvec.norm_qkv_rope(x, 1e-6, None, res, g, qkv_linear, position, theta, 4, 2, gains,
                                 1e-6, 0.5)
            matvec.norm_qkv_rope(x, 1e-6, xs, None, None, qkv_linear, position, theta, 4, 2,
                                 factor=0.5)
            up_linear = _linear(2 * 200, 320, bits, dtype, 15)
            matvec.gate_up(x, 1e-6, xs, res, g, up_linear)
            matvec.gate_up(x, 1e-6, None, None, None, up_linear)


@pytest.fixture(scope="module")
def recorded():
    return record(launch_every_kernel)


def test_every_kernel_is_recorded(recorded):
    """Every kernel the package names (kernel("NAME", ...) in its files) and each of the norm
    kernel's 16 forms was launched for Metal, in each dtype: a kernel added later without a launch
    here fails this test, not silently the check."""
    named = {n for f in KERNEL_DIR.glob("*.py") for n in re.findall(r'\bkernel\(\s*"(\w+)"', f.read_text())}
    names = {key[0] for key in recorded.kernels}
    forms_ = {"flashnorm_" + "".join(f for f, on in zip("rwbc", bits) if on)
              for bits in ((a, b, c, d) for a in (0, 1) for b in (0, 1) for c in (0, 1) for d in (0, 1))}
    assert named and named | forms_ <= names, (named | forms_) - names
    for key, launches in recorded.kernels.items():
        assert {t for _, template, _ in launches for k, t in template if k == "T"} == {mx.float32, mx.float16,
                                                                                       mx.bfloat16}, key[0]


def test_metal_bodies_compile(recorded):
    """The Metal form of every kernel body, in every variant the launchers ask for, compiles with
    no error (see the module docstring for what this does and does not check)."""
    errors = check_recorded(recorded)
    assert len(errors) == len(recorded.kernels) >= 22
    assert not any(errors.values()), "\n".join(f"{n}:\n  " + "\n  ".join(e) for n, e in errors.items() if e)


def _add_rss_and_norm():
    scale.add_rss(rand((2, 8, 320), 1), 1e-6)
    normalize.fused("metal", rand((2, 8, 320), 2), rand((2, 8, 320), 3), rand((320,), 4), None, 1.0, False, 1e-6)


@pytest.mark.parametrize("spelling, header, kernel, words", [
    # a CUDA barrier left in the body (its respelling dropped)
    ({"__syncthreads()": None}, None, "fn_add_rss", "__syncthreads"),
    # a CUDA warp shuffle left in the shared Metal header
    (None, ("simd_shuffle_xor(v, ushort(k))", "__shfl_xor_sync(0xffffffff, v, k)"), "fn_add_rss", "__shfl_xor_sync"),
    # a dropped `;`
    ({"total = t;": "total = t"}, None, "fn_add_rss", "expected ';'"),
    # a threadgroup array respelled as a thread-local one: the norm's block sum takes threadgroup memory
    ({"__shared__": ""}, None, "flashnorm_rw", "fnorm_block_sum"),
    # a 4-byte as_type to an 8-byte type
    ({"__int_as_float": "as_type<long>"}, None, ("fn_add_rss", "flashnorm_rw"), "differ in size"),
])
def test_check_fails_on_a_broken_spelling(monkeypatch, spelling, header, kernel, words):
    """A deliberately broken Metal spelling is reported as a compile error of each kernel it breaks,
    and of no other (they compile with the real spelling: test_metal_bodies_compile)."""
    if spelling:
        table = {k: v for k, v in build.METAL_SPELLING.items() if spelling.get(k, "") is not None}
        monkeypatch.setattr(build, "METAL_SPELLING", {**table, **{k: v for k, v in spelling.items() if v is not None}})
    if header:
        assert header[0] in build.HEADERS["metal"]
        monkeypatch.setitem(build.HEADERS, "metal", build.HEADERS["metal"].replace(*header))
    errors = check_recorded(record(_add_rss_and_norm))
    broken = {kernel} if isinstance(kernel, str) else set(kernel)
    assert {n for n, e in errors.items() if e} == broken, errors
    assert all(words in "\n".join(errors[n]) for n in broken), errors
