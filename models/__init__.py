"""Reference architectures, stated as published. FlashNorm lives in mlx_flashnorm.flashnorm."""
from . import llama, openelm

ARCHITECTURES = {"llama": llama, "mistral": llama, "openelm": openelm}
