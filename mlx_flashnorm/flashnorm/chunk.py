"""Several greedy decode steps of a model in one launch (kernels.decode_chunk): its arguments read
from the model's parts in each norm mode, the blocks' as decode_stack reads them (stack._spec), the
final norm's (flash: the final DeferredNorm's gain; rms: the model's RMSNorm's weights; none: a
NoNorm) and the LM head's (a quantized embedding as a tied head: TiedFlashHead in flash; an untied
quantized head: FlashHead in flash, the model's QuantizedLinear in rms and none)."""
import mlx.core as mx
import mlx.nn as nn

from .. import kernels
from ..nn import PlainRMSNorm, RMSNorm
from .head import TiedFlashHead
from .norm import DeferredNorm, NoNorm, QuantizedDeferredLinear
from .stack import _rms, _spec, _stacked

# each mode's final norm, and its untied head
FINAL = {"flash": (DeferredNorm,), "rms": (RMSNorm, PlainRMSNorm), "none": (NoNorm,)}
UNTIED = {"flash": (QuantizedDeferredLinear,),
          "rms": (nn.QuantizedLinear, kernels.QuantizedLinear),
          "none": (nn.QuantizedLinear, kernels.QuantizedLinear)}


def _affine(m, classes):
    """(weight, scales, biases, group size, bits) of a quantized module of exactly one of classes,
    affine, 4- or 8-bit, with no bias and no gain of its own; None for any other."""
    if (type(m) in classes and m.mode == "affine" and m.bits in (4, 8) and "biases" in m
            and "bias" not in m and "gain" not in m):
        return m["weight"], m["scales"], m["biases"], m.group_size, m.bits
    return None


def chunk_spec(embedding, layers, norm, head):
    """decode_chunk's arguments (but for the token, position, steps, caches and k) for a model whose
    logits are head(norm(layers(embedding(token)))): the blocks' (decode_stack's, their matrices
    stacked), the embedding's and the head's arrays (head None, or flash's TiedFlashHead: the
    embedding as a linear), the final norm's gains and epsilon; None where a part is not of the
    forms the kernel computes."""
    spec = _spec(layers)
    # Gemma's form (GeGLU, post-norms in the gains, RoPE angles a layer) is decode_layers' alone
    if (spec is None or spec.pop("gelu") or spec["theta"].ndim != 1
            or spec["gains"] is not None and spec["gains"].shape[1] != 2):
        return None
    mode = spec["norm"]
    emb = _affine(embedding, (nn.QuantizedEmbedding, kernels.QuantizedEmbedding))
    tied = head is None if mode != "flash" else type(head) is TiedFlashHead and "scale" not in head
    lm = emb if tied else (head is not None and _affine(head, UNTIED[mode]))
    if emb is None or not lm or type(norm) not in FINAL[mode]:
        return None
    K = emb[0].shape[-1] * 32 // emb[4]
    if mode == "rms" and not _rms(norm, K):
        return None
    gain = (norm.weight if mode == "rms" else norm.get("gain") if mode == "flash" else None)
    gain = None if gain is None else gain.astype(mx.float32)
    if gain is not None:
        mx.eval(gain)  # a constant of the compiled chunk's graph (as _spec's gains)
    return dict(spec, layers=_stacked(layers, spec["layers"]), embedding=emb, head=lm,
                head_gain=gain, head_eps=0.0 if mode == "none" else norm.eps)


def chunk_supported(spec, kv):
    """Whether the kernel itself runs spec (chunk_spec's, with k: the most steps a launch) over the
    caches kv ((k, v) per layer) (kernels.decode_chunk_supported; else decode_chunk runs its
    reference)."""
    return (spec["theta"].shape[0] * 2 == kv[0][0].shape[-1]
            and kernels.decode_chunk_supported(spec["layers"], kv, spec["n_heads"],
                                               spec["n_kv_heads"], spec["group_size"],
                                               spec["bits"], spec["embedding"], spec["head"],
                                               spec["head_gain"], spec["norm"], spec["k"]))


def decode_chunk(spec, y, cache, steps):
    """Up to spec's k greedy decode steps (`steps`, an int32 array, says how many) after the token y
    ((1,) uint32) over StaticKVCaches at an array offset (the compiled step's), the caches' new k
    and v written: the steps' tokens (kernels.decode_chunk, or its reference where the kernel does
    not run)."""
    kv = [(c.keys, c.values) for c in cache]
    tokens, kv = kernels.decode_chunk(y, cache[0].offset, steps, caches=kv, **spec)
    for c, (keys, values) in zip(cache, kv):
        c.keys, c.values = keys, values
    return tokens
