"""CUDA kernels compiled once per machine: MLX's own NVRTC (through ctypes) turns a CUDA file into
a cubin kept on disk (CACHE_DIR, a temporary file renamed into place) under a hash of the code, the
GPU architecture and NVRTC's version. MLX compiles an mx.fast.cuda_kernel with NVRTC in every
process, slowly; a kept binary loads quickly (bench/RESULTS.md, "Compile once")."""
import hashlib
import os
import stat
import sys
from functools import lru_cache
from pathlib import Path

import mlx.core as mx

# Compiled kernels and the self-checks that passed (kernels.check) are kept here.
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx_flashnorm"


def read_cached(file):
    """A cache file's bytes, or None (a cache miss) where there is no regular file to read: it is
    opened without waiting (a FIFO in its place would wait for a writer forever) and read only if
    it is a regular file; a folder, a link loop or an unreadable file is a miss too."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        os.set_blocking(fd, True)
        with open(fd, "rb", closefd=False) as f:
            return f.read()
    except OSError:
        return None
    finally:
        os.close(fd)


def write_cached(file, data):
    """Keep data in a cache file: written to a temporary file made anew beside it and renamed into
    place, so that a special file there is replaced, never written through (a folder stays). A
    cache that cannot be written only costs the next process time."""
    tmp = file.with_suffix(f".tmp{os.getpid()}")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        with open(fd, "wb") as f:
            f.write(data)
        tmp.replace(file)
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


@lru_cache(maxsize=None)
def _nvrtc(path=None):
    """NVRTC through ctypes and its version: the library at `path`, else MLX's (already loaded
    into this process by its CUDA backend)."""
    import ctypes
    import ctypes.util

    if path is None:
        with open("/proc/self/maps") as maps:
            loaded = [line.split()[-1] for line in maps if "/libnvrtc.so" in line]
        path = loaded[0] if loaded else ctypes.util.find_library("nvrtc") or "libnvrtc.so"
    lib = ctypes.CDLL(path)
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return lib, f"{major.value}.{minor.value}"


def _site_packages():
    """The folder MLX is installed in (site-packages), where the nvidia wheels put nvidia/."""
    return Path(mx.__file__).parents[1]  # mx.__file__: site-packages/mlx/core.*.so


def wheel_nvrtc():
    """(libnvrtc, include folder) of the pip wheels nvidia-cuda-nvrtc and nvidia-cuda-runtime
    (site-packages' nvidia/cu13/lib and nvidia/cu13/include), or None where either is missing:
    NVRTC and the headers our kernels include, enough to compile them for any GPU architecture
    on a machine without one (tests/test_cuda_compile.py)."""
    root = _site_packages() / "nvidia" / "cu13"
    lib, include = root / "lib" / "libnvrtc.so.13", root / "include"
    found = lib.is_file() and (include / "cuda_fp16.h").is_file()
    return (str(lib), str(include)) if found else None


@lru_cache(maxsize=None)
def _cuda_include():
    """A folder holding cuda_fp16.h (the CUDA headers MLX's own JIT compiles against)."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    roots += sorted(str(p.parent) for p in (_site_packages() / "nvidia").glob("*/include"))
    for root in filter(None, roots):
        for folder in (Path(root) / "include", Path(root)):
            if (folder / "cuda_fp16.h").is_file():
                return str(folder)
    raise RuntimeError("no CUDA headers (cuda_fp16.h) found: set CUDA_HOME")


def _cuda_arch():
    return mx.device_info()["architecture"]  # such as "sm_90"


@lru_cache(maxsize=None)
def cuda_binary(name, code):
    """The cubin of CUDA file `code` for this GPU: read from CACHE_DIR, or compiled with NVRTC and
    kept there (a temporary file renamed into place) under a hash of the code, the GPU
    architecture and NVRTC's version."""
    lib, version = _nvrtc()
    arch = _cuda_arch()
    key = hashlib.sha256(f"{code}\n{arch}\n{version}".encode()).hexdigest()[:24]
    file = CACHE_DIR / "cuda" / f"{name}-{key}.cubin"
    cached = read_cached(file)
    if cached is not None:
        return cached
    # (a big kernel takes NVRTC a minute or more: a server's first start would look hung)
    print(f"mlx_flashnorm: compiling the CUDA kernel {name} for this GPU ({arch}), once: kept in "
          f"{file.parent}", file=sys.stderr, flush=True)
    binary = compile_cubin(lib, name, code, arch, _cuda_include())[0]
    write_cached(file, binary)  # a read-only cache only costs the next process a compile
    return binary


def compile_cubin(lib, name, code, arch, include, debug=False):
    """(cubin, log): CUDA file `code` compiled by NVRTC (`lib`, through ctypes) for GPU
    architecture `arch` ("sm_90") against the CUDA headers in folder `include`, and NVRTC's log
    (its warnings; empty where none); debug: unoptimized device code (--device-debug: the
    whole front end and assembler, in a third of the time). A failed step raises RuntimeError, a
    compile's with the log."""
    import ctypes

    prog = ctypes.c_void_p()
    check = lambda rc, what: None if rc == 0 else _nvrtc_error(lib, prog, rc, what)
    check(lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), f"{name}.cu".encode(), 0, None,
                                 None), "create")
    try:
        opts = [f"--gpu-architecture={arch}", "--std=c++17", f"--include-path={include}"]
        opts += ["--device-debug"] * debug
        check(lib.nvrtcCompileProgram(prog, len(opts),
                                      (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])),
              "compile")
        size = ctypes.c_size_t()
        check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        cubin = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetCUBIN(prog, cubin), "cubin")
        return cubin.raw, _log(lib, prog)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _log(lib, prog):
    import ctypes

    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value + 1)
    lib.nvrtcGetProgramLog(prog, buf)
    return buf.value.decode(errors="replace").strip()


def _nvrtc_error(lib, prog, rc, what):
    import ctypes

    log = _log(lib, prog) if what == "compile" else ""
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    raise RuntimeError(f"NVRTC {what} failed ({lib.nvrtcGetErrorString(rc).decode()}): "
                       f"{log[:2000]}")


# Each kernel's self-check (CHECKS, self_check) is a call on small float16 inputs, written beside
# it.
