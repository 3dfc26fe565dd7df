"""CPU: where decoding is bound by MLX's (single-threaded) 4-bit matrix-vector product,
quantized_matmul splits the weight rows over two CPU streams, which MLX runs on two threads; the
result is bit-identical. row_parallel swaps it into a loaded model's quantized layers."""
import os
import threading

import mlx.core as mx
import mlx.nn as nn

from .. import forms

CPU_STREAMS = 2  # measured on 2 cores: a 4-bit matvec 1.8x faster, decode 1.4x (bench/RESULTS.md)


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
    is the same computation as before, so the result is bit-identical. On the CPU a half-precision
    product runs in float32 and is rounded once: MLX's CPU kernel accumulates in the half type,
    10-40x slower and 10 units in the last place off where float32 accumulation (as on a GPU)
    is not (bench/RESULTS.md, "Half precision on the CPU")."""
    if mx.default_device() != mx.cpu:  # first, and once: an eager forward pass calls this per linear
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size,
                                   bits=bits, mode=mode)
    if x.dtype in (mx.float16, mx.bfloat16) and mode == "affine":
        f32 = mx.float32
        return quantized_matmul(x.astype(f32), w, scales.astype(f32), biases.astype(f32), group_size,
                                bits, mode).astype(x.dtype)
    n = w.shape[0]
    if not (forms.ENABLED and (os.cpu_count() or 1) > 1 and n >= 2 * CPU_STREAMS):
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size,
                                   bits=bits, mode=mode)
    cuts = [n * i // CPU_STREAMS for i in range(CPU_STREAMS + 1)]
    parts = [mx.quantized_matmul(x, w[a:b], scales[a:b], None if biases is None else biases[a:b],
                                 transpose=True, group_size=group_size, bits=bits, mode=mode, stream=st)
             for a, b, st in zip(cuts, cuts[1:], _cpu_streams())]
    return mx.concatenate(parts, axis=-1)


class QuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear computed through quantized_matmul (the loader swaps it in on the CPU)."""

    def __call__(self, x):
        y = quantized_matmul(x, self["weight"], self["scales"], self.get("biases"), self.group_size,
                             self.bits, self.mode)
        return y + self["bias"] if "bias" in self else y


class QuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose as_linear (a tied LM head) goes through quantized_matmul."""

    def as_linear(self, x):
        return quantized_matmul(x, self["weight"], self["scales"], self.get("biases"), self.group_size,
                                self.bits, self.mode)


def row_parallel(model):
    """Make every nn.QuantizedLinear / nn.QuantizedEmbedding of model use quantized_matmul, in
    place (the same arrays, the same parameter names; only the class changes), where the default
    device is the CPU; on a GPU quantized_matmul is MLX's own, so the classes stay MLX's (one
    call frame less per linear in an eager forward pass)."""
    if mx.default_device() != mx.cpu:
        return model
    for _, m in model.named_modules():
        if type(m) is nn.QuantizedLinear:
            m.__class__ = QuantizedLinear
        elif type(m) is nn.QuantizedEmbedding:
            m.__class__ = QuantizedEmbedding
    return model


