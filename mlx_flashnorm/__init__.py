"""mlx-flashnorm: a small, fast LLM runner on MLX with FlashNorm applied at load time."""
import os
from importlib.metadata import PackageNotFoundError, version

# MLX's CUDA backend sends GPU work as CUDA graphs of at most this many operations (its default
# is 100 on Hopper). One decode step of these models is 250-450 operations; larger graphs cut the
# per-token host work: decode +20% on an H200 (bench/RESULTS.md). Read at MLX's first GPU use.
os.environ.setdefault("MLX_MAX_OPS_PER_BUFFER", "1000")

try:
    __version__ = version("mlx-flashnorm")
except PackageNotFoundError:  # run from a source tree that is not installed
    __version__ = "0+unknown"

from .loader import load
# The package mlx_flashnorm.generate (API; its __main__ is the command) is imported here, so the
# name `generate` below is the function, whatever is imported later.
from .generate import generate, stream_generate  # noqa: E402

__all__ = ["load", "generate", "stream_generate", "__version__"]
