"""Sec. 5 for a whole decode step: every block of a Llama-family, OpenELM or Gemma 3 stack (4/8-bit
or full-precision weights, SwiGLU; Qwen 2's q/k/v biases; OpenELM's heads and FFN width per layer;
Gemma's post-norms, GeGLU, sliding windows and RoPE angles per layer) in one kernel launch,
kernels.decode_layers (one row) or kernels.decode_rows (a batch), where it runs; the model's own
loop over its blocks everywhere else. Each norm mode on the same kernels, which differ only in the
normalization: flash (FlashAttention or the QK-norm's FlashQKNormAttention, FlashSwiGLU,
FlashGeGLU or OpenELM's FlashFusedSwiGLU, DeferredNorm pre-norms; Gemma's post-norms its own), rms
(the model's own RMSNorms and QK-norm, the attention and MLP with concat.py's concatenated q/k/v
and gate/up, or OpenELM's own qkv_proj and proj_1), none (remove_norms' NoNorms)."""
import mlx.core as mx
import mlx.nn as nn

from .. import kernels
from ..cache import StaticKVCache
from ..errors import UserError
from ..nn import PlainRMSNorm, RMSNorm
from ..rope import rope_frequencies
from .attention import FlashAttention, FlashQKNormAttention
from .ffn import FlashFusedSwiGLU, FlashGeGLU, FlashSwiGLU
from .norm import (DeferredLinear, DeferredNorm, NoNorm, QuantizedDeferredLinear, deferred_output,
                   norm_weight)

# The blocks the whole-step kernels compute, by the names of their modules: the two pre-norms, the
# attention and its q/k/v and output linears, the FFN and its gate/up and down linears, and where
# a block has them its post-norms (_post). A block is one of them where its children are exactly
# these.
LLAMA = (("input_layernorm", "post_attention_layernorm"), "self_attn", ("qkv_proj", "o_proj"),
         "mlp", ("gate_up_proj", "down_proj"))
OPENELM = (("attn_norm", "ffn_norm"), "attn", ("qkv_proj", "out_proj"), "ffn", ("proj_1", "proj_2"))
# Gemma 3's: the post-attention and post-feedforward norms on o_proj's and down_proj's outputs
# (kernels.decode_layers' post-norms), its FFN GeGLU (tanh GELU)
GEMMA = (("input_layernorm", "pre_feedforward_layernorm"), "self_attn", ("qkv_proj", "o_proj"),
         "mlp", ("gate_up_proj", "down_proj"),
         ("post_attention_layernorm", "post_feedforward_layernorm"))
BLOCKS = (LLAMA, OPENELM, GEMMA)


def _post(names):
    """A BLOCKS entry's post-norms (Gemma's), or ()."""
    return names[5] if len(names) > 5 else ()


def _gemma_norm(m):
    """Whether m is Gemma 3's RMSNorm (models/gemma3.py: gain offset + weight, computed in float32
    and rounded once), known by its offset."""
    return isinstance(m, RMSNorm) and getattr(m, "offset", None) is not None


def block(layer):
    """The entry of BLOCKS naming layer's children and their four linears (q/k/v and gate/up
    concatenated: a model loaded without concat.py's pass has none), or None."""
    keys = set(layer.keys())
    return next((b for b in BLOCKS if keys == {*b[0], b[1], b[3], *_post(b)}
                 and all(n in layer[b[1]] for n in b[2]) and all(n in layer[b[3]] for n in b[4])),
                None)


def _form(linear, classes):
    """(bits, group_size) of a linear of exactly one of classes (a sharded one, summing over ranks,
    is another class) that the kernels read: affine quantized, or full precision (the bits of its
    weights' dtype, no groups), holding no array the kernels would not apply (a kept gain); None
    for any other."""
    if type(linear) not in classes or not set(linear) <= {"weight", "scales", "biases", "bias"}:
        return None
    if "scales" not in linear:
        return 8 * linear.weight.dtype.size, None
    quantized = linear.mode == "affine" and "biases" in linear
    return (linear.bits, linear.group_size) if quantized else None


def _arrays(linear):
    """A linear's matrix as the kernels take it: (weight, scales, biases), the last two None at
    full precision."""
    return linear["weight"], linear.get("scales"), linear.get("biases")


# each kind of the kernels' stacked arrays (kernels.layer_arrays' order): its linear among
# _linears' and the linear's array
KINDS = [(i, a) for i in range(4) for a in ("weight", "scales", "biases")] + [(0, "bias")]


def _linears(layer, names=LLAMA):
    """A block's four matrices, in the kernels' order."""
    attn, ffn = layer[names[1]], layer[names[3]]
    return attn[names[2][0]], attn[names[2][1]], ffn[names[4][0]], ffn[names[4][1]]


def mode(layer, names=LLAMA):
    """The norm mode of a block, by its pre-norms' class: "flash" (DeferredNorm), "rms" (the
    model's RMSNorm, or Gemma's), "none" (NoNorm); None for any other."""
    kinds = {type(layer[n]) for n in names[0]}
    if len(kinds) != 1:
        return None
    if _gemma_norm(layer[names[0][0]]):
        return "rms"
    return {DeferredNorm: "flash", RMSNorm: "rms", PlainRMSNorm: "rms",
            NoNorm: "none"}.get(kinds.pop())


class _Stacks:
    """stack_weights' arrays (a plain attribute of the first block, not a child: no parameters)."""

    def __init__(self, arrays, rows):
        self.arrays, self.rows = arrays, rows


def stack_weights(model):
    """Make each kind of the blocks' arrays (qkv weight, scales, biases; o_proj's; gate_up's;
    down_proj's; qkv's bias: KINDS) one array over the layers (kernels.stacked), each block's array
    a view of it (kernels.layer_views: no copy is kept), where decode_layers takes these blocks: a
    launch then takes one input a kind, not one a kind and layer (its host work grows with its
    inputs). The same values: every other path reads the views as it read the arrays. Blocks the
    kernels' layer table does not hold (kernels.table_fits) are left as they are: stacking would
    only cost a kind's copy of memory at load."""
    layers = getattr(model, "layers", None)
    spec = _spec(layers) if layers and isinstance(layers[0], nn.Module) else None
    if spec is None or not kernels.table_fits(spec["layers"]):
        return model
    names = block(layers[0])
    arrays, rows = kernels.stacked(spec["layers"]), []
    # one kind at a time: its old arrays go before the next is stacked
    kinds = zip(*map(kernels.layer_arrays, spec["layers"]))
    for (i, name), stack, kind in zip(KINDS, arrays, kinds):
        if kind[0] is None:  # a kind these blocks have not
            rows.append(kind)
            continue
        views = kernels.layer_views(stack, kind)
        mx.eval(stack, views)
        for layer, view in zip(layers, views):
            _linears(layer, names)[i][name] = view
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
    """The arguments decode_layers takes for these blocks (with `norm`, their mode), or None where
    a block is not of the forms it computes (any other module, a bias but q/k/v's on every block, a
    sharded linear, mixed quantization or precision, mixed modes)."""
    names = block(layers[0])
    norm = names and mode(layers[0], names)
    if norm is None or any(block(layer) != names or mode(layer, names) != norm for layer in layers):
        return None
    spec = (_flash_spec if norm == "flash" else _plain_spec)(layers, names)
    if spec is None:
        return None
    linears, classes = [_linears(layer, names) for layer in layers], spec.pop("classes")
    form = _form(linears[0][0], classes[0])
    biased = "bias" in linears[0][0]  # Qwen 2's q/k/v, on every block; no other linear's
    if (form is None or any(_form(m, c) != form for ms in linears for m, c in zip(ms, classes))
            or any(("bias" in ms[0]) != biased or any("bias" in m for m in ms[1:])
                   for ms in linears)):
        return None
    mats = [tuple(_arrays(m) for m in ms) + ((ms[0].bias,) if biased else ()) for ms in linears]
    # made once per trace of the compiled step (not from traced inputs: a constant of its graph)
    mx.eval([a for a in (spec["gains"], spec["qk_gains"], spec["theta"]) if a is not None])
    return dict(spec, layers=mats, group_size=form[1], bits=form[0], norm=norm)


def _stacked_or_none(arrays):
    return mx.stack(arrays) if arrays else None


def _per_layer(thetas):
    """RoPE's angles as the kernels take them: one table where every layer's is the same, else a
    row a layer (Gemma's sliding-window layers have their own base); None where their sizes
    differ."""
    if any(t.shape != thetas[0].shape for t in thetas):
        return None
    same = all(mx.array_equal(t, thetas[0]).item() for t in thetas)
    return thetas[0] if same else mx.stack(thetas)


def _flash_spec(layers, names):
    """_spec's settings for FlashNorm's blocks (DeferredNorm pre-norms fused into their
    consumers, FlashAttention or FlashQKNormAttention, a late-scaled FlashSwiGLU or FlashGeGLU;
    Gemma's: DeferredNorms apply() leaves unfused beside kept norms, keeping their gains (the
    post-norms' go in the same array; gains of 1 where apply() folded them into full-precision
    weights), the model's post-norms, an FFN applying its own scale before the post-norm)."""
    attn, ffn = layers[0][names[1]], layers[0][names[3]]
    if not isinstance(attn, (FlashAttention, FlashQKNormAttention)) or names[2][0] not in attn:
        return None
    qk_norm = isinstance(attn, FlashQKNormAttention)
    if qk_norm and ("q_gain" not in attn or attn.out_name != names[2][1]):
        return None
    eps, post = layers[0][names[0][0]].eps, _post(names)
    K = _linears(layers[0], names)[1]["weight"].shape[0]  # the output projection's rows
    deferred = (QuantizedDeferredLinear, DeferredLinear)
    gains, qk_gains = [], []
    for layer in layers:
        a, f = layer[names[1]], layer[names[3]]
        norms = [layer[n] for n in names[0]]
        late = type(f) in (FlashSwiGLU, FlashGeGLU) and f.late or type(f) is FlashFusedSwiGLU
        posts = [layer[n] for n in post]  # the model's own
        if (type(a) is not type(attn) or not late or type(f) is not type(ffn)
                or names[4][0] not in f
                or any(not _gemma_norm(m) or not _rms(m, K) or m.eps != eps for m in posts)
                or any(not (m.fuse or post) or m.eps != eps for m in norms)
                or post and getattr(f, "defer_output", False)
                or a.traditional or a.factor != attn.factor
                or a.head_dim != attn.head_dim
                or any(("gain" in m) != ("gain" in norms[0]) for m in norms)):
            return None
        if "gain" in norms[0] or post:  # post: gains of 1 where apply() folded them (full
            # precision), as the post-norms' ride in the same array
            gains.append(mx.stack([m.gain.astype(mx.float32) if "gain" in m
                                   else mx.ones((K,), mx.float32) for m in norms]
                                  + [norm_weight(m) for m in posts]))
        if qk_norm:
            qk_gains.append(mx.stack([a.q_gain, a.k_gain]).astype(mx.float32))
    theta = _per_layer([layer[names[1]]._theta for layer in layers])
    if theta is None:
        return None
    return dict(gains=_stacked_or_none(gains), qk_gains=_stacked_or_none(qk_gains),
                theta=theta, eps=eps, factor=attn.factor, gelu=type(ffn) is FlashGeGLU,
                qk_eps=attn.qk_eps if qk_norm else 0.0, **_heads(layers, names),
                classes=[deferred, (nn.QuantizedLinear, kernels.QuantizedLinear, nn.Linear),
                         deferred, deferred])


def _rms(m, n):
    """Whether m is the model's RMSNorm over n values with weights and an epsilon."""
    return ("weight" in m and "bias" not in m and m.eps is not None and m._last == n
            and m.weight.shape == (n,))


def _theta(attn):
    """The angle per position of each RoPE pair of the model's own attention (as FlashNorm's
    attention takes it), or None for a RoPE the kernels do not compute (interleaved, or another
    kind)."""
    rope = attn.get("rope")
    if rope is None or getattr(rope, "traditional", True):
        return None
    try:
        scale, theta = rope_frequencies(rope)
    except UserError:
        return None
    return scale * theta


HEADS = ("n_heads", "n_kv_heads", "head_dim", "scale")  # what the model's attention states


def _plain_spec(layers, names):
    """_spec's settings for the model's own blocks in norm mode rms (RMSNorm pre-norms, QK-norm
    where the model has it; Gemma's: its own norms, post-norms too) or none (every norm a NoNorm):
    the attention of concat.py's qkv_proj with the softmax scale in sdpa, the SwiGLU (Gemma:
    GeGLU) FFN of one gate_up linear."""
    attn = layers[0][names[1]]
    if any(getattr(attn, n, None) is None for n in HEADS):
        return None
    rms = mode(layers[0], names) == "rms"
    K = _linears(layers[0], names)[1]["weight"].shape[0]  # the output projection's rows
    qk_norm = rms and "q_norm" in attn
    eps = layers[0][names[0][0]].eps if rms else 0.0
    qk_eps = attn.q_norm.eps if qk_norm else 0.0
    parts = {*names[2], "rope", "q_norm", "k_norm"}
    # the model's norms: Gemma's (post-norms) or RMSNorms; none: NoNorms
    kind = (_gemma_norm if _post(names) else lambda m: type(m) in (RMSNorm, PlainRMSNorm)) \
        if rms else (lambda m: type(m) is NoNorm)
    gains, qk_gains, thetas = [], [], []
    for layer in layers:
        a, f = layer[names[1]], layer[names[3]]
        norms = [layer[n] for n in names[0]]
        qk = [a[n] for n in ("q_norm", "k_norm") if n in a]
        posts = [layer[n] for n in _post(names)]
        thetas.append(_theta(a))
        if (not set(a.keys()) <= parts or not all(n in a for n in names[2])
                or set(f.keys()) != set(names[4]) or ("q_norm" in a) != ("q_norm" in attn)
                or any(getattr(a, n, None) is None for n in HEADS)
                or (a.head_dim, a.scale) != (attn.head_dim, attn.scale)
                or type(a.rope) is not type(attn.rope) or thetas[-1] is None
                or not all(kind(m) for m in norms + qk + posts)):
            return None
        if rms and (any(not _rms(m, K) or m.eps != eps for m in norms + posts)
                    or any(not _rms(m, a.head_dim) or m.eps != qk_eps for m in qk)):
            return None
        if rms:
            gains.append(mx.stack([norm_weight(m) for m in norms + posts]))
        if qk_norm:
            qk_gains.append(mx.stack([mx.stack([norm_weight(m)] * 2) for m in qk]))
    theta = _per_layer(thetas)
    if theta is None:
        return None
    linear = (nn.QuantizedLinear, kernels.QuantizedLinear, nn.Linear)
    return dict(gains=_stacked_or_none(gains), qk_gains=_stacked_or_none(qk_gains), theta=theta,
                eps=eps, factor=attn.scale, qk_eps=qk_eps, gelu=names is GEMMA,
                **_heads(layers, names), classes=[linear] * 4)


def _heads(layers, names):
    """n_heads and n_kv_heads as the kernels take them: one int where every layer has the same,
    else one a layer (OpenELM's layer-wise scaling; their ratio is checked by the kernels)."""
    out = {}
    for n in ("n_heads", "n_kv_heads"):
        v = [getattr(layer[names[1]], n) for layer in layers]
        out[n] = v[0] if len(set(v)) == 1 else v
    return out


def _stacked(layers, mats):
    """mats (_spec's layers) with their stacks: stack_weights' where it stacked these blocks (and
    no array was replaced since), else stacked copies (evaluated here: constants of a compiled
    step)."""
    kept = getattr(layers[0], "_stacks", None)
    if kept is None or any(kernels.layer_arrays(mats[l])[k] is not a
                           for k, rows in enumerate(kept.rows) for l, a in enumerate(rows)):
        kept = _Stacks(kernels.stacked(mats), None)
        mx.eval(kept.arrays)
    return kernels.Layers(mats, kept.arrays)


def kv_buffers(layers, capacity):
    """Zeroed (k, v) buffers of `capacity` positions for each layer of a stack the kernels take,
    in the activations' dtype (its scales', or its full-precision weights'), as prefill_rows
    writes a first prompt into them; None for other stacks. A compiled prefill takes them as
    inputs (decoding.prefill): made inside a traced function, equal buffers may be merged into one
    (mx.compile merges equal operations), and the kernel, which writes the caches in place, would
    then write every layer's k and v into one."""
    spec = _spec(layers) if layers and isinstance(layers[0], nn.Module) else None
    if spec is None:
        return None
    w, scales = spec["layers"][0][0][:2]
    return _buffers(spec, capacity, w.dtype if scales is None else scales.dtype)


def _buffers(spec, capacity, dtype):
    D = spec["theta"].shape[-1] * 2
    per = kernels.layer_sizes(spec["layers"], spec["n_heads"], spec["n_kv_heads"])
    return [tuple(mx.zeros((1, hkv, capacity, D), dtype) for _ in range(2)) for _, hkv, _ in per]


def decode_stack(layers, h, cache, windows=None):
    """The input of the final norm, (x, residual), after every block for the decode rows h
    (embeddings, (B, 1, K)) through one kernel, with the caches' new k and v written (flash: x a
    Deferred, the last FFN's scale left to the final DeferredNorm; rms, none: the last FFN's
    output, which the model's own final norm adds to the residual; Gemma's: the last block's
    post-feedforward norm of it): B = 1 over StaticKVCaches, kernels.decode_layers; B rows over a
    batch's caches (serve.slots.RowsKVCache), kernels.decode_rows; a prompt's tokens (h: (1, n,
    K), 1 < n <= kernels.MAX_ROWS) over StaticKVCaches, kernels.prefill_rows (buffers of the
    caches' capacity made here where they have none yet, their offsets advanced by n). Both kinds
    of cache say so with `static_rows` (buffers of every position, an array offset per row, or an
    int while a StaticKVCache is prefilled: a sliding-window layer's too, its window a lower bound
    on the positions it reads). windows: per layer its sliding window or None (Gemma 3's: the
    model's masks). None where the kernel does not take these blocks (then the model runs its
    loop): an eager decode step, the CPU, the portable path, another architecture,
    sliding-window blocks (is_sliding) without their windows."""
    prefill = (h.ndim == 3 and h.shape[0] == 1 and 1 < h.shape[1] <= kernels.MAX_ROWS
               and bool(cache) and isinstance(cache[0], StaticKVCache))
    if (not layers or not cache or h.ndim != 3 or h.shape[1] != 1 and not prefill
            or not getattr(cache[0], "static_rows", False)
            or isinstance(cache[0].offset, int) and not prefill
            or windows is None and any(getattr(layer, "is_sliding", False) for layer in layers)):
        return None
    name = "prefill_rows" if prefill else "decode_layers" if h.shape[0] == 1 else "decode_rows"
    if name != "decode_layers" and kernels.use_decode_layers(name):
        kernels.self_check([name])  # checked on first use (kernels.check.LAZY)
    if not kernels.use_decode_layers(name):
        return None
    spec = _spec(layers)
    if spec is None:
        return None
    D, n = spec["theta"].shape[-1] * 2, h.shape[1]
    if prefill and any(c.keys is None for c in cache):  # a first prefill, eager: buffers here
        for c, kv in zip(cache, _buffers(spec, cache[0].capacity, h.dtype)):
            c.keys, c.values = kv
    kv = [(c.keys, c.values) for c in cache]
    x = h.reshape(n, 1, -1) if prefill else h
    if (D != kv[0][0].shape[-1]
            or not kernels.decode_layers_supported(x, spec["layers"], kv, spec["n_heads"],
                                                   spec["n_kv_heads"], spec["group_size"],
                                                   spec["bits"], name=name)):
        return None
    run = {"decode_layers": kernels.decode_layers, "decode_rows": kernels.decode_rows,
           "prefill_rows": kernels.prefill_rows}[name]
    spec["layers"] = _stacked(layers, spec["layers"])
    y, ys, p, kv = run(x, cache[0].offset, caches=kv, windows=windows, **spec)
    for c, (k, v) in zip(cache, kv):
        c.keys, c.values = k, v
        if prefill:
            c.offset = c.offset + n
    if prefill:  # the tokens back as one sequence's
        y, ys, p = (a.reshape(1, n, -1) for a in (y, ys, p))
    names = block(layers[-1])
    if spec["norm"] == "flash":  # rms, none: ys is 1
        y = deferred_output(layers[-1][names[3]], y, ys)
    if _post(names):  # the last post-feedforward norm (the others ran in the kernel)
        y = layers[-1][_post(names)[1]](y)
    return y, p
