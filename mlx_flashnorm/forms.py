"""Which form each norm mode takes on this device and dtype: the one place that decides.

Everything that needs to know reads it here (the kernels, the norm modules, FlashNorm's whole-model
pass, the loader, the decode loop); nothing else keeps a switch.

    device and state                      rms                       flash
    GPU, our kernels pass their check     fused add+norm kernel     "fused": deferred 1/RMS inside
                                          (one row)                 the kernels (Sec. 5), compiled
                                                                    decode over a static cache
    GPU, kernels off or add_rss failed    mx.fast.rms_norm          "weightless": Sec. 1 only (norm
    ("portable": MLX primitives only)     (PlainRMSNorm)            weights folded or kept), eager
                                                                    decode, as mlx-lm runs
    CPU                                   mx.fast.rms_norm          "deferred": the plain-MLX
                                          (PlainRMSNorm)            composition of the kernels (the
                                                                    tests' reference), compiled
                                                                    decode

The switches: MLX_FLASHNORM_KERNELS=0 in the environment (or ``forms.ENABLED = False``) turns our
kernels off, MLX_FLASHNORM_DISABLE=NAME,... the kernels named; a kernel that fails its first-use
self-check (kernels.check) is added to DISABLED for the rest of the process; BACKEND forces the
norm kernel's path ("auto", "fallback", "cuda", "metal"; tests and benchmarks)."""
import os
from contextlib import contextmanager
from functools import lru_cache

import mlx.core as mx

ENABLED = os.environ.get("MLX_FLASHNORM_KERNELS", "1") != "0"
# kernels that failed their self-check in this process (they fall back), and those named in
# MLX_FLASHNORM_DISABLE (comma-separated, e.g. "decode_layers": the step's per-sublayer kernels)
DISABLED = set(filter(None, os.environ.get("MLX_FLASHNORM_DISABLE", "").split(",")))
BACKEND = "auto"  # the norm kernel's path: "auto" picks the GPU's kernel for a fused residual add

NORMS = ("rms", "flash", "none")  # the norm modes every command and load() take


@contextmanager
def without(*names):
    """The kernels named kept off (DISABLED) inside the block; those off before stay off."""
    added = set(names) - DISABLED
    DISABLED.update(added)
    try:
        yield
    finally:
        DISABLED.difference_update(added)


@lru_cache(maxsize=None)
def gpu_backend():
    """"cuda" or "metal" where MLX has that GPU backend, else None (asked once per process)."""
    return "metal" if mx.metal.is_available() else ("cuda" if mx.cuda.is_available() else None)


def use_gpu(name=None):
    """True when our kernels (or the one named) run: enabled, the default device a GPU with MLX's
    CUDA or Metal backend, and the kernel not disabled by its self-check."""
    return (ENABLED and mx.default_device() == mx.gpu and gpu_backend() is not None
            and name not in DISABLED)


def portable():
    """True on a GPU where our kernels do not run (MLX_FLASHNORM_KERNELS=0, or add_rss failed its
    self-check): models then run on MLX's own primitives alone, as mlx-lm's do. There a deferred
    1/RMS has no fused kernel to live in and would cost extra element-wise launches beside
    mx.fast.rms_norm, so FlashNorm takes its weightless form and decoding runs eagerly over exactly
    the filled cache, as mlx-lm does: a compiled step over a fixed-size cache needs a masked
    attention, which MLX's CUDA backend does not fuse (bench/RESULTS.md, "Portable path"). The CPU
    keeps the deferred form (the tests' reference)."""
    return mx.default_device() == mx.gpu and not use_gpu("add_rss")


def flash_form():
    """The form `--norm flash` takes here: "weightless" on the portable path, else "fused" where
    our kernels run and "deferred" (their plain-MLX composition) elsewhere."""
    if portable():
        return "weightless"
    return "fused" if use_gpu() else "deferred"


def compiled_decode():
    """Whether decoding runs the compiled one-token step over a static cache (everywhere but the
    portable path, see portable)."""
    return not portable()


def compiled_prefill():
    """Whether a prefill chunk runs as a compiled function of a bucket of prompt lengths
    (decoding.prefill): where our kernels run on a GPU, where a short prefill is host work
    (bench/RESULTS.md, "Prefill"); off with MLX_FLASHNORM_DISABLE=compiled_prefill. Not on the
    CPU, where a prefill is compute-bound and the padding to a bucket would cost its share, nor on
    the portable path (compiled_decode)."""
    return use_gpu("compiled_prefill") and not portable()


def select_backend(backend=None):
    """The norm kernel's path for `backend` (None: BACKEND): "auto" resolves to the GPU's kernel
    where it runs, else "fallback" (the plain MLX composition)."""
    backend = BACKEND if backend is None else backend
    if backend == "auto":
        return gpu_backend() if use_gpu("normalize") else "fallback"
    if backend not in ("fallback", "metal", "cuda"):
        raise ValueError(f"unknown backend {backend!r}")
    return backend


def available_backends():
    """Norm kernel paths that can run here: "fallback" always, plus the GPU's kernel if any."""
    gpu = gpu_backend()
    return ["fallback"] + ([gpu] if gpu else [])
