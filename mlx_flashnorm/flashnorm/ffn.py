"""Sec. 2.2: the SwiGLU / GeGLU feed-forward after a FlashNorm'd pre-norm (Llama's mlp, OpenELM's
ffn, Gemma's GeGLU): the gate branch scaled by 1/RMS before its activation, the up branch's scale
deferred past the down projection; one fused kernel per decode row where it runs (Sec. 5)."""
import mlx.core as mx
import mlx.nn as nn

from .. import kernels
from ..concat import GATE_UP, held, project
from .norm import deferred, deferred_input, deferred_output, fused, split_gain


def fused_gate_up(module, x, gate_up, down):
    """Sec. 5 for a SwiGLU FFN: its output (deferred_output) from kernels.gate_up on the Pending x
    and the down projection, or None where the fused kernel does not take x (or down has a bias,
    which must come after the deferred scale)."""
    pending = fused(x, "gate_up", module, gate_up)
    if pending is None or "bias" in module[down]:
        return None
    pending.p, h, s = kernels.gate_up(*pending.args, module[gate_up])
    return deferred_output(module, module[down](h), s)


class FlashSwiGLU(nn.Module):
    """Sec. 2.2, SwiGLU after RMSNorm (Llama's mlp: gate_proj, up_proj, down_proj; or one
    concatenated gate_up_proj, concat.py: bias-free, the same computation as FlashFusedSwiGLU's).

    The norm weights are folded into gate and up (or, fold=False, multiplied onto x once for
    both); the gate branch is scaled by s = 1/RMS before SiLU (SiLU is not scale invariant); the up
    branch's scale is deferred past down_proj (all of it is linear). With gate or up biases both
    take s before their bias (down_proj is not scaled)."""

    activation = staticmethod(nn.silu)

    def __init__(self, norm, mlp, fold=True):
        super().__init__()
        folded, self.gain = split_gain(norm, fold)
        self.eps = norm.eps
        for p in held(mlp, GATE_UP):
            setattr(self, p, deferred(mlp[p], folded))
        self.down_proj = deferred(mlp.down_proj)
        # else s before the biases
        self.late = not any("bias" in mlp[p] for p in held(mlp, GATE_UP))

    def __call__(self, x):
        if (self.activation is nn.silu
                and (y := fused_gate_up(self, x, "gate_up_proj", "down_proj")) is not None):
            return y
        a, s = deferred_input(self, x)
        late = self.late
        gate, up = project(self, a, GATE_UP, None if late else s)
        h = (kernels.gated(self.activation)(gate, s, up) if late
             else (self.activation(gate) * up).astype(up.dtype))
        if late and "bias" not in self.down_proj:
            return deferred_output(self, self.down_proj(h), s)
        return self.down_proj(h, s if late else None)


class FlashGeGLU(FlashSwiGLU):
    """Sec. 2.2 with GELU (Gemma's mlp: GeGLU, tanh-approximated GELU): as FlashSwiGLU, the gate
    branch scaled by 1/RMS before the (not scale-invariant) GELU, the up branch's scale deferred."""

    activation = staticmethod(nn.gelu_approx)


class FlashFusedSwiGLU(nn.Module):
    """Sec. 2.2 for OpenELM's ffn: proj_1 = [gate; up] (one fused, bias-free matmul), proj_2.
    The gate half is scaled by 1/RMS before SiLU, the up half's scale is deferred to the output."""

    def __init__(self, norm, ffn, fold=True):
        super().__init__()
        if "bias" in ffn.proj_1 or "bias" in ffn.proj_2:
            raise ValueError("FlashFusedSwiGLU needs bias-free proj_1 and proj_2")
        folded, self.gain = split_gain(norm, fold)
        self.eps = norm.eps
        self.proj_1 = deferred(ffn.proj_1, folded)
        self.proj_2 = deferred(ffn.proj_2)

    def __call__(self, x):
        if (y := fused_gate_up(self, x, "proj_1", "proj_2")) is not None:
            return y
        a, s = deferred_input(self, x)
        gate, up = mx.split(self.proj_1(a), 2, axis=-1)
        h = kernels.gated(nn.silu)(gate, s, up)
        return deferred_output(self, self.proj_2(h), s)
