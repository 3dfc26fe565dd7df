"""Reference architectures, stated as published, one file each. Each file also states how FlashNorm
maps onto its architecture (FLASHNORM, an mlx_flashnorm.flashnorm.Mapping) and the config.json
model_type values it serves (MODEL_TYPES); the transformations live in mlx_flashnorm.flashnorm."""
from . import gemma3, llama, openelm, qwen2, qwen3

ARCHITECTURES = {t: m for m in (llama, openelm, qwen2, qwen3, gemma3) for t in m.MODEL_TYPES}
