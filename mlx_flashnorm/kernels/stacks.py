"""The whole-step kernels' self-check inputs (step.check_decode_layers, rows.check_decode_rows),
which the tests take too: random stacks of each form the kernels compute
(random_stack, check_stacks: Llama's, OpenELM's layer-wise sizes, Qwen 2's q/k/v biases at 4 bits
and full precision, Gemma 3's post-norms, GeGLU, head size 256, sliding window and RoPE angles a
layer) and each norm mode's tables (check_modes, check_tables)."""
import mlx.core as mx

from .build import rand


def random_stack(L, K, HQ, HKV, D, I, C, pos, seed, bits=4, bias=False):
    """A random stack, quantized (bits 4 or 8, groups of 64) or full precision (bits None: weights
    of rand's dtype), with q/k/v biases where asked (Qwen 2's: about 0.5, some larger), and caches
    filled up to pos."""
    def matrix(rows, cols, s):
        w = rand((rows, cols), s, scale=0.05)
        return (w, None, None) if bits is None else tuple(mx.quantize(w, 64, bits))

    layers = [(matrix((HQ + 2 * HKV) * D, K, seed + 10 * l), matrix(K, HQ * D, seed + 10 * l + 1),
               matrix(2 * I, K, seed + 10 * l + 2), matrix(K, I, seed + 10 * l + 3))
              + ((rand(((HQ + 2 * HKV) * D,), seed + 10 * l + 6, scale=0.5),) if bias else ())
              for l in range(L)]
    mask = (mx.arange(C) < pos)[None, None, :, None]
    caches = [tuple(mx.where(mask, rand((1, HKV, C, D), seed + 10 * l + 4 + j), 0)
                    for j in range(2))
              for l in range(L)]
    return layers, caches


def check_stacks(rows, pos, seed):
    """The self-checks' stacks, (layers, caches for `rows` rows, n_heads, n_kv_heads, bits, theta,
    form, modes) each, form the keyword arguments past `norm` (windows, gelu), modes those of
    check_modes it runs in; caches filled up to pos: two 4-bit layers alike (4 query heads, 2 kv
    heads, FFN width 384) and two of their own sizes as OpenELM's (4 and 8 query heads, 2 and 4 kv
    heads, FFN widths 128 and 384; the same query heads per kv head, so the same compiled
    variant), head size 64, in every mode; two layers alike with q/k/v biases (Qwen 2's), 4-bit
    and full precision (bits: those of rand's dtype, a variant of its own), in flash and rms
    without QK-norm (which add a bias differently; none adds it as rms does): few launches, as the
    check runs at first use; and Gemma 3's form (check_modes' post-norms), two 4-bit layers of
    head size 256 (4 query heads, 1 kv head, FFN width 384), the first of a sliding window of 16
    positions, RoPE angles of their own, GeGLU, in each of its modes."""
    K, D, C = 256, 64, 64
    biased = (0, 2)  # check_modes' indices: flash and rms without QK-norm
    alike = random_stack(2, K, 4, 2, D, 384, C, pos, seed)
    own = [random_stack(1, K, hq, hq // 2, D, i, C, pos, seed + 50 + l)
           for l, (hq, i) in enumerate(((4, 128), (8, 384)))]
    own = ([m for s in own for m in s[0]], [c for s in own for c in s[1]])
    quantized, full = (random_stack(2, K, 4, 2, D, 384, C, pos, seed + 70, b, bias=True)
                       for b in (4, None))
    gemma = random_stack(2, K, 4, 1, 256, 384, C, pos, seed + 70)
    many = lambda caches: [tuple(mx.concatenate([a, a[:, :, ::-1], a][:rows]) for a in c)
                           for c in caches]
    theta, llama = check_tables(2, K, D)[0], dict(windows=None, gelu=False)
    angles = mx.stack([mx.exp(-mx.arange(128, dtype=mx.float32) * c) for c in (0.07, 0.11)])
    modes = check_modes(2, K, D)
    return [(alike[0], many(alike[1]), 4, 2, 4, theta, llama, modes),
            (own[0], many(own[1]), [4, 8], [2, 4], 4, theta, llama, modes),
            (quantized[0], many(quantized[1]), 4, 2, 4, theta, llama, [modes[i] for i in biased]),
            (full[0], many(full[1]), 4, 2, 8 * full[0][0][0][0].dtype.size, theta, llama,
             [modes[i] for i in biased]),
            (gemma[0], many(gemma[1]), 4, 1, 4, angles, dict(windows=[16, None], gelu=True),
             check_modes(2, K, 256, post=True))]


def check_tables(L, K, D):
    """The self-checks' RoPE angles, pre-norm gains (about trained models' 16) and QK-norm
    tables."""
    theta = mx.exp(-mx.arange(D // 2, dtype=mx.float32) * 0.3)
    return (theta, 16 * (1 + 0.3 * rand((L, 2, K), 42, mx.float32)),
            1 + 0.3 * rand((L, 2, 2, D), 43, mx.float32))


def check_modes(L, K, D, post=False, dtype=mx.float16, seed=42):
    """The self-checks' variants (and the GPU tests', of their own dtype and seed), (gains,
    qk_gains, factor, qk_eps, norm) each: flash with Sec. 3 and Sec. 4 (QK-norm; gains about
    trained models' 16: check_tables' at seed 42), rms without and with QK-norm (norm weights of
    dtype's values about 1), none; post (Gemma 3's): flash and rms with QK-norm and the
    post-norms' gains after the pre-norms', none."""
    gains = 16 * (1 + 0.3 * rand((L, 2, K), seed, mx.float32))
    qk = 1 + 0.3 * rand((L, 2, 2, D), seed + 1, mx.float32)
    near_one = lambda shape, s: (1 + 0.3 * rand(shape, s, mx.float32)).astype(dtype).astype(
        mx.float32)
    w, wq = near_one((L, 2, K), seed + 2), near_one((L, 2, 2, D), seed + 3)
    if post:
        wp = near_one((L, 2, K), seed + 4)
        return [(mx.concatenate([gains, wp], 1), qk, D**-0.25, 1e-6, "flash"),
                (mx.concatenate([w, wp], 1), wq, D**-0.5, 1e-6, "rms"),
                (None, None, D**-0.5, 0.0, "none")]
    return [(gains, None, D**-0.25, 0.0, "flash"), (gains, qk, D**-0.25, 1e-6, "flash"),
            (w, None, D**-0.5, 0.0, "rms"), (w, wq, D**-0.5, 1e-6, "rms"),
            (None, None, D**-0.5, 0.0, "none")]
    return [(gains, None, D**-0.25, 0.0, "flash"), (gains, qk, D**-0.25, 1e-6, "flash"),
            (w, None, D**-0.5, 0.0, "rms"), (w, wq, D**-0.5, 1e-6, "rms"),
            (None, None, D**-0.5, 0.0, "none")]
