"""quantized_matmul: on the CPU, where decoding is bound by MLX's (single-threaded) 4-bit
matrix-vector product, it splits the weight rows over two CPU streams, which MLX runs on two
threads (the result is bit-identical); on a GPU it multiplies a batch's rows as one matrix.
through_quantized_matmul swaps it into a loaded model's quantized layers."""
import os
import threading

import mlx.core as mx
import mlx.nn as nn

from .. import forms

# the weight rows split over this many streams: a 4-bit matvec and decode both faster
# (bench/RESULTS.md, "CPU row-parallel matmul")
CPU_STREAMS = 2


_thread = threading.local()


def _cpu_streams():
    """The streams of the row blocks; an MLX stream belongs to the thread that made it, so each
    thread running a model (the server's generation worker, say) gets its own."""
    if not hasattr(_thread, "cpu_streams"):
        _thread.cpu_streams = [mx.new_stream(mx.cpu) for _ in range(CPU_STREAMS)]
    return _thread.cpu_streams


def quantized_matmul(x, w, scales, biases, group_size, bits, mode="affine"):
    """x @ dequantize(w).T, as mx.quantized_matmul(..., transpose=True). On the CPU (with at least
    two cores) the output columns are computed in row blocks of w on separate streams; each block
    is the same computation as before, so the result is bit-identical. On a GPU a batch's decode
    rows (B, 1, K) are one matrix (1, B, K): MLX's CUDA kernel multiplied each of the B matrices on
    its own, reading the weights B times (the tied head, a large part of a batched decode step:
    bench/RESULTS.md, "The batched step"). On the CPU a half-precision product runs in float32 and
    is rounded once: MLX's CPU kernel accumulates in the half type, much slower and several units
    in the last place off where float32 accumulation (as on a GPU) is not (bench/RESULTS.md, "Half
    precision on the CPU")."""
    # first, and once: an eager forward pass calls this per linear
    if mx.default_device() != mx.cpu:
        # a batch's decode rows as one matrix
        if x.ndim == 3 and x.shape[0] > 1 and x.shape[1] == 1:
            return quantized_matmul(x.reshape(1, -1, x.shape[2]), w, scales, biases, group_size,
                                    bits, mode).reshape(x.shape[0], 1, -1)
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size,
                                   bits=bits, mode=mode)
    if x.dtype in (mx.float16, mx.bfloat16) and mode == "affine":
        f32 = mx.float32
        return quantized_matmul(x.astype(f32), w, scales.astype(f32), biases.astype(f32),
                                group_size, bits, mode).astype(x.dtype)
    n = w.shape[0]
    if not (forms.ENABLED and (os.cpu_count() or 1) > 1 and n >= 2 * CPU_STREAMS):
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size,
                                   bits=bits, mode=mode)
    cuts = [n * i // CPU_STREAMS for i in range(CPU_STREAMS + 1)]
    parts = [mx.quantized_matmul(x, w[a:b], scales[a:b], None if biases is None else biases[a:b],
                                 transpose=True, group_size=group_size, bits=bits, mode=mode,
                                 stream=st)
             for a, b, st in zip(cuts, cuts[1:], _cpu_streams())]
    return mx.concatenate(parts, axis=-1)


class QuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear computed through quantized_matmul (the loader swaps it in)."""

    def __call__(self, x):
        y = quantized_matmul(x, self["weight"], self["scales"], self.get("biases"),
                             self.group_size, self.bits, self.mode)
        return y + self["bias"] if "bias" in self else y


class QuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose as_linear (a tied LM head) goes through quantized_matmul."""

    def as_linear(self, x):
        return quantized_matmul(x, self["weight"], self["scales"], self.get("biases"),
                                self.group_size, self.bits, self.mode)


def through_quantized_matmul(model):
    """Make every nn.QuantizedLinear / nn.QuantizedEmbedding of model compute through
    quantized_matmul (its weight rows over two threads on the CPU, a batch's rows as one matrix on
    a GPU), in place: the same arrays, the same parameter names; only the class changes."""
    for _, m in model.named_modules():
        if type(m) is nn.QuantizedLinear:
            m.__class__ = QuantizedLinear
        elif type(m) is nn.QuantizedEmbedding:
            m.__class__ = QuantizedEmbedding
    return model


