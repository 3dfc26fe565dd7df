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
from .stacks import check_stacks

THREADS = 256  # 8 warps a block
SMAX = 16  # attention splits per kv head, at most
MAX_LAYERS = 36  # the pointer table's len(ARRAYS) a layer in static shared memory
MAX_ROWS = 256  # rows of the batched form (rows.py), at most
CUDA = Path(__file__).parent / "cuda"  # the kernels' CUDA: step.cu, rows.cu, whole_step.cuh

# The sizes and flags a launch passes in its int array `dims`, in order (build.pack, build.declare):
# the model width, group size, the widest layer's query and kv heads and FFN width (each layer's
# come in the layer table after these fields: layer_table), cache capacity, blocks, the widest
# matvec input, whether the norms' gains are kept, whether the rows are half precision (1/RSSe's
# power of two taken out), QK-norm, the norm's, RoPE's and QK-norm's float settings, the norm
# mode (NORMS), the post-norms (Gemma 3's: POST), and whether q/k/v have a bias (Qwen 2's:
# layer_arrays).
SIZES = (("K", "int"), ("GS", "int"), ("HQM", "int"), ("HKVM", "int"), ("IM", "int"), ("C", "int"),
         ("NB", "int"), ("XMAX", "int"), ("has_g", "bool"), ("prescale", "bool"),
         ("qk_norm", "bool"), ("eps", "float"), ("factor", "float"), ("qk_eps", "float"),
         ("NORM", "int"), ("post", "bool"), ("qkv_bias", "bool"))
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
# a layer's sizes in the layer table, after its STACKED offsets (layer_table): query heads, kv
# heads, FFN width, sliding window, the offset of its RoPE angles in theta
LAYER_SIZES = ("HQ", "HKV", "I", "W", "TH")
LT = len(STACKED) + len(LAYER_SIZES)  # the layer table's ints a layer
# Gemma 3's blocks (post): four norms a layer in `gains`, (L, 4, K): the two pre-norms', then the
# post-attention norm's (on o_proj's output) and the post-feedforward norm's (on down_proj's), both
# before the residual add; those two are the model's own in flash and rms (gain 1 + w), and the
# model's norms compute in float32, rounded once (rms: the pre-norms and QK-norm too)
POST = 4


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
    rows = "\n    ".join(f"tab[NA * l + {k}] = {a} + long(lt[LT * l + {k}]);"
                         for k, a in enumerate(STACKED))
    stacked = f"  if (threadIdx.x < NL) {{\n    const int l = threadIdx.x;\n    {rows}\n  }}\n"
    return stacked + "".join(f"  if (threadIdx.x == {l}) {{ tab[NA * {l} + A_KC] = kc{l}; "
                             f"tab[NA * {l} + A_VC] = vc{l}; }}\n" for l in range(layers))


def places():
    """The C constants of the tables' shapes, which the bodies read them by (no number of their
    own): NA and LT, a layer's pointers and ints; A_<array> (ARRAYS), a pointer's place in a
    layer's; L_<size> (LAYER_SIZES), a size's place in a layer's row of the layer table."""
    arrays = ", ".join(f"A_{a.upper()} = {k}" for k, a in enumerate(ARRAYS))
    sizes = ", ".join(f"L_{n} = {len(STACKED) + k}" for k, n in enumerate(LAYER_SIZES))
    return (f"  constexpr int NA = {len(ARRAYS)}, LT = {LT};  // step.table, step.layer_table\n"
            f"  constexpr int {arrays};\n  constexpr int {sizes};\n")


def compose(folder, file, fields, layers, own=("body",)):
    """A whole-step kernel's CUDA for `layers` layers, (body, header) as make_kernel takes them,
    from folder's `file` (its pieces `own`: its body, and where named a device piece of its own
    functions) and whole_step.cuh: the body with its sizes declared (fields: its SIZES), its
    pointer table (table) and whole_step.cuh's layer and attend pieces filled in; the header of
    the backend's shared functions (HEADERS), whole_step.cuh's device piece and the file's."""
    shared = pieces(folder / "whole_step.cuh", "device", "layer", "attend")
    mine = pieces(folder / file, *own)
    sizes = (declare(fields) + f"  const int* lt = dims + {len(fields)};  // step.layer_table\n"
             + places())
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


def layout(K, xmax):
    """The template constants of the kernel's shared memory layout, K and xmax as KRES and XIN: the
    launch's shared bytes (shared_bytes) then follow from its binary's template, as they must:
    MLX loads a binary once and fixes its dynamic shared limit at its first launch, so a second
    model of the same template and another width failed (rows.launch_plan's XA likewise)."""
    return [("KRES", K), ("XIN", xmax)]


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
    return 4 * 8 + 8 * len(ARRAYS) * L + 4 * GQ * D * (1 + 8) + 4 * 2 * 8 * GQ


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
    """Whether the whole-step kernel (name: "decode_layers", one row, "decode_rows", a batch, or
    "prefill_rows", a prompt's tokens) may run here (CUDA, our kernels on, its self-check
    passed)."""
    return forms.use_gpu(name) and gpu_backend() == "cuda"


def layer_sizes(layers, n_heads, n_kv_heads):
    """Each layer's (query heads, kv heads, FFN width): n_heads and n_kv_heads one int for every
    layer or one per layer (OpenELM's), the width from its gate/up rows."""
    per = lambda v: list(v) if isinstance(v, (list, tuple)) else [v] * len(layers)
    return [(q, k, mats[2][0].shape[0] // 2)
            for q, k, mats in zip(per(n_heads), per(n_kv_heads), layers)]


def layer_table(layers, n_heads, n_kv_heads, windows=None, theta=None):
    """The layer table the kernels read after the sizes fields of `dims` (`lt`), LT ints a layer:
    the offsets (in elements) of its arrays in the stacked inputs (STACKED: the arrays of a kind one
    after another; 0 for one it has not), then LAYER_SIZES: its query heads, kv heads and FFN
    width, its sliding window (0: every position; windows, per layer or None) and the offset of its
    RoPE angles in `theta` (a row a layer where theta is (L, D / 2), else 0)."""
    offsets, out = [0] * len(STACKED), []
    windows = windows or [None] * len(layers)
    for l, (mats, sizes) in enumerate(zip(layers, layer_sizes(layers, n_heads, n_kv_heads))):
        rope = l * theta.shape[-1] if theta is not None and theta.ndim == 2 else 0
        row = offsets + list(sizes) + [windows[l] or 0, rope]
        assert len(row) == LT
        out += row
        offsets = [o + (0 if a is None else a.size) for o, a in zip(offsets, layer_arrays(mats))]
    return tuple(out)


def supported(x, layers, caches, n_heads, n_kv_heads, group_size, bits, name="decode_layers"):
    """Whether the kernel `name` takes this stack: CUDA with our kernels on, x one row ((1, 1, K);
    decode_rows: (B, 1, K), B <= MAX_ROWS, a cache row each; prefill_rows: decode_rows' kernel over
    B tokens of one cache row), every layer's matrices 4- or 8-bit (affine, groups of
    group_size) or every one full precision (bits those of x's dtype: weights of that dtype, no
    scales or biases; group_size unused), of its own sizes (layer_sizes: heads and FFN width per
    layer; the query heads per kv head alike), qkv_proj's bias (of x's dtype) on every layer or on
    none, at most MAX_LAYERS layers, each kind's arrays within int32 offsets (table_fits), sizes
    in whole 16-byte chunks and groups (decode_rows: spans of 32 values, tensor cores with tf32),
    head size 64 or 128, or 256 in half precision (a row of the attention's keys is at most 32
    lanes of 16 bytes), at most 8 query heads per kv head; decode_layers' shared memory within
    what the GPU gives a block (shared_limit; decode_rows fits its passes to it:
    rows.launch_plan), its static arrays within 48 KB (step.static_bytes)."""
    B, full = x.shape[0], bits == 8 * x.dtype.size
    cache_rows = 1 if name == "prefill_rows" else B
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
    if name != "decode_layers":  # the tensor cores' spans: 32 values a group; tf32 from sm_80 on
        cw = 32
        if compute_capability() < 8:
            return False
    HQM, GQ = max(q for q, _, _ in per), per[0][0] // per[0][1]
    xmax = max(K, HQM * D, max(i for _, _, i in per))
    if (D not in (64, 128, 256) or D == 256 and x.dtype == mx.float32 or GQ > 8
            or not full and group_size % cw
            or any(q % k or q // k != GQ for q, k, _ in per)
            or any(v % cw or not full and v % group_size for q, _, i in per for v in (K, q * D, i))
            or name == "decode_layers"
            and (shared_bytes(K, xmax, bits, D, GQ, len(layers), True) > shared_limit()
                 or static_bytes(D, GQ, len(layers)) > 48 * 1024)):
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
                or k.shape[:2] != (cache_rows, hkv)):
            return False
    return table_fits(layers)


def table_fits(layers):
    """Whether the layer table holds these layers: at most MAX_LAYERS, each kind's arrays together
    within its int32 offsets (a full-precision model of billions of parameters is not)."""
    return len(layers) <= MAX_LAYERS and all(sum(a.size for a in kind if a is not None) < 2**31
                                             for kind in zip(*map(layer_arrays, layers)))


def decode_layers(x, offset, layers, caches, gains, qk_gains, theta, eps, factor, qk_eps, n_heads,
                  n_kv_heads, group_size, bits, norm="flash", windows=None, gelu=False):
    """Every layer of a Llama-family stack for one decode row x (the embedding, (1, 1, K)):
    (y, ys, p, caches) where y * ys is the last down_proj's output (its scale deferred), p the
    residual stream, and caches the (k, v) buffers with this position written.

    layers: per layer the (weight, scales, biases) of qkv_proj, o_proj, gate_up_proj (gate rows
    over up rows) and down_proj (full precision, bits those of x's dtype: (weight, None, None)),
    and where q/k/v have one (Qwen 2) qkv_proj's bias vector after them, which each mode adds as
    the model's layers do (flash: after the deferred scale, which attention then no more applies;
    its rounding: _reference); caches: per layer (k, v), (1, kv heads, capacity, D); offset: the
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
                  shared_memory=shared_bytes(K, xmax, bits, D, GQ, len(layers)),
                  template=layout(K, xmax), norm=norm, windows=windows, gelu=gelu)


def sizes(x, layers, theta, n_heads, n_kv_heads):
    """(K, D, I, xmax, HQ, HKV, GQ) of a stack: the model width, head size, the widest layer's FFN
    width, the widest matvec input, the most query and kv heads of a layer (layer_sizes), and the
    query heads per kv head."""
    per = layer_sizes(layers, n_heads, n_kv_heads)
    K, D = x.shape[-1], theta.shape[-1] * 2
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
           keep_work=False, norm="flash", windows=None, gelu=False, prefill=False):
    """One launch of a whole-step kernel (this file's; rows.py's with its sizes table, which adds
    the row count B (fields), and its rows per matvec pass and warps (NW) in the template): one
    block per SM of 8 warps (or NW), the shared inputs, the stacked arrays (stacked) and every
    layer's caches. Returns (y, ys, p, caches); the caches were written in place, so they are
    handed out as depending on the launch (reading them runs it first). keep_work: the work buffer
    (work floats) too, last (bench/probes/rows_phases.py reads its clock stamps there). windows,
    gelu and gains' post-norms as decode_layers takes them; prefill: the rows are one sequence's
    tokens in one cache row (rows.prefill_rows)."""
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
                             B=x.shape[0], NORM=NORMS[norm],
                             post=gains is not None and gains.shape[1] == POST,
                             qkv_bias=len(layers[0]) == 5, prefill=prefill))
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


def _matvec(x, matrix, group_size, bits):
    """x (a row, float32) times a matrix (weight, scales, biases) transposed, in float32: quantized,
    or full precision (no scales)."""
    (w, s, b), f32 = matrix, mx.float32
    if s is None:
        return x @ w.astype(f32).T
    return mx.quantized_matmul(x[None], w, s.astype(f32), b.astype(f32), transpose=True,
                               group_size=group_size, bits=bits)[0]


def _reference(x, offset, layers, caches, gains, qk_gains, theta, eps, factor, qk_eps, n_heads,
               n_kv_heads, group_size, bits, norm="flash", windows=None, gelu=False):
    """decode_layers in plain MLX (float32 arithmetic, rounded to x's dtype where the kernel
    rounds), over the whole cache with a mask, so that an array position (a compiled step) works:
    the fallback and the self-check's yardstick. norm: the mode (NORMS); rms and none round as the
    model's own layers do (each linear's output, RMSNorm's, RoPE's and SwiGLU's or GeGLU's steps,
    the sigmoid's and GELU's too, in T; with post-norms, Gemma 3's norms: in float32 on the
    residual add's unrounded sum, rounded once); flash keeps its 4- and 8-bit matvecs' outputs in
    float32, as Sec. 5's fused kernels do, and rounds full-precision ones to T, as its (unfused)
    linears do. q/k/v's bias is added as the model's linears add it: flash, to the output in T
    times the deferred scale in T (DeferredLinear), rms and none, to the output in T
    (nn.QuantizedLinear) or to the exact output (full precision: nn.Linear's addmm rounds once),
    the sum rounded to T."""
    f32, T = mx.float32, x.dtype
    K, D = x.shape[-1], theta.shape[-1] * 2
    per = layer_sizes(layers, n_heads, n_kv_heads)
    flash, post = norm == "flash", gains is not None and gains.shape[1] == POST
    full = bits == 8 * T.size
    pos = offset if isinstance(offset, int) else position_array(offset)[:1].reshape(())
    pow2 = ((lambda v: mx.power(2.0, mx.floor(mx.log2(v)))) if T != f32
            else (lambda v: mx.array(1.0)))
    rnd = lambda v: v.astype(T).astype(f32)
    # a matvec's output as the model's linear leaves it: in T (flash: as its input took the power
    # of two P of its 1/RSSe, add_rss), but for flash's 4- and 8-bit ones, kept in float32 as
    # Sec. 5's fused kernels keep it (no fused kernel takes full precision)
    out_of = (lambda v, P: v) if flash and not full else (lambda v, P: rnd(v * P) / P)

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
    for l, (mats, (kc, vc)) in enumerate(zip(layers, caches)):
        (qkv, o, gu, down), c = mats[:4], layer_arrays(mats)[-1]
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
        raw = _matvec(a, qkv, group_size, bits)
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
        o_out = rnd(_matvec(att, o, group_size, bits))
        p, a = stream((normed(o_out, gains[l, 2], eps) if post else o_out) + p, 1)
        s2 = mx.rsqrt((p * p).sum() + K * eps) if flash else one
        P2 = pow2(s2)
        gate, up = (out_of(y, P2) for y in mx.split(_matvec(a, gu, group_size, bits), 2))
        if flash:
            g = gate * s2
            a = rnd((tanh_gelu(g) if gelu else g * mx.sigmoid(g)) * up * P2)
            xs = s2 / P2
        else:
            a = rnd((tanh_gelu(gate, rnd) if gelu else rnd(gate * sigmoid(gate))) * up)
            xs = one
        h = rnd(_matvec(a, down, group_size, bits))
    return (h.astype(T).reshape(x.shape), xs.reshape(x.shape[:-1] + (1,)),
            p.astype(T).reshape(x.shape), out)


def check_decode_layers():
    """Two layers, 41 positions (two splits a kv head), each stack of check_stacks (layers alike,
    of their own sizes, with q/k/v biases, full precision, Gemma 3's form) in its modes."""
    pos = 40
    x = rand((1, 1, 256), 41)
    out = []
    for layers, caches, HQ, HKV, bits, theta, form, modes in check_stacks(1, pos, 40):
        for gains, qk_gains, factor, qk_eps, norm in modes:
            kv = [tuple(mx.array(a) for a in c) for c in caches]
            y, ys, p, kv = decode_layers(x, pos, layers, kv, gains, qk_gains, theta, 1e-5, factor,
                                         qk_eps, HQ, HKV, 64, bits, norm=norm, **form)
            out += [y, ys, p] + [a[..., pos, :] for c in kv for a in c]
    return out


CHECK = (check_decode_layers, 2e-2)
