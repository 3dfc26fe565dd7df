"""mlx-flashnorm: a small, fast LLM runner on MLX with FlashNorm applied at load time."""
import os
import warnings
from importlib.metadata import PackageNotFoundError, version

# MLX's CUDA backend sends GPU work as CUDA graphs of at most this many operations (its default
# is 100 on Hopper). One decode step of these models is some hundreds of operations; larger graphs
# cut the per-token host work and speed decode up (bench/RESULTS.md, "Launches per step"). Read at
# MLX's first GPU use.
os.environ.setdefault("MLX_MAX_OPS_PER_BUFFER", "1000")

try:
    __version__ = version("mlx-flashnorm")
except PackageNotFoundError:  # run from a source tree that is not installed
    __version__ = "0+unknown"

# `python -m mlx_flashnorm.generate` finds the module imported by the line below already; its
# __main__ block then runs that module's main, so runpy's warning about it says nothing useful.
warnings.filterwarnings("ignore", r"'mlx_flashnorm\.\w+' found in sys\.modules", RuntimeWarning)

from .loader import load  # noqa: E402
# the command module first: importing it binds the package's `generate` to the module, which the
# line after it binds to the function, for good (a later import finds the module loaded)
from . import generate as _command  # noqa: E402
from .decoding import generate, stream_generate  # noqa: E402

del _command

__all__ = ["load", "generate", "stream_generate", "__version__"]
