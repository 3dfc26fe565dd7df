"""Sec. 5 for a whole decode step: every block of a Llama-family stack (FlashAttention or Qwen 3's
FlashQKNormAttention, FlashSwiGLU, DeferredNorm pre-norms, 4/8-bit weights) in one kernel launch,
kernels.decode_layers, where it runs; the model's own loop over its blocks everywhere else."""
import mlx.core as mx
import mlx.nn as nn

from .. import kernels
from .attention import FlashAttention, FlashQKNormAttention
from .ffn import FlashSwiGLU
from .norm import DeferredNorm, QuantizedDeferredLinear, deferred_output


def _quantized(linear, *classes):
    """A bias-free affine quantized linear of exactly one of classes (a sharded one, summing over
    ranks, is another class)."""
    return (type(linear) in classes and linear.mode == "affine" and "bias" not in linear
            and "biases" in linear)


def _arrays(linear):
    return linear["weight"], linear["scales"], linear["biases"]


def _linears(layer):
    """A block's four matrices, in the kernels' order."""
    return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj)


class _Stacks:
    """stack_weights' arrays (a plain attribute of the first block, not a child: no parameters)."""

    def __init__(self, arrays, rows):
        self.arrays, self.rows = arrays, rows


def stack_weights(model):
    """Make each of the 12 arrays of the blocks' matrices (qkv weight, scales, biases; o_proj's;
    gate_up's; down_proj's) one array over the layers, each block's array a row of it (a view: no
    copy is kept), where decode_layers takes these blocks: a launch then takes 12 inputs for them,
    not 12 per layer (its host work grows with its inputs). The same values: every other path
    reads the rows as it read the arrays."""
    layers = getattr(model, "layers", None)
    spec = _spec(layers) if layers and hasattr(layers[0], "self_attn") else None
    if spec is None:
        return model
    arrays, rows = kernels.stacked(spec["layers"]), []
    # one kind at a time: its old arrays go before the next is stacked
    for k, stack in enumerate(arrays):
        views = [stack[l] for l in range(len(layers))]
        mx.eval(stack, views)
        for layer, view in zip(layers, views):
            _linears(layer)[k // 3][("weight", "scales", "biases")[k % 3]] = view
        rows.append(views)
    layers[0]._stacks = _Stacks(arrays, rows)
    return model


def unstack(model):
    """Forget stack_weights' arrays, for a pass that replaces the blocks' arrays (shard.split): they
    would keep the old values' memory."""
    layers = getattr(model, "layers", None)
    if layers:
        vars(layers[0]).pop("_stacks", None)


def _spec(layers):
    """The arguments decode_layers takes for these blocks, or None where a block is not of the
    forms it computes (any other module, a bias, a sharded linear, mixed quantization)."""
    first = layers[0]
    attn = first.self_attn
    if not isinstance(attn, (FlashAttention, FlashQKNormAttention)) or "qkv_proj" not in attn:
        return None
    qk_norm = isinstance(attn, FlashQKNormAttention)
    if qk_norm and ("q_gain" not in attn or attn.out_name != "o_proj"):
        return None
    eps = first.input_layernorm.eps
    mats, gains, qk_gains = [], [], []
    for layer in layers:
        a, f = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if (type(a) is not type(attn) or type(f) is not FlashSwiGLU or not f.late
                or "gate_up_proj" not in f
                or any(type(m) is not DeferredNorm or not m.fuse or m.eps != eps for m in norms)
                or (not qk_norm and a.qkv_bias) or a.traditional or a.factor != attn.factor
                or a.n_heads != attn.n_heads or a.n_kv_heads != attn.n_kv_heads
                or not _quantized(a.qkv_proj, QuantizedDeferredLinear)
                or not _quantized(a.o_proj, nn.QuantizedLinear, kernels.QuantizedLinear)
                or not _quantized(f.gate_up_proj, QuantizedDeferredLinear)
                or not _quantized(f.down_proj, QuantizedDeferredLinear)):
            return None
        linears = _linears(layer)
        if any((m.bits, m.group_size) != (attn.qkv_proj.bits, attn.qkv_proj.group_size)
               for m in linears):
            return None
        if any(("gain" in m) != ("gain" in norms[0]) for m in norms):
            return None
        mats.append(tuple(_arrays(m) for m in linears))
        if "gain" in norms[0]:
            gains.append(mx.stack([m.gain.astype(mx.float32) for m in norms]))
        if qk_norm:
            qk_gains.append(mx.stack([a.q_gain, a.k_gain]).astype(mx.float32))
    # made once per trace of the compiled step (not from traced inputs: a constant of its graph)
    gains = mx.stack(gains) if gains else None
    qk_gains = mx.stack(qk_gains) if qk_gains else None
    mx.eval([a for a in (gains, qk_gains) if a is not None])
    return dict(layers=mats, gains=gains, qk_gains=qk_gains, theta=attn._theta, eps=eps,
                factor=attn.factor, qk_eps=attn.qk_eps if qk_norm else 0.0, n_heads=attn.n_heads,
                n_kv_heads=attn.n_kv_heads, group_size=attn.qkv_proj.group_size,
                bits=attn.qkv_proj.bits)


def _stacked(layers, mats):
    """mats (_spec's layers) with their stacks: stack_weights' where it stacked these blocks (and
    no array was replaced since), else stacked copies (evaluated here: constants of a compiled
    step)."""
    kept = getattr(layers[0], "_stacks", None)
    if kept is None or any(mats[l][k // 3][k % 3] is not a for k, rows in enumerate(kept.rows)
                           for l, a in enumerate(rows)):
        kept = _Stacks(kernels.stacked(mats), None)
        mx.eval(kept.arrays)
    return kernels.Layers(mats, kept.arrays)


def decode_stack(layers, h, cache):
    """The input of the final norm, (x, residual), after every block for the decode rows h
    (embeddings, (B, 1, K)) through one kernel, with the caches' new k and v written: B = 1 over
    StaticKVCaches, kernels.decode_layers; B rows over a batch's caches (serve.slots.RowsKVCache),
    kernels.decode_rows. Both kinds of cache say so with `static_rows` (buffers of every position,
    an array offset per row). None where the kernel does not take these blocks (then the model runs
    its loop): a prefill, an eager step, the CPU, the portable path, another architecture."""
    if (not layers or not cache or h.ndim != 3 or h.shape[1] != 1
            or not getattr(cache[0], "static_rows", False) or isinstance(cache[0].offset, int)):
        return None
    name = "decode_layers" if h.shape[0] == 1 else "decode_rows"
    if name == "decode_rows" and kernels.use_decode_layers(name):
        kernels.self_check([name])  # checked on first use (kernels.check.LAZY)
    if not kernels.use_decode_layers(name):
        return None
    spec = _spec(layers)
    kv = [(c.keys, c.values) for c in cache]
    if (spec is None or spec["theta"].shape[0] * 2 != kv[0][0].shape[-1]
            or not kernels.decode_layers_supported(h, spec["layers"], kv, spec["n_heads"],
                                                   spec["n_kv_heads"], spec["group_size"],
                                                   spec["bits"], name=name)):
        return None
    run = kernels.decode_layers if name == "decode_layers" else kernels.decode_rows
    spec["layers"] = _stacked(layers, spec["layers"])
    y, ys, p, kv = run(h, cache[0].offset, caches=kv, **spec)
    for c, (k, v) in zip(cache, kv):
        c.keys, c.values = k, v
    return deferred_output(layers[-1].mlp, y, ys), p
