"""decode_layers: every decoder layer of a Llama-family stack for one decode row in one CUDA launch.

A decode step of a small model is bound by launches, not by memory: reading SmolLM2-135M's
weights takes a fraction of the host work of the per-sublayer kernels' launches (norm_qkv_rope,
decode_attention, o_proj, gate_up, down_proj, several a layer: bench/RESULTS.md, "Launches per
step"). Here one persistent kernel runs all layers: its blocks (one per SM, all resident) meet at a
grid-wide barrier between the phases of a layer, and FlashNorm makes each norm free inside the
matvec after it (Sec. 5): every block recomputes the residual add and 1/RSSe of the row it reads
(a few KB) instead of waiting for another launch.

Per layer, between barriers:
  1. p = x * xs + r (the residual stream), s = 1/RSSe(p); the q/k/v rows of p * g (raw)
  2. RoPE with s (Sec. 3) or QK-norm's own 1/RSSe and gains (Sec. 4) on q and k, v * s, the new
     k and v written into the static cache in place, and attention over the filled positions,
     split over blocks (flash-decoding: partial max, sum and values per split)
  3. the splits merged, o_proj
  4. p2 = o + p, s2 = 1/RSSe(p2), gate/up rows of p2 * g2, SwiGLU with the up scale deferred
  5. down_proj; its deferred scale s2 (over the power of two P) goes to the next layer's add
Gemma 3's blocks (POST): phases 1 and 4 first put the row they read (down_proj's output times its
scale, o_proj's) through its post-norm, a whole-row reduction every block makes (the last layer's
post-feedforward norm is the caller's); GeGLU in place of SwiGLU; a sliding-window layer attends
to its last positions only, with its own RoPE angles.
CUDA only: the per-sublayer kernels stay the form Metal runs (no grid-wide barrier there).
Its plain-MLX reference (_reference) is the fallback and the self-check's yardstick (CHECK)."""
import ctypes
import math
from functools import lru_cache
from pathlib import Path

import mlx.core as mx

from .. import forms
from ..forms import gpu_backend
from .build import HEADERS, constant, declare, fill, make_kernel, pack, pieces, position_array, rand

THREADS = 256  # 8 warps a block
SMAX = 16  # attention splits per kv head, at most
MAX_LAYERS = 36  # the pointer table's 14 a layer in static shared memory
MAX_ROWS = 64  # rows of the batched form (rows.py), at most
CUDA = Path(__file__).parent / "cuda"  # the kernels' CUDA: step.cu, rows.cu, whole_step.cuh

# The sizes and flags a launch passes in its int array `dims`, in order (build.pack, build.declare):
# the model width, group size, the widest layer's query and kv heads and FFN width (each layer's
# come in the layer table after these fields: layer_table), cache capacity, blocks, the widest
# matvec input, whether the norms' gains are kept, whether the rows are half precision (1/RSSe's
# power of two taken out), QK-norm, the norm's, RoPE's and QK-norm's float settings, the norm
# mode (NORMS), and the post-norms (Gemma 3's: POST).
SIZES = (("K", "int"), ("GS", "int"), ("HQM", "int"), ("HKVM", "int"), ("IM", "int"), ("C", "int"),
         ("NB", "int"), ("XMAX", "int"), ("has_g", "bool"), ("prescale", "bool"),
         ("qk_norm", "bool"), ("eps", "float"), ("factor", "float"), ("qk_eps", "float"),
         ("NORM", "int"), ("post", "bool"))
# The norm modes (--norm), each the function of that mode's own layers: flash, the 1/RSSe deferred
# past the matvecs (gains: the pre-norms' sqrt(K) g on the inputs; factor: the square root of the
# softmax scale, into q and k); rms, RMSNorm before each matvec as the model's layers compute and
# round it (gains: the norms' weights; qk_gains[:, :, 0]: QK-norm's; factor: the softmax scale);
# none, the residual add alone (no gains).
NORMS = {"flash": 0, "rms": 1, "none": 2}
# a layer's arrays, in the pointer table's order: its four matrices (weight, scales, biases each)
# and its caches; the matrices come one input a kind (stacked: layer l's at its offset in it)
ARRAYS = ("wqkv", "sqkv", "bqkv", "wo", "so", "bo", "wgu", "sgu", "bgu", "wd", "sd", "bd", "kc",
          "vc")
STACKED = ARRAYS[:12]
# Gemma 3's blocks (post): four norms a layer in `gains`, (L, 4, K): the two pre-norms', then the
# post-attention norm's (on o_proj's output) and the post-feedforward norm's (on down_proj's), both
# before the residual add; those two are the model's own in flash and rms (gain 1 + w), and the
# model's norms compute in float32, rounded once (rms: the pre-norms and QK-norm too)
POST = 4


def input_names(layers):
    """Both kernels' inputs: the shared ones, the 12 stacked matrices (STACKED), each layer's
    caches. A launch's host work grows with its inputs (bench/RESULTS.md, "Host work of the batched
    step"), so the layers' matrices come as 12 arrays."""
    return (["x", "off", "dims", "theta", "gains", "qkg", "sync", *STACKED]
            + [f"{a}{l}" for l in range(layers) for a in ARRAYS[12:]])


def table(layers):
    """The body's pointer table in shared memory: thread l of each block points at layer l's arrays
    in the 12 matrix inputs (at its offsets in the layer table `lt`, layer_table) and at its
    caches."""
    rows = "\n    ".join(f"tab[14 * l + {k}] = {a} + long(lt[17 * l + {k}]);"
                         for k, a in enumerate(STACKED))
    stacked = f"  if (threadIdx.x < NL) {{\n    const int l = threadIdx.x;\n    {rows}\n  }}\n"
    return stacked + "".join(f"  if (threadIdx.x == {l}) {{ tab[{14 * l + 12}] = kc{l}; "
                             f"tab[{14 * l + 13}] = vc{l}; }}\n" for l in range(layers))


def compose(folder, file, fields, layers, own=("body",)):
    """A whole-step kernel's CUDA for `layers` layers, (body, header) as make_kernel takes them,
    from folder's `file` (its pieces `own`: its body, and where named a device piece of its own
    functions) and whole_step.cuh: the body with its sizes declared (fields: its SIZES), its
    pointer table (table) and whole_step.cuh's layer and attend pieces filled in; the header of
    the backend's shared functions (HEADERS), whole_step.cuh's device piece and the file's."""
    shared = pieces(folder / "whole_step.cuh", "device", "layer", "attend")
    mine = pieces(folder / file, *own)
    sizes = declare(fields) + f"  const int* lt = dims + {len(fields)};  // step.layer_table\n"
    body = fill(mine["body"], SIZES=sizes, TABLE=table(layers), LAYER=shared["layer"],
                ATTEND=shared["attend"])
    return body, HEADERS["cuda"] + shared["device"] + mine.get("device", "")


def source(layers):
    """decode_layers' CUDA for `layers` layers: (body, header) as make_kernel takes them."""
    return compose(CUDA, "step.cu", SIZES, layers)


@lru_cache(maxsize=None)
def step_kernel(layers):
    return make_kernel("fn_decode_layers", input_names(layers), ["y", "p", "ys", "work"],
                       *source(layers))


def shared_bytes(K, xmax, bits, D, GQ, L, total=False):
    """The dynamic shared memory of a launch: the residual row and the matvec input with its chunk
    sums. Where it and the body's static arrays pass 48 KB, at least 48004 bytes are asked for:
    only then does MLX raise the kernel's limit (cuFuncSetAttribute), without which the launch
    is refused. total: that and the static arrays."""
    dynamic = 4 * (K + xmax + xmax // (4 * 32 // bits))
    static = static_bytes(D, GQ, L)
    asked = max(dynamic, 48004) if dynamic + static > 48 * 1024 else dynamic
    return asked + static if total else asked


def static_bytes(D, GQ, L):
    """The body's static shared arrays: red, tab, qsh and sacc, sm and sl (at most 48 KB: no
    launch gives a block more of them)."""
    return 4 * 8 + 8 * 14 * L + 4 * GQ * D * (1 + 8) + 4 * 2 * 8 * GQ


@lru_cache(maxsize=None)
def shared_limit():
    """The shared memory a block may use, static and dynamic together: the GPU's opt-in maximum
    (it differs by architecture); Hopper's 227 KB where it cannot be asked."""
    return _device_attribute(97) or 227 * 1024


def _device_attribute(number):
    """A CUDA device attribute of GPU 0 from the driver MLX loaded (cuDeviceGetAttribute), or None
    where it cannot be asked."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        value = ctypes.c_int()
        if lib.cuDeviceGetAttribute(ctypes.byref(value), number, 0) == 0:
            return value.value
    except (OSError, AttributeError):
        pass
    return None


@lru_cache(maxsize=None)
def sm_count():
    """The GPU's multiprocessors (the grid: one resident block each); 16 where they cannot be
    asked."""
    n = _device_attribute(16)
    return n if n and n > 0 else 16


@lru_cache(maxsize=None)
def compute_capability():
    """The GPU's compute capability major number (9 on Hopper); 0 where it cannot be asked."""
    return _device_attribute(75) or 0


@lru_cache(maxsize=None)
def sync_state():
    """The grid barrier's counters (64 uint32, in device memory): zero between launches."""
    a = mx.zeros((64,), mx.uint32)
    mx.eval(a)
    return a


def use_decode_layers(name="decode_layers"):
    """Whether the whole-step kernel (name: "decode_layers", one row, or "decode_rows", a batch)
    may run here (CUDA, our kernels on, its self-check passed)."""
    return forms.use_gpu(name) and gpu_backend() == "cuda"


def layer_sizes(layers, n_heads, n_kv_heads):
    """Each layer's (query heads, kv heads, FFN width): n_heads and n_kv_heads one int for every
    layer or one per layer (OpenELM's), the width from its gate/up rows."""
    per = lambda v: list(v) if isinstance(v, (list, tuple)) else [v] * len(layers)
    return [(q, k, mats[2][0].shape[0] // 2)
            for q, k, mats in zip(per(n_heads), per(n_kv_heads), layers)]


def layer_table(layers, n_heads, n_kv_heads, windows=None, theta=None):
    """The layer table the kernels read after the sizes fields of `dims` (`lt`), 17 ints a layer:
    the offsets (in elements) of its 12 arrays in the 12 matrix inputs (stacked: the arrays of a
    kind one after another), then its query heads, kv heads and FFN width, its sliding window (0:
    every position; windows, per layer or None) and the offset of its RoPE angles in `theta` (a
    row a layer where theta is (L, D / 2), else 0)."""
    offsets, out = [0] * 12, []
    windows = windows or [None] * len(layers)
    for l, (mats, sizes) in enumerate(zip(layers, layer_sizes(layers, n_heads, n_kv_heads))):
        arrays = [a for m in mats for a in m]
        rope = l * theta.shape[-1] if theta is not None and theta.ndim == 2 else 0
        out += offsets + list(sizes) + [windows[l] or 0, rope]
        offsets = [o + a.size for o, a in zip(offsets, arrays)]
    return tuple(out)


def supported(x, layers, caches, n_heads, n_kv_heads, group_size, bits, name="decode_layers"):
    """Whether the kernel `name` takes this stack: CUDA with our kernels on, x one row ((1, 1, K);
    decode_rows: (B, 1, K), B <= MAX_ROWS), 4 or 8 bits, every layer's matrices of its own sizes
    (layer_sizes: heads and FFN width per layer; the query heads per kv head alike), each kind's
    arrays within int32 offsets, sizes in whole 16-byte chunks and groups (decode_rows: spans of
    32 values, tensor cores with tf32), head size 64 or 128, or 256 in half precision (a row of
    the attention's keys is at most 32 lanes of 16 bytes), at most 8 query heads per kv head;
    decode_layers' shared memory within what the GPU gives a block (shared_limit; decode_rows fits
    its passes to it: rows.launch_plan), its static arrays within 48 KB (step.static_bytes)."""
    B = x.shape[0]
    if not (use_decode_layers(name) and x.ndim == 3 and x.shape[1] == 1
            and (B == 1 if name == "decode_layers" else B <= MAX_ROWS)
            and x.dtype in (mx.float16, mx.bfloat16, mx.float32) and bits in (4, 8)
            and 0 < len(layers) <= MAX_LAYERS):
        return False
    K, D = x.shape[-1], caches[0][0].shape[-1]
    per = layer_sizes(layers, n_heads, n_kv_heads)
    if len(per) != len(layers) or len(caches) != len(layers):
        return False
    cw = 4 * 32 // bits
    if name == "decode_rows":  # the tensor cores' spans: 32 values in one group; tf32 from sm_80 on
        cw = 32
        if compute_capability() < 8:
            return False
    HQM, GQ = max(q for q, _, _ in per), per[0][0] // per[0][1]
    xmax = max(K, HQM * D, max(i for _, _, i in per))
    if (D not in (64, 128, 256) or D == 256 and x.dtype == mx.float32 or GQ > 8
            or group_size % cw
            or any(q % k or q // k != GQ for q, k, _ in per)
            or any(v % group_size or v % cw for q, _, i in per for v in (K, q * D, i))
            or name == "decode_layers"
            and (shared_bytes(K, xmax, bits, D, GQ, len(layers), True) > shared_limit()
                 or static_bytes(D, GQ, len(layers)) > 48 * 1024)):
        return False
    for mats, (k, v), (hq, hkv, I) in zip(layers, caches, per):
        shapes = [(K * bits // 32, hq * D + 2 * hkv * D), (hq * D * bits // 32, K),
                  (K * bits // 32, 2 * I), (I * bits // 32, K)]
        for (w, s, b), (width, rows) in zip(mats, shapes):
            if (w.dtype != mx.uint32 or w.shape != (rows, width) or s.dtype != x.dtype
                    or b.dtype != x.dtype):
                return False
        if (k.dtype != x.dtype or v.dtype != x.dtype or k.shape != v.shape
                or k.shape[:2] != (B, hkv)):
            return False
    # each kind's arrays together within the int32 offsets of the layer table
    return all(sum(m[i][j].size for m in layers) < 2**31 for i in range(4) for j in range(3))


def decode_layers(x, offset, layers, caches, gains, qk_gains, theta, eps, factor, qk_eps, n_heads,
                  n_kv_heads, group_size, bits, norm="flash", windows=None, gelu=False):
    """Every layer of a Llama-family stack for one decode row x (the embedding, (1, 1, K)):
    (y, ys, p, caches) where y * ys is the last down_proj's output (its scale deferred), p the
    residual stream, and caches the (k, v) buffers with this position written.

    layers: per layer the (weight, scales, biases) of qkv_proj, o_proj, gate_up_proj (gate rows
    over up rows) and down_proj; caches: per layer (k, v), (1, kv heads, capacity, D); offset: the
    position (an int or the decode step's array); gains: (L, 2, K) float32, the two pre-norms'
    gains kept on the input, or None (folded), or (L, 4, K) with the post-norms' (POST); qk_gains:
    (L, 2, 2, D) float32, QK-norm's gains and their RoPE-permuted copy for q and k (Sec. 4), or None
    (Sec. 3: factor * s on q and k); theta: RoPE's angles (D / 2,), or (L, D / 2) a layer; windows:
    per layer its sliding window (attention over the last that many positions) or None (every
    position), or None; gelu: GeGLU (tanh GELU, Gemma 3's) in place of SwiGLU.
    norm: the mode (NORMS), which says what gains, qk_gains and factor are; in rms and none ys is 1
    and y + p the last layer's output (no scale deferred; with post-norms, the last layer's
    post-feedforward norm is the caller's: y is down_proj's output)."""
    if not supported(x, layers, caches, n_heads, n_kv_heads, group_size, bits):
        return _reference(x, offset, layers, caches, gains, qk_gains, theta, eps, factor, qk_eps,
                          n_heads, n_kv_heads, group_size, bits, norm, windows, gelu)
    K, D, I, xmax, HQ, HKV, GQ = sizes(x, layers, theta, n_heads, n_kv_heads)
    return launch(step_kernel(len(layers)), x, position_array(offset), layers, caches, gains,
                  qk_gains, theta, eps, factor, qk_eps, n_heads, n_kv_heads, group_size, bits,
                  work=(HQ + 2 * HKV) * D + HQ * SMAX * (D + 2) + K + I,
                  shared_memory=shared_bytes(K, xmax, bits, D, GQ, len(layers)), norm=norm,
                  windows=windows, gelu=gelu)


def sizes(x, layers, theta, n_heads, n_kv_heads):
    """(K, D, I, xmax, HQ, HKV, GQ) of a stack: the model width, head size, the widest layer's FFN
    width, the widest matvec input, the most query and kv heads of a layer (layer_sizes), and the
    query heads per kv head."""
    per = layer_sizes(layers, n_heads, n_kv_heads)
    K, D = x.shape[-1], theta.shape[-1] * 2
    HQ, HKV, I = (max(v[j] for v in per) for j in range(3))
    return K, D, I, max(K, HQ * D, I), HQ, HKV, per[0][0] // per[0][1]


class Layers(list):
    """A stack's layers (per layer the (weight, scales, biases) of its four matrices) with `stacks`:
    the 12 arrays (stacked) holding each layer's arrays, in that order (flashnorm.stack_weights
    makes them at load time, so that they take no memory of their own: layer_views)."""

    def __init__(self, layers, stacks):
        super().__init__(layers)
        self.stacks = stacks


def stacked(layers):
    """The 12 matrix inputs a launch takes, one a kind: the layers' own stacks, else copies; a
    kind's arrays stacked (L, rows, columns) where every layer's has one shape, else flattened one
    after another (OpenELM's layers differ), layer l's at its offset in the layer table."""
    if isinstance(layers, Layers):
        return layers.stacks
    kinds = [[mats[i][j] for mats in layers] for i in range(4) for j in range(3)]
    return [mx.stack(arrays) if len({a.shape for a in arrays}) == 1
            else mx.concatenate([a.reshape(-1) for a in arrays]) for arrays in kinds]


def layer_views(stack, arrays):
    """Each layer's array of one kind as a view of its input (stacked): row l of a stack, else its
    span of the flat array, in the shape of `arrays` (the layers' own)."""
    if stack.ndim == 3:
        return [stack[l] for l in range(len(arrays))]
    views, at = [], 0
    for a in arrays:
        views.append(stack[at:at + a.size].reshape(a.shape))
        at += a.size
    return views


def launch(kernel, x, positions, layers, caches, gains, qk_gains, theta, eps, factor, qk_eps,
           n_heads, n_kv_heads, group_size, bits, work, shared_memory, fields=SIZES, template=(),
           keep_work=False, norm="flash", windows=None, gelu=False):
    """One launch of a whole-step kernel (this file's; rows.py's with its sizes table, which adds
    the row count B (fields), and its rows per matvec pass and warps (NW) in the template): one
    block per SM of 8 warps (or NW), the shared inputs, the 12 stacked matrices (stacked) and every
    layer's caches. Returns (y, ys, p, caches); the caches were written in place, so they are
    handed out as depending on the launch (reading them runs it first). keep_work: the work buffer
    (work floats) too, last (bench/probes/rows_phases.py reads its clock stamps there). windows,
    gelu and gains' post-norms as decode_layers takes them."""
    if norm == "rms" and gains is None:  # the kernel would read the norms' weights from `gains`
        raise ValueError("norm 'rms' needs the norms' weights (gains)")
    K, D, I, xmax, HQ, HKV, GQ = sizes(x, layers, theta, n_heads, n_kv_heads)
    threads = 32 * dict(template).get("NW", THREADS // 32)
    none = constant(mx.float32, 0.0)
    dims = pack(fields, dict(K=K, GS=group_size, HQM=HQ, HKVM=HKV, IM=I,
                             C=caches[0][0].shape[2], NB=sm_count(), XMAX=xmax,
                             has_g=gains is not None, prescale=x.dtype != mx.float32,
                             qk_norm=qk_gains is not None, eps=eps, factor=factor, qk_eps=qk_eps,
                             B=x.shape[0], NORM=NORMS[norm],
                             post=gains is not None and gains.shape[1] == POST))
    dims += layer_table(layers, n_heads, n_kv_heads, windows, theta)
    y, p, ys, scratch = kernel(
        inputs=[x, positions, constant(mx.int32, *dims), theta, none if gains is None else gains,
                none if qk_gains is None else qk_gains, sync_state(), *stacked(layers)]
        + [a for kv in caches for a in kv],
        template=[("T", x.dtype), ("BITS", bits), ("D", D), ("GQ", GQ), ("NL", len(layers)),
                  ("SMAX", SMAX), ("GELU", gelu), *template],
        grid=(sm_count() * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[x.shape, x.shape, (max(x.shape[0], 4),), (work,)],
        output_dtypes=[x.dtype, x.dtype, mx.float32, mx.float32], shared_memory=shared_memory)
    # ys (a float a row) comes in 16 bytes at least and is read through a view: MLX keeps an array
    # of 8 bytes or less in a managed page, which the next kernel reading it waits on
    ys = ys[:x.shape[0]].reshape(x.shape[:-1] + (1,))
    flat = mx.depends([a for kv in caches for a in kv], [y])
    out = y, ys, p, list(zip(flat[0::2], flat[1::2]))
    return out + (scratch,) if keep_work else out


def _qmm(x, w, s, b, group_size, bits):
    f32 = mx.float32
    return mx.quantized_matmul(x[None], w, s.astype(f32), b.astype(f32), transpose=True,
                               group_size=group_size, bits=bits)[0]


def _reference(x, offset, layers, caches, gains, qk_gains, theta, eps, factor, qk_eps, n_heads,
               n_kv_heads, group_size, bits, norm="flash", windows=None, gelu=False):
    """decode_layers in plain MLX (float32 arithmetic, rounded to x's dtype where the kernel
    rounds), over the whole cache with a mask, so that an array position (a compiled step) works:
    the fallback and the self-check's yardstick. norm: the mode (NORMS); rms and none round as the
    model's own layers do (each linear's output, RMSNorm's, RoPE's and SwiGLU's or GeGLU's steps,
    the sigmoid's and GELU's too, in T; with post-norms, Gemma 3's norms: in float32 on the
    residual add's unrounded sum, rounded once)."""
    f32, T = mx.float32, x.dtype
    K, D = x.shape[-1], theta.shape[-1] * 2
    per = layer_sizes(layers, n_heads, n_kv_heads)
    flash, post = norm == "flash", gains is not None and gains.shape[1] == POST
    pos = offset if isinstance(offset, int) else position_array(offset)[:1].reshape(())
    pow2 = ((lambda v: mx.power(2.0, mx.floor(mx.log2(v)))) if T != f32
            else (lambda v: mx.array(1.0)))
    rnd = lambda v: v.astype(T).astype(f32)

    def normed(v, w, e):  # RMSNorm as mx.fast.rms_norm rounds it; post: as Gemma 3's does
        r = v * mx.rsqrt((v * v).mean(-1, keepdims=True) + e)
        return rnd(r * w) if post else rnd(rnd(r) * w)

    def sigmoid(g):  # as MLX's CUDA Sigmoid computes it in T (whole_step.cuh's fn_sigmoid)
        y = rnd(1 / rnd(1 + rnd(mx.exp(mx.abs(g)))))
        return mx.where(g < 0, y, rnd(1 - y))

    def tanh_gelu(v, r=lambda a: a):  # mlx.nn.gelu_approx, each step and constant through r
        c1, c2 = r(mx.array(0.044715)), r(mx.array(math.sqrt(2 / math.pi)))
        t = r(c2 * r(v + r(c1 * r(v ** 3))))
        return r(r(0.5 * v) * r(1 + r(mx.tanh(t))))

    def stream(t, k):  # the residual stream t, unrounded: (p, the input of matvec k after it)
        p = rnd(t)
        if norm == "rms":  # RMSNorm(p), Gemma's of the unrounded sum
            return p, normed(t if post else p, gains[l, k], eps)
        return p, (p * gains[l, k] if flash and gains is not None else p)

    one = mx.array(1.0)
    h, xs, p, out = x.reshape(K).astype(f32), None, None, []
    for l, ((qkv, o, gu, down), (kc, vc)) in enumerate(zip(layers, caches)):
        HQ, HKV, _ = per[l]
        GQ = HQ // HKV
        th = theta[l] if theta.ndim == 2 else theta
        cs, sn = mx.cos(pos * th), mx.sin(pos * th)
        if xs is None:
            t = h
        else:  # post: the last layer's post-feedforward norm on down_proj's output times its scale
            t = (normed(rnd(h * xs), gains[l - 1, 3], eps) if post else h * xs) + p
        p, a = stream(t, 0)
        s = mx.rsqrt((p * p).sum() + K * eps) if flash else one
        P = pow2(s)
        raw = _qmm(a, *qkv, group_size, bits).reshape(-1, D)
        raw = raw if flash else rnd(raw)
        q, k, v = raw[:HQ], raw[HQ:HQ + HKV], raw[HQ + HKV:]
        gq = gk = mx.ones((2, D))
        if not flash:
            inv_q = inv_k = one
            if qk_gains is not None:
                q, k = normed(q, qk_gains[l, 0, 0], qk_eps), normed(k, qk_gains[l, 1, 0], qk_eps)
        elif qk_gains is None:
            inv_q = inv_k = factor * s
        else:
            inv = lambda r: mx.rsqrt(((r * P) ** 2).sum(-1, keepdims=True) + D * qk_eps) * P
            inv_q, inv_k = inv(q), inv(k)
            gq, gk = qk_gains[l, 0], qk_gains[l, 1]

        def rope(r, inv, g):
            a, b = r[:, :D // 2], r[:, D // 2:]
            ya = inv * (a * g[0, :D // 2] * cs - b * g[1, :D // 2] * sn)
            yb = inv * (b * g[0, D // 2:] * cs + a * g[1, D // 2:] * sn)
            return rnd(mx.concatenate([ya, yb], axis=-1))

        q, k, v = rope(q, inv_q, gq), rope(k, inv_k, gk), rnd(v * s)
        if not flash:
            q = q * factor  # the softmax scale on the rounded q
        j = mx.arange(kc.shape[2])
        at = (j == pos)[None, None, :, None]  # the new position's row
        kc, vc = (mx.where(at, k.astype(T)[None, :, None], kc),
                  mx.where(at, v.astype(T)[None, :, None], vc))
        out.append((kc, vc))
        scores = q.reshape(HKV, GQ, D) @ kc[0].astype(f32).transpose(0, 2, 1)  # (HKV, GQ, capacity)
        seen = j <= pos
        if windows and windows[l]:  # a sliding-window layer: its last windows[l] positions
            seen = seen & (j > pos - windows[l])
        scores = mx.where(seen, scores, -mx.inf)
        att = rnd((mx.softmax(scores, axis=-1) @ vc[0].astype(f32)).reshape(-1))
        o_out = rnd(_qmm(att, *o, group_size, bits))
        p, a = stream((normed(o_out, gains[l, 2], eps) if post else o_out) + p, 1)
        gate, up = mx.split(_qmm(a, *gu, group_size, bits), 2)
        if flash:
            s2 = mx.rsqrt((p * p).sum() + K * eps)
            P2 = pow2(s2)
            g = gate * s2
            a = rnd((tanh_gelu(g) if gelu else g * mx.sigmoid(g)) * up * P2)
            xs = s2 / P2
        else:
            gate, up = rnd(gate), rnd(up)
            a = rnd((tanh_gelu(gate, rnd) if gelu else rnd(gate * sigmoid(gate))) * up)
            xs = one
        h = rnd(_qmm(a, *down, group_size, bits))
    return (h.astype(T).reshape(x.shape), xs.reshape(x.shape[:-1] + (1,)),
            p.astype(T).reshape(x.shape), out)


def _random_stack(L, K, HQ, HKV, D, I, C, pos, seed):
    """A random quantized stack (4-bit, groups of 64) with caches filled up to pos."""
    def quantized(rows, cols, s):
        return mx.quantize(rand((rows, cols), s, scale=0.05), 64, 4)

    layers = [(quantized((HQ + 2 * HKV) * D, K, seed + 10 * l),
               quantized(K, HQ * D, seed + 10 * l + 1),
               quantized(2 * I, K, seed + 10 * l + 2), quantized(K, I, seed + 10 * l + 3))
              for l in range(L)]
    mask = (mx.arange(C) < pos)[None, None, :, None]
    caches = [tuple(mx.where(mask, rand((1, HKV, C, D), seed + 10 * l + 4 + j), 0)
                    for j in range(2))
              for l in range(L)]
    return layers, caches


def check_stacks(rows, pos, seed):
    """The self-checks' three stacks, (layers, caches for `rows` rows, n_heads, n_kv_heads, theta,
    form) each, form the keyword arguments past `norm` (windows, gelu): two layers alike (4 query
    heads, 2 kv heads, FFN width 384) and two of their own sizes as OpenELM's (4 and 8 query
    heads, 2 and 4 kv heads, FFN widths 128 and 384; the same query heads per kv head, so the same
    compiled variant), head size 64; and Gemma 3's form (check_modes' post-norms), two layers of
    head size 256 (4 query heads, 1 kv head, FFN width 384), the first of a sliding window of 16
    positions, RoPE angles of their own, GeGLU; caches filled up to pos."""
    K, D, C = 256, 64, 64
    alike = _random_stack(2, K, 4, 2, D, 384, C, pos, seed)
    own = [_random_stack(1, K, hq, hq // 2, D, i, C, pos, seed + 50 + l)
           for l, (hq, i) in enumerate(((4, 128), (8, 384)))]
    own = ([m for s in own for m in s[0]], [c for s in own for c in s[1]])
    gemma = _random_stack(2, K, 4, 1, 256, 384, C, pos, seed + 70)
    many = lambda caches: [tuple(mx.concatenate([a, a[:, :, ::-1], a][:rows]) for a in c)
                           for c in caches]
    theta, llama = check_tables(2, K, D)[0], dict(windows=None, gelu=False)
    angles = mx.stack([mx.exp(-mx.arange(128, dtype=mx.float32) * c) for c in (0.07, 0.11)])
    return [(alike[0], many(alike[1]), 4, 2, theta, llama),
            (own[0], many(own[1]), [4, 8], [2, 4], theta, llama),
            (gemma[0], many(gemma[1]), 4, 1, angles, dict(windows=[16, None], gelu=True))]


def check_tables(L, K, D):
    """The self-checks' RoPE angles, pre-norm gains (about trained models' 16) and QK-norm
    tables."""
    theta = mx.exp(-mx.arange(D // 2, dtype=mx.float32) * 0.3)
    return (theta, 16 * (1 + 0.3 * rand((L, 2, K), 42, mx.float32)),
            1 + 0.3 * rand((L, 2, 2, D), 43, mx.float32))


def check_modes(L, K, D, post=False):
    """The self-checks' variants, (gains, qk_gains, factor, qk_eps, norm) each: flash with Sec. 3
    and Sec. 4 (QK-norm), rms without and with QK-norm (weights of float16 values about 1), none;
    post (Gemma 3's): flash and rms with QK-norm and the post-norms' gains after the pre-norms',
    none."""
    _, gains, qk = check_tables(L, K, D)
    half = lambda shape, seed: (1 + 0.3 * rand(shape, seed, mx.float32)).astype(
        mx.float16).astype(mx.float32)
    w, wq = half((L, 2, K), 44), half((L, 2, 2, D), 45)
    if post:
        wp = half((L, 2, K), 46)
        return [(mx.concatenate([gains, wp], 1), qk, D**-0.25, 1e-6, "flash"),
                (mx.concatenate([w, wp], 1), wq, D**-0.5, 1e-6, "rms"),
                (None, None, D**-0.5, 0.0, "none")]
    return [(gains, None, D**-0.25, 0.0, "flash"), (gains, qk, D**-0.25, 1e-6, "flash"),
            (w, None, D**-0.5, 0.0, "rms"), (w, wq, D**-0.5, 1e-6, "rms"),
            (None, None, D**-0.5, 0.0, "none")]


def check_decode_layers():
    """Two layers, 41 positions (two splits a kv head), each mode (check_modes) of each stack
    (check_stacks: layers alike, of their own sizes, Gemma 3's form)."""
    L, K, pos = 2, 256, 40
    x = rand((1, 1, K), 41)
    out = []
    for layers, caches, HQ, HKV, theta, form in check_stacks(1, pos, 40):
        modes = check_modes(L, K, theta.shape[-1] * 2, form["gelu"])
        for gains, qk_gains, factor, qk_eps, norm in modes:
            kv = [tuple(mx.array(a) for a in c) for c in caches]
            y, ys, p, kv = decode_layers(x, pos, layers, kv, gains, qk_gains, theta, 1e-5, factor,
                                         qk_eps, HQ, HKV, 64, 4, norm=norm, **form)
            out += [y, ys, p] + [a[..., pos, :] for c in kv for a in c]
    return out


CHECK = (check_decode_layers, 2e-2)
