"""mlx-flashnorm: a small, fast LLM runner on MLX with FlashNorm applied at load time."""
import importlib
import os

# MLX's CUDA backend sends GPU work as CUDA graphs of at most this many operations (its default
# is 100 on Hopper). One decode step of these models is 250-450 operations; larger graphs cut the
# per-token host work: decode +20% on an H200 (bench/RESULTS.md). Read at MLX's first GPU use.
os.environ.setdefault("MLX_MAX_OPS_PER_BUFFER", "1000")

from .loader import load

__all__ = ["load", "generate", "stream_generate"]


def __getattr__(name):
    # Imported lazily so that `python -m mlx_flashnorm.generate` does not import the module twice.
    if name in ("generate", "stream_generate"):
        module = importlib.import_module(".generate", __name__)
        globals().update(generate=module.generate, stream_generate=module.stream_generate)
        return globals()[name]
    raise AttributeError(name)
