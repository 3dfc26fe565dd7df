"""The final norm and the LM head: folded into an untied head (or kept as its input gain), or kept
as a scale vector beside a tied embedding."""
import mlx.nn as nn

from .. import kernels
from .norm import Deferred, Pending, deferred, norm_gain, split_gain, times


def FlashHead(norm, linear, fold=True):
    """Final RMSNorm + an untied LM head (an nn.Linear, or nn.QuantizedLinear with fold=False) as
    one deferred linear (Fig. 1(c)): sqrt(n)*g folded into the head weight (fold) or kept as its
    input gain, logits scaled by the deferred 1/RSSe. For a tied embedding, apply(head="untie")
    passes a copy of the embedding: vocab x dim extra parameters."""
    folded, kept = split_gain(norm, fold)
    head = deferred(linear, folded, norm.eps)
    head.gain = kept  # None: no gain (folded)
    return head


class TiedFlashHead(nn.Module):
    """Final RMSNorm + tied LM head, keeping the embedding shared (the 'scale' variant): the norm
    weights stay as one scale vector, logits = E (x * sqrt(n) g) * 1/RSSe(x); no reduction sits
    between x and the matmul. The embedding is looked up on the model at call time, so it may be
    quantized (or replaced) later; it is not a parameter of this module."""

    def __init__(self, norm, model):
        super().__init__()
        self.eps = norm.eps
        self.scale = norm_gain(norm)
        self._model = lambda: model  # a plain attribute: keeps the embedding out of this subtree

    def __call__(self, x):
        if isinstance(x, Pending):
            x = x.settle()
        if isinstance(x, Deferred):
            xg, s = x.xg, x.s
        else:
            _, xg, s = kernels.add_rss(x, self.eps, g=self.scale)
        return times(self._model().embed_tokens.as_linear(xg), s)
