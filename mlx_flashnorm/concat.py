"""Concatenated projections: the linears of a block that read the same input merged into one, at
load time (loader.prepare, after FlashNorm and quantization), so that a step runs one matmul where
it ran three or two: q_proj, k_proj, v_proj -> qkv_proj; gate_proj, up_proj -> gate_up_proj.
Llama's decode step goes from 7 to 4 matmuls per layer; on a GPU each operation costs host time.

The parts' arrays are stacked along the output axis: weight, bias, and for a quantized linear its
scales and biases (quantization groups run along the input axis, so this is exact). A group whose
linears differ in class, quantization, dtype or bias stays separate. The model files keep the
architecture as published and read their projections through project() (or heads(): q, k, v split
into attention heads), which splits the one output where the module holds the concatenated linear.
Where the split falls is not stored: q | k | v at the module's head counts (n_heads, n_kv_heads,
head_dim), gate | up in halves. An export writes the checkpoint's layout, so the savers load with
concat=False."""
import copy

import mlx.core as mx

QKV, GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
GROUPS = {QKV: "qkv_proj", GATE_UP: "gate_up_proj"}  # the parts -> their concatenated linear
PER_OUTPUT = {"weight", "bias", "scales", "biases"}  # arrays with one row per output


def held(module, parts):
    """The names of module's linears for parts: the concatenated one (also OpenELM's own qkv_proj),
    or the parts themselves."""
    merged = GROUPS.get(parts)
    return (merged,) if merged in module else parts


def project(module, x, parts, *args):
    """The outputs of module's linears `parts` (a GROUPS key) on x, each linear called as
    linear(x, *args): one matmul split in parts where the module holds the concatenated linear,
    else one matmul each."""
    merged = GROUPS[parts]
    if merged not in module:
        return [module[p](x, *args) for p in parts]
    if parts == QKV:
        q, kv = module.n_heads * module.head_dim, module.n_kv_heads * module.head_dim
        cuts = [q, q + kv]
    else:
        cuts = 2
    return mx.split(module[merged](x, *args), cuts, axis=-1)


def heads(module, x, *args):
    """q, k, v of an attention module on x (B, L, dim), each as (B, heads, L, head_dim): its q/k/v
    linears as project() calls them, the concatenated output (concat.py's, or OpenELM's own
    qkv_proj) reshaped and transposed once and split at the head counts n_heads, n_kv_heads."""
    B, L, _ = x.shape
    if "qkv_proj" not in module:
        return [module[p](x, *args).reshape(B, L, -1, module.head_dim).transpose(0, 2, 1, 3)
                for p in QKV]
    qkv = module.qkv_proj(x, *args).reshape(B, L, -1, module.head_dim).transpose(0, 2, 1, 3)
    return mx.split(qkv, [module.n_heads, module.n_heads + module.n_kv_heads], axis=1)


def _kind(linear):
    """What the linears of a group must share: class, quantization, and the arrays they hold
    (names, dtypes, shapes but for the output axis)."""
    arrays = sorted((k, v.dtype, v.shape[1:]) for k, v in linear.items())
    return (type(linear), getattr(linear, "bits", None), getattr(linear, "group_size", None),
            getattr(linear, "mode", None), getattr(linear, "eps", None), arrays)


def merge(linears):
    """One linear whose output is the linears' outputs side by side: a copy of the first (its class
    and settings) holding their arrays concatenated along the output axis; None where they differ
    (_kind) or hold an array that is not per output (a norm gain)."""
    kind = _kind(linears[0])
    if any(_kind(m) != kind for m in linears) or not set(linears[0]) <= PER_OUTPUT:
        return None
    new = copy.copy(linears[0])
    for name in linears[0]:
        new[name] = mx.concatenate([m[name] for m in linears], axis=0)
    mx.eval(new.parameters())  # the parts' arrays are freed group by group
    return new


def concatenate(model):
    """Merge every group of GROUPS that a module of model holds into one linear, in place; returns
    the model. Reference modules and FlashNorm's alike read them through project()."""
    for _, module in model.named_modules():
        for parts, name in GROUPS.items():
            if all(p in module for p in parts):
                linear = merge([module[p] for p in parts])
                if linear is not None:
                    for p in parts:
                        del module[p]
                    module[name] = linear
    return model
