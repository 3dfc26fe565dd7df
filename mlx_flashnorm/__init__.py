"""mlx-flashnorm: a small, fast LLM runner on MLX with FlashNorm applied at load time."""
import importlib

from .loader import load

__all__ = ["load", "generate", "stream_generate"]


def __getattr__(name):
    # Imported lazily so that `python -m mlx_flashnorm.generate` does not import the module twice.
    if name in ("generate", "stream_generate"):
        module = importlib.import_module(".generate", __name__)
        globals().update(generate=module.generate, stream_generate=module.stream_generate)
        return globals()[name]
    raise AttributeError(name)
