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
CUDA only: the per-sublayer kernels stay the form Metal runs (no grid-wide barrier there).
Its plain-MLX reference (_reference) is the fallback and the self-check's yardstick (CHECK)."""
import ctypes
from functools import lru_cache
from pathlib import Path

import mlx.core as mx

from .. import forms
from ..forms import gpu_backend
from .build import HEADERS, constant, declare, fill, make_kernel, pack, pieces, position_array, rand

THREADS = 256  # 8 warps a block
SMAX = 16  # attention splits per kv head, at most
MAX_LAYERS = 36  # the pointer table's len(ARRAYS) a layer in static shared memory
MAX_ROWS = 64  # rows of the batched form (rows.py), at most
CUDA = Path(__file__).parent / "cuda"  # the kernels' CUDA: step.cu, rows.cu, whole_step.cuh

# The sizes and flags a launch passes in its int array `dims`, in order (build.pack, build.declare):
# the model width, group size, the widest layer's query and kv heads and FFN width (each layer's
# come in the layer table after these fields: layer_table), cache capacity, blocks, the widest
# matvec input, whether the norms' gains are kept, whether the rows are half precision (1/RSSe's
# power of two taken out), QK-norm, the norm's, RoPE's and QK-norm's float settings, and the norm
# mode (NORMS), and whether q/k/v have a bias (Qwen 2's: layer_arrays).
SIZES = (("K", "int"), ("GS", "int"), ("HQM", "int"), ("HKVM", "int"), ("IM", "int"), ("C", "int"),
         ("NB", "int"), ("XMAX", "int"), ("has_g", "bool"), ("prescale", "bool"),
         ("qk_norm", "bool"), ("eps", "float"), ("factor", "float"), ("qk_eps", "float"),
         ("NORM", "int"), ("qkv_bias", "bool"))
# The norm modes (--norm), each the function of that mode's own layers: flash, the 1/RSSe deferred
# past the matvecs (gains: the pre-norms' sqrt(K) g on the inputs; factor: the square root of the
# softmax scale, into q and k); rms, RMSNorm before each matvec as the model's layers compute and
# round it (gains: the norms' weights; qk_gains[:, :, 0]: QK-norm's; factor: the softmax scale);
# none, the residual add alone (no gains).
NORMS = {"flash": 0, "rms": 1, "none": 2}
# a layer's arrays, in the pointer table's order: its four matrices (weight, scales, biases each;
# a full-precision matrix has only its weight), qkv_proj's bias vector, and its caches; all but the
# caches come one input a kind (stacked: layer l's at its offset in it)
ARRAYS = ("wqkv", "sqkv", "bqkv", "wo", "so", "bo", "wgu", "sgu", "bgu", "wd", "sd", "bd", "cqkv",
          "kc", "vc")
STACKED = ARRAYS[:13]
LT = len(STACKED) + 3  # the layer table's ints a layer: the offsets, then its sizes (layer_table)


def layer_arrays(mats):
    """A layer's arrays in STACKED's order, None for those it has not (a full-precision matrix's
    scales and biases; qkv_proj's bias, a fifth entry of the layer where it has one)."""
    return [a for m in mats[:4] for a in m] + [mats[4] if len(mats) > 4 else None]


def input_names(layers):
    """Both kernels' inputs: the shared ones, the stacked arrays (STACKED), each layer's caches. A
    launch's host work grows with its inputs (bench/RESULTS.md, "Host work of the batched step"),
    so the layers' matrices come as one array a kind."""
    return (["x", "off", "dims", "theta", "gains", "qkg", "sync", *STACKED]
            + [f"{a}{l}" for l in range(layers) for a in ARRAYS[len(STACKED):]])


def table(layers):
    """The body's pointer table in shared memory, NA = len(ARRAYS) a layer: thread l of each block
    points at layer l's arrays in the stacked inputs (at its offsets in the layer table `lt`,
    layer_table) and at its caches."""
    n, na = len(STACKED), len(ARRAYS)
    rows = "\n    ".join(f"tab[NA * l + {k}] = {a} + long(lt[LT * l + {k}]);"
                         for k, a in enumerate(STACKED))
    stacked = f"  if (threadIdx.x < NL) {{\n    const int l = threadIdx.x;\n    {rows}\n  }}\n"
    return stacked + "".join(f"  if (threadIdx.x == {l}) {{ tab[{na * l + n}] = kc{l}; "
                             f"tab[{na * l + n + 1}] = vc{l}; }}\n" for l in range(layers))


def compose(folder, file, fields, layers, own=("body",)):
    """A whole-step kernel's CUDA for `layers` layers, (body, header) as make_kernel takes them,
    from folder's `file` (its pieces `own`: its body, and where named a device piece of its own
    functions) and whole_step.cuh: the body with its sizes declared (fields: its SIZES), its
    pointer table (table) and whole_step.cuh's layer and attend pieces filled in; the header of
    the backend's shared functions (HEADERS), whole_step.cuh's device piece and the file's."""
    shared = pieces(folder / "whole_step.cuh", "device", "layer", "attend")
    mine = pieces(folder / file, *own)
    sizes = (declare(fields) + f"  const int* lt = dims + {len(fields)};  // step.layer_table\n"
             f"  constexpr int NA = {len(ARRAYS)}, LT = {LT};  // step.table, step.layer_table\n")
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
    # red, tab, qsh + sacc, sm + sl
    static = 4 * 8 + 8 * len(ARRAYS) * L + 4 * GQ * D * (1 + 8) + 4 * 2 * 8 * GQ
    asked = max(dynamic, 48004) if dynamic + static > 48 * 1024 else dynamic
    return asked + static if total else asked


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


def layer_table(layers, n_heads, n_kv_heads):
    """The layer table the kernels read after the sizes fields of `dims` (`lt`), LT ints a layer:
    the offsets (in elements) of its arrays in the stacked inputs (STACKED: the arrays of a kind one
    after another; 0 for one it has not), then its query heads, kv heads and FFN width."""
    offsets, out = [0] * len(STACKED), []
    for mats, sizes in zip(layers, layer_sizes(layers, n_heads, n_kv_heads)):
        out += offsets + list(sizes)
        offsets = [o + (0 if a is None else a.size) for o, a in zip(offsets, layer_arrays(mats))]
    return tuple(out)


def supported(x, layers, caches, n_heads, n_kv_heads, group_size, bits, name="decode_layers"):
    """Whether the kernel `name` takes this stack: CUDA with our kernels on, x one row ((1, 1, K);
    decode_rows: (B, 1, K), B <= MAX_ROWS), every layer's matrices 4- or 8-bit (affine, groups of
    group_size) or every one full precision (bits those of x's dtype: weights of that dtype, no
    scales or biases; group_size unused), of its own sizes (layer_sizes: heads and FFN width per
    layer; the query heads per kv head alike), qkv_proj's bias (of x's dtype) on every layer or on
    none, at most MAX_LAYERS layers, each kind's arrays within int32 offsets (table_fits), sizes
    in whole 16-byte chunks and groups (decode_rows: spans of 32 values, tensor cores with tf32),
    head size 64 or 128, at most 8 query heads per kv head; decode_layers' shared memory within
    what the GPU gives a block (shared_limit; decode_rows fits its passes to it:
    rows.launch_plan)."""
    B, full = x.shape[0], bits == 8 * x.dtype.size
    if not (use_decode_layers(name) and x.ndim == 3 and x.shape[1] == 1
            and (B == 1 if name == "decode_layers" else B <= MAX_ROWS)
            and x.dtype in (mx.float16, mx.bfloat16, mx.float32) and (bits in (4, 8) or full)
            and layers and all(len(m) in (4, 5) for m in layers)):
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
    if (D not in (64, 128) or GQ > 8 or not full and group_size % cw
            or any(q % k or q // k != GQ for q, k, _ in per)
            or any(v % cw or not full and v % group_size for q, _, i in per for v in (K, q * D, i))
            or name == "decode_layers"
            and shared_bytes(K, xmax, bits, D, GQ, len(layers), True) > shared_limit()):
        return False
    biased = len(layers[0]) == 5
    for mats, (k, v), (hq, hkv, I) in zip(layers, caches, per):
        nqkv = (hq + 2 * hkv) * D
        shapes = [(K, nqkv), (hq * D, K), (K, 2 * I), (I, K)]  # (columns, rows)
        for (w, s, b), (columns, rows) in zip(mats[:4], shapes):
            if (w.shape != (rows, columns if full else columns * bits // 32)
                    or (w.dtype != x.dtype or s is not None or b is not None if full else
                        w.dtype != mx.uint32 or s is None or b is None or s.dtype != x.dtype
                        or b.dtype != x.dtype)):
                return False
        if (len(mats) == 5) != biased or biased and (mats[4].shape != (nqkv,)
                                                     or mats[4].dtype != x.dtype):
            return False
        if (k.dtype != x.dtype or v.dtype != x.dtype or k.shape != v.shape
                or k.shape[:2] != (B, hkv)):
            return False
    return table_fits(layers)


def table_fits(layers):
    """Whether the layer table holds these layers: at most MAX_LAYERS, each kind's arrays together
    within its int32 offsets (a full-precision model of billions of parameters is not)."""
    return len(layers) <= MAX_LAYERS and all(sum(a.size for a in kind if a is not None) < 2**31
                                             for kind in zip(*map(layer_arrays, layers)))


def decode_layers(x, offset, layers, caches, gains, qk_gains, theta, eps, factor, qk_eps, n_heads,
                  n_kv_heads, group_size, bits, norm="flash"):
    """Every layer of a Llama-family stack for one decode row x (the embedding, (1, 1, K)):
    (y, ys, p, caches) where y * ys is the last down_proj's output (its scale deferred), p the
    residual stream, and caches the (k, v) buffers with this position written.

    layers: per layer the (weight, scales, biases) of qkv_proj, o_proj, gate_up_proj (gate rows
    over up rows) and down_proj (full precision, bits those of x's dtype: (weight, None, None)),
    and where q/k/v have one (Qwen 2) qkv_proj's bias vector after them, which each mode adds as
    the model's layers do (flash: after the deferred scale, which attention then no more applies;
    its rounding: _reference); caches: per layer (k, v), (1, kv heads, capacity, D); offset: the
    position (an int or the decode step's array); gains: (L, 2, K) float32, the two pre-norms'
    gains kept on the input, or None (folded); qk_gains: (L, 2, 2, D) float32, QK-norm's gains
    and their RoPE-permuted copy for q and k (Sec. 4), or None (Sec. 3: factor * s on q and k).
    norm: the mode (NORMS), which says what gains, qk_gains and factor are; in rms and none ys is 1
    and y + p the last layer's output (no scale deferred)."""
    if not supported(x, layers, caches, n_heads, n_kv_heads, group_size, bits):
        return _reference(x, offset, layers, caches, gains, qk_gains, theta, eps, factor, qk_eps,
                          n_heads, n_kv_heads, group_size, bits, norm)
    K, D, I, xmax, HQ, HKV, GQ = sizes(x, layers, theta, n_heads, n_kv_heads)
    return launch(step_kernel(len(layers)), x, position_array(offset), layers, caches, gains,
                  qk_gains, theta, eps, factor, qk_eps, n_heads, n_kv_heads, group_size, bits,
                  work=(HQ + 2 * HKV) * D + HQ * SMAX * (D + 2) + K + I,
                  shared_memory=shared_bytes(K, xmax, bits, D, GQ, len(layers)), norm=norm)


def sizes(x, layers, theta, n_heads, n_kv_heads):
    """(K, D, I, xmax, HQ, HKV, GQ) of a stack: the model width, head size, the widest layer's FFN
    width, the widest matvec input, the most query and kv heads of a layer (layer_sizes), and the
    query heads per kv head."""
    per = layer_sizes(layers, n_heads, n_kv_heads)
    K, D = x.shape[-1], theta.shape[0] * 2
    HQ, HKV, I = (max(v[j] for v in per) for j in range(3))
    return K, D, I, max(K, HQ * D, I), HQ, HKV, per[0][0] // per[0][1]


class Layers(list):
    """A stack's layers (decode_layers' `layers`) with `stacks`: the arrays (stacked) holding each
    layer's arrays, in STACKED's order (flashnorm.stack_weights makes them at load time, so that
    they take no memory of their own: layer_views)."""

    def __init__(self, layers, stacks):
        super().__init__(layers)
        self.stacks = stacks


def stacked(layers):
    """The stacked inputs a launch takes, one a kind (STACKED): the layers' own stacks, else copies;
    a kind's arrays stacked (L, rows, columns) where every layer's has one shape, else flattened one
    after another (OpenELM's layers differ), layer l's at its offset in the layer table; for a kind
    the layers have not (layer_arrays: None), a constant the kernels never read, of the activations'
    dtype (that of the scales, or of full-precision weights), as a kind's array would be: the CUDA
    file, which names each input's type, stays one."""
    if isinstance(layers, Layers):
        return layers.stacks
    w, scales = layers[0][0][:2]
    none = constant(w.dtype if scales is None else scales.dtype, 0)
    return [none if arrays[0] is None
            else mx.stack(arrays) if len({a.shape for a in arrays}) == 1
            else mx.concatenate([a.reshape(-1) for a in arrays])
            for arrays in zip(*map(layer_arrays, layers))]


def layer_views(stack, arrays):
    """Each layer's array of one kind as a view of its input (stacked): row l of a stack, else its
    span of the flat array, in the shape of `arrays` (the layers' own)."""
    if stack.ndim == arrays[0].ndim + 1:
        return [stack[l] for l in range(len(arrays))]
    views, at = [], 0
    for a in arrays:
        views.append(stack[at:at + a.size].reshape(a.shape))
        at += a.size
    return views


def launch(kernel, x, positions, layers, caches, gains, qk_gains, theta, eps, factor, qk_eps,
           n_heads, n_kv_heads, group_size, bits, work, shared_memory, fields=SIZES, template=(),
           keep_work=False, norm="flash"):
    """One launch of a whole-step kernel (this file's; rows.py's with its sizes table, which adds
    the row count B (fields), and its rows per matvec pass and warps (NW) in the template): one
    block per SM of 8 warps (or NW), the shared inputs, the stacked arrays (stacked) and every
    layer's caches. Returns (y, ys, p, caches); the caches were written in place, so they are
    handed out as depending on the launch (reading them runs it first). keep_work: the work buffer
    (work floats) too, last (bench/probes/rows_phases.py reads its clock stamps there)."""
    if norm == "rms" and gains is None:  # the kernel would read the norms' weights from `gains`
        raise ValueError("norm 'rms' needs the norms' weights (gains)")
    K, D, I, xmax, HQ, HKV, GQ = sizes(x, layers, theta, n_heads, n_kv_heads)
    threads = 32 * dict(template).get("NW", THREADS // 32)
    none = constant(mx.float32, 0.0)
    # GS: full precision has no groups (1 divides every size)
    dims = pack(fields, dict(K=K, GS=group_size if bits in (4, 8) else 1, HQM=HQ, HKVM=HKV, IM=I,
                             C=caches[0][0].shape[2], NB=sm_count(), XMAX=xmax,
                             has_g=gains is not None, prescale=x.dtype != mx.float32,
                             qk_norm=qk_gains is not None, eps=eps, factor=factor, qk_eps=qk_eps,
                             B=x.shape[0], NORM=NORMS[norm], qkv_bias=len(layers[0]) == 5))
    dims += layer_table(layers, n_heads, n_kv_heads)
    y, p, ys, scratch = kernel(
        inputs=[x, positions, constant(mx.int32, *dims), theta, none if gains is None else gains,
                none if qk_gains is None else qk_gains, sync_state(), *stacked(layers)]
        + [a for kv in caches for a in kv],
        template=[("T", x.dtype), ("BITS", bits), ("D", D), ("GQ", GQ), ("NL", len(layers)),
                  ("SMAX", SMAX), *template],
        grid=(sm_count() * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[x.shape, x.shape, (max(x.shape[0], 4),), (work,)],
        output_dtypes=[x.dtype, x.dtype, mx.float32, mx.float32], shared_memory=shared_memory)
    # ys (a float a row) comes in 16 bytes at least and is read through a view: MLX keeps an array
    # of 8 bytes or less in a managed page, which the next kernel reading it waits on
    ys = ys[:x.shape[0]].reshape(x.shape[:-1] + (1,))
    flat = mx.depends([a for kv in caches for a in kv], [y])
    out = y, ys, p, list(zip(flat[0::2], flat[1::2]))
    return out + (scratch,) if keep_work else out


def _matvec(x, matrix, group_size, bits):
    """x (a row, float32) times a matrix (weight, scales, biases) transposed, in float32: quantized,
    or full precision (no scales)."""
    (w, s, b), f32 = matrix, mx.float32
    if s is None:
        return x @ w.astype(f32).T
    return mx.quantized_matmul(x[None], w, s.astype(f32), b.astype(f32), transpose=True,
                               group_size=group_size, bits=bits)[0]


def _reference(x, offset, layers, caches, gains, qk_gains, theta, eps, factor, qk_eps, n_heads,
               n_kv_heads, group_size, bits, norm="flash"):
    """decode_layers in plain MLX (float32 arithmetic, rounded to x's dtype where the kernel
    rounds), over the whole cache with a mask, so that an array position (a compiled step) works:
    the fallback and the self-check's yardstick. norm: the mode (NORMS); rms and none round as the
    model's own layers do (each linear's output, RMSNorm's, RoPE's and SwiGLU's steps, its
    sigmoid's too, in T); flash keeps its 4- and 8-bit matvecs' outputs in float32, as Sec. 5's
    fused kernels do, and rounds full-precision ones to T, as its (unfused) linears do. q/k/v's
    bias is added as the model's linears add it: flash, to the output in T times the deferred
    scale in T (DeferredLinear), rms and none, to the output in T (nn.QuantizedLinear) or to the
    exact output (full precision: nn.Linear's addmm rounds once), the sum rounded to T."""
    f32, T = mx.float32, x.dtype
    K, D = x.shape[-1], theta.shape[0] * 2
    per = layer_sizes(layers, n_heads, n_kv_heads)
    flash, full = norm == "flash", bits == 8 * T.size
    pos = offset if isinstance(offset, int) else position_array(offset)[:1].reshape(())
    pow2 = ((lambda v: mx.power(2.0, mx.floor(mx.log2(v)))) if T != f32
            else (lambda v: mx.array(1.0)))
    rnd = lambda v: v.astype(T).astype(f32)
    # a matvec's output as the model's linear leaves it: in T (flash: as its input took the power
    # of two P of its 1/RSSe, add_rss), but for flash's 4- and 8-bit ones, kept in float32 as
    # Sec. 5's fused kernels keep it (no fused kernel takes full precision)
    out_of = (lambda v, P: v) if flash and not full else (lambda v, P: rnd(v * P) / P)

    def normed(v, w, e):  # RMSNorm as mx.fast.rms_norm rounds it
        return rnd(rnd(v * mx.rsqrt((v * v).mean(-1, keepdims=True) + e)) * w)

    def sigmoid(g):  # as MLX's CUDA Sigmoid computes it in T (whole_step.cuh's fn_sigmoid)
        y = rnd(1 / rnd(1 + rnd(mx.exp(mx.abs(g)))))
        return mx.where(g < 0, y, rnd(1 - y))

    def pre(v, k):  # a matvec's input: p times the gain (flash), RMSNorm(p) (rms), p (none)
        if norm == "rms":
            return normed(v, gains[l, k], eps)
        return v * gains[l, k] if flash and gains is not None else v

    cs, sn = mx.cos(pos * theta), mx.sin(pos * theta)
    one = mx.array(1.0)
    h, xs, p, out = x.reshape(K).astype(f32), None, None, []
    for l, (mats, (kc, vc)) in enumerate(zip(layers, caches)):
        (qkv, o, gu, down), c = mats[:4], layer_arrays(mats)[-1]
        HQ, HKV, _ = per[l]
        GQ = HQ // HKV
        p = rnd(h if xs is None else h * xs + p)
        s = mx.rsqrt((p * p).sum() + K * eps) if flash else one
        P = pow2(s)
        raw = _matvec(pre(p, 0), qkv, group_size, bits)
        if c is None:
            raw = out_of(raw, P)
        elif flash:  # the rows take s before the bias, so attention applies it no more
            raw = rnd(rnd(rnd(raw * P) * (s / P)) + c.astype(f32))
            s = P = one
        else:
            raw = rnd((raw if full else rnd(raw)) + c.astype(f32))
        raw = raw.reshape(-1, D)
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
        at = (mx.arange(kc.shape[2]) == pos)[None, None, :, None]  # the new position's row
        kc, vc = (mx.where(at, k.astype(T)[None, :, None], kc),
                  mx.where(at, v.astype(T)[None, :, None], vc))
        out.append((kc, vc))
        scores = q.reshape(HKV, GQ, D) @ kc[0].astype(f32).transpose(0, 2, 1)  # (HKV, GQ, capacity)
        scores = mx.where(mx.arange(kc.shape[2]) <= pos, scores, -mx.inf)
        att = rnd((mx.softmax(scores, axis=-1) @ vc[0].astype(f32)).reshape(-1))
        p = rnd(rnd(_matvec(att, o, group_size, bits)) + p)
        s2 = mx.rsqrt((p * p).sum() + K * eps) if flash else one
        P2 = pow2(s2)
        gate, up = (out_of(y, P2) for y in mx.split(_matvec(pre(p, 1), gu, group_size, bits), 2))
        if flash:
            a = rnd(gate * s2 * mx.sigmoid(gate * s2) * up * P2)
            xs = s2 / P2
        else:
            a = rnd(rnd(gate * sigmoid(gate)) * up)
            xs = one
        h = rnd(_matvec(a, down, group_size, bits))
    return (h.astype(T).reshape(x.shape), xs.reshape(x.shape[:-1] + (1,)),
            p.astype(T).reshape(x.shape), out)


def _random_stack(L, K, HQ, HKV, D, I, C, pos, seed, bits=4, bias=False):
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
    """The self-checks' stacks, (layers, caches for `rows` rows, n_heads, n_kv_heads, bits, modes)
    each, caches filled up to pos: two 4-bit layers alike (4 query heads, 2 kv heads, FFN width
    384) and two of their own sizes as OpenELM's (4 and 8 query heads, 2 and 4 kv heads, FFN widths
    128 and 384; the same query heads per kv head, so the same compiled variant), in every mode
    (check_modes); and two layers alike with q/k/v biases (Qwen 2's), 4-bit and full precision
    (bits: those of rand's dtype, a variant of its own), in flash and rms (which add a bias
    differently; none adds it as rms does): few launches, as the check runs at first use."""
    K, D, C = 256, 64, 64
    every, biased = range(5), (0, 2)  # check_modes' indices
    alike = _random_stack(2, K, 4, 2, D, 384, C, pos, seed)
    own = [_random_stack(1, K, hq, hq // 2, D, i, C, pos, seed + 50 + l)
           for l, (hq, i) in enumerate(((4, 128), (8, 384)))]
    own = ([m for s in own for m in s[0]], [c for s in own for c in s[1]])
    quantized, full = (_random_stack(2, K, 4, 2, D, 384, C, pos, seed + 70, b, bias=True)
                       for b in (4, None))
    many = lambda caches: [tuple(mx.concatenate([a, a[:, :, ::-1], a][:rows]) for a in c)
                           for c in caches]
    return [(alike[0], many(alike[1]), 4, 2, 4, every),
            (own[0], many(own[1]), [4, 8], [2, 4], 4, every),
            (quantized[0], many(quantized[1]), 4, 2, 4, biased),
            (full[0], many(full[1]), 4, 2, 8 * full[0][0][0][0].dtype.size, biased)]


def check_tables(L, K, D):
    """The self-checks' RoPE angles, pre-norm gains (about trained models' 16) and QK-norm
    tables."""
    theta = mx.exp(-mx.arange(D // 2, dtype=mx.float32) * 0.3)
    return (theta, 16 * (1 + 0.3 * rand((L, 2, K), 42, mx.float32)),
            1 + 0.3 * rand((L, 2, 2, D), 43, mx.float32))


def check_modes(L, K, D):
    """The self-checks' variants, (gains, qk_gains, factor, qk_eps, norm) each: flash with Sec. 3
    and Sec. 4 (QK-norm), rms without and with QK-norm (weights of float16 values about 1), none."""
    _, gains, qk = check_tables(L, K, D)
    w = (1 + 0.3 * rand((L, 2, K), 44, mx.float32)).astype(mx.float16).astype(mx.float32)
    wq = (1 + 0.3 * rand((L, 2, 2, D), 45, mx.float32)).astype(mx.float16).astype(mx.float32)
    return [(gains, None, D**-0.25, 0.0, "flash"), (gains, qk, D**-0.25, 1e-6, "flash"),
            (w, None, D**-0.5, 0.0, "rms"), (w, wq, D**-0.5, 1e-6, "rms"),
            (None, None, D**-0.5, 0.0, "none")]


def check_decode_layers():
    """Two layers, 41 positions (two splits a kv head), the stacks of check_stacks (layers alike,
    of their own sizes, with q/k/v biases, full precision), each in its modes (check_modes)."""
    L, K, D, pos = 2, 256, 64, 40
    theta = check_tables(L, K, D)[0]
    x = rand((1, 1, K), 41)
    out = []
    for layers, caches, HQ, HKV, bits, modes in check_stacks(1, pos, 40):
        for i in modes:
            gains, qk_gains, factor, qk_eps, norm = check_modes(L, K, D)[i]
            kv = [tuple(mx.array(a) for a in c) for c in caches]
            y, ys, p, kv = decode_layers(x, pos, layers, kv, gains, qk_gains, theta, 1e-5, factor,
                                         qk_eps, HQ, HKV, 64, bits, norm=norm)
            out += [y, ys, p] + [a[..., pos, :] for c in kv for a in c]
    return out


CHECK = (check_decode_layers, 2e-2)
