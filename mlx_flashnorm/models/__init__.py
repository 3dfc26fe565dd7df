"""Reference architectures, stated as published, one file each. Each file also states how FlashNorm
maps onto its architecture (FLASHNORM, an mlx_flashnorm.flashnorm.Mapping) and the config.json
model_type values it serves (MODEL_TYPES); the transformations live in mlx_flashnorm.flashnorm
and mlx_flashnorm.concat (projections read through concat.project and concat.heads)."""
from . import gemma3, llama, openelm, qwen2, qwen3

ARCHITECTURES = {t: m for m in (llama, openelm, qwen2, qwen3, gemma3) for t in m.MODEL_TYPES}
# GGUF general.architecture -> the model file mapping its metadata and tensors (from_gguf); llama
# GGUF files are mapped by mlx_flashnorm.gguf itself.
GGUF_ARCHITECTURES = {m.GGUF_ARCHITECTURE: m for m in (gemma3, qwen2, qwen3)}
