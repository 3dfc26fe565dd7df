"""mlx_flashnorm.nn: the normalize operator (forward, closed-form backward, fused
residual scheme), the fused add+norm kernel against the fallback, and the modules.

Everything but the kernel test runs on the CPU in float32 (float64 for finite
differences); the kernel test runs over every backend present: the fallback alone on a
machine without a GPU, and also the Metal or CUDA kernel where there is one.
"""
import itertools
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_flashnorm import forms
from mlx_flashnorm import nn as fnn
from mlx_flashnorm.nn import DyT, LayerNorm, RMSNorm, normalize

D = 24


@pytest.fixture(autouse=True)
def on_cpu():
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(device)


def rel_err(a, b):
    """Relative error in the Frobenius norm: |a - b| / |b|."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def elementary(x, residual, weight, bias, c, center, eps):
    """The seed's forward, step by step, in numpy float64."""
    x = np.asarray(x, dtype=np.float64)
    p = x if residual is None else x + np.asarray(residual, dtype=np.float64)
    d = p.shape[-1]
    q = p - p.mean(-1, keepdims=True) if center else p
    sigma = np.sqrt((q * q).sum(-1, keepdims=True) / d + eps)
    c = math.sqrt(d) if c is None else c
    o = c / math.sqrt(d) * (q / sigma)
    if weight is not None:
        o = o * np.asarray(weight, dtype=np.float64)
    if bias is not None:
        o = o + np.asarray(bias, dtype=np.float64)
    return o, p


def make(shape=(3, 5, D), dtype=mx.float32, seed=0):
    keys = mx.random.split(mx.random.key(seed), 4)
    x = mx.random.normal(shape, key=keys[0]).astype(dtype) + 0.5  # a mean to remove
    res = mx.random.normal(shape, key=keys[1]).astype(dtype)
    w = (1 + 0.3 * mx.random.normal(shape[-1:], key=keys[2])).astype(dtype)
    b = (0.3 * mx.random.normal(shape[-1:], key=keys[3])).astype(dtype)
    return x, res, w, b


CASES = list(itertools.product([False, True], repeat=4))  # center, residual, weight, bias
CASE_IDS = ["c{}r{}w{}b{}".format(*map(int, case)) for case in CASES]


def pick(arrays, use_res, use_w, use_b):
    x, res, w, b = arrays
    return x, res if use_res else None, w if use_w else None, b if use_b else None


# ---------------------------------------------------------------------------- forward

@pytest.mark.parametrize("c", [None, 1.0, 3.0])
@pytest.mark.parametrize("center,use_res,use_w,use_b", CASES, ids=CASE_IDS)
def test_forward_matches_composition(center, use_res, use_w, use_b, c):
    x, res, w, b = pick(make(), use_res, use_w, use_b)
    o, p = normalize(x, res, w, b, c=c, center=center, eps=1e-5, backend="fallback")
    o_ref, p_ref = elementary(x, res, w, b, c, center, 1e-5)
    assert o.shape == x.shape and o.dtype == mx.float32
    assert rel_err(o, o_ref) < 1e-6
    assert rel_err(p, p_ref) < 1e-6
    # the same path as the one chosen automatically on the CPU
    o_auto, _ = normalize(x, res, w, b, c=c, center=center, eps=1e-5)
    assert mx.array_equal(o_auto, o)


def test_default_c_is_fast_rms_norm_and_layer_norm():
    x, _, w, b = make()
    o, p = normalize(x, weight=w, eps=1e-5)
    assert rel_err(o, mx.fast.rms_norm(x, w, 1e-5)) < 1e-6
    assert p is x
    o, _ = normalize(x, weight=w, bias=b, center=True, eps=1e-5)
    assert rel_err(o, mx.fast.layer_norm(x, w, b, 1e-5)) < 1e-6


def test_eps_default_is_dtype_eps():
    x = make()[0] * 1e-3  # mean(x^2) ~ 1e-6: eps shows
    o, _ = normalize(x)
    assert rel_err(o, elementary(x, None, None, None, None, False, 1.1920929e-07)[0]) < 1e-6
    assert rel_err(o, elementary(x, None, None, None, None, False, 1e-5)[0]) > 1e-2


# ---------------------------------------------------------------------------- modules

def seed_rmsnorm(x, gamma, eps):
    """The seed's torch module, in numpy: x * rsqrt(eps + mean(x^2, -1)) * gamma."""
    x = np.asarray(x, dtype=np.float64)
    y = x / np.sqrt(eps + (x ** 2).mean(-1, keepdims=True))
    return y if gamma is None else y * np.asarray(gamma, dtype=np.float64)


def test_rmsnorm_module_matches_seed():
    x = make()[0] * 1e-3
    m = RMSNorm(D)
    assert m.eps is None and m.normalized_shape == (D,)
    assert [k for k, _ in tree_flatten(m.parameters())] == ["weight"]
    assert mx.array_equal(m.weight, mx.ones((D,)))
    m.weight = make()[2]
    eps32 = float(mx.finfo(mx.float32).eps)
    assert rel_err(m(x), seed_rmsnorm(x, m.weight, eps32)) < 1e-6
    assert rel_err(RMSNorm(D, eps=1e-5)(x), seed_rmsnorm(x, None, 1e-5)) < 1e-6
    # float16 input: its own eps (9.8e-4), float16 rounding tolerance
    x16 = (make()[0] * 0.03).astype(mx.float16)
    out16 = RMSNorm(D, elementwise_affine=False)(x16)
    assert out16.dtype == mx.float16
    assert rel_err(out16, seed_rmsnorm(x16, None, 2.0 ** -10)) < 2e-3
    assert rel_err(out16, seed_rmsnorm(x16, None, eps32)) > 1e-2


def test_rmsnorm_no_affine_has_no_parameters():
    m = RMSNorm((4, 6), elementwise_affine=False)
    assert tree_flatten(m.parameters()) == []
    assert "weight" not in m  # an MLX Module holds no None members


def test_rmsnorm_multidim_shape():
    x = make((2, 3, 4, 6))[0]
    m = RMSNorm((4, 6), eps=1e-6)
    assert m.weight.shape == (4, 6)
    m.weight = 1 + 0.1 * mx.random.normal((4, 6), key=mx.random.key(7))
    xn = np.asarray(x, dtype=np.float64)
    ref = xn / np.sqrt((xn ** 2).mean((-2, -1), keepdims=True) + 1e-6)
    ref = ref * np.asarray(m.weight, dtype=np.float64)
    assert rel_err(m(x), ref) < 1e-6
    # the fused residual form over the same trailing dims
    r = make((2, 3, 4, 6), seed=1)[0]
    o, p = m(x, r)
    assert rel_err(p, x + r) < 1e-6
    assert rel_err(o, m(x + r)) < 1e-6
    with pytest.raises(ValueError):
        m(mx.zeros((2, 6, 4)))


def test_layernorm_module():
    x, _, w, b = make()
    m = LayerNorm(D)
    assert sorted(k for k, _ in tree_flatten(m.parameters())) == ["bias", "weight"]
    m.weight, m.bias = w, b
    assert rel_err(m(x), mx.fast.layer_norm(x, w, b, 1e-5)) < 1e-6
    assert [k for k, _ in tree_flatten(LayerNorm(D, bias=False).parameters())] == ["weight"]
    assert tree_flatten(LayerNorm(D, elementwise_affine=False).parameters()) == []
    x2 = make((2, 3, 4, 6))[0]
    xn = np.asarray(x2, dtype=np.float64)
    q = xn - xn.mean((-2, -1), keepdims=True)
    ref = q / np.sqrt((q ** 2).mean((-2, -1), keepdims=True) + 1e-5)
    assert rel_err(LayerNorm((4, 6))(x2), ref) < 1e-6


def test_dyt():
    x, _, w, b = make()
    m = DyT(D, alpha_init=0.7)
    assert sorted(k for k, _ in tree_flatten(m.parameters())) == ["alpha", "bias", "weight"]
    assert m.alpha.size == 1 and m.alpha.item() == pytest.approx(0.7)
    m.weight, m.bias = w, b
    ref = np.asarray(w) * np.tanh(0.7 * np.asarray(x, dtype=np.float64)) + np.asarray(b)
    assert rel_err(m(x), ref) < 1e-6
    g = mx.grad(lambda a: (m.weight * mx.tanh(a * x) + m.bias).sum())(m.alpha)
    assert g.shape == (1,)


# ---------------------------------------------------------------------------- backward

def loss_of(fn, cot_o, cot_p, use_res):
    """A scalar that weights o and (with a residual) p by fixed random cotangents."""
    def loss(*arrays):
        o, p = fn(*arrays)
        value = (o * cot_o).sum()
        return value + (p * cot_p).sum() if use_res else value
    return loss


def split(arrays, use_res, use_w, use_b):
    it = iter(arrays)
    return next(it), *(next(it) if on else None for on in (use_res, use_w, use_b))


@pytest.mark.parametrize("c", [None, 2.0])
@pytest.mark.parametrize("center,use_res,use_w,use_b", CASES, ids=CASE_IDS)
def test_vjp_matches_autodiff_of_composition(center, use_res, use_w, use_b, c):
    x, res, w, b = make()
    arrays = [a for a, on in zip((x, res, w, b), (True, use_res, use_w, use_b)) if on]
    cot_o, cot_p = make(seed=3)[:2]
    scale = 1.0 if c is None else c / math.sqrt(D)

    def fused(*a):
        return normalize(*split(a, use_res, use_w, use_b), c=c, center=center, eps=1e-5,
                         backend="fallback")

    def plain(*a):
        return fnn.compose(*split(a, use_res, use_w, use_b), scale, center, 1e-5)

    argnums = tuple(range(len(arrays)))
    g_custom = mx.grad(loss_of(fused, cot_o, cot_p, use_res), argnums)(*arrays)
    g_plain = mx.grad(loss_of(plain, cot_o, cot_p, use_res), argnums)(*arrays)
    for gc, gp in zip(g_custom, g_plain):
        assert gc.shape == gp.shape and gc.dtype == mx.float32
        assert rel_err(gc, gp) < 1e-5  # float32: different summation orders


@pytest.mark.parametrize("center", [False, True])
def test_vjp_matches_finite_differences_float64(center):
    """The custom vjp in float64 (MLX's CPU supports it) against central differences,
    h = 1e-6, of the seed's forward in numpy float64 (mx.fast.rms_norm/layer_norm
    reduce in float32 even for float64 input, too coarse for differences), for x,
    residual, w and b, with c = 1.5 and eps = 1e-3 so that eps counts."""
    x, res, w, b = (a.astype(mx.float64) for a in make((2, 6)))
    cot_o, cot_p = (np.asarray(a, dtype=np.float64) for a in make((2, 6), seed=5)[:2])

    def fn(*a):
        return normalize(*a, c=1.5, center=center, eps=1e-3, backend="fallback")

    arrays = [x, res, w, b]
    grads = mx.grad(loss_of(fn, mx.array(cot_o), mx.array(cot_p), True), (0, 1, 2, 3))(*arrays)

    def loss(*a):
        o, p = elementary(*a, 1.5, center, 1e-3)
        return float((o * cot_o).sum() + (p * cot_p).sum())

    h = 1e-6
    numpy_arrays = [np.asarray(a, dtype=np.float64) for a in arrays]
    for k, (a, g) in enumerate(zip(numpy_arrays, grads)):
        assert g.dtype == mx.float64
        fd = np.empty(a.size)
        for i in range(a.size):
            values = []
            for sign in (1, -1):
                bumped = a.copy().ravel()
                bumped[i] += sign * h
                trial = list(numpy_arrays)
                trial[k] = bumped.reshape(a.shape)
                values.append(loss(*trial))
            fd[i] = (values[0] - values[1]) / (2 * h)
        assert rel_err(g.reshape(-1), fd) < 1e-8, f"argument {k}"


def test_eps_enters_the_backward():
    """With a large eps the closed form must still be exact (sigma includes eps)."""
    x, _, w, _ = make((4, 8))
    x = x * 0.01
    g1 = mx.grad(lambda a: (normalize(a, weight=w, eps=0.1)[0] ** 2).sum())(x)
    g2 = mx.grad(lambda a: (mx.fast.rms_norm(a, w, 0.1) ** 2).sum())(x)
    assert rel_err(g1, g2) < 1e-5


# ---------------------------------------------------------------------------- fused stack

def linear_layers(n, d, seed=11):
    keys = mx.random.split(mx.random.key(seed), n)
    return [mx.random.normal((d, d), key=k) / math.sqrt(d) for k in keys]


def norm_weights(n, d, seed=12):
    return [1 + 0.2 * mx.random.normal((d,), key=k) for k in mx.random.split(mx.random.key(seed), n)]


def naive_stack(x, mats, ws):
    for m, w in zip(mats, ws):  # x_k = f_k(norm(x_(k-1))) + x_(k-1)
        x = normalize(x, weight=w, eps=1e-5)[0] @ m + x
    return x


def fused_stack(x, mats, ws):
    p, r = x, None  # p_0 = x, r_0 = 0
    for m, w in zip(mats, ws):  # r_k = p_(k-1) + r_(k-1), q_k = norm(r_k), p_k = f_k(q_k)
        q, r = normalize(p, r, w, eps=1e-5)
        p = q @ m
    return p + r


@pytest.mark.parametrize("n", [1, 2, 5])
def test_fused_residual_stack_equals_naive(n):
    x = make((3, D))[0]
    mats, ws = linear_layers(n, D), norm_weights(n, D)
    assert rel_err(fused_stack(x, mats, ws), naive_stack(x, mats, ws)) < 1e-6
    # and so do the gradients, through the closed-form vjp and the p output
    cot = make((3, D), seed=9)[0]
    g_fused = mx.grad(lambda a, m: (fused_stack(a, m, ws) * cot).sum(), (0, 1))(x, mats)
    g_naive = mx.grad(lambda a, m: (naive_stack(a, m, ws) * cot).sum(), (0, 1))(x, mats)
    assert rel_err(g_fused[0], g_naive[0]) < 1e-5
    for a, b in zip(g_fused[1], g_naive[1]):
        assert rel_err(a, b) < 1e-5


# ---------------------------------------------------------------------------- backends

KERNEL_SHAPES = [(1, 1280), (2, 3, 2048), (4, 96), (1, 4096), (2, 10000)]


@pytest.mark.parametrize("backend", forms.available_backends())
def test_backend_path(backend):
    """On a machine without a GPU the only backend is the fallback, and "auto" must pick
    it; with Metal or CUDA the kernel runs on the GPU and must match the fallback:
    float32 within 2e-6 relative (rsqrt and summation order), float16 within 2e-3."""
    if backend == "fallback":
        assert fnn.select_backend("auto") == "fallback"
        assert fnn.select_backend() == "fallback"
        x, res, w, b = make()
        o, p = normalize(x, res, w, b, eps=1e-5)
        o_ref, p_ref = fnn.compose(x, res, w, b, 1.0, False, 1e-5)
        assert mx.array_equal(o, o_ref) and mx.array_equal(p, p_ref)
        return
    mx.set_default_device(mx.gpu)
    assert fnn.select_backend("auto") == backend
    # every flag combination on one shape in float32; the two usual ones (add+RMSNorm,
    # add+LayerNorm) on every shape in both dtypes.  Each combination and dtype is one
    # kernel compile (about 2 s with NVRTC), so the matrix is kept small.
    runs = [((7, 1000), mx.float32) + case for case in CASES]
    runs += [(shape, dtype, center, True, True, center)
             for shape in KERNEL_SHAPES for dtype in (mx.float32, mx.float16)
             for center in (False, True)]
    for shape, dtype, center, use_res, use_w, use_b in runs:
        args = pick(make(shape, dtype), use_res, use_w, use_b)
        o_k, p_k = normalize(*args, c=2.0, center=center, eps=1e-5, backend=backend)
        o_f, p_f = normalize(*args, c=2.0, center=center, eps=1e-5, backend="fallback")
        assert o_k.dtype == o_f.dtype and o_k.shape == o_f.shape
        tol = 2e-6 if dtype == mx.float32 else 2e-3
        label = (shape, dtype, center, use_res, use_w, use_b)
        assert rel_err(o_k.astype(mx.float32), o_f.astype(mx.float32)) < tol, label
        assert mx.array_equal(p_k, p_f), label
    # strided input goes through the kernel too, and grads flow through the kernel path
    x, res, w, b = make((64, 96))
    xt = x.T[:64]  # (64, 64), not row contiguous
    assert rel_err(normalize(xt, res[:, :64], w[:64], backend=backend)[0],
                   normalize(xt, res[:, :64], w[:64], backend="fallback")[0]) < 2e-6
    g_k = mx.grad(lambda a: (normalize(a, res, w, c=2.0, eps=1e-5,
                                       backend=backend)[0] * b).sum())(x)
    g_f = mx.grad(lambda a: (normalize(a, res, w, c=2.0, eps=1e-5,
                                       backend="fallback")[0] * b).sum())(x)
    assert rel_err(g_k, g_f) < 1e-5


def test_module_runs_the_kernel_for_one_row_only(monkeypatch):
    """A norm module at inference takes the fused add+norm kernel for a one-row input (a decode
    step) and the composition (x + r, mx.fast.rms_norm) for the rows of a prompt, where a custom
    launch's host cost outweighs the pass it saves. The kernel is stood in for by a spy, so the
    choice is tested on any machine; both paths give the composition's values."""
    launched = []

    def spy(backend, x, residual, weight, bias, scale, center, eps):
        launched.append(x.shape)
        return fnn.compose(x, residual, weight, bias, scale, center, eps)

    monkeypatch.setattr(fnn, "fused", spy)
    monkeypatch.setattr(fnn, "select_backend", lambda backend=None: "cuda")
    norm = RMSNorm(D, eps=1e-5)
    norm.eval()
    for rows in (1, 7):
        x, r, w, _ = make((1, rows, D))
        norm.weight = w
        o, p = norm(x, r)
        want, p_want = fnn.compose(x, r, w, None, 1.0, False, 1e-5)
        assert mx.array_equal(o, want) and mx.array_equal(p, p_want)
    assert launched == [(1, 1, D)]


def test_plain_norms_where_no_kernel_runs(monkeypatch):
    """Where no norm kernel can run (here: the CPU), plain_norms makes a model's one-axis RMSNorms
    PlainRMSNorm: the same values and gradients as RMSNorm's inference path, alone or with a
    residual; where a kernel runs it changes nothing."""
    model = nn_container()
    assert fnn.plain_norms(model) is model
    assert [type(m).__name__ for m in (model.a, model.b, model.c)] == ["PlainRMSNorm", "RMSNorm", "LayerNorm"]
    ref = RMSNorm(D, eps=1e-5)
    x, r, w, _ = make((1, 3, D))
    ref.weight = model.a.weight = w
    ref.eval()
    assert mx.array_equal(model.a(x), ref(x))
    for res in (r, None):
        (o, p), (o_ref, p_ref) = model.a(x, res), ref(x, res)
        assert mx.array_equal(o, o_ref) and mx.array_equal(p, p_ref)
    gx = mx.grad(lambda x_: (model.a(x_, r)[0] ** 2).sum())(x)  # training: mx.fast.rms_norm's vjp
    want = mx.grad(lambda x_: (fnn.compose(x_, r, w, None, 1.0, False, 1e-5)[0] ** 2).sum())(x)
    assert rel_err(gx, want) < 1e-5
    kept = nn_container()
    monkeypatch.setattr(fnn, "select_backend", lambda backend=None: "cuda")
    fnn.plain_norms(kept)
    assert type(kept.a) is RMSNorm


def nn_container():
    import mlx.nn as mnn
    m = mnn.Module()
    m.a, m.b, m.c = RMSNorm(D, eps=1e-5), RMSNorm((2, D // 2)), LayerNorm(D)
    return m
