"""FlashNorm (Graef, Wasielewski, Clapp: arXiv 2407.09577) as load-time transformations.

The model files stay plain reference code. Each transformation here takes a (norm, consumer) pair
of a loaded model and replaces it: the norm becomes a DeferredNorm (the residual add and 1/RSS,
handed on as a Deferred value, not applied) and the consumer a flash module that computes the
same function with the 1/RMS scale deferred past the matmul and the norm gain sqrt(n) g either
folded into its linear weights (fold=True: weightless, for full precision) or multiplied onto its
input, the weights untouched (fold=False: for quantized weights, which then equal those of the
reference exactly). One class or function per paper section:

    fold_weight, weightless            Sec. 1, Fig. 1(b): weightless normalization
    DeferredLinear, rss_scale          Sec. 1, Fig. 1(c) + Appendix A/B: deferred 1/RMSe
    DeferredNorm, Deferred             what is left of a pre-norm in a model, and its output
    FlashReLUFFN, FlashGLU             Sec. 2.1 / 2.2 (ReGLU, bilinear GLU): toy FFNs
    FlashSwiGLU, FlashFusedSwiGLU      Sec. 2.2: SwiGLU (Llama mlp, OpenELM ffn)
    FlashGeGLU                         Sec. 2.2 with tanh GELU (Gemma mlp)
    FlashAttention                     Sec. 3: 1/RMS and 1/sqrt(h) fused into RoPE's cos/sin
    FlashQKNormAttention               Sec. 4: QK-norm (OpenELM, Qwen 3, Gemma 3), norm weights
                                       fused into cos/sin
    decode_stack                       Sec. 5 for a whole decode step: every block in one kernel
    FlashHead, TiedFlashHead           final norm + LM head (untied: folded or input gain; tied:
                                       kept scale vector)
    FlashLayerNormLinear, DyTLinear    Sec. 1.1: LayerNorm / DyT bias moved into the next linear
    merge_mean_centering               Sec. 1.2: mean centering merged into a preceding linear

Files: norm.py (the deferred scale and what carries it), ffn.py, attention.py, head.py (the forms
the models use), stack.py (the whole decode step's kernel), paper.py (the forms no model uses).
This file: the whole-model passes.

apply(model, fold=...) rewrites a whole model following the Mapping its model file states
(models/*.py: FLASHNORM, a Pair per pre-norm); remove_norms(model) drops every norm
(a speed ceiling, not the same function). Weights are folded in float32 and cast back to the model
dtype. Why not always fold: quantizing W*g loses far more than quantizing W where g varies inside a
quantization group (bench/RESULTS.md, "Perplexity"), so a quantized model keeps g on the
activations. Every linear keeps its path (model.layers.0.self_attn.q_proj stays that), so
per-module quantization settings carry over, and DeferredLinear quantizes to QuantizedDeferredLinear
(a QuantizedLinear becomes one as it is, with apply(fold=False)).
"""
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from .. import forms
from ..concat import held
from ..errors import UserError
from ..nn import RMSNorm
from ..rope import apply_rope, permute_gain, rope_frequencies, rope_tables, rotate  # noqa: F401
from .attention import FlashAttention, FlashQKNormAttention
from .ffn import FlashFusedSwiGLU, FlashGeGLU, FlashSwiGLU
from .head import FlashHead, TiedFlashHead
from .norm import (Deferred, DeferredLinear, DeferredNorm, NoNorm, Pending,
                   QuantizedDeferredLinear, deferred, fold_weight, norm_gain, norm_weight,
                   rss_scale, weightless)
from .stack import decode_stack, kv_buffers, stack_weights, unstack
from .paper import (DyTLinear, FlashDyT, FlashGLU, FlashLayerNormLinear, FlashReLUFFN,
                    merge_mean_centering)

__all__ = ["apply", "remove_norms", "decode_stack", "kv_buffers", "stack_weights", "unstack",
           "make_weightless", "folded_norms", "mapping", "Mapping", "Pair", "NoNorm", "HEADS",
           "DEFAULT_HEAD",
           "FlashAttention", "FlashQKNormAttention", "FlashSwiGLU", "FlashGeGLU",
           "FlashFusedSwiGLU", "FlashHead", "TiedFlashHead", "Deferred", "DeferredLinear",
           "DeferredNorm", "Pending", "QuantizedDeferredLinear", "deferred", "fold_weight",
           "norm_gain", "norm_weight", "rss_scale", "weightless", "DyTLinear", "FlashDyT",
           "FlashGLU", "FlashLayerNormLinear", "FlashReLUFFN", "merge_mean_centering", "apply_rope",
           "permute_gain", "rope_frequencies", "rope_tables", "rotate"]

HEADS = ("scale", "untie")
DEFAULT_HEAD = "scale"



class Pair(NamedTuple):
    """A pre-norm of a block and what it feeds, as a model file states it: the norm's attribute on
    the block, its consumer's, the flash module replacing the consumer, the consumer's linears
    that take the norm weights in a weightless export (make_weightless), and whether the flash
    module may hand its last deferred scale on to the next DeferredNorm (its output goes straight
    to a residual add) or must apply it (its output feeds a norm first: Gemma's post-norms)."""
    norm: str
    consumer: str
    flash: type
    linears: tuple
    defer_output: bool = True


class Mapping(NamedTuple):
    """How FlashNorm maps onto one architecture; each model file states its own as FLASHNORM
    (models/*.py). pairs: the block's (pre-norm, consumer) Pairs; trunk: the attribute of the
    Model holding the final `norm` (which goes into the LM head); tie_key: the config key saying
    the embedding is tied (set false when an export unties it); kept: the block's norms FlashNorm
    leaves as they are, with why (verify and the README name them)."""
    pairs: tuple
    trunk: str
    tie_key: str
    kept: tuple = ()


def mapping(model):
    """The Mapping the model's architecture file states (its class attribute FLASHNORM)."""
    spec = getattr(type(model), "FLASHNORM", None)
    if spec is None:
        raise UserError(f"FlashNorm has no mapping for model type '{model.args.model_type}' "
                        "(its model file states no FLASHNORM)")
    return spec


def folded_norms(model):
    """(parameter path, norm) of every norm whose weights FlashNorm folds away: each block's
    pre-norms of the Mapping's pairs and the final norm (not QK-norms, not the kept norms). A
    weightless checkpoint (make_weightless) stores these with effective gain 1."""
    spec = mapping(model)
    paths = {id(m): p for p, m in model.named_modules()}
    norms = [getattr(layer, pair.norm) for layer in model.layers for pair in spec.pairs]
    norms.append(getattr(model, spec.trunk).norm)
    return [(f"{paths[id(n)]}.weight", n) for n in norms]


def _check_full_precision(model):
    if any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
           for _, m in model.named_modules()):
        raise UserError("folding norm weights needs full-precision weights: dequantize the model "
                        "first (loader.dequantize), or keep the norm gain on the activations "
                        "(flashnorm.apply(model, fold=False))")


def apply(model, head=DEFAULT_HEAD, fold=True, deferred=None):
    """Rewrite a loaded model (in place), as its model file's FLASHNORM Mapping says, to compute
    the same function with FlashNorm; returns it. Every pre-norm becomes a DeferredNorm (residual
    add, 1/RSSe and any kept gain in one pass) and its consumer a flash module reading that
    Deferred value; the final norm's weights go into the LM head (or stay as its DeferredNorm's
    gain).

    fold=True (full precision only): each norm's sqrt(n) g is folded into the weights of the
    linears it feeds. fold=False: no linear weight is touched (a QuantizedLinear becomes a
    QuantizedDeferredLinear holding the same arrays, nothing is dequantized) and the gain
    multiplies each flash module's input once; quantizing afterwards gives exactly the quantized
    weights of the reference model. Use it for quantized models (bench/RESULTS.md, "Perplexity").

    head: how a tied embedding takes the final norm. "scale" (default) keeps the embedding shared
    and the norm weights as one scale vector (TiedFlashHead): no extra memory. "untie" folds them
    into an untied vocab x dim copy (FlashHead): more memory and no faster (bench/RESULTS.md,
    "Final norm and tied head"), since decode is bound by reading weights. An untied model always
    folds into its own lm_head. "untie" exists to fold, so it needs fold=True.

    deferred: False gives Sec. 1's weightless form alone (Fig. 1(b)): with fold, every norm's
    weights folded into the linears it feeds (the final norm's into an untied lm_head), the norms
    kept without effective weights; without fold the model is left as it is. None (default): False
    where forms.flash_form() is "weightless" (the portable path: a deferred scale would only add
    element-wise launches beside mx.fast.rms_norm there), else True."""
    if head not in HEADS:
        raise UserError(f"head must be one of {', '.join(HEADS)}, not '{head}'")
    if head == "untie" and not fold:
        raise UserError("head 'untie' folds the final norm into a head copy: it needs fold=True")
    spec = mapping(model)
    if fold:
        _check_full_precision(model)
    if deferred is None:
        deferred = forms.flash_form() != "weightless"
    if not deferred:
        if fold:
            _fold_blocks(model, spec)
            if "lm_head" in model:
                weightless(getattr(model, spec.trunk).norm, [model.lm_head])
        mx.eval(model.parameters())
        return model
    for layer in model.layers:
        for pair in spec.pairs:
            module = pair.flash(getattr(layer, pair.norm), getattr(layer, pair.consumer), fold)
            # an FFN's last scale into the next residual add
            module.defer_output = pair.defer_output
            setattr(layer, pair.consumer, module)
            norm = DeferredNorm(module.eps, module.pop("gain", None))
            norm.fuse = not spec.kept  # a kept norm (Gemma's post-norms) reads the residual itself
            setattr(layer, pair.norm, norm)
    trunk = getattr(model, spec.trunk)
    norm = trunk.norm
    if "lm_head" in model:
        model.lm_head = FlashHead(norm, model.lm_head, fold)
    elif head == "untie":
        w = model.embed_tokens.weight
        untied = nn.Linear(w.shape[1], w.shape[0], bias=False)
        untied.weight = w
        model.lm_head = FlashHead(norm, untied)
    else:
        model.lm_head = TiedFlashHead(norm, model)
    gain = model.lm_head.pop("scale", None) if isinstance(model.lm_head, TiedFlashHead) \
        else model.lm_head.pop("gain", None)
    trunk.norm = DeferredNorm(norm.eps, gain)
    mx.eval(model.parameters())
    return model


def remove_norms(model):
    """Replace every RMSNorm (pre-norms, final norm, QK-norms) by an identity, in place. Not the
    same function: the speed ceiling of any norm optimization, as in the paper's table. No linear
    weight is touched, so a quantized model stays as it is."""
    mapping(model)
    norms = [(path, NoNorm()) for path, m in model.named_modules()
             if isinstance(m, (RMSNorm, nn.RMSNorm))]
    model.update_modules(tree_unflatten(norms))
    return model


def _fold_blocks(model, spec):
    """weightless() on every Pair of every block: the pre-norms' weights into their linears."""
    for layer in model.layers:
        for pair in spec.pairs:
            consumer = getattr(layer, pair.consumer)
            weightless(getattr(layer, pair.norm),
                       [consumer[name] for name in held(consumer, pair.linears)])


def make_weightless(model):
    """Sec. 1, Fig. 1(b) on a whole model, in place, keeping its reference structure (for export):
    every pre-norm's weights folded into the linears it feeds and set to 1; the final norm folded
    into the LM head, untying a tied embedding (a head copy is written). QK-norm weights are not
    foldable into a linear (a per-head RMS sits between) and are kept. Returns the model; its
    config says the head is untied and "flash_norm": true (the mark others' loaders read, and
    loader.build_model checks). Quantizing this form afterwards quantizes W*g, which costs
    quality at low bits (bench/RESULTS.md, "Perplexity"); a stock loader has no place for the gain
    on the activations, so an export has no other choice."""
    spec = mapping(model)
    _check_full_precision(model)
    _fold_blocks(model, spec)
    trunk = getattr(model, spec.trunk)
    if "lm_head" not in model:
        w = model.embed_tokens.weight
        model.lm_head = nn.Linear(w.shape[1], w.shape[0], bias=False)
        model.lm_head.weight = w
        setattr(model.args, spec.tie_key, False)
        model.config = dict(model.config, **{spec.tie_key: False})
    weightless(trunk.norm, [model.lm_head])
    if hasattr(model, "config"):
        model.config = dict(model.config, flash_norm=True)
    mx.eval(model.parameters())
    return model
