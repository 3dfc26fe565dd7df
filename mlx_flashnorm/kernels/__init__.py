"""Fused kernels for the decode step, each with a plain-MLX fallback, one file per kernel family
(its source, launcher, fallback and self-check, as mlx-lm's models/gated_delta.py holds one):

    attention.py   decode_attention: softmax(q k^T * scale) v over the first n cached positions
    scale.py       add_rss: the residual add and FlashNorm's deferred 1/RSSe in one pass
    rope.py        rope_after_qkv: RoPE after the projections with the deferred scale (Sec. 3) or
                   the QK-norm gains fused into cos/sin (Sec. 4)
    matvec.py      norm_qkv_rope, gate_up: Sec. 5, the pre-norm inside its consumer's 4/8-bit matvec
    step.py        decode_layers: every layer of a decode step in one persistent CUDA kernel
    rows.py        decode_rows: the same for a batch of rows, each at its own position;
                   prefill_rows: a prompt's tokens as its rows, in one cache
    cuda/          the CUDA of step.py's and rows.py's kernels (step.cu, rows.cu, whole_step.cuh)
    normalize.py   the norm modules' fused residual add + RMSNorm/LayerNorm
    cpu.py         the CPU's row-parallel quantized matmul (bit-identical, two threads)

and the build system: build.py (the CUDA body, its Metal spelling, make_kernel), nvrtc.py (CUDA
binaries compiled once per machine and kept on disk), check.py (the first-use self-check). Which
kernels run is decided in mlx_flashnorm.forms. Inside ``mx.compile`` a custom kernel is one node of
the graph like any built-in op, so each kernel removes the nodes (and GPU launches) of the ops it
replaces: that is the per-token cost that bounds decoding on a fast GPU."""
from .scale import add_rss, power_of_two_below, scale_shape
from .attention import CHUNK, SPLIT_ABOVE, decode_attention
from .build import constant, float_bits, position_array
from .check import self_check
from .cpu import QuantizedEmbedding, QuantizedLinear, quantized_matmul, through_quantized_matmul
from .matvec import KMAX, fused_supported, gate_up, gated, norm_qkv_rope
from .rope import rope_after_qkv, rope_after_qkv_supported
from .step import (MAX_ROWS, Layers, decode_layers, layer_arrays, layer_sizes, layer_views,
                   stacked, supported as decode_layers_supported, table_fits, use_decode_layers)
from .rows import decode_rows, prefill_rows

__all__ = ["add_rss", "power_of_two_below", "scale_shape", "CHUNK", "SPLIT_ABOVE",
           "decode_attention", "constant", "float_bits", "position_array", "self_check",
           "QuantizedEmbedding", "QuantizedLinear", "quantized_matmul", "through_quantized_matmul",
           "KMAX", "fused_supported", "gate_up", "gated", "norm_qkv_rope", "rope_after_qkv",
           "rope_after_qkv_supported", "MAX_ROWS", "Layers", "decode_layers", "layer_arrays",
           "layer_sizes", "layer_views",
           "stacked", "decode_layers_supported", "table_fits", "use_decode_layers",
           "decode_rows", "prefill_rows"]
