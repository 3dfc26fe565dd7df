"""The CUDA compile check: every CUDA variant the kernels' self-checks launch, compiled by NVRTC
on a machine without a GPU.

On a GPU build.make_kernel writes one CUDA file per variant (build.cuda_source: the dtypes and
template arguments of a launch) and compiles it with MLX's NVRTC (nvrtc.cuda_binary). Here each
self-check call of kernels.check.CHECKS (the LAZY ones too) runs with the backend set to CUDA
(gpu_backend, forms.use_gpu, and a compute capability of 9: Hopper, where decode_rows runs), once
in each dtype the kernels take (build.CHECK_DTYPE: the checks' inputs of no dtype of their own),
with build.cuda_source recorded, build.cuda_binary stubbed and mx.fast.precompiled_cuda_kernel
returning zeros of the output shapes and dtypes, so that each launcher goes on as on a GPU. Each
distinct CUDA file is then compiled by NVRTC from the pip wheels nvidia-cuda-nvrtc and
nvidia-cuda-runtime (nvrtc.wheel_nvrtc; the test extra installs them on Linux) for sm_90 (H100,
H200; add "sm_80" to ARCHS for the A100): NVRTC needs no GPU. They are compiled unoptimized
(--device-debug): the same front end and assembler, every instruction checked, without the
optimizer's time, most of an optimized compile's. Any compile error fails the test, with NVRTC's
log.

What it catches: C++ syntax and type errors in a body or a shared header, a template constant or
input name the body uses but the launch does not give, a variant that does not instantiate for a
dtype, an intrinsic or instruction the architecture lacks. What it cannot: wrong numbers, races,
launch limits (shared memory, registers at the launch's block size), what only the optimizer
meets, and variants the self-checks do not launch (other head sizes, bit widths); the self-check
on a GPU covers those it runs, optimized."""
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest

from mlx_flashnorm import forms
from mlx_flashnorm.kernels import build, check, nvrtc, scale

NVRTC = nvrtc.wheel_nvrtc()  # (libnvrtc, include folder) or None
pytestmark = pytest.mark.skipif(
    NVRTC is None, reason="needs NVRTC and the CUDA headers of the pip wheels nvidia-cuda-nvrtc "
    "and nvidia-cuda-runtime (cu13, in MLX's site-packages): pip install -e '.[test]'")

ARCHS = ("sm_90",)  # H100 and H200 (a second architecture doubles the suite's compile time)
DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def _kernel_modules():
    return [m for n, m in list(sys.modules.items()) if n.startswith("mlx_flashnorm.kernels.")]


def _clear_launchers():
    """Forget what the kernel files made once (their lru_cache'd launchers, each with its compiled
    variants), so that each launch below is made, and its CUDA file written, again."""
    for module in _kernel_modules():
        for f in list(vars(module).values()):
            if hasattr(f, "cache_clear") and getattr(f, "__module__", None) == module.__name__:
                f.cache_clear()


def record(names=None, dtypes=DTYPES):
    """{(check name, dtype): [(kernel name, template, CUDA file), ...]}: the variants each
    self-check call (of CHECKS, or those named) launches on CUDA with its inputs in each dtype."""
    launched, current = {}, []
    cuda_source = build.cuda_source

    def source(name, *args):
        code = cuda_source(name, *args)
        current.append((name, tuple((k, str(v)) for k, v in args[-1]), code))
        return code

    with pytest.MonkeyPatch.context() as mp:
        for module in [forms] + _kernel_modules():  # the backend, wherever a kernel file asks
            if hasattr(module, "gpu_backend"):
                mp.setattr(module, "gpu_backend", lambda: "cuda")
            if hasattr(module, "compute_capability"):
                mp.setattr(module, "compute_capability", lambda: 9)
        mp.setattr(forms, "use_gpu", lambda name=None: True)
        mp.setattr(build, "cuda_source", source)
        mp.setattr(build, "cuda_binary", lambda name, code: b"cubin")
        mp.setattr(build, "VARIANTS", set())
        mp.setattr(mx.fast, "precompiled_cuda_kernel", lambda **kw: [
            mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])])
        try:
            for dtype in dtypes:
                mp.setattr(build, "CHECK_DTYPE", dtype)
                for name in names or check.CHECKS:
                    _clear_launchers()
                    current.clear()
                    check.CHECKS[name][0]()
                    launched[name, dtype] = list(current)
        finally:
            _clear_launchers()  # no launcher made for CUDA outlives the test
    return launched


def compile_all(launched, archs=ARCHS):
    """{(kernel name, template, arch): NVRTC's error or None} and {...: NVRTC's warnings} over each
    distinct CUDA file of `launched` (record's), compiled for each of `archs`."""
    lib = nvrtc._nvrtc(NVRTC[0])[0]
    jobs = list({(name, template, code, arch): None for variants in launched.values()
                 for name, template, code in variants for arch in archs})

    def compile_one(job):
        name, _, code, arch = job
        try:
            cubin, log = nvrtc.compile_cubin(lib, name, code, arch, NVRTC[1], debug=True)
            return (None if cubin else "an empty cubin"), log
        except RuntimeError as e:
            return str(e), ""

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # NVRTC runs outside the GIL
        results = dict(zip(jobs, pool.map(compile_one, jobs)))
    errors = {(n, t, a): e for (n, t, _, a), (e, _) in results.items()}
    warnings = {(n, t, a): w for (n, t, _, a), (_, w) in results.items() if w}
    return errors, warnings


@pytest.fixture(scope="module")
def launched():
    return record()


@pytest.fixture(scope="module")
def compiled(launched):
    return compile_all(launched)


def test_every_check_launches_cuda_in_each_dtype(launched):
    """Each self-check (the LAZY ones too) launches at least one CUDA variant of its kernel in each
    dtype, templated on that dtype (T): a check that falls back to plain MLX under the CUDA backend
    would leave its kernel unchecked here."""
    assert {name for name, _ in launched} == set(check.CHECKS) and check.LAZY <= set(check.CHECKS)
    for (name, dtype), variants in launched.items():
        assert any(dict(t).get("T") == str(dtype) for _, t, _ in variants), (name, dtype, variants)


def test_every_variant_compiles(launched, compiled):
    """Every CUDA file the self-checks launch, in each dtype, compiles for each of ARCHS: each
    check's kernels in at least one variant per dtype and architecture, and no variant fails."""
    errors, _ = compiled
    for (name, dtype), variants in launched.items():
        for arch in ARCHS:
            assert any(errors.get((n, t, arch), "not compiled") is None for n, t, _ in variants), \
                (name, dtype, arch)
    failed = {k: e for k, e in errors.items() if e}
    assert not failed, "\n\n".join(f"{n} {dict(t)} {a}:\n{e}" for (n, t, a), e in failed.items())


def test_a_broken_kernel_fails_to_compile(monkeypatch):
    """A kernel body with a syntax error (a dropped `;`) fails to compile, with NVRTC's message, and
    only that kernel's variants do: the check reads the bodies the launchers are made of."""
    assert "float ss = 0.0f;" in scale._ADD_RSS
    broken = scale._ADD_RSS.replace("float ss = 0.0f;", "float ss = 0.0f")
    monkeypatch.setattr(scale, "_ADD_RSS", broken)
    errors, _ = compile_all(record(["add_rss", "normalize"], [mx.float16]), ["sm_90"])
    assert {n for n, _, _ in errors} == {"fn_add_rss", "flashnorm_rw"}
    assert {n for (n, _, _), e in errors.items() if e} == {"fn_add_rss"}, errors
    assert all('expected a ";"' in e for e in errors.values() if e), errors
