"""The paper's forms that no model here uses (reached from the tests): Sec. 2.1 / 2.2 toy FFNs
(ReLU, ReGLU, bilinear GLU), Sec. 1.1 LayerNorm and DyT biases moved into the next linear, Sec. 1.2
mean centering merged into a preceding linear."""
import math

import mlx.core as mx
import mlx.nn as nn

from .norm import DeferredLinear, deferred, fold_weight, gained, rss_scale, split_gain


class FlashReLUFFN(nn.Module):
    """Sec. 2.1: RMSNorm -> up -> ReLU -> down. ReLU(s*a) = s*ReLU(a) for s >= 0, so the whole
    1/RMS scale moves to the FFN output (before down's bias). up must be bias-free."""

    def __init__(self, norm, up, down, fold=True):
        super().__init__()
        if "bias" in up:
            raise ValueError("Sec. 2.1 needs a bias-free up projection "
                             "(ReLU(s*a + c) != s*ReLU(a + c))")
        folded, self.gain = split_gain(norm, fold)
        self.eps = norm.eps
        self.up = deferred(up, folded)
        self.down = deferred(down)

    def __call__(self, x):
        return self.down(nn.relu(self.up(gained(self, x))), rss_scale(x, self.eps))


class FlashGLU(nn.Module):
    """Sec. 2.2, ReGLU and bilinear GLU: RMSNorm -> down(act(gate) * up) with act ReLU or the
    identity (both positively homogeneous). Both branches carry s, so one 1/MS = s^2 scale is
    applied at the output. gate and up must be bias-free."""

    ACTIVATIONS = {"relu": nn.relu, "bilinear": lambda a: a}

    def __init__(self, norm, gate, up, down, activation, fold=True):
        super().__init__()
        if activation not in self.ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(self.ACTIVATIONS)} "
                             "(s*act(a) = act(s*a))")
        if "bias" in gate or "bias" in up:
            raise ValueError("Sec. 2.2 (ReGLU/bilinear) needs bias-free gate and up projections")
        folded, self.gain = split_gain(norm, fold)
        self.eps, self.activation = norm.eps, activation
        self.gate, self.up, self.down = deferred(gate, folded), deferred(up, folded), deferred(down)

    def __call__(self, x):
        s = rss_scale(x, self.eps)
        a = gained(self, x)
        return self.down(self.ACTIVATIONS[self.activation](self.gate(a)) * self.up(a), s * s)



def _move_bias(norm, linear, gain):
    """Sec. 1.1: a linear after y = n(x)*g + beta becomes W* = W*gain, c* = c + W beta."""
    out_dims, in_dims = linear.weight.shape
    new_bias = linear.bias.astype(mx.float32) if "bias" in linear else mx.zeros((out_dims,))
    if "bias" in norm:
        new_bias = new_bias + linear.weight.astype(mx.float32) @ norm.bias.astype(mx.float32)
    return fold_weight(linear.weight, gain), new_bias.astype(linear.weight.dtype)


class FlashLayerNormLinear(nn.Module):
    """Sec. 1.1: LayerNorm (weight g, bias beta) followed by a linear (W, c). beta moves to the
    linear's bias (c* = c + W beta), sqrt(n)*g is folded into W, and the 1/RSSe of the centered
    input is deferred to the output (before c*). center=False when Sec. 1.2 already merged the
    mean centering into the preceding linear (merge_mean_centering)."""

    def __init__(self, norm, linear, center=True):
        super().__init__()
        n = linear.weight.shape[1]
        gain = math.sqrt(n) * (norm.weight.astype(mx.float32) if "weight" in norm
                               else mx.ones((n,)))
        out_dims, in_dims = linear.weight.shape
        self.linear = DeferredLinear(in_dims, out_dims, bias=True)
        self.linear.weight, self.linear.bias = _move_bias(norm, linear, gain)
        self.linear.eps = norm.eps
        self.center = center

    def __call__(self, x):
        if self.center:
            x = x - mx.mean(x, axis=-1, keepdims=True)
        return self.linear(x)


def DyTLinear(dyt, linear):
    """Sec. 1.1 for DyT: y = g*tanh(alpha x) + beta then linear(W, c) becomes
    linear(W*g, c + W beta) applied to tanh(alpha x): returns (alpha, the new nn.Linear)."""
    out_dims, in_dims = linear.weight.shape
    new = nn.Linear(in_dims, out_dims, bias=True)
    new.weight, new.bias = _move_bias(dyt, linear, dyt.weight.astype(mx.float32))
    return FlashDyT(dyt.alpha, new)


class FlashDyT(nn.Module):
    """tanh(alpha x) followed by a linear carrying DyT's weight and bias (see DyTLinear)."""

    def __init__(self, alpha, linear):
        super().__init__()
        self.alpha, self.linear = alpha, linear

    def __call__(self, x):
        return self.linear(mx.tanh(self.alpha * x))


def merge_mean_centering(linear):
    """Sec. 1.2: a linear y = x V^T + c followed by mean centering over y's n features equals
    y* = x V*^T + c* with V* = V - s/n, s_i the sum of column i over the outputs (the paper's row
    sums of V in its (in, out) layout), i.e. V* = V - mean(V, axis=0), and c* = c - mean(c).
    The LayerNorm after it then needs no centering: FlashLayerNormLinear(..., center=False)."""
    out_dims, in_dims = linear.weight.shape
    w = linear.weight.astype(mx.float32)
    new = nn.Linear(in_dims, out_dims, bias="bias" in linear)
    new.weight = (w - mx.mean(w, axis=0, keepdims=True)).astype(linear.weight.dtype)
    if "bias" in linear:
        c = linear.bias.astype(mx.float32)
        new.bias = (c - mx.mean(c)).astype(linear.bias.dtype)
    return new
